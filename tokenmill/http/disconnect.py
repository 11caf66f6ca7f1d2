"""Cancel a non-streaming handler when its client goes away (light: the router uses it without the engine)."""
from __future__ import annotations

import asyncio
from typing import Awaitable, Optional, TypeVar

from starlette.requests import Request

T = TypeVar("T")


async def until_disconnected(request: Request, work: Awaitable[T]) -> Optional[T]:
    """Run a non-streaming handler, cancelling it (which aborts its engine requests) if the client goes
    away first. Returns None in that case."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone; nothing to report
        pass
    return None
