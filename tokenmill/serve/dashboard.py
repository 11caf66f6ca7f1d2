"""The live dashboard at /dashboard: static pages (serve/static/) and one server-sent-events stream of
snapshots a few times a second.

Data comes from what the API process already receives: AsyncLLM's metric hooks (tokens, and each request's
event times when it ends, for TTFT, ITL and E2E; fanned out to ServerMetrics and to DashboardStats), the
EngineStats that arrive with every step (KV blocks, prefix-cache and speculation counters, and the engine's
per-step records, engine/step_records.py) and the open requests' records (running and waiting: what the
API has sent and the engine has or has not yet scheduled, the same count the request table is made of).
One producer task builds each snapshot once and hands it to every open stream, so more viewers cost almost
nothing more, and it runs only while one is open.

Authentication: the pages themselves hold no data and are served to anyone; everything under
/dashboard/api/ is guarded by --api-key like /v1 (http/auth.py's PROTECTED). The page asks for the key, keeps it
in the tab's sessionStorage and sends it as `Authorization: Bearer` on fetch() — the SSE stream is read
with fetch() and a stream reader rather than EventSource, which cannot send headers; the key is never put
in a URL (URLs end up in logs and browser history).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import weakref
from collections import deque
from itertools import islice
from importlib import resources
from typing import Any, Awaitable, Callable, Optional

from fastapi import FastAPI
from starlette.responses import Response, StreamingResponse

from tokenmill.engine.output_processor import RequestTimes
from tokenmill.http.errors import APIError

logger = logging.getLogger("tokenmill")

WINDOW_S = 60.0           # latency percentiles over the requests that ended in this sliding window
SNAPSHOT_INTERVAL_S = 0.25
_STATIC = ("dashboard.html", "dashboard.js", "dashboard.css")


def percentiles(values, qs=(50, 90, 99)) -> dict[str, Optional[float]]:
    """Nearest-rank percentiles (None for an empty window)."""
    v = sorted(values)
    if not v:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": v[min(len(v), max(1, math.ceil(q / 100 * len(v)))) - 1] for q in qs}


class LatencyWindow:
    """The requests that ended in the last `seconds` (at most `max_requests` of them, and at most `max_gaps`
    inter-token gaps among them), each recorded whole when it ends: its TTFT, its E2E and the gaps between its
    deltas. Every figure of the latency panel is then over one set of requests: per request e2e >= ttft, so
    E2E >= TTFT at every percentile too (sorting both lists keeps that rank by rank). Taken when they happen
    instead, TTFT included requests still running and E2E those aborted before a token (two sets: an E2E P50
    of 1 s under a TTFT P50 of 10 s). A request that ended before its first token has no TTFT: it is counted
    (`without_token`), not mixed in. Values are kept in plain deques so a snapshot's percentiles are a few
    C-level sorts (about 1 ms for the largest window), not a Python filter."""

    def __init__(self, seconds: float, max_requests: int, max_gaps: int) -> None:
        self.seconds, self.max_requests, self.max_gaps = seconds, max_requests, max_gaps
        self.times: deque = deque()      # when each request ended, oldest first
        self.ttft: deque = deque()
        self.e2e: deque = deque()
        self.num_gaps: deque = deque()   # how many of `itl` each request put there
        self.itl: deque = deque()
        self.without_token: deque = deque()  # when requests without a first token ended

    def add(self, times: Optional[RequestTimes], e2e: float) -> None:
        """A request ended `e2e` seconds after it arrived; `times` are its event times."""
        now = time.monotonic()
        if times is None or times.first_token is None:
            self.without_token.append(now)
            return
        ttft = times.first_token - times.arrival
        times = [t for t, _ in times.token_times]
        gaps = [b - a for a, b in zip(times, times[1:])]
        share = max(1, self.max_gaps // 8)
        if len(gaps) > share:  # a very long output: evenly spaced quantiles of its gaps stand for all of them
            gaps.sort()
            gaps = [gaps[i * len(gaps) // share] for i in range(share)]
        self.times.append(now)
        self.ttft.append(ttft)
        self.e2e.append(max(e2e, self.ttft[-1]))  # the caller's clock read: the invariant must not hang on it
        self.num_gaps.append(len(gaps))
        self.itl.extend(gaps)
        while len(self.times) > 1 and (len(self.times) > self.max_requests or len(self.itl) > self.max_gaps):
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        self.times.popleft()
        self.ttft.popleft()
        self.e2e.popleft()
        for _ in range(self.num_gaps.popleft()):
            self.itl.popleft()

    def percentiles(self) -> dict[str, Any]:
        cutoff = time.monotonic() - self.seconds
        while self.times and self.times[0] < cutoff:
            self._drop_oldest()
        while self.without_token and self.without_token[0] < cutoff:
            self.without_token.popleft()
        return {"ttft": percentiles(self.ttft), "itl": percentiles(self.itl), "e2e": percentiles(self.e2e),
                "requests": len(self.times), "without_token": len(self.without_token), "window_s": self.seconds}


class DashboardStats:
    """AsyncLLM's stat hooks, kept as a window of finished requests (for percentiles) and running totals."""

    def __init__(self, window: float = WINDOW_S, max_requests: int = 4096, max_gaps: int = 8192,
                 max_steps: int = 2048) -> None:
        # bounded, so sorting them a few times a second stays cheap on the event loop however fast requests
        # end (a fast GPU: the last max_requests, not 60 s)
        self.finished = LatencyWindow(window, max_requests, max_gaps)
        self.steps: deque = deque(maxlen=max_steps)  # engine step records, oldest first
        self.num_steps = 0
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.finished_requests = 0
        self.engine = None  # the last EngineStats

    def on_scheduled(self, queue_time: float) -> None:
        pass

    def on_first_token(self, ttft: float) -> None:
        pass  # recorded with the rest of the request when it ends (LatencyWindow)

    def on_inter_token(self, itl: float) -> None:
        pass  # likewise

    def on_generation_tokens(self, n: int) -> None:
        self.generation_tokens += n

    def on_finished(self, reasons: list[str], e2e: float, prompt_tokens: int, generation_tokens: int,
                    times: Optional[RequestTimes] = None) -> None:
        self.finished.add(times, e2e)
        self.finished_requests += len(reasons) or 1
        self.prompt_tokens += prompt_tokens

    def on_engine_stats(self, s) -> None:
        self.engine = s
        if s.steps:
            self.steps.extend(s.steps)
            self.num_steps += len(s.steps)

    def latency(self) -> dict[str, Any]:
        return self.finished.percentiles()

    def recent_steps(self, n: int) -> list:
        """The last n step records, oldest first (without copying the whole ring)."""
        return list(islice(reversed(self.steps), n))[::-1]


