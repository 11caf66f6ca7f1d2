"""Disaggregated prefill/decode behind the router, with real `tokenmill serve` processes on 127.0.0.1.

The API carries kv_transfer_params in and out; `tokenmill router --prefill URL --decode URL...` runs each
request's prefill phase on the prefill instance and relays the decode instance's answer, which equals a
direct request to one instance (greedy, streamed and not); a decode instance killed while it holds a
request makes the router retry the other with nothing lost; `tokenmill serve --disaggregate 1P1D` is one
command whose decode instance computes only a transferred prompt's last token, and malformed --disaggregate
values are refused with one-line errors.
"""
from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from models import tiny_model
from server_utils import CliProc, ServerProc, metrics, sse_events
from tokenmill.cli import main
from tokenmill.engine.output_processor import OutputProcessor, RequestState
from tokenmill.engine.request import EngineCoreOutput, FinishReason
from tokenmill.router.disagg import is_batch, prefill_request
from tokenmill.sampling_params import SamplingParams

PROMPTS = ["Hello, my name is", "The capital of France is Paris. The capital of Italy is",
           "Paged attention stores keys and values in fixed-size blocks of tokens, and", "1 2 3 4 5 6 7"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]


# -- no servers --------------------------------------------------------------------------------------
def test_prefill_request_is_one_token_without_streaming():
    req = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True, "n": 3, "best_of": 3, "min_tokens": 4,
           "stream_options": {"include_usage": True}, "temperature": 0}
    body = prefill_request(req, chat=False)
    assert body == {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False, "n": 1, "temperature": 0,
                    "kv_transfer_params": {"do_remote_decode": True}}
    assert prefill_request({"messages": CHAT}, chat=True)["max_completion_tokens"] == 1
    assert req["max_tokens"] == 50  # the original is untouched: it goes to the decode instance
    assert is_batch({"prompt": ["a", "b"]}) and not is_batch({"prompt": ["a"]}) and not is_batch({"prompt": [1, 2]})


