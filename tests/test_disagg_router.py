"""Disaggregated prefill/decode behind the router, with real `tokenmill serve` processes on 127.0.0.1.

One module-wide deployment: `tokenmill serve --disaggregate 2P1D` (two prefill instances, one decode
instance, the router; instance URLs read from the router's /metrics) beside one plain colocated instance
(the reference, and an instance without a connector). Checked: the API carries kv_transfer_params in and out;
2P1D greedy outputs equal the colocated instance for a concurrent batch of varied prompts (float32, streamed
and not, completions and chat), each answer's usage counts every prompt token as cached, and the decode
instance's /metrics show zero prompt tokens computed (it took each prefill instance's first token);
`tokenmill router --prefill URL --decode URL...` in front of an instance without a connector relays its
answers unchanged and counts the fallback; every instance's KV cache returns to zero usage after the requests,
a client abort mid-stream included; a killed prefill instance makes the router use the other one; a decode
instance killed while it holds a request makes the router retry the other with nothing lost; tokenmill bench
serve reports the router's counters; malformed --disaggregate values are refused with one-line errors.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from models import tiny_model
from server_utils import CliProc, ServerProc, child_pids, metrics, sse_events
from tokenmill.cli import main
from tokenmill.engine.output_processor import OutputProcessor, RequestState
from tokenmill.messages import EngineCoreOutput, FinishReason
from tokenmill.router.disagg import is_batch, prefill_request
from tokenmill.sampling_params import SamplingParams

PROMPTS = ["Hello, my name is", "The capital of France is Paris. The capital of Italy is",
           "Paged attention stores keys and values in fixed-size blocks of tokens, and", "1 2 3 4 5 6 7"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]


# -- no servers --------------------------------------------------------------------------------------
def test_prefill_request_is_one_token_without_streaming():
    req = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True, "n": 3, "best_of": 3, "min_tokens": 4,
           "stream_options": {"include_usage": True}, "temperature": 0}
    body = prefill_request(req, "/v1/completions")
    assert body == {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False, "n": 1, "temperature": 0,
                    "kv_transfer_params": {"do_remote_decode": True}}
    assert prefill_request({"messages": CHAT}, "/v1/chat/completions")["max_completion_tokens"] == 1
    assert prefill_request({"input": "hi", "max_output_tokens": 9}, "/v1/responses")["max_output_tokens"] == 1
    assert req["max_tokens"] == 50  # the original is untouched: it goes to the decode instance
    assert is_batch({"prompt": ["a", "b"]}) and not is_batch({"prompt": ["a"]}) and not is_batch({"prompt": [1, 2]})


def test_finished_output_carries_kv_transfer_params():
    proc = OutputProcessor(None)
    params = SamplingParams(max_tokens=1, detokenize=False)
    proc.add_request(RequestState("r", None, [1, 2, 3], params, None, delta=True), ["r"])
    where = {"do_remote_prefill": True, "remote_block_ids": [0], "remote_port": 1}
    ((_, out),), _ = proc.process([EngineCoreOutput("r", [7], finish_reason=FinishReason.LENGTH,
                                               kv_transfer_params=where)])
    assert out.finished and out.kv_transfer_params == where


@pytest.mark.parametrize("argv, message", [
    (["serve", "m", "--disaggregate", "1P0D"], "--disaggregate expects xPyD"),
    (["serve", "m", "--disaggregate", "two"], "--disaggregate expects xPyD"),
    (["serve", "m", "--disaggregate", "1P1D", "-dp", "2"], "cannot be combined"),
    (["router", "--prefill", "http://127.0.0.1:1"], "at least one --prefill and one --decode"),
    (["router", "--replica", "http://127.0.0.1:1", "--prefill", "http://127.0.0.1:2", "--decode",
      "http://127.0.0.1:3"], "either --replica or --prefill/--decode"),
    (["router"], "needs --replica URLs, or --prefill and --decode"),
])
def test_malformed_disaggregation_is_refused(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


# -- one deployment: tokenmill serve --disaggregate 2P1D, and a plain colocated instance -------------------
HC = ("--health-check-interval", "60", "--health-check-timeout", "60")  # failures are found by requests alone
LONG = " ".join(PROMPTS[:3])  # four blocks of tokens


def instance_pid(launcher: CliProc, url: str) -> int:
    """The launcher's child `tokenmill serve` process listening on url's port (children of any of its threads)."""
    port = url.rsplit(":", 1)[1]
    pids = child_pids(launcher.proc.pid)
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        if b"--port" in argv and argv[argv.index(b"--port") + 1] == port.encode():
            return pid
    raise RuntimeError(f"no instance on port {port} among {pids}")


def _roles(launcher: CliProc) -> dict[str, list[str]]:
    """{'prefill': [urls], 'decode': [urls]}, read from the launcher's router's /metrics."""
    roles: dict[str, list[str]] = {"prefill": [], "decode": []}
    for key in metrics(launcher):
        if key.startswith("tokenmill:router_disagg_requests_total{"):
            labels = dict(kv.split("=", 1) for kv in key[key.index("{") + 1:-1].split(","))
            roles[labels["role"]].append(labels["replica"])
    return {k: sorted(v) for k, v in roles.items()}


class Deployment:
    def __init__(self) -> None:
        model = tiny_model("llama")
        with ThreadPoolExecutor(2) as pool:
            ref = pool.submit(ServerProc, model)
            self.launcher = ServerProc(model, "--disaggregate", "2P1D", *HC)
            self.ref = ref.result()  # colocated reference; it has no connector
        roles = _roles(self.launcher)
        self.prefill, self.decode = roles["prefill"], roles["decode"]
        assert len(self.prefill) == 2 and len(self.decode) == 1, roles
        self.routers: list[CliProc] = []

    def router(self, prefill: list[str], decode: list[str]) -> CliProc:
        """A `tokenmill router` in front of some of the instances."""
        self.routers.append(CliProc(["router", *[a for u in prefill for a in ("--prefill", u)],
                                     *[a for u in decode for a in ("--decode", u)], *HC], startup_timeout=60))
        return self.routers[-1]

    def instance_pid(self, url: str) -> int:
        return instance_pid(self.launcher, url)

    def stop(self) -> None:
        for p in (*self.routers, self.launcher, self.ref):
            p.stop()


@pytest.fixture(scope="module")
def deployment():
    d = Deployment()
    yield d
    d.stop()


def _body(prompt, stream: bool, chat: bool = False, max_tokens: int = 8, usage: bool = False) -> dict:
    body = {"temperature": 0, "max_tokens": max_tokens, "stream": stream}
    if stream and usage:
        body["stream_options"] = {"include_usage": True}
    return {**body, "messages": prompt} if chat else {**body, "prompt": prompt}


def _generate(url: str, body: dict) -> tuple[str, str, dict]:
    """(text, finish_reason, the last JSON object: the response, or a stream's usage chunk or else its final
    chunk)."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with httpx.Client(base_url=url, timeout=60) as http:
        if not body["stream"]:
            r = http.post(path, json=body)
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            return c["message"]["content"] if "message" in c else c["text"], c["finish_reason"], r.json()
        with http.stream("POST", path, json=body) as r:
            assert r.status_code == 200, r.read()
            events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    text = "".join(c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text", "")
                   for c in chunks)
    last = next((e for e in reversed(events[:-1]) if e.get("usage")), chunks[-1])
    return text, chunks[-1]["choices"][0]["finish_reason"], last


