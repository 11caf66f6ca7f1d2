"""The router's fleet with real `tokenmill serve` replicas (the default model): self-healing after SIGKILL, a
rolling upgrade under load, canary weights, drain (router and server), autoscaling 1 -> 3 -> 1 (slow) and
the Ray launcher.

One router launches two replicas (`--launch ... --min-replicas 2`) beside a canary group of one server it
was given by URL (25% of the requests); the tests run on it in order: canary weight, SIGKILL, upgrade, drain.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server_utils import CliProc, ServerProc, metrics, process_alive, require_default_model, sse_events
from tokenmill.router.pool import parse_replica_metrics

ADMIN = "admin-key"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
SERVE = "tokenmill serve --dtype float32 --kv-cache-memory-bytes 64MiB"
FLEET_FLAGS = ["--health-check-interval", "0.5", "--health-check-timeout", "1", "--admin-key", ADMIN,
               "--replica-threads", "1"]


def wait_for(what, timeout: float = 120.0, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what.__doc__ or what}")


def admin(router: CliProc) -> dict:
    return httpx.get(router.url + "/admin/replicas", headers=ADMIN_HEADERS, timeout=10).json()


def fleet_members(router: CliProc, state: str = "serving") -> list[dict]:
    return [m for m in admin(router)["fleets"][0]["replicas"] if m["state"] == state]


def request_once(url: str, i: int, max_tokens: int = 12) -> str:
    """One completion through the router: 'ok', 'cut' (a started stream ended by a clear error event and
    [DONE]) or 'failed: ...'. Every other request streams."""
    body = {"prompt": f"Request {i}: the weather today is", "max_tokens": max_tokens, "stream": i % 2 == 1}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=httpx.Timeout(60.0)) as r:
            if r.status_code != 200:
                return f"failed: {r.status_code} {r.read()[:200]!r}"
            if not body["stream"]:
                return "ok" if json.loads(r.read())["choices"][0]["text"] is not None else "failed: no text"
            events = sse_events(r.iter_lines())
    except httpx.HTTPError as e:
        return f"failed: {type(e).__name__}: {e}"
    if not events or events[-1] != "[DONE]":
        return f"failed: stream did not end with [DONE]: {events[-2:]}"
    errors = [e for e in events[:-1] if isinstance(e, dict) and "error" in e]
    if errors:
        return "cut" if errors[0]["error"].get("code") == "replica_failed" else f"failed: {errors[0]}"
    return "ok"


class Load:
    """`clients` threads sending requests through the router until stopped."""

    def __init__(self, url: str, clients: int) -> None:
        self.url, self.results, self.stopped = url, [], threading.Event()
        self.count = iter(range(10 ** 9))
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self) -> None:
        while not self.stopped.is_set():
            self.results.append(request_once(self.url, next(self.count)))

    def stop(self) -> list[str]:
        self.stopped.set()
        for t in self.threads:
            t.join(90)
        return self.results


def assert_no_kv_leak(server_url: str) -> None:
    """Once idle, the server holds no request and no KV block."""
    def idle():
        load = parse_replica_metrics(httpx.get(server_url + "/metrics", timeout=10).text)
        return load if load.running == 0 and load.waiting == 0 else None

    assert wait_for(idle, timeout=20).kv_usage == 0.0


@pytest.fixture(scope="module")
def fleet():
    """(router over 2 launched replicas + a canary group of one server at 25%, the canary server)."""
    require_default_model()
    canary = ServerProc(None, "--admin-key", ADMIN)
    router = CliProc(["router", "--launch", SERVE, "--min-replicas", "2", *FLEET_FLAGS,
                      "--group", f"canary={canary.url}:25%"])
    try:
        wait_for(lambda: len(fleet_members(router)) == 2, timeout=180)
        yield router, canary
    finally:
        router.stop()
        canary.stop()


def binomial_p_value(k: int, n: int, p: float) -> float:
    """Two-sided exact binomial test: the probability of an outcome at most as likely as k."""
    pmf = [math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(n + 1)]
    return min(1.0, sum(q for q in pmf if q <= pmf[k] * (1 + 1e-9)))


def test_canary_gets_its_weight_and_its_own_metrics(fleet):
    router, _ = fleet
    count = "tokenmill:router_request_duration_seconds_count{{group={}}}"
    before = metrics(router)
    n = 400
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: httpx.get(router.url + "/v1/models", timeout=30).status_code, range(n)))
    assert codes == [200] * n
    after = metrics(router)
    canary, default = (after[count.format(g)] - before.get(count.format(g), 0) for g in ("canary", "default"))
    assert canary + default == n
    assert binomial_p_value(int(canary), n, 0.25) > 1e-3, f"{canary} of {n} went to the 25% canary"
    # each group has its own latency histogram (a canary is judged by its own P99) and error count
    for g in ("canary", "default"):
        assert after[f"tokenmill:router_time_to_first_byte_seconds_count{{group={g}}}"] > 0
        assert f"tokenmill:router_request_duration_seconds_bucket{{group={g},le=1.0}}" in after


def busy_victim(router: CliProc) -> tuple[dict, Load]:
    """A launched replica with requests in flight from a 4-client load through the router (still running)."""
    victim = fleet_members(router)[0]
    load = Load(router.url, 4)

    def victim_busy():
        """the victim to have requests in flight"""
        return any(m["url"] == victim["url"] and m["in_flight"] > 0 for m in fleet_members(router))

    wait_for(victim_busy, timeout=60, every=0.05)
    return victim, load


def wait_replaced(router: CliProc, victim: dict) -> None:
    def replaced():
        """two serving replicas again, the victim not among them"""
        urls = [m["url"] for m in fleet_members(router)]
        return len(urls) == 2 and victim["url"] not in urls

    wait_for(replaced, timeout=180)


def test_sigkilled_replica_is_replaced_and_no_unstarted_request_is_lost(fleet):
    router, _ = fleet
    victim, load = busy_victim(router)
    os.kill(victim["pid"], signal.SIGKILL)
    time.sleep(3)  # the load goes on across the death
    results = load.stop()
    assert [r for r in results if r.startswith("failed")] == []
    assert results.count("ok") >= 8, results  # 'cut': a stream that had started there, ended with an error event
    wait_replaced(router, victim)
    assert not process_alive(victim["pid"])
    assert metrics(router)["tokenmill:router_fleet_events_total{event=replaced}"] >= 1
    for m in fleet_members(router):
        assert_no_kv_leak(m["url"])


@pytest.mark.slow
def test_hung_replica_is_replaced_after_the_grace_period_and_no_stream_hangs(fleet):
    router, _ = fleet
    victim, load = busy_victim(router)
    os.kill(victim["pid"], signal.SIGSTOP)  # alive but silent: only its health checks tell

    def missed_once():
        """a failed health check of the victim"""
        entry = next((r for r in admin(router)["replicas"] if r["url"] == victim["url"]), None)
        return entry is not None and entry["failures"] >= 1

    wait_for(missed_once, timeout=30, every=0.1)
    assert victim["url"] in [m["url"] for m in fleet_members(router)]  # one miss is not a death
    wait_replaced(router, victim)
    results = load.stop()  # returns: the streams that were on the hung replica ended when it was killed
    assert [r for r in results if r.startswith("failed")] == []
    assert not process_alive(victim["pid"])


def test_rolling_upgrade_under_load_fails_no_request(fleet):
    router, _ = fleet
    old = {m["url"] for m in fleet_members(router)}
    load = Load(router.url, 3)
    time.sleep(1)
    cmd = [sys.executable, "-m", "tokenmill.cli", "upgrade", "--router", router.url, "--launch",
           SERVE + " --max-num-seqs 32"]
    up = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "TOKENMILL_ADMIN_KEY": ADMIN})
    results = load.stop()
    assert up.returncode == 0, up.stderr
    assert {line.split(" -> ")[0] for line in up.stdout.splitlines() if " -> " in line} == old
    assert "2 replicas upgraded" in up.stdout
    assert len(results) >= 10 and set(results) == {"ok"}, [x for x in results if x != "ok"]
    now = fleet_members(router)
    assert len(now) == 2 and not old & {m["url"] for m in now}
    assert all(m["argv"][-2:] == ["--max-num-seqs", "32"] for m in now)
    for gone in admin(router)["fleets"][0]["retired"][-2:]:  # drained: nothing left there when stopped
        assert gone["in_flight"] == 0 and gone["running"] == 0 and gone["kv_usage"] == 0.0, gone
    for m in now:
        assert_no_kv_leak(m["url"])


def test_drain_a_replica_at_the_router_and_at_the_server(fleet):
    router, canary = fleet
    assert httpx.post(router.url + "/admin/drain", params={"replica": canary.url}).status_code == 401
    r = httpx.post(router.url + "/admin/drain", params={"replica": canary.url}, headers=ADMIN_HEADERS, timeout=60)
    assert r.json() == {"replica": canary.url, "drained": True, "stopped": False}
    assert canary.url not in [x["url"] for x in admin(router)["replicas"]]
    assert request_once(router.url, 0) == "ok"  # the launched replicas serve on

    launched = fleet_members(router)[0]["url"]  # started without --admin-key: its admin endpoints are off
    assert httpx.post(launched + "/admin/drain").json()["error"]["code"] == "admin_disabled"
    body = {"prompt": "Count: one, two,", "max_tokens": 24, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", canary.url + "/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # in flight when the drain starts
        r = httpx.post(canary.url + "/admin/drain", headers=ADMIN_HEADERS)
        assert r.json() == {"draining": True, "in_flight": 1}
        refused = httpx.post(canary.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "server_draining"
        assert httpx.get(canary.url + "/health").status_code == 503
        assert sse_events(lines)[-1] == "[DONE]"  # the request in flight finishes
    assert wait_for(lambda: httpx.get(canary.url + "/admin/drain", headers=ADMIN_HEADERS).json()["in_flight"] == 0)
    assert_no_kv_leak(canary.url)


def test_launched_canary_group_and_a_ttft_target_end_to_end():
    """`--group canary=tokenmill serve ...:25%` launches its own replica beside the --launch group, and a
    `--target ttft_p90` (set below what any generation takes) scales the default group 1 -> 2 under load;
    every request is answered, each group serves its share."""
    require_default_model()
    router = CliProc(["router", "--launch", SERVE, "--min-replicas", "1", "--max-replicas", "2",
                      "--target", "ttft_p90=0.05s", "--scale-down-delay", "600", *FLEET_FLAGS,
                      "--group", f"canary={SERVE}:25%"])
    try:
        def serving(group: str) -> list[dict]:
            fleet = next(f for f in admin(router)["fleets"] if f["group"] == group)
            return [m for m in fleet["replicas"] if m["state"] == "serving"]

        wait_for(lambda: len(serving("default")) == 1 and len(serving("canary")) == 1, timeout=180)
        load = Load(router.url, 3)
        wait_for(lambda: len(serving("default")) == 2, timeout=180)
        time.sleep(2)  # requests on the new replica too
        results = load.stop()
        assert results and [r for r in results if r != "ok"] == []
        m = metrics(router)
        assert m["tokenmill:router_fleet_events_total{event=scaled_up}"] == 1
        count = "tokenmill:router_request_duration_seconds_count{{group={}}}"
        assert m[count.format("canary")] > 0 and m[count.format("default")] > 0
        pool = {r["url"] for r in admin(router)["replicas"]}
        assert {r["url"] for r in serving("canary") + serving("default")} == pool  # 3 launched, all routed to
    finally:
        router.stop()


@pytest.mark.slow
def test_autoscaler_scales_1_to_3_to_1_under_stepped_load():
    require_default_model()
    router = CliProc(["router", "--launch", SERVE, "--min-replicas", "1", "--max-replicas", "3",
                      "--target", "queue=2", "--scale-down-delay", "3", *FLEET_FLAGS])
    try:
        wait_for(lambda: len(fleet_members(router)) == 1, timeout=180)
        light = Load(router.url, 1)  # 1 request at a time: half the target, no scaling
        time.sleep(4)
        assert len(fleet_members(router)) == 1 and not fleet_members(router, "starting")
        heavy = Load(router.url, 7)  # 8 at a time: 4x the target on one replica

        def three():
            """3 serving replicas"""
            return len(fleet_members(router)) == 3

        wait_for(three, timeout=240)
        time.sleep(2)
        results = light.stop() + heavy.stop()
        assert [r for r in results if r != "ok"] == []

        def one():
            """back to 1 serving replica, none draining or stopping"""
            return len(fleet_members(router)) == 1 and len(admin(router)["fleets"][0]["replicas"]) == 1

        wait_for(one, timeout=120)
        m = metrics(router)
        assert m["tokenmill:router_fleet_events_total{event=scaled_up}"] == 2
        assert m["tokenmill:router_fleet_events_total{event=scaled_down}"] == 2
        retired = admin(router)["fleets"][0]["retired"]
        assert len(retired) == 2 and all(r["in_flight"] == r["running"] == r["kv_usage"] == 0 for r in retired)
        assert_no_kv_leak(fleet_members(router)[0]["url"])
    finally:
        router.stop()


def test_ray_launcher_runs_serve_in_an_actor_and_reports_its_exit():
    """A Ray actor on the local Ray instance starts `tokenmill serve` on its node and reports its URL and
    pid; a replica that cannot start (a model that does not exist) is reported dead, not hanging."""
    ray = pytest.importorskip("ray")
    from tokenmill.fleet.launchers import RayLauncher

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        handle = RayLauncher(None, threads=1).start(["/nonexistent/model.gguf"])
        assert handle.url.startswith("http://") and handle.pid > 0
        wait_for(lambda: not handle.alive(), timeout=90)
        handle.kill()
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_router_launches_a_replica_on_ray():
    require_default_model()
    router = CliProc(["router", "--launcher", "ray", "--launch", SERVE, *FLEET_FLAGS])
    try:
        wait_for(lambda: len(fleet_members(router)) == 1, timeout=240)
        member = fleet_members(router)[0]
        assert admin(router)["fleets"][0]["launcher"] == "ray"
        assert request_once(router.url, 0) == "ok" and request_once(router.url, 1) == "ok"
    finally:
        router.stop()
    wait_for(lambda: not process_alive(member["pid"]), timeout=60)
