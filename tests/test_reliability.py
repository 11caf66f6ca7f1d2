"""Soak and fault runs against a real `tokenmill serve` on the built-in default model (SmolLM2-135M): many
concurrent streams with clients walking away, mass aborts, slow and idle clients, the engine killed under
load, and a schemathesis fuzz of the HTTP API from its own OpenAPI document.

CI runs short versions; `TOKENMILL_SOAK=1 pytest -s tests/test_reliability.py` runs the full
sizes the issue asks for (1000 streams, 10,000 aborts, 1000 idle connections, a longer fuzz). Each test
prints its figures (`pytest -s` shows them)."""
from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

import httpx
import pytest

from server_utils import ServerProc, metrics, require_default_model, sse_events

FULL = os.environ.get("TOKENMILL_SOAK") == "1"
SIZES = {"streams": 1000 if FULL else 120, "aborts": 10000 if FULL else 300, "idle": 1000 if FULL else 200,
         "fuzz": 60 if FULL else 4}


@pytest.fixture(scope="module")
def server():
    require_default_model()
    # --batch-invariant: a request's greedy tokens do not depend on what else is in the batch, so each
    # stream can be compared with its own request run alone (a crossed stream cannot pass).
    s = ServerProc(None, "--max-model-len", "256", "--batch-invariant", "--max-num-seqs", "64",
                   "--kv-cache-memory-bytes", "96MiB", startup_timeout=600)
    yield s
    s.stop(signal.SIGKILL)


def _rss_kib(pid: int) -> int:
    """Anonymous resident memory: what a leak grows. The GGUF's mapped weights are file pages, paged in as
    they are first read (the embedding a row at a time as new tokens are looked up), which is no leak."""
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("RssAnon")).split()[1])


def _wait_idle(server, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if (m["tokenmill:num_requests_running"] == 0 and m["tokenmill:num_requests_waiting"] == 0
                and m["tokenmill:kv_cache_usage_perc"] == 0.0) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def _body(i: int, max_tokens: int = 12) -> dict:
    return {"prompt": f"Request {i}: the number {i * 7919 % 1000} is", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}


async def _stream(client: httpx.AsyncClient, body: dict, walk_away: bool) -> str | None:
    """The stream's text, or None if this client disconnected after its first token."""
    text = ""
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                return text
            event = json.loads(data)
            assert "error" not in event, event
            text += event["choices"][0]["text"]
            if walk_away and text:
                return None
    raise AssertionError("stream ended without [DONE]")


def test_concurrent_streams_with_disconnects(server):
    n = SIZES["streams"]
    rng = random.Random(0)
    walk = [rng.random() < 0.3 for _ in range(n)]
    engine = server.engine_pid()
    rss0 = _rss_kib(engine)

    async def run():
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as c:
            return await asyncio.gather(*(_stream(c, _body(i), walk[i]) for i in range(n)))

    probes: list[float] = []
    stop = threading.Event()

    def probe():  # the event loop must answer a health check within a second while the engine is saturated
        while not stop.wait(0.25):
            t = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=5).status_code == 200
            probes.append(time.monotonic() - t)

    prober = threading.Thread(target=probe)
    prober.start()
    t0 = time.monotonic()
    try:
        texts = asyncio.run(run())
    finally:
        stop.set()
        prober.join()
    elapsed = time.monotonic() - t0
    m = _wait_idle(server)
    assert m["tokenmill:num_requests_running"] == 0 and m["tokenmill:kv_cache_usage_perc"] == 0.0, m
    # None lost, none crossed: every finished stream equals its own request, run alone afterwards.
    done = [i for i in range(n) if not walk[i]]
    assert all(texts[i] is not None for i in done)
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for i in done[:: max(1, len(done) // 40)]:
            alone = c.post("/v1/completions", json=_body(i)).json()["choices"][0]["text"]
            assert texts[i] == alone, (i, texts[i], alone)
    rss1 = _rss_kib(engine)
    print(f"\n[soak] {n} streams ({sum(walk)} walked away) in {elapsed:.1f}s; engine RSS {rss0 / 1024:.0f} -> "
          f"{rss1 / 1024:.0f} MiB; KV usage after {m['tokenmill:kv_cache_usage_perc']}; /health max "
          f"{max(probes) * 1000:.0f} ms over {len(probes)} probes")
    assert max(probes) < 1.0


def test_mass_aborts_after_first_token_leak_nothing(server):
    """Anonymous memory after a round of n aborted streams stays within 5% of where it was after a first round
    (the first batches of 64 streams grow the allocator's and kernels' buffers once: 256 -> 312 MiB, then
    312 -> 319 -> 319 -> 319 over four rounds of 300, measured). On a loaded machine a later round can still
    raise the allocator's high-water mark once (+8-10% seen in full suite runs); a leak grows every round, so
    a round past 5% gets one more, which must not."""
    n = SIZES["aborts"]
    engine = server.engine_pid()

    async def run(count: int):
        sem = asyncio.Semaphore(64)
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as c:
            async def one(i):
                async with sem:
                    return await _stream(c, _body(i, max_tokens=64), walk_away=True)
            return await asyncio.gather(*(one(i) for i in range(count)))

    asyncio.run(run(n))  # warm-up: the steady state is what must not grow
    _wait_idle(server)
    rss0 = _rss_kib(engine)
    t0 = time.monotonic()
    results = asyncio.run(run(n))
    elapsed = time.monotonic() - t0
    assert all(r is None for r in results)
    m = _wait_idle(server)
    assert m["tokenmill:num_requests_running"] == 0 and m["tokenmill:kv_cache_usage_perc"] == 0.0, m
    rss1 = _rss_kib(engine)
    print(f"\n[soak] {n} requests aborted after their first token in {elapsed:.1f}s; engine RSS "
          f"{rss0 / 1024:.0f} -> {rss1 / 1024:.0f} MiB ({(rss1 / rss0 - 1) * 100:+.1f}%)")
    if rss1 >= rss0 * 1.05:
        assert all(r is None for r in asyncio.run(run(n)))
        _wait_idle(server)
        rss2 = _rss_kib(engine)
        print(f"[soak] one more round: {rss1 / 1024:.0f} -> {rss2 / 1024:.0f} MiB")
        assert rss2 < rss1 * 1.05


def test_slow_and_idle_clients_do_not_block_others(server):
    host, port = "127.0.0.1", server.port
    idle = []
    for _ in range(SIZES["idle"]):
        s = socket.create_connection((host, port))
        s.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())  # then it stays, kept alive
        idle.append(s)
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    trickle = socket.create_connection((host, port))
    trickle.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n".encode())
    stop = threading.Event()

    def drip():  # one byte a second
        for b in body:
            if stop.wait(1.0):
                return
            trickle.sendall(bytes([b]))

    t = threading.Thread(target=drip)
    t.start()
    try:
        latencies = []
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for i in range(5):
                t0 = time.monotonic()
                r = c.post("/v1/completions", json=_body(i, max_tokens=4))
                latencies.append(time.monotonic() - t0)
                assert r.status_code == 200
        print(f"\n[soak] {len(idle)} idle keep-alive connections + a 1 byte/s body: other requests took "
              f"max {max(latencies) * 1000:.0f} ms")
        assert max(latencies) < 10
    finally:
        stop.set()
        t.join()
        for s in idle + [trickle]:
            s.close()


# The largest completions request the default limits allow (--max-prompts-per-request 2048), ~100 KB of text
BIG_PROMPTS = [f"Prompt {i:04d}: list the first prime numbers, then" for i in range(2048)]


def _dashboard_snapshot(server) -> dict:
    with httpx.stream("GET", server.url + "/dashboard/api/events", timeout=30) as r:
        return json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])


