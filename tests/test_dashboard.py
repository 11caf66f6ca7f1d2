"""The live dashboard (/dashboard) of `tokenmill serve` and `tokenmill router`.

One real server on the default model (with --api-key) and one router in front of it serve the whole
module. The HTTP tests check the key guards the data, the snapshot stream agrees with /metrics and the
Grafana dashboard only names metrics /metrics has. The browser test drives Debian's chromium with
Playwright while a load runs (skipped when either is missing); its screenshots go to
$TOKENMILL_ARTIFACTS or pytest's tmp dir, never the repository.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time

import httpx
import pytest

from models import tiny_model
from server_utils import API_KEY, CliProc, ServerProc, metrics, require_default_model, shared_server
from tokenmill.serve.dashboard import Broadcaster, LatencyWindow, percentiles

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(request):
    require_default_model()
    return shared_server(request.config, None, api_key=API_KEY)


@pytest.fixture(scope="module")
def router(server):
    proc = CliProc(["router", "--replica", server.url, "--health-check-interval", "0.5"], api_key=API_KEY)
    yield proc
    proc.stop()


class Load:
    """A small steady load: `workers` threads sending short chat completions until stopped."""

    def __init__(self, url: str, workers: int = 2, max_tokens: int = 12) -> None:
        self.url, self.max_tokens, self.sent, self.errors = url, max_tokens, 0, []
        self.stop_event = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(workers)]

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=120) as c:
            while not self.stop_event.is_set():
                body = {"messages": [{"role": "user", "content": f"Count to {self.sent % 7 + i + 3}, please."}],
                        "max_tokens": self.max_tokens, "temperature": 0.8}
                r = c.post(self.url + "/v1/chat/completions", json=body, headers=AUTH)
                if r.status_code != 200:
                    self.errors.append(r.text)
                self.sent += 1

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(120)


def snapshots(url: str, n: int, timeout: float = 30) -> list[dict]:
    out = []
    with httpx.stream("GET", url + "/dashboard/api/events", headers=AUTH, timeout=timeout) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                if len(out) == n:
                    return out
    return out


def test_percentiles_nearest_rank():
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    p = percentiles(range(1, 101))
    assert (p["p50"], p["p90"], p["p99"]) == (50, 90, 99)
    assert percentiles([3.0]) == {"p50": 3.0, "p90": 3.0, "p99": 3.0}


def test_window_drops_old_requests(monkeypatch):
    from tokenmill.engine.output_processor import RequestTimes

    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])

    def stream(ttft: float, gaps: list[float]) -> RequestTimes:
        first = now[0] - sum(gaps)
        return RequestTimes(arrival=first - ttft, first_token=first, token_times=[(first, 1)] + [
            (first + sum(gaps[:i + 1]), 1) for i in range(len(gaps))])

    w = LatencyWindow(seconds=10, max_requests=3, max_gaps=16)
    for ttft in (5.0, 1.0, 3.0, 2.0):  # the oldest falls off (max_requests), its gaps with it
        w.add(stream(ttft, [0.5, 0.5]), ttft + 1.0)
    w.add(RequestTimes(), 0.2)  # no first token: counted, not in the percentiles
    p = w.percentiles()
    assert (p["ttft"]["p99"], p["ttft"]["p50"], p["e2e"]["p50"]) == (3.0, 2.0, 3.0)
    assert (p["requests"], p["without_token"], list(w.itl)) == (3, 1, [0.5] * 6)
    w.add(stream(4.0, [0.1, 0.2, 0.3, 0.4, 0.5]), 5.5)  # a long output: max_gaps // 8 of its gaps' quantiles
    assert list(w.itl)[-2:] == pytest.approx([0.1, 0.3]) and w.percentiles()["requests"] == 3
    big = LatencyWindow(seconds=10, max_requests=100, max_gaps=16)
    for _ in range(9):  # 18 gaps: the oldest request goes, with its 2
        big.add(stream(1.0, [0.5, 0.5]), 2.0)
    assert (big.percentiles()["requests"], len(big.itl)) == (8, 16)
    now[0] = 111.0  # every request ended before the window
    p = w.percentiles()
    assert p["ttft"] == p["itl"] == p["e2e"] == {"p50": None, "p90": None, "p99": None}
    assert (p["requests"], p["without_token"]) == (0, 0) and not w.itl and not w.times


def _drive_hooks(stats, requests, clock) -> None:
    """Call DashboardStats' hooks in the order AsyncLLM does for `requests`, each (arrival, first token or
    None, [later delta times], end or None: still open): first token, inter-token gaps, then on_finished
    with the request's RequestTimes when it ends (finished, or aborted with or without a first token)."""
    from tokenmill.engine.output_processor import RequestTimes

    events = []
    for i, (arrival, first, deltas, end) in enumerate(requests):
        s = RequestTimes(arrival=arrival)
        times = ([first] if first is not None else []) + deltas
        events += [(t, 0, s) for t in times if end is None or t <= end]
        if end is not None:
            events.append((end, 1, s))
    for t, kind, s in sorted(events, key=lambda e: (e[0], e[1])):
        clock[0] = t
        if kind == 0:
            if s.first_token is None:
                stats.on_first_token(t - s.arrival)
            else:
                stats.on_inter_token(t - s.last_token)
            s.on_tokens(t, t, 1)
        else:
            stats.on_finished(["abort" if s.first_token is None else "length"], t - s.arrival, 10,
                              len(s.token_times), s)


