"""Bearer-key checks: --api-key on the model's endpoints (APIKeyMiddleware) and --admin-key on /admin/*
(check_admin), for `tokenmill serve` and `tokenmill router` alike."""
from __future__ import annotations

import secrets
from typing import Optional

from starlette.requests import Request

from tokenmill.http.errors import APIError

# what --api-key guards: everything that touches the model, and the dashboard's data (its pages hold none)
PROTECTED = ("/v1", "/tokenize", "/detokenize", "/dashboard/api")

ADMIN_KEY_HELP = ("enable the /admin/* endpoints (drain, ...), which then require 'Authorization: Bearer KEY' "
                  "(default: $TOKENMILL_ADMIN_KEY; without a key they answer 403)")


class APIKeyMiddleware:
    """Plain ASGI (no per-request task like BaseHTTPMiddleware, so streaming stays cheap)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED) and scope["method"] != "OPTIONS":
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not secrets.compare_digest(auth, self.expected):
                err = APIError(401, "Incorrect or missing API key; send 'Authorization: Bearer <key>'.",
                               code="invalid_api_key")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def check_admin(request: Request, admin_key: Optional[str]) -> None:
    if not admin_key:
        raise APIError(403, "The admin endpoints are disabled; start with --admin-key to enable them.",
                       code="admin_disabled")
    auth = request.headers.get("authorization", "").encode()
    if not secrets.compare_digest(auth, f"Bearer {admin_key}".encode()):
        raise APIError(401, "Incorrect or missing admin key; send 'Authorization: Bearer <admin key>'.",
                       code="invalid_admin_key")