class StatFanout:
    """Hands each AsyncLLM stat hook to several receivers (ServerMetrics and DashboardStats)."""

    def __init__(self, *targets) -> None:
        self.targets = targets

    def on_scheduled(self, queue_time: float) -> None:
        for t in self.targets:
            t.on_scheduled(queue_time)

    def on_first_token(self, ttft: float) -> None:
        for t in self.targets:
            t.on_first_token(ttft)

    def on_inter_token(self, itl: float) -> None:
        for t in self.targets:
            t.on_inter_token(itl)

    def on_generation_tokens(self, n: int) -> None:
        for t in self.targets:
            t.on_generation_tokens(n)

    def on_finished(self, reasons: list[str], e2e: float, prompt_tokens: int, generation_tokens: int,
                    times: Optional[RequestTimes] = None) -> None:
        for t in self.targets:
            t.on_finished(reasons, e2e, prompt_tokens, generation_tokens, times)

    def on_engine_stats(self, s) -> None:
        for t in self.targets:
            t.on_engine_stats(s)


class Broadcaster:
    """Builds a snapshot every `interval` seconds while anyone listens and gives it to every listener.
    A listener that falls behind loses old snapshots (its queue keeps the newest few), never the server.
    Each snapshot carries what building and encoding the previous one cost this process (`snapshot_ms`,
    and `snapshot_busy` = that cost over the interval): the dashboard's own overhead, in plain sight."""

    def __init__(self, build: Callable[[], Awaitable[dict]] | Callable[[], dict], interval: float) -> None:
        self.build = build
        self.interval = interval
        self.listeners: set[asyncio.Queue] = set()
        self.task: Optional[asyncio.Task] = None
        self.last_cost = 0.0  # seconds of this process's time the last snapshot took (build + encode)
        self.closed = False
        _HUBS.add(self)

    def close(self) -> None:
        """The server is stopping: end every open stream and refuse new ones. A snapshot stream never ends by
        itself, and uvicorn waits for open responses up to --shutdown-timeout (30 s) before it exits."""
        self.closed = True
        for q in self.listeners:
            if q.full():
                q.get_nowait()
            q.put_nowait(None)  # the end of the stream

    async def _snapshot(self) -> bytes:
        try:
            start = time.perf_counter()
            snap = self.build()
            if asyncio.iscoroutine(snap):  # waits on others (the router asks its replicas): not our CPU
                snap = await snap
                start = time.perf_counter()
            snap.update(snapshot_ms=round(self.last_cost * 1e3, 3),
                        snapshot_busy=round(self.last_cost / self.interval, 5))
            data = f"data: {json.dumps(snap, separators=(',', ':'))}\n\n".encode()
            self.last_cost = time.perf_counter() - start
            return data
        except Exception:  # noqa: BLE001 - a snapshot bug must not end the stream for good
            logger.exception("dashboard snapshot failed")
            return b": snapshot failed\n\n"

    async def _run(self) -> None:
        while self.listeners and not self.closed:
            data = await self._snapshot()
            if self.closed:  # closed while building: a full queue must not drop the end for a snapshot
                break
            for q in list(self.listeners):
                if q.full():
                    q.get_nowait()
                q.put_nowait(data)
            await asyncio.sleep(self.interval)
        self.task = None

    async def stream(self):
        if self.closed:
            return
        q: asyncio.Queue = asyncio.Queue(maxsize=4)
        self.listeners.add(q)
        if self.task is None:
            self.task = asyncio.create_task(self._run(), name="tokenmill-dashboard")
        try:
            yield b"retry: 2000\n\n"
            while (data := await q.get()) is not None:
                yield data
        finally:
            self.listeners.discard(q)