def _short_latency(c: httpx.Client) -> float:
    t0 = time.monotonic()
    r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


def test_largest_request_delays_a_short_one_by_under_a_second(server):
    """Issue 29.7: one request of 1000 prompts x n=128 made a 4-token request take 398 s (the engine runs
    requests in arrival order, and all of it had arrived first). A large request now reaches the engine a
    window at a time, and what waits is counted where /metrics and /health can see it. The big request is
    streamed and closed after the measurement (its disconnect aborts the rest), so this stays cheap."""
    body = {"prompt": BIG_PROMPTS, "max_tokens": 1, "temperature": 0, "stream": True}
    assert 90_000 < len(json.dumps(body)) < 110_000
    admitted, done = threading.Event(), threading.Event()
    big: dict = {"finished": 0}
    probes: list[float] = []

    def send_big():
        with httpx.Client(base_url=server.url, timeout=600) as c, c.stream("POST", "/v1/completions", json=body) as r:
            big["status"] = r.status_code
            admitted.set()
            for line in r.iter_lines():
                big["finished"] += line.count('"finish_reason":"length"')
                if done.is_set():
                    return  # closing the stream aborts what is left

    def probe():
        while not done.wait(0.1):
            t0 = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            probes.append(time.monotonic() - t0)

    with httpx.Client(base_url=server.url, timeout=300) as c:
        alone = sorted(_short_latency(c) for _ in range(3))[1]
        sender, prober = threading.Thread(target=send_big), threading.Thread(target=probe)
        sender.start()
        prober.start()
        try:
            assert admitted.wait(60) and big["status"] == 200, big
            beside = [_short_latency(c) for _ in range(3)]
            waiting = httpx.get(server.url + "/health?detail=1", timeout=30).json().get("num_requests_waiting")
            scraped = metrics(server)["tokenmill:num_requests_waiting"]
            tile = _dashboard_snapshot(server)["engine"]["waiting"]
            finished = big["finished"]
        finally:
            done.set()
            sender.join()
            prober.join()
    print(f"\n[big request] 2048 prompts ({len(json.dumps(body)) / 1000:.0f} KB): a 2-token request alone "
          f"{alone * 1000:.0f} ms, beside it {[round(x * 1000) for x in beside]} ms; /health max "
          f"{max(probes) * 1000:.0f} ms over {len(probes)} probes; {waiting} sequences waiting "
          f"({finished} finished)")
    assert max(beside) - alone < 1.0
    assert max(probes) < 1.0
    # Counted while it is in flight: what the API process holds back plus what the engine has not started
    assert finished < 1500 and waiting >= 2048 - finished - 64 - 200 and scraped >= 2048 - finished - 64 - 400
    assert tile >= 2048 - finished - 64 - 400, tile  # the dashboard's tile counts the same
    assert _wait_idle(server)["tokenmill:num_requests_waiting"] == 0


