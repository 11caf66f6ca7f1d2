"""The start-up ledger (tokenmill/startup.py) and the request ledger (--enable-request-timing), on real
`tokenmill serve` processes with a tiny random model; `tokenmill bench serve`'s connection fields."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from models import tiny_model
from server_utils import API_KEY, CliProc, ServerProc, metrics, shared_server, sse_events
from tokenmill.cli import main
from tokenmill.models.resolution import resolve_engine_config
from tokenmill.startup import OTHER, Phase, critical_path

MODEL = "tiny-llama"
TIMING_KEYS = ("queue", "prefill", "decode", "detokenize", "total")
API_PHASES = ("interpreter", "imports", "model resolution", "tokenizer", "server setup", "serving start")
ENGINE_PHASES = ("engine process start", "kernels", "weight load", "weight packing", "kv allocation")


@pytest.fixture(scope="module")
def timed_server():
    """A server with --enable-request-timing whose warm start this test measures: spawn -> /health 200."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.frontend import load_tokenizer

    model = tiny_model("llama")  # built (once per session) before the clock starts
    load_tokenizer(resolve_engine_config(EngineConfig.from_kwargs(model=model, dtype="float32")))  # its resolution record
    t0 = time.time()
    server = ServerProc(model, "--served-model-name", MODEL, "--enable-request-timing", poll_s=0.02)
    measured = time.time() - t0
    yield server, measured
    server.stop()


@pytest.fixture(scope="module")
def plain_server(request):
    # the server test_server.py uses (shared within a session): no --enable-request-timing
    return shared_server(request.config, tiny_model("llama"), "--served-model-name", MODEL, api_key=API_KEY)


def test_critical_path_splits_overlaps_and_gaps():
    # b runs inside a's tail and ends later: the overlap is b's; the gap [4, 5) is nobody's
    phases = [Phase("a", 0.0, 3.0), Phase("b", 2.0, 4.0, "engine"), Phase("c", 5.0, 6.0)]
    r = critical_path(phases, origin=0.0, ready=6.5)
    assert r.total == 6.5
    assert r.critical == pytest.approx({"a": 2.0, "b": 2.0, "c": 1.0, OTHER: 1.5})
    assert sum(r.critical.values()) == pytest.approx(r.total)
    hidden = critical_path([Phase("long", 0.0, 5.0), Phase("hidden", 1.0, 2.0)], 0.0, 5.0)
    assert hidden.critical == {"long": 5.0, "hidden": 0.0}  # overlapped work adds nothing


def test_ledger_sums_to_measured_start(timed_server):
    server, measured = timed_server
    detail = httpx.get(server.url + "/health", params={"detail": 1}, timeout=10).json()
    startup = detail["startup"]
    shares = startup["phase_seconds"]
    assert set(API_PHASES + ENGINE_PHASES) <= set(shares)
    assert sum(shares.values()) == pytest.approx(startup["total_seconds"], abs=0.01)
    # spawn -> 200 as this test saw it (/health polled every 0.02 s) against process start -> ready: within 10%
    assert startup["total_seconds"] == pytest.approx(measured, rel=0.1)
    assert startup["total_seconds"] <= measured + 0.01  # the ledger ends before the 200 it answers
    assert shares.get(OTHER, 0.0) < 0.1 * startup["total_seconds"] + 0.3  # the phases cover the start
    by_name = {p["name"]: p for p in startup["phases"]}
    assert by_name["interpreter"]["start"] == 0.0 and by_name["weight load"]["process"] == "rank0"
    assert by_name["engine process start"]["process"] == "engine"
    assert all(p["seconds"] >= 0 for p in startup["phases"])
    # a warm start: the API process resolved the model from its record, without torch (the engine has it)
    assert "dtype selection" not in shares and "torch" not in startup["imported_at_ready"]


def test_plain_health_unchanged_and_metrics_have_the_phases(timed_server):
    server, _ = timed_server
    r = httpx.get(server.url + "/health", timeout=10)
    assert r.status_code == 200 and r.content == b""
    m = metrics(server)
    phases = {k: v for k, v in m.items() if k.startswith("tokenmill:startup_phase_seconds{")}
    assert {f"tokenmill:startup_phase_seconds{{phase={p}}}" for p in API_PHASES + ENGINE_PHASES} <= set(phases)
    assert sum(phases.values()) == pytest.approx(m["tokenmill:startup_seconds"], abs=0.01)


def _server_timing(header: str) -> dict[str, float]:
    """name -> dur (ms) of a Server-Timing header; entries without a dur (a stream's pointer) map to None."""
    out = {}
    for entry in header.split(","):
        name, *params = [x.strip() for x in entry.split(";")]
        durs = [float(p.removeprefix("dur=")) for p in params if p.startswith("dur=")]
        out[name] = durs[0] if durs else None
    return out