_HUBS: "weakref.WeakSet[Broadcaster]" = weakref.WeakSet()  # every dashboard of this process (serve, router)


def end_streams() -> None:
    """Ends the open dashboard streams of this process, for a server that is shutting down (run on its loop)."""
    for hub in list(_HUBS):
        hub.close()


def _static(name: str) -> bytes:
    return resources.files("tokenmill.serve").joinpath("static", name).read_bytes()


def mount(app: FastAPI, kind: str, build_snapshot, info: Callable[[], Any],
          interval: float = SNAPSHOT_INTERVAL_S) -> Broadcaster:
    """The routes both `tokenmill serve` and `tokenmill router` share: the pages, /dashboard/api/info (what
    this server is) and /dashboard/api/events (the snapshot stream). Register before any catch-all route."""
    types = {"html": "text/html; charset=utf-8", "js": "text/javascript; charset=utf-8", "css": "text/css"}
    pages = {name: _static(name) for name in _STATIC}
    hub = Broadcaster(build_snapshot, interval)
    no_store = {"Cache-Control": "no-store"}

    @app.get("/dashboard")
    async def page() -> Response:
        return Response(pages["dashboard.html"], media_type=types["html"], headers=no_store)

    @app.get("/dashboard/static/{name}")
    async def static(name: str) -> Response:
        if name not in pages:
            raise APIError(404, f"no dashboard file {name!r}", code="not_found")
        return Response(pages[name], media_type=types[name.rsplit(".", 1)[1]], headers=no_store)

    @app.get("/dashboard/api/info")
    async def api_info() -> Response:
        return Response(json.dumps({"kind": kind, **info()}), media_type="application/json")

    @app.get("/dashboard/api/events")
    async def events() -> Response:
        return StreamingResponse(hub.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    return hub
