"""OpenAI-style errors: :class:`APIError` (status + the ``{"error": {...}}`` body), the mapping of the
client library's errors and the daemon's error codes onto it, and the FastAPI exception handlers that
turn request-validation and routing errors into the same body."""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from specsched.client import ConnectionLost, MessageTooLarge, RequestTimeout, ServerError, SpecschedError
from specsched.daemon.protocol import ErrorCode

INVALID = "invalid_request_error"

# daemon error code -> (HTTP status, OpenAI error type, OpenAI code)
DAEMON_CODES: dict[str, tuple[int, str, str | None]] = {
    ErrorCode.INVALID_FIELD.value: (400, INVALID, None),
    ErrorCode.PROMPT_TOO_LONG.value: (400, INVALID, "context_length_exceeded"),
    ErrorCode.UNKNOWN_PROPOSER.value: (400, INVALID, None),
    ErrorCode.TOO_MANY_INFLIGHT.value: (429, "rate_limit_error", "rate_limit_exceeded"),
    ErrorCode.OVERLOADED.value: (503, "server_error", "overloaded"),
    ErrorCode.SHUTTING_DOWN.value: (503, "server_error", "shutting_down"),
}
FIELD_PATH = re.compile(r"^generate\.(\w+)")  # "generate.stop[0]: ..." names the field


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, type: str = INVALID, param: str | None = None,
                 code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, INVALID, param, code)


def daemon_down(detail: str) -> APIError:
    return APIError(503, f"the specsched daemon is unavailable: {detail}", "server_error", None,
                    "daemon_unavailable")  # fmt: skip


def from_client_error(e: SpecschedError) -> APIError:
    """The HTTP error for an error of the client library (a daemon ``error`` reply or a transport one)."""
    if isinstance(e, ServerError):
        status, kind, code = DAEMON_CODES.get(e.code, (500, "server_error", None))
        match = FIELD_PATH.match(e.message)
        param = match.group(1) if match and status == 400 else None
        return APIError(status, e.message, kind, param, code or e.code)
    if isinstance(e, ConnectionLost):
        return daemon_down(f"the connection dropped ({e.message})")
    if isinstance(e, RequestTimeout):
        return APIError(504, f"the daemon did not answer in time: {e.message}", "server_error", code=e.code)
    if isinstance(e, MessageTooLarge):
        return bad_request(f"the request is too large for the daemon: {e.message}", code="request_too_large")
    return APIError(500, f"{e.code}: {e.message}", "server_error", None, e.code)


def _validation_error(exc: RequestValidationError) -> APIError:
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {err.get('msg', '')}", None, "invalid_json")
    param = ".".join(loc) or None
    if err.get("type") == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param)
    if err.get("type") == "missing":
        return bad_request(f"Missing required parameter: {param!r}", param)
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    return bad_request(f"{param}: {msg}" if param else msg, param)


def install_handlers(app: FastAPI) -> None:
    """Every error leaves the app as an OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        kind = INVALID if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), kind).response()