def _check_timing(t: dict[str, float]) -> None:
    assert set(TIMING_KEYS) <= set(t)
    assert all(v >= 0 for v in t.values())
    assert t["queue"] + t["prefill"] + t["decode"] <= t["total"] + 0.01
    assert t["prefill"] > 0 and t["total"] > 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_request_timing_header(timed_server, path):
    server, _ = timed_server
    body = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    body |= {"prompt": "Hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200
    _check_timing(_server_timing(r.headers["server-timing"]))
    assert "timing" not in r.json()  # the body stays OpenAI's


@pytest.mark.parametrize("include_usage", [False, True])
def test_request_timing_in_final_stream_chunk(timed_server, include_usage):
    server, _ = timed_server
    body = {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    last, rest = events[-2], events[:-2]
    assert ("usage" in last) == include_usage  # the last chunk before [DONE], whichever it is
    _check_timing({k.removesuffix("_ms"): v for k, v in last["timing"].items()})
    assert not any("timing" in e for e in rest)


def test_openai_sdk_parses_the_timed_stream(timed_server):
    server, _ = timed_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason is not None
    assert set(f"{k}_ms" for k in TIMING_KEYS) <= set(chunks[-1].model_extra["timing"])


def test_no_timing_without_the_flag(plain_server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
    r = httpx.post(plain_server.url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200 and "server-timing" not in r.headers
    with httpx.stream("POST", plain_server.url + "/v1/completions", json=body | {"stream": True}, headers=headers,
                      timeout=60) as s:
        assert not any("timing" in e for e in sse_events(s.iter_lines()) if e != "[DONE]")


def test_router_adds_its_time(timed_server):
    server, _ = timed_server
    router = CliProc(["router", "--replica", server.url, "--health-check-interval", "0.5"])
    try:
        body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
        t = _server_timing(r.headers["server-timing"])
        _check_timing(t)
        assert t["router"] >= 0
        with httpx.stream("POST", router.url + "/v1/completions", json=body | {"stream": True}, timeout=60) as s:
            assert _server_timing(s.headers["server-timing"])["router"] >= 0
            assert "timing" in sse_events(s.iter_lines())[-2]  # the replica's final chunk, relayed as is
    finally:
        router.stop()


def test_bench_serve_reports_connections(plain_server, tmp_path, capsys):
    out = tmp_path / "result.json"
    rc = main(["bench", "serve", "--base-url", plain_server.url, "--api-key", API_KEY, "--num-prompts", "6",
               "--max-concurrency", "2", "--input-len", "8", "--output-len", "3", "--warmup", "0",
               "--no-progress", "--save-result", str(out)])
    assert rc == 0
    assert "connections" in capsys.readouterr().out
    r = json.loads(out.read_text())
    s, recs = r["summary"], r["requests"]
    # keep-alive: 6 requests, at most 2 at once, so at most 2 connections; without it each request opens its own
    assert len(recs) == 6 and s["connections_opened"] <= 2
    assert s["connect_ms"]["count"] == s["connections_opened"]
    for x in recs:
        assert x["connect"] >= 0 and (x["connect"] > 0) == (not x["connection_reused"])
        if x["ttft"] is not None:  # (None when all 3 tokens decoded to no visible text yet)
            assert x["connect"] <= x["ttft"]


@pytest.mark.parametrize("args, message", [
    (["--llama-server-bin", "/nonexistent/llama-server"], "not an executable file"),
    (["--llama-server-bin", "/bin/true", "--", "."], "needs a .gguf model"),
    (["--cold-runs", "-1"], "--cold-runs must be 0 or more"),
    (["--compare-with", "/nonexistent"], "not a tokenmill source tree"),
])
def test_bench_startup_bad_peer_arguments(args, message, capsys):
    rc = main(["bench", "startup", *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1


def test_bench_startup_busy_neighbour_spins_one_core_and_stops():
    """--busy-neighbour (issue 29, defect 5: warm starts measured beside a process taking one core)."""
    from tokenmill.bench.startup import busy_neighbour

    def cpu_ticks(pid):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])

    with busy_neighbour(True) as spinner:
        time.sleep(0.1)
        start = cpu_ticks(spinner.pid)
        time.sleep(0.5)
        assert cpu_ticks(spinner.pid) - start >= 5  # >= 50 ms of CPU in 0.5 s: spinning, even on a loaded machine
    assert spinner.poll() is not None  # stopped with the block
    with busy_neighbour(False) as none:
        assert none is None