def test_eight_megabytes_of_token_ids_do_not_stall_the_event_loop(server):
    """A body just under the default --max-request-body-bytes (8 MiB) of token ids, ~3.9M of them: the UTF-8
    check made a Python call per id and the prompt was checked id by id before its length, 2.4 s on the
    event loop that serves every other request. A short request sent meanwhile must not wait > 1 s."""
    body = ('{"prompt": [[' + ",".join(["1"] * 3_900_000) + "]], \"max_tokens\": 1}").encode()
    assert 7_000_000 < len(body) < 8 << 20
    with httpx.Client(base_url=server.url, timeout=120) as c:
        alone = sorted(_short_latency(c) for _ in range(3))[1]
        beside: list[float] = []
        sent = threading.Event()

        def shorts():
            sent.wait()
            with httpx.Client(base_url=server.url, timeout=120) as c2:
                for _ in range(10):
                    beside.append(_short_latency(c2))
        t = threading.Thread(target=shorts)
        t.start()
        sent.set()
        r = c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        t.join()
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"], r.text[:300]
    print(f"\n[8 MB of token ids] 400 in {r.elapsed.total_seconds():.2f}s; a 2-token request alone "
          f"{alone * 1000:.0f} ms, beside it max {max(beside) * 1000:.0f} ms")
    assert max(beside) - alone < 1.0


def test_fuzz_openapi_no_server_errors():
    """schemathesis generates requests from the server's own /openapi.json: none may get a 5xx or hang,
    and the server is healthy afterwards. Its own server, in the default mode users run (not the module's
    batch-invariant one), with a 64-token context: the coverage phase sends ~1600 requests, and those that leave
    max_tokens unset generate to the end of the context (at 256 tokens the run took 124 s of the suite, at 96
    about 60 s, at 64 about 50 s, with the same verdicts)."""
    exe = shutil.which("schemathesis") or shutil.which("st")
    if exe is None:
        pytest.skip("schemathesis is not installed (pip install -e '.[dev]')")
    require_default_model()
    server = ServerProc(None, "--max-model-len", "64", "--max-num-seqs", "64",
                        "--kv-cache-memory-bytes", "96MiB", startup_timeout=600)
    try:
        cmd = [exe, "run", server.url + "/openapi.json", "--checks", "not_a_server_error", "--max-examples",
               str(SIZES["fuzz"]), "--request-timeout", "120", "--seed", "1", "--suppress-health-check", "all",
               "--generation-deterministic"]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tempfile.gettempdir())
        tail = "\n".join(proc.stdout.splitlines()[-25:])
        print(f"\n[fuzz] {time.monotonic() - t0:.0f}s\n{tail}")
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    finally:
        server.stop()


def test_engine_killed_under_load_fails_streams_and_recovers(server):
    """Last in the module: the engine restarts after this."""
    results: list = []

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            async def one(i):
                events = []
                async with c.stream("POST", "/v1/completions",
                                    json={**_body(i, max_tokens=200), "stream": True}) as r:
                    events = sse_events([line async for line in r.aiter_lines()])
                results.append(events)
            await asyncio.gather(*(one(i) for i in range(16)))

    def killer():
        time.sleep(1.5)
        os.kill(server.engine_pid(), signal.SIGKILL)

    k = threading.Thread(target=killer)
    k.start()
    t0 = time.monotonic()
    asyncio.run(asyncio.wait_for(run(), 60))
    k.join()
    assert len(results) == 16
    assert all(e[-1] == "[DONE]" and "error" in e[-2] for e in results), [e[-2:] for e in results]
    health = httpx.get(server.url + "/health", timeout=5)
    assert health.status_code == 503 or health.status_code == 200  # restarting, or already back
    deadline = time.monotonic() + 120
    while httpx.get(server.url + "/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    print(f"\n[fault] engine SIGKILL with 16 streams open: all ended with an error event; serving again after "
          f"{time.monotonic() - t0:.1f}s")
    r = httpx.post(server.url + "/v1/completions", json=_body(1, max_tokens=3), timeout=60)
    assert r.status_code == 200