def test_finished_output_carries_kv_transfer_params():
    proc = OutputProcessor(None)
    params = SamplingParams(max_tokens=1, detokenize=False)
    proc.add_request(RequestState("r", None, [1, 2, 3], params, None, delta=True), ["r"])
    where = {"do_remote_prefill": True, "remote_block_ids": [0], "remote_port": 1}
    (out,), _ = proc.process([EngineCoreOutput("r", [7], finish_reason=FinishReason.LENGTH,
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


# -- a prefill instance, two decode instances, the router ----------------------------------------------
@pytest.fixture(scope="module")
def deployment():
    model = tiny_model("llama")
    with ThreadPoolExecutor(3) as pool:
        prefill, *decode = list(pool.map(lambda _: ServerProc(model), range(3)))
    router = CliProc(["router", "--prefill", prefill.url, *[a for d in decode for a in ("--decode", d.url)],
                      "--health-check-interval", "60", "--health-check-timeout", "60"], startup_timeout=60)
    yield prefill, decode, router
    for p in (router, prefill, *decode):
        p.stop()


def _body(prompt, stream: bool, chat: bool = False) -> dict:
    body = {"temperature": 0, "max_tokens": 8, "stream": stream}
    return {**body, "messages": prompt} if chat else {**body, "prompt": prompt}


def _generate(url: str, body: dict) -> tuple[str, str, dict]:
    """(text, finish_reason, the last JSON object: the response or the final chunk)."""
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
    return text, chunks[-1]["choices"][0]["finish_reason"], chunks[-1]


def _sum(m: dict, prefix: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(prefix))


def test_kv_transfer_params_accepted_by_an_instance(deployment):
    prefill, _, _ = deployment
    for chat in (False, True):
        body = {**_body(CHAT if chat else PROMPTS[0], False, chat), "kv_transfer_params": {"do_remote_decode": True}}
        _, finish, response = _generate(prefill.url, body)
        # An instance without a connector ignores the params and returns none.
        assert finish == "length" and response["usage"]["completion_tokens"] == 8
        assert "kv_transfer_params" not in response


def test_two_phase_output_equals_a_direct_request(deployment):
    prefill, decode, router = deployment
    cases = [(p, s, False) for p in PROMPTS for s in (False, True)] + [(CHAT, s, True) for s in (False, True)]
    before = metrics(router)
    for prompt, stream, chat in cases:
        direct = _generate(prefill.url, _body(prompt, False, chat))[:2]
        assert _generate(router.url, _body(prompt, stream, chat))[:2] == direct, (prompt, stream)
    m, n = metrics(router), len(cases)
    assert _sum(m, f"tokenmill:router_disagg_requests_total{{replica={prefill.url},role=prefill}}") \
        - _sum(before, f"tokenmill:router_disagg_requests_total{{replica={prefill.url},role=prefill}}") == n
    decoded = [_sum(m, f"tokenmill:router_disagg_requests_total{{replica={d.url},role=decode}}") for d in decode]
    assert sum(decoded) == n and min(decoded) >= 1, decoded  # least load, equals rotate
    # These instances run without --kv-transfer-config: each decode instance recomputed the prompt.
    assert m["tokenmill:router_disagg_fallbacks_total{reason=no_kv_transfer_params}"] == n
    assert m["tokenmill:router_prefill_phase_seconds_count"] == n


def test_decode_instance_killed_before_answering_is_retried(deployment):
    prefill, (d1, d2), router = deployment
    expected = _generate(prefill.url, _body(PROMPTS[1], False))[:2]
    d1.proc.send_signal(signal.SIGSTOP)  # it accepts connections but never answers
    key = f"tokenmill:router_replica_in_flight{{replica={d1.url}}}"
    results: list = []
    try:
        for _ in range(4):  # decode instances alternate on equal load: one of the first two requests goes to d1
            t = threading.Thread(target=lambda: results.append(_generate(router.url, _body(PROMPTS[1], False))))
            t.start()
            deadline = time.monotonic() + 20
            while t.is_alive() and metrics(router).get(key, 0) < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            if t.is_alive():
                break
        assert metrics(router).get(key, 0) == 1, "no request reached the stopped decode instance"
        d1.proc.kill()  # it dies holding the request: the router retries on d2
        t.join(60)
        assert not t.is_alive()
    finally:
        d1.proc.kill()
        d1.proc.wait(10)
    assert all(r[:2] == expected for r in results), results
    m = metrics(router)
    assert m["tokenmill:router_disagg_retries_total{role=decode}"] >= 1
    assert m[f"tokenmill:router_replica_healthy{{replica={d1.url}}}"] == 0
    assert _generate(router.url, _body(PROMPTS[2], True))[1] == "length"  # d2 serves on


# -- tokenmill serve --disaggregate 1P1D -----------------------------------------------------------------
def test_serve_disaggregate_as_one_command(deployment, tmp_path, capsys):
    prefill, _, _ = deployment
    s = ServerProc(tiny_model("llama"), "--disaggregate", "1P1D")
    try:
        for prompt, stream in [(PROMPTS[0], False), (PROMPTS[3], True)]:
            assert _generate(s.url, _body(prompt, stream))[:2] == _generate(prefill.url, _body(prompt, False))[:2]
        # The connector moved the prompt's KV: the decode instance computed only its last token.
        long_prompt = " ".join(PROMPTS[:3])
        text, finish, response = _generate(s.url, _body(long_prompt, False))
        assert (text, finish) == _generate(prefill.url, _body(long_prompt, False))[:2]
        usage = response["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1 > 16, usage
        m = metrics(s)
        assert m["tokenmill:router_disagg_fallbacks_total{reason=no_kv_transfer_params}"] == 0
        assert _sum(m, "tokenmill:router_disagg_requests_total") == 6  # three requests, two phases each
        assert _sum(m, "tokenmill:router_replica_healthy") == 2
        # tokenmill bench serve reports the router's disaggregation counters
        out = tmp_path / "bench.json"
        assert main(["bench", "serve", "--base-url", s.url, "--num-prompts", "4", "--input-len", "16",
                     "--output-len", "4", "--tokenizer", tiny_model("llama"), "--warmup", "0", "--no-progress",
                     "--save-result", str(out)]) == 0
        assert "kv transfer" in capsys.readouterr().out
        kt = json.loads(out.read_text())["summary"]["kv_transfer"]
        assert kt["router_prefill_phases"] == 4 and kt["router_prefill_phase_mean_ms"] > 0, kt
        assert kt.get("router_fallbacks", 0) == 0, kt
        assert s.stop(signal.SIGINT, timeout=60) == 0, s.logs()
    finally:
        s.stop()
