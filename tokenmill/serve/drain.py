"""Draining, for `tokenmill serve` (`/admin/drain`, guarded by --admin-key: http/auth.py's check_admin).

`POST /admin/drain` on a server: it stops taking new work (503 with Retry-After, which a router answers by
retrying the request on another replica), lets what is in flight finish, and its /health answers 503
`draining` so routers take it out of rotation; the reply says how many requests are still in flight, and
`GET /admin/drain` polls that until 0, when the server can be stopped without failing anyone.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.http.errors import APIError


@dataclass
class DrainState:
    draining: bool = False
    in_flight: int = 0     # requests under /v1 being answered (streams until their last byte)

    def status(self) -> dict:
        return {"draining": self.draining, "in_flight": self.in_flight}

    def refusal(self) -> APIError:
        return APIError(503, "This server is draining (POST /admin/drain): it finishes the requests it has and "
                             "takes no new ones; send this one to another replica.", code="server_draining",
                        headers={"Retry-After": "1"})


class DrainMiddleware:
    """Counts /v1 requests in flight and refuses new ones while draining (plain ASGI: streams stay cheap)."""

    def __init__(self, app, drain: DrainState) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1") or scope["method"] in ("GET", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await self.drain.refusal().response()(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1