def _sum(m: dict, prefix: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(prefix))


def _url_metrics(url: str) -> dict[str, float]:
    class _At:
        pass
    at = _At()
    at.url = url
    return metrics(at)


def _counter(url: str, name: str) -> float:
    """A counter on an instance's /metrics (its _total sample, whatever its labels)."""
    m = _url_metrics(url)
    return m.get(f"tokenmill:{name}_total", 0)  # the connector's counters appear once they count


CASES = [(p, False) for p in (*PROMPTS, LONG)] + [(CHAT, True)]


def test_kv_transfer_params_accepted_by_an_instance(deployment):
    for chat in (False, True):
        body = {**_body(CHAT if chat else PROMPTS[0], False, chat), "kv_transfer_params": {"do_remote_decode": True}}
        _, finish, response = _generate(deployment.ref.url, body)
        # An instance without a connector ignores the params and returns none.
        assert finish == "length" and response["usage"]["completion_tokens"] == 8
        assert "kv_transfer_params" not in response


def test_2p1d_outputs_equal_colocated_and_decode_computes_no_prompt_token(deployment):
    d, decode = deployment, deployment.decode[0]
    expected = {json.dumps(p): _generate(d.ref.url, _body(p, False, chat))[:2] for p, chat in CASES}
    counted = ("kv_pulls", "kv_transferred_tokens", "prefix_cache_hits", "prompt_tokens", "prompt_tokens_computed")
    start = {c: _counter(decode, c) for c in counted}
    before = metrics(d.launcher)
    jobs = [(p, s, chat) for p, chat in CASES for s in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:  # one concurrent batch
        results = list(pool.map(lambda j: _generate(d.launcher.url, _body(j[0], j[1], j[2], usage=True)), jobs))
    prompt_tokens = 0
    for (prompt, stream, chat), (text, finish, last) in zip(jobs, results):
        assert (text, finish) == expected[json.dumps(prompt)], (prompt, stream)
        # The decode instance had every prompt token's KV (pulled, or in its own cache) and the first token
        usage = last["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"], (prompt, stream, usage)
        prompt_tokens += usage["prompt_tokens"]
    n, m = len(jobs), metrics(d.launcher)
    delta = {c: _counter(decode, c) - start[c] for c in counted}
    assert delta["kv_pulls"] == n and delta["prompt_tokens"] == prompt_tokens, delta
    assert delta["prompt_tokens_computed"] == 0, delta  # the "zero prompt tokens computed"
    assert _counter(d.prefill[0], "prompt_tokens_computed") + _counter(d.prefill[1], "prompt_tokens_computed") > 0
    # Every prompt token came by transfer, or from the decode instance's own prefix cache (the twins run
    # concurrently: the second may find the first's blocks there and pull only the rest).
    assert 0 < delta["kv_transferred_tokens"] <= prompt_tokens, delta
    assert delta["kv_transferred_tokens"] + delta["prefix_cache_hits"] == prompt_tokens, delta
    assert _counter(decode, "kv_pull_fallbacks") == 0
    assert _sum(m, "tokenmill:router_disagg_fallbacks_total") == 0
    phases = {u: _sum(m, f"tokenmill:router_disagg_requests_total{{replica={u},role=prefill}}")
              - _sum(before, f"tokenmill:router_disagg_requests_total{{replica={u},role=prefill}}") for u in d.prefill}
    assert sum(phases.values()) == n, phases
    assert _sum(m, f"tokenmill:router_disagg_requests_total{{replica={decode},role=decode}}") \
        - _sum(before, f"tokenmill:router_disagg_requests_total{{replica={decode},role=decode}}") == n


def test_responses_api_is_disaggregated_too(deployment):
    """/v1/responses through 2P1D: a one-token prefill phase (max_output_tokens 1), then the decode instance
    pulls the prompt's KV and takes the prefill's first token (no prompt token recomputed); the output equals
    the colocated instance's."""
    d, decode = deployment, deployment.decode[0]
    body = {"input": LONG, "instructions": "Continue.", "temperature": 0, "max_output_tokens": 8}
    expected = httpx.post(d.ref.url + "/v1/responses", json=body, timeout=60).json()
    pulls = _counter(decode, "kv_pulls")
    r = httpx.post(d.launcher.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output"][0]["content"][0]["text"] == expected["output"][0]["content"][0]["text"]
    assert out["status"] == expected["status"] == "incomplete"
    usage = out["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] == usage["input_tokens"], usage
    assert _counter(decode, "kv_pulls") == pulls + 1


class _Trap:
    """A listening socket on a free port that records whether anything connected to it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]

    def connected(self) -> bool:
        try:
            self.sock.accept()[0].close()
            return True
        except socket.timeout:
            return False


def _aimed_at(port) -> dict:
    """kv_transfer_params a client makes up, naming a pull source on 127.0.0.1:port."""
    return {"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "127.0.0.1", "remote_port": port,
            "remote_request_id": "r", "remote_block_ids": [0, 1], "num_tokens": 20, "kv_fingerprint": "ab"}


def test_decode_instance_refuses_pull_sources_a_client_names(deployment):
    """Issue 29, defect 10, on the decode instance itself: params naming a port that is not one of the prefill
    instances `--disaggregate` listed in its allowed_peers are a 400 and nothing connects there; a malformed port
    ("abc" once killed its engine) is a 400 too; the instance serves on."""
    decode, trap = deployment.decode[0], _Trap()
    with trap.sock, httpx.Client(base_url=decode, timeout=60) as http:
        for path, body in (("/v1/completions", {"prompt": LONG}),
                           ("/v1/chat/completions", {"messages": CHAT, "stream": True})):
            for params in (_aimed_at(trap.port), _aimed_at("abc")):
                r = http.post(path, json={**body, "max_tokens": 4, "kv_transfer_params": params})
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"].startswith("kv_transfer_params"), r.text
            assert "allowed_peers" in http.post(path, json={**body, "kv_transfer_params": _aimed_at(trap.port)}).text
        assert not trap.connected()
        assert http.get("/health").status_code == 200
    assert _generate(decode, _body(PROMPTS[0], False))[1] == "length"


def test_router_drops_the_clients_kv_transfer_params(deployment):
    """Issue 29, defect 10, through the router: a batch prompt skips the prefill phase and went to the decode
    instance with the client's body as it was, params included; the router now drops them (the batch is computed
    on the decode instance as before), and a single prompt's phases use only the prefill instance's params."""
    d, trap = deployment, _Trap()
    expected = [_generate(d.ref.url, _body(p, False))[0] for p in PROMPTS[:2]]
    with trap.sock:
        for params in (_aimed_at(trap.port), _aimed_at("abc"), {"surprise": 1}):
            r = httpx.post(d.launcher.url + "/v1/completions", timeout=60,
                           json={**_body(PROMPTS[:2], False), "kv_transfer_params": params})
            assert r.status_code == 200, r.text
            assert [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])] == expected
            body = {**_body(PROMPTS[0], True), "kv_transfer_params": params}
            assert _generate(d.launcher.url, body)[0] == expected[0]
        assert not trap.connected()
    assert _counter(d.decode[0], "kv_pull_fallbacks") == 0


def test_router_in_front_of_an_instance_without_a_connector(deployment):
    d = deployment
    router = d.router([d.ref.url], d.decode)  # (one URL cannot be both a prefill and a decode instance)
    cases = [(PROMPTS[0], False, False), (PROMPTS[3], True, False), (CHAT, False, True), (CHAT, True, True)]
    computed = _counter(d.decode[0], "prompt_tokens_computed")
    for prompt, stream, chat in cases:
        direct = _generate(d.ref.url, _body(prompt, False, chat))[:2]
        assert _generate(router.url, _body(prompt, stream, chat))[:2] == direct, (prompt, stream)
    assert _counter(d.decode[0], "prompt_tokens_computed") > computed  # no KV came: it computed the prompts
    m, n = metrics(router), len(cases)
    assert _sum(m, f"tokenmill:router_disagg_requests_total{{replica={d.ref.url},role=prefill}}") == n
    assert m[f"tokenmill:router_disagg_requests_total{{replica={d.decode[0]},role=decode}}"] == n
    # Its prefill instance has no connector: each decode instance recomputed the prompt.
    assert m["tokenmill:router_disagg_fallbacks_total{reason=no_kv_transfer_params}"] == n
    assert m["tokenmill:router_prefill_phase_seconds_count"] == n


def _wait_kv_empty(urls: list[str], timeout: float = 15) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        scraped = {u: _url_metrics(u) for u in urls}
        usage = {u: m["tokenmill:kv_cache_usage_perc"] for u, m in scraped.items()}
        held = {u: _sum(m, "tokenmill:kv_held_requests") for u, m in scraped.items()}  # producers only
        if not any(usage.values()) and not any(held.values()) or time.monotonic() > deadline:
            return {"usage": usage, "held": held}
        time.sleep(0.2)


def test_kv_caches_empty_after_requests_and_a_client_abort(deployment):
    d = deployment
    with httpx.Client(base_url=d.launcher.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=_body(LONG, True, max_tokens=400)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass  # one token arrived: the decode instance pulled the prompt and is decoding; then the abort
    assert _generate(d.launcher.url, _body(PROMPTS[1], False))[1] == "length"  # the engine serves on
    state = _wait_kv_empty([*d.prefill, *d.decode, d.ref.url])
    assert not any(state["usage"].values()) and not any(state["held"].values()), state
    assert _counter(d.decode[0], "kv_pull_fallbacks") == 0


def test_prefill_instance_killed_the_other_one_serves(deployment):
    import os

    d = deployment
    dead, alive = d.prefill
    before = metrics(d.launcher)
    assert before[f"tokenmill:router_disagg_requests_total{{replica={dead},role=prefill}}"] >= 1, before
    expected = {json.dumps(p): _generate(d.ref.url, _body(p, False, chat))[:2] for p, chat in CASES}
    os.killpg(d.instance_pid(dead), signal.SIGKILL)  # its engine process too (same session)
    pulls = _counter(d.decode[0], "kv_pulls")
    for prompt, chat in CASES:  # the prefix-aware policy sends the prompts it sent to `dead` there again
        assert _generate(d.launcher.url, _body(prompt, True, chat))[:2] == expected[json.dumps(prompt)], prompt
    m = metrics(d.launcher)
    assert m["tokenmill:router_disagg_retries_total{role=prefill}"] >= 1
    assert m[f"tokenmill:router_replica_healthy{{replica={dead}}}"] == 0
    assert _sum(m, f"tokenmill:router_disagg_requests_total{{replica={alive},role=prefill}}") \
        - _sum(before, f"tokenmill:router_disagg_requests_total{{replica={alive},role=prefill}}") == len(CASES)
    assert _sum(m, "tokenmill:router_disagg_fallbacks_total") == \
        _sum(before, "tokenmill:router_disagg_fallbacks_total")  # the KV still came by transfer
    assert _counter(d.decode[0], "kv_pulls") - pulls == len(CASES)
    state = _wait_kv_empty([alive, *d.decode])
    assert not any(state["usage"].values()) and not any(state["held"].values()), state


def test_bench_serve_reports_the_routers_counters(deployment, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "serve", "--base-url", deployment.launcher.url, "--num-prompts", "4", "--input-len", "16",
                 "--output-len", "4", "--tokenizer", tiny_model("llama"), "--warmup", "0", "--no-progress",
                 "--save-result", str(out)]) == 0
    assert "kv transfer" in capsys.readouterr().out
    kt = json.loads(out.read_text())["summary"]["kv_transfer"]
    assert kt["router_prefill_phases"] == 4 and kt["router_prefill_phase_mean_ms"] > 0, kt
    assert kt.get("router_fallbacks", 0) == 0, kt


def test_decode_instance_killed_before_answering_is_retried(deployment):
    """Last: it kills the colocated instance (here a second decode instance)."""
    d = deployment
    victim = d.ref
    router = d.router([d.prefill[1]], [d.decode[0], victim.url])
    expected = _generate(victim.url, _body(PROMPTS[1], False))[:2]
    victim.proc.send_signal(signal.SIGSTOP)  # it accepts connections but never answers
    key = f"tokenmill:router_replica_in_flight{{replica={victim.url}}}"
    results: list = []
    try:
        for _ in range(4):  # decode instances alternate on equal load: one of the first two requests goes to it
            t = threading.Thread(target=lambda: results.append(_generate(router.url, _body(PROMPTS[1], False))))
            t.start()
            deadline = time.monotonic() + 20
            while t.is_alive() and metrics(router).get(key, 0) < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            if t.is_alive():
                break
        assert metrics(router).get(key, 0) == 1, "no request reached the stopped decode instance"
        victim.proc.kill()  # it dies holding the request: the router retries on the launcher's decode instance
        t.join(60)
        assert not t.is_alive()
    finally:
        victim.proc.kill()
        victim.proc.wait(10)
    assert all(r[:2] == expected for r in results), results
    m = metrics(router)
    assert m["tokenmill:router_disagg_retries_total{role=decode}"] >= 1
    # A reset connection is checked with a probe before the replica is marked down (pool.report_failure): on
    # a loaded machine the probe may still be running when the retried request has finished.
    healthy = f"tokenmill:router_replica_healthy{{replica={victim.url}}}"
    deadline = time.monotonic() + 15
    while metrics(router)[healthy] != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metrics(router)[healthy] == 0
    assert _generate(router.url, _body(PROMPTS[2], True))[1] == "length"  # the other decode instance serves on
    # The retried request's KV came from the prefill instance that still held it: nothing recomputed.
    assert _counter(d.decode[0], "kv_pull_fallbacks") == 0
    state = _wait_kv_empty([d.prefill[1], *d.decode])
    assert not any(state["usage"].values()) and not any(state["held"].values()), state
    assert d.launcher.stop(signal.SIGINT, timeout=60) == 0, d.launcher.logs()


# -- its own deployment: 1P1D, probed every second ----------------------------------------------------------
def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not {what} after {timeout:.0f}s"
        time.sleep(0.2)


def _alive_on(launcher: CliProc, url: str, old_pid: int) -> bool:
    try:
        return instance_pid(launcher, url) != old_pid and httpx.get(url + "/health", timeout=2).status_code == 200
    except (RuntimeError, FileNotFoundError, httpx.HTTPError):
        return False


def test_disaggregate_relaunches_a_prefill_instance_that_died():
    """The instances `--disaggregate` started are kept running: a SIGKILLed prefill instance is started again on
    its port, the router takes it back, and requests are prefilled there again (nothing recomputed)."""
    launcher = ServerProc(tiny_model("llama"), "--disaggregate", "1P1D", "--health-check-interval", "1")
    try:
        (prefill,), (decode,) = _roles(launcher)["prefill"], _roles(launcher)["decode"]
        expected = _generate(launcher.url, _body(PROMPTS[1], False))[:2]
        pid = instance_pid(launcher, prefill)
        os.killpg(pid, signal.SIGKILL)  # its engine process too (same session)
        _wait(lambda: _alive_on(launcher, prefill, pid), 90, "relaunched")
        healthy = f"tokenmill:router_replica_healthy{{replica={prefill}}}"
        _wait(lambda: metrics(launcher).get(healthy) == 1, 10, "back in the router's pool")
        before = metrics(launcher)
        for stream in (False, True):
            assert _generate(launcher.url, _body(PROMPTS[1], stream))[:2] == expected
        m = metrics(launcher)
        served = f"tokenmill:router_disagg_requests_total{{replica={prefill},role=prefill}}"
        assert m[served] - before[served] == 2
        assert _sum(m, "tokenmill:router_disagg_fallbacks_total") == _sum(before, "tokenmill:router_disagg_fallbacks_total")
        assert "starting it again" in launcher.logs()
        assert launcher.stop(signal.SIGINT, timeout=60) == 0, launcher.logs()
    finally:
        launcher.stop(signal.SIGKILL)
