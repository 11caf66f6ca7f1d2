"""Request-body limits for `tokenmill serve` and `tokenmill router`: 413 over --max-request-body-bytes, 408 for
a body that stops arriving (--request-body-timeout)."""
from __future__ import annotations

import asyncio
import logging

from starlette.responses import Response

from tokenmill.http.errors import APIError

logger = logging.getLogger("tokenmill")


def add_body_args(group) -> None:
    """Request-body flags of `tokenmill serve` and `tokenmill router` (BodyLimitMiddleware)."""
    group.add_argument("--max-request-body-bytes", type=int, default=8 << 20,
                       help="largest request body; larger ones get 413")
    group.add_argument("--request-body-timeout", type=float, default=20.0,
                       help="seconds to wait for the next part of a request body; a client that stalls longer "
                            "gets 408 and its connection is closed (a slow upload that keeps sending is fine)")


class BodyLimitMiddleware:
    """413 for a request body over --max-request-body-bytes, by its Content-Length or, for a chunked body, as
    soon as the bytes received pass the limit: the body is read here (never more than the limit) and handed
    on whole. 408, and the connection closed, when no part of the body arrives for --request-body-timeout
    seconds: a client that sends half a body and stalls would otherwise hold its connection (and this
    coroutine) for as long as it likes. A slow upload that keeps sending is never cut."""

    def __init__(self, app, limit: int, timeout: float = 20.0) -> None:
        self.app = app
        self.limit = limit
        self.timeout = timeout

    def _too_large(self) -> Response:
        return APIError(413, f"The request body is larger than this server's limit of {self.limit} bytes "
                             "(--max-request-body-bytes).", code="request_too_large").response()

    def _timed_out(self, received: int) -> Response:
        # Connection: close, as the rest of the body may still come and cannot be told from a next request
        return APIError(408, f"The request body stopped arriving: nothing for {self.timeout:g} s after {received} "
                             "bytes (--request-body-timeout).", code="request_timeout",
                        headers={"Connection": "close"}).response()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self._too_large()(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except asyncio.TimeoutError:
                logger.debug("%s %s: no body bytes for %g s after %d; answered 408", scope["method"],
                             scope["path"], self.timeout, size)
                await self._timed_out(size)(scope, receive, send)
                return
            if message["type"] != "http.request":  # client gone
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._too_large()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only the disconnect notice

        await self.app(scope, replay, send)