@pytest.mark.parametrize("seed", range(8))
def test_latency_percentiles_come_from_one_set_of_finished_requests(monkeypatch, seed):
    """Issue 29.3: E2E P50 1,060 ms below TTFT P50 9,854 ms. TTFT was taken when a first token came (of
    requests still running too) and E2E when a request ended (also those aborted before any token): two
    sets. Now every figure of the latency panel comes from the requests that ended in the window and had a
    first token, recorded together when each ends, so E2E >= TTFT at every percentile, whatever the mix."""
    import random

    from tokenmill.serve.dashboard import DashboardStats

    rng = random.Random(seed)
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    requests = []
    for _ in range(rng.randint(1, 60)):
        arrival = 1000 + rng.uniform(0, 30)
        first = arrival + rng.uniform(0.01, 12) if rng.random() < 0.8 else None
        deltas = [] if first is None else sorted(first + rng.uniform(0, 3) for _ in range(rng.randint(0, 20)))
        end = rng.choice([None, arrival + rng.uniform(0.01, 1.5),
                          max([arrival] + [t for t in [first, *deltas] if t is not None]) + rng.uniform(0, 0.5)])
        requests.append((arrival, first, deltas, end))
    # and always the capture's shape: long waits still running, short requests aborted before a token
    requests += [(1000.0, 1010.0, [1010.1], None)] * 3 + [(1001.0, None, [], 1002.0)] * 3
    stats = DashboardStats(window=600)
    _drive_hooks(stats, requests, clock)
    lat = stats.latency()
    ended = [r for r in requests if r[3] is not None and r[1] is not None and r[1] <= r[3]]
    assert lat["requests"] == len(ended)
    assert lat["without_token"] == sum(r[3] is not None and (r[1] is None or r[1] > r[3]) for r in requests)
    for q in ("p50", "p90", "p99"):
        ttft, e2e = lat["ttft"][q], lat["e2e"][q]
        assert (ttft is None) == (e2e is None) == (not ended)
        assert ttft is None or e2e >= ttft, (q, lat)
    # ITL: the gaps between the deltas of those same requests, and only those
    gaps = sorted(b - a for r in ended for a, b in zip([r[1], *r[2]], r[2]) if b <= r[3])
    assert lat["itl"] == percentiles(gaps)


def test_snapshots_carry_their_own_cost():
    import asyncio

    hub = Broadcaster(lambda: {"x": 1}, interval=0.25)
    first, second = (json.loads(asyncio.run(hub._snapshot()).decode()[6:]) for _ in range(2))
    assert first == {"x": 1, "snapshot_ms": 0.0, "snapshot_busy": 0.0}  # nothing built before it
    assert second["snapshot_ms"] > 0 and second["snapshot_busy"] == pytest.approx(second["snapshot_ms"] / 250, abs=1e-4)



