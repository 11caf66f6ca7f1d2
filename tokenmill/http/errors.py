"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the matching HTTP status."""
from __future__ import annotations

import logging
from typing import Optional

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

logger = logging.getLogger("tokenmill")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(msgspec.json.encode(self.body()), status_code=self.status, headers=self.headers,
                        media_type="application/json")


def bad_request(message: str, param: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param)


def param_of(message: str, known: tuple[str, ...]) -> Optional[str]:
    """SamplingParams errors start with the field's name ('temperature must be ...')."""
    first = message.split(" ", 1)[0]
    return first if first in known else None


def install_error_handlers(app, what: str = "server") -> None:
    """Answer APIError, HTTP errors (404, 405, ...) and anything unexpected (500, logged) of a FastAPI app with
    OpenAI-shaped bodies. `what` names the app in the 500 message ("server", "router")."""
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled %s error", what)
        return APIError(500, f"Internal {what} error: {type(exc).__name__}: {exc}").response()
