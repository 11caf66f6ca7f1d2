"""The live dashboard at /dashboard: static pages (serve/static/) and one server-sent-events stream of
snapshots a few times a second.

Data comes from what the API process already receives: AsyncLLM's metric hooks (TTFT, ITL, E2E, tokens;
fanned out to ServerMetrics and to DashboardStats), the EngineStats that arrive with every step (queue
sizes, KV blocks, prefix-cache and speculation counters, and the engine's per-step records,
engine/step_records.py) and the open requests' streams. One producer task builds each snapshot once and
hands it to every open stream, so more viewers cost almost nothing more, and it runs only while one is
open.

Authentication: the pages themselves hold no data and are served to anyone; everything under
/dashboard/api/ is guarded by --api-key like /v1 (api_server.PROTECTED). The page asks for the key, keeps it
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
from collections import deque
from itertools import islice
from importlib import resources
from typing import Any, Awaitable, Callable, Optional

from fastapi import FastAPI
from starlette.responses import Response, StreamingResponse

logger = logging.getLogger("tokenmill")

WINDOW_S = 60.0           # latency percentiles over this sliding window (and at most 4096 samples)
SNAPSHOT_INTERVAL_S = 0.25
_STATIC = ("dashboard.html", "dashboard.js", "dashboard.css")


def percentiles(values, qs=(50, 90, 99)) -> dict[str, Optional[float]]:
    """Nearest-rank percentiles (None for an empty window)."""
    v = sorted(values)
    if not v:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": v[min(len(v), max(1, math.ceil(q / 100 * len(v)))) - 1] for q in qs}


class Window:
    """The last `seconds` of samples (at most `max_samples`): times and values kept apart so a snapshot's
    percentiles are one C-level sort of plain floats (about 0.3 ms for 4096), not a Python filter."""

    def __init__(self, seconds: float, max_samples: int) -> None:
        self.seconds = seconds
        self.times: deque = deque(maxlen=max_samples)
        self.values: deque = deque(maxlen=max_samples)

    def add(self, value: float) -> None:
        self.times.append(time.monotonic())
        self.values.append(value)

    def percentiles(self) -> dict[str, Optional[float]]:
        cutoff = time.monotonic() - self.seconds
        while self.times and self.times[0] < cutoff:
            self.times.popleft()
            self.values.popleft()
        return percentiles(self.values)


class DashboardStats:
    """AsyncLLM's stat hooks, kept as sliding windows (for percentiles) and running totals."""

    def __init__(self, window: float = WINDOW_S, max_samples: int = 4096, max_steps: int = 2048) -> None:
        # at most max_samples each, so sorting them a few times a second stays cheap on the event loop
        # however fast tokens come (a fast GPU: the last max_samples, not 60 s)
        self.ttft = Window(window, max_samples)
        self.itl = Window(window, max_samples)
        self.e2e = Window(window, max_samples)
        self.steps: deque = deque(maxlen=max_steps)  # engine step records, oldest first
        self.num_steps = 0
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.finished_requests = 0
        self.engine = None  # the last EngineStats

    def on_scheduled(self, queue_time: float) -> None:
        pass

    def on_first_token(self, ttft: float) -> None:
        self.ttft.add(ttft)

    def on_inter_token(self, itl: float) -> None:
        self.itl.add(itl)

    def on_generation_tokens(self, n: int) -> None:
        self.generation_tokens += n

    def on_finished(self, reasons: list[str], e2e: float, prompt_tokens: int, generation_tokens: int) -> None:
        self.e2e.add(e2e)
        self.finished_requests += len(reasons) or 1
        self.prompt_tokens += prompt_tokens

    def on_engine_stats(self, s) -> None:
        self.engine = s
        if s.steps:
            self.steps.extend(s.steps)
            self.num_steps += len(s.steps)

    def latency(self) -> dict[str, dict]:
        return {"ttft": self.ttft.percentiles(), "itl": self.itl.percentiles(), "e2e": self.e2e.percentiles()}

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

    def on_finished(self, reasons: list[str], e2e: float, prompt_tokens: int, generation_tokens: int) -> None:
        for t in self.targets:
            t.on_finished(reasons, e2e, prompt_tokens, generation_tokens)

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
        while self.listeners:
            data = await self._snapshot()
            for q in list(self.listeners):
                if q.full():
                    q.get_nowait()
                q.put_nowait(data)
            await asyncio.sleep(self.interval)
        self.task = None

    async def stream(self):
        q: asyncio.Queue = asyncio.Queue(maxsize=4)
        self.listeners.add(q)
        if self.task is None:
            self.task = asyncio.create_task(self._run(), name="tokenmill-dashboard")
        try:
            yield b"retry: 2000\n\n"
            while True:
                yield await q.get()
        finally:
            self.listeners.discard(q)


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
            from tokenmill.serve.errors import APIError

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