def test_closing_a_broadcaster_ends_its_streams():
    """What a shutting-down server does to its dashboards: open streams end (after what they were sent), and a
    stream opened afterwards ends at once, so uvicorn has no open response to wait on."""
    import asyncio

    async def scenario():
        hub = Broadcaster(lambda: {"x": 1}, interval=0.01)
        stream = hub.stream()
        assert await anext(stream) == b"retry: 2000\n\n" and (await anext(stream)).startswith(b"data: ")
        hub.close()
        rest = [chunk async for chunk in stream]
        assert all(c.startswith(b"data: ") for c in rest) and not hub.listeners
        assert [chunk async for chunk in hub.stream()] == []
        await asyncio.sleep(0.05)
        assert hub.task is None  # the producer stopped too

    asyncio.run(asyncio.wait_for(scenario(), 5))

def test_engine_step_records(tiny):
    """The engine's per-step records: prefill + decode tokens add up to the tokens the steps ran."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(tiny("llama"), dtype="float32", kv_cache_memory_bytes="16MiB", step_records=True)
    engine = llm.engine
    outs = llm.generate(["hello there world", "a b c d e f"], SamplingParams(max_tokens=5, temperature=0,
                                                                           ignore_eos=True))
    records = engine.stats().steps
    assert records and all(len(r) == 7 for r in records)
    assert sum(r[2] for r in records) == sum(len(o.prompt_token_ids) for o in outs)
    assert sum(r[3] for r in records) == 2 * 4  # 5 tokens each, the first sampled at the end of the prefill
    assert all(r[1] > 0 and r[4] >= 1 and r[5] > 0 and r[6] > 0 for r in records)
    assert engine.stats().steps == []  # drained


def test_figures_measured_low_are_raised_to_what_steps_reach(tiny, tmp_path, monkeypatch, caplog):
    """A CPU figure measured on a busy machine (here: cached as 1 MB/s and 1 MFLOP/s) would put MBU/MFU over
    100%: the first step that beats it raises the ceilings to the observed rates, says so, and fixes the
    cache."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.engine import step_records

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    path = step_records._cpu_figures_path()
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        json.dump({"memory_bytes": 2**30, "bandwidth": 1e6, "flops": {"fp32": 1e6}}, f)
    llm = LLM(tiny("llama"), dtype="float32", kv_cache_memory_bytes="16MiB", step_records=True)
    with caplog.at_level("WARNING", logger="tokenmill"):
        llm.generate(["hello there world"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    records = llm.engine.stats().steps
    assert records and all(0 < r[5] <= 1 and 0 < r[6] <= 1 for r in records)
    assert sum("measured low" in m for m in caplog.messages) == 1
    with open(path) as f:
        assert json.load(f)["bandwidth"] > 1e6


def test_pages_are_public_but_data_needs_the_key(server, router):
    for base in (server.url, router.url):
        page = httpx.get(base + "/dashboard", timeout=10)
        assert page.status_code == 200 and "dashboard.js" in page.text
        assert httpx.get(base + "/dashboard/static/dashboard.js", timeout=10).status_code == 200
        for path in ("/dashboard/api/info", "/dashboard/api/events"):
            r = httpx.get(base + path, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = httpx.get(base + path, headers={"Authorization": "Bearer wrong"}, timeout=10)
            assert r.status_code == 401
    assert httpx.get(server.url + "/dashboard/api/info", headers=AUTH).json()["kind"] == "engine"
    assert httpx.get(router.url + "/dashboard/api/info", headers=AUTH).json()["kind"] == "router"
    missing = httpx.get(server.url + "/dashboard/static/secrets.txt", timeout=10)
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}


def test_snapshots_agree_with_metrics(server):
    with Load(server.url, workers=2):
        live = snapshots(server.url, 8)
    assert any(s["engine"].get("running", 0) > 0 for s in live)
    assert live[-1]["num_steps"] > live[0]["num_steps"]
    step = live[-1]["steps"][-1]
    assert step[2] + step[3] > 0 and step[4] >= 1 and step[5] > 0  # tokens, batch, MFU
    time.sleep(0.5)  # let the last outputs land
    snap, m = snapshots(server.url, 1)[0], metrics(server)
    tp = snap["throughput"]
    assert tp["generation_tokens"] == m["tokenmill:generation_tokens_total"] > 0
    assert tp["prompt_tokens"] == m["tokenmill:prompt_tokens_total"]
    done = sum(v for k, v in m.items() if k.startswith("tokenmill:request_success_total"))
    assert tp["finished_requests"] == done
    assert snap["latency"]["ttft"]["p50"] is not None and snap["latency"]["itl"]["p99"] is not None
    kv = snap["engine"]["kv"]
    assert kv["used"] + kv["cached_free"] + kv["free"] == kv["total"] == m["tokenmill:kv_cache_total_blocks"]
    assert snap["engine"]["prefix"]["queries"] == m["tokenmill:prefix_cache_queries_total"]
    rid = next(r["id"] for r in snap["requests"] if r["state"] == "finished")
    detail = httpx.get(f"{server.url}/dashboard/api/requests/{rid}", headers=AUTH, timeout=10).json()
    assert detail["tokens"] and all(b[0] >= a[0] for a, b in zip(detail["tokens"], detail["tokens"][1:]))
    cfg = httpx.get(server.url + "/dashboard/api/config?batch=4", headers=AUTH, timeout=60).json()
    assert cfg["config"]["dtype"] == "float32" and cfg["config"]["batch_invariant"] is False
    assert "decode" in cfg["plan"]["text"] and cfg["plan"]["batch_size"] == 4


def test_grafana_dashboard_uses_only_real_metrics(server):
    with open(os.path.join(ROOT, "docs", "grafana", "tokenmill.json")) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = {n for e in exprs for n in re.findall(r"tokenmill:[A-Za-z0-9_:]+", e)}
    assert len(names) >= 15
    text = httpx.get(server.url + "/metrics", timeout=10).text
    exported = set(re.findall(r"^(tokenmill:[A-Za-z0-9_:]+)", text, re.M))  # samples
    for line in re.findall(r"^# TYPE (\S+) (\S+)", text, re.M):  # families without samples yet (e.g. per position)
        name, kind = line
        exported |= {name, name + "_total"} if kind == "counter" else {name}
    missing = sorted(n for n in names if n not in exported)
    assert not missing, f"docs/grafana/tokenmill.json names metrics /metrics does not have: {missing}"


def test_no_dashboard_flag():
    srv = ServerProc(tiny_model("llama"), "--no-dashboard")
    try:
        assert httpx.get(srv.url + "/dashboard", timeout=10).status_code == 404
        assert httpx.get(srv.url + "/dashboard/api/events", timeout=10).status_code == 404
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    finally:
        srv.stop()


# -- in a real browser --------------------------------------------------------------------------------
def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    return path


@pytest.fixture(scope="module")
def browser():
    chromium = _chromium()
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    path = os.environ.get("TOKENMILL_ARTIFACTS") or str(tmp_path_factory.mktemp("dashboard-artifacts"))
    os.makedirs(path, exist_ok=True)
    return path


def _number(page, sel: str) -> float:
    text = page.inner_text(sel).replace(",", "")
    return float(text) if re.fullmatch(r"-?[\d.]+", text) else float("nan")


# One look at the page, in one synchronous script (so one snapshot's rendering): the tiles, what the request
# table's rows add up to, the latency table's cells, and whether the plan text fits its panel.
_PAGE_STATE = """() => {
  const rows = [...document.querySelectorAll('#t-requests tbody tr[data-state]')];
  const total = (k) => rows.reduce((a, r) => a + Number(r.dataset[k]), 0);
  const num = (id) => Number(document.getElementById(id).textContent.replace(/,/g, ''));
  const plan = document.getElementById('plan-text');
  return {tiles: {waiting: num('v-waiting'), running: num('v-running')},
          rows: {waiting: total('waiting'), running: total('running')},
          states: rows.filter((r) => r.dataset.id).map((r) => [r.dataset.state, r.cells[1].textContent,
                                                               Number(r.dataset.waiting), Number(r.dataset.running)]),
          latency: Object.fromEntries([...document.querySelectorAll('#t-latency tbody tr')].map(
            (tr) => [tr.cells[0].textContent, [...tr.cells].slice(1).map((td) => parseFloat(td.textContent))])),
          plan: [plan.scrollWidth, plan.clientWidth,
                 document.getElementById('panel-plan').scrollWidth, document.getElementById('panel-plan').clientWidth]};
}"""


def _check_page_state(st: dict) -> None:
    """Issue 29.3: the tiles equal what the table lists (a waiting tile of 0 beside 8 rows listed as waiting),
    each row's state matches its counts, and E2E >= TTFT at every percentile."""
    assert st["tiles"] == st["rows"], st
    for state, text, waiting, running in st["states"]:
        if state == "waiting":
            assert text == "waiting" and waiting > 0 and running == 0, st
        elif state == "running":
            assert text.startswith("running") and (waiting == 0) == (text == "running"), st
    lat = st["latency"]
    for ttft, e2e in zip(lat["TTFT"], lat["E2E"]):
        assert ttft != ttft or e2e >= ttft, lat  # NaN: '–', no request in the window yet


def test_dashboard_in_a_browser(server, router, browser, artifacts):
    page = browser.new_page(viewport={"width": 1280, "height": 1500})
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/dashboard")
    # The key is enforced: no data until it is given; a wrong one is refused.
    page.wait_for_selector("#key-form:not([hidden])", timeout=15000)
    assert page.is_hidden("#engine-view")
    page.fill("#key-input", "wrong")
    page.click("#key-form button")
    page.wait_for_function("document.querySelector('#key-error').textContent.includes('refused')", timeout=15000)
    # Until the first snapshot: a "waiting for the first snapshot" note, not empty panels (the stream is held
    # off here, then let through).
    held: list = []
    page.route("**/dashboard/api/events", lambda route: held.append(route))
    page.fill("#key-input", API_KEY)
    page.click("#key-form button")
    page.wait_for_selector("#first-snapshot:not([hidden])", timeout=15000)
    while not held:
        page.wait_for_timeout(50)
    assert page.is_hidden("#engine-view") and "first snapshot" in page.inner_text("#first-snapshot")
    page.screenshot(path=os.path.join(artifacts, "dashboard-first-paint.png"))
    held[0].continue_()
    page.unroute("**/dashboard/api/events")
    page.wait_for_selector("#engine-view:not([hidden])", timeout=15000)
    assert page.is_hidden("#first-snapshot")
    errors.clear()  # the 401s above are logged by the browser as failed loads: they are the point

    with Load(server.url, workers=2) as load:
        page.wait_for_function("Number(document.querySelector('#v-running').textContent) > 0", timeout=30000)
        first = {k: _number(page, f"#v-{k}") for k in ("gen-tokens", "finished", "steps")}
        page.wait_for_function(f"Number(document.querySelector('#v-steps').textContent.replace(/,/g, '')) > "
                               f"{first['steps'] + 20}", timeout=30000)
        page.wait_for_function(f"Number(document.querySelector('#v-finished').textContent) > {first['finished']}",
                               timeout=60000)
        page.wait_for_function("document.querySelectorAll('#t-requests tbody tr').length > 0", timeout=10000)
        assert _number(page, "#v-gen-tps") > 0
        assert page.inner_text("#v-hit") != "–" and page.inner_text("#t-latency").count("–") < 9
        page.wait_for_function("document.querySelector('#plan-text').textContent.includes('decode')", timeout=60000)
        plan = page.evaluate(_PAGE_STATE)["plan"]
        assert plan[0] <= plan[1] and plan[2] <= plan[3], plan  # the plan text is not cut off at the edge
        # A request of many prompts beside the load: some of its sequences wait (in the engine's queue, or
        # held back by the API), and every look at the page finds the tiles equal to what the table lists.
        prompts = [f"Prompt {i}: say a word" for i in range(64)]
        big = threading.Thread(target=lambda: httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=120,
                                                         json={"prompt": prompts, "max_tokens": 2}))
        big.start()
        looks = []
        while big.is_alive() or not looks:
            looks.append(page.evaluate(_PAGE_STATE))
            _check_page_state(looks[-1])
            if looks[-1]["tiles"]["waiting"] > 0 and not any(st["tiles"]["waiting"] > 0 for st in looks[:-1]):
                page.screenshot(path=os.path.join(artifacts, "dashboard-waiting.png"), full_page=True)
            page.wait_for_timeout(100)
        big.join()
        assert any(st["tiles"]["waiting"] > 0 for st in looks), looks[-1]
        assert any(st["tiles"]["running"] > 0 for st in looks), looks[-1]
        assert "SmolLM2" in page.inner_text("#t-config") and "float32" in page.inner_text("#t-config")
        page.click("#t-requests tbody tr[data-id]")
        page.wait_for_selector("#request-detail:not([hidden])", timeout=10000)
        page.screenshot(path=os.path.join(artifacts, "dashboard-under-load.png"), full_page=True)
    assert not load.errors, load.errors[:2]
    # Idle: the page's counters equal /metrics.
    time.sleep(1.5)
    m = metrics(server)
    done = sum(v for k, v in m.items() if k.startswith("tokenmill:request_success_total"))
    page.wait_for_function(f"Number(document.querySelector('#v-finished').textContent) == {done}", timeout=10000)
    page.wait_for_function("Number(document.querySelector('#v-gen-tokens').textContent.replace(/,/g, '')) == "
                           f"{m['tokenmill:generation_tokens_total']}", timeout=10000)
    _check_page_state(page.evaluate(_PAGE_STATE))

    # The playground streams an answer with per-token latency.
    page.fill("#pg-input", "What is the capital of France?")
    page.fill("#pg-temperature", "0")
    page.click("#pg-send")
    page.wait_for_function("document.querySelector('#pg-stats').textContent.includes('TTFT')", timeout=60000)
    assert "Paris" in page.inner_text("#pg-output")
    assert page.locator("#pg-output span").count() > 3
    page.screenshot(path=os.path.join(artifacts, "dashboard-playground.png"), full_page=True)

    assert not errors, errors  # no console errors on the engine's page
    # The router's view: its replica, healthy, and the requests routed through it.
    page.goto(router.url + "/dashboard")  # another origin (port): the key is asked again
    page.wait_for_selector("#key-form:not([hidden])", timeout=15000)
    page.fill("#key-input", API_KEY)
    page.click("#key-form button")
    page.wait_for_selector("#router-view:not([hidden])", timeout=15000)
    errors.clear()  # the 401 before the key again
    page.wait_for_function("document.querySelector('#r-healthy').textContent.startsWith('1 /')", timeout=15000)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for _ in range(3):
        assert httpx.post(router.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60).status_code == 200
    page.wait_for_function("Number(document.querySelector('#r-requests').textContent) >= 3", timeout=15000)
    assert server.url in page.inner_text("#t-replicas")
    page.screenshot(path=os.path.join(artifacts, "dashboard-router.png"), full_page=True)
    assert not errors, errors
    page.close()


def _stream_until_closed(url: str, api_key: str, out: dict) -> None:
    """Reads a dashboard stream until the server ends it; out['events'] counts snapshots, out['ended'] is
    set when the stream ended cleanly (the server closed it, not a read error)."""
    out["events"] = 0
    try:
        with httpx.stream("GET", url + "/dashboard/api/events", headers={"Authorization": f"Bearer {api_key}"},
                          timeout=httpx.Timeout(60, connect=5)) as r:
            for line in r.iter_lines():
                out["events"] += line.startswith("data: ")
        out["ended"] = time.monotonic()
    except httpx.HTTPError as e:
        out["error"] = repr(e)


@pytest.mark.parametrize("kind", ["serve", "router"])
def test_open_dashboard_stream_does_not_hold_up_shutdown(server, kind):
    """SIGINT/SIGTERM with a dashboard stream open: the stream ends and the process exits at once, rather than
    after the whole --shutdown-timeout (30 s) the snapshot stream, which never ends by itself, held it for."""
    if kind == "serve":
        proc = ServerProc(None, api_key=API_KEY)
    else:
        proc = CliProc(["router", "--replica", server.url, "--health-check-interval", "0.5"], api_key=API_KEY)
    try:
        sig = signal.SIGINT if kind == "serve" else signal.SIGTERM  # Ctrl-C; a service manager's stop
        out: dict = {}
        reader = threading.Thread(target=_stream_until_closed, args=(proc.url, API_KEY, out), daemon=True)
        reader.start()
        deadline = time.monotonic() + 30
        while out.get("events", 0) < 2 and time.monotonic() < deadline and reader.is_alive():
            time.sleep(0.05)
        assert out.get("events", 0) >= 2, out
        t0 = time.monotonic()
        proc.proc.send_signal(sig)
        try:
            code = proc.proc.wait(10)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - t0
        reader.join(5)
        assert code == 0 and took < 5, f"{kind} exited {code} {took:.1f}s after {sig.name}: {proc.logs()[-2000:]}"
        assert "ended" in out and out["ended"] - t0 < 5, out
    finally:
        proc.stop(signal.SIGKILL)
        os.unlink(proc.log.name)
