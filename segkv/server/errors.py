"""OpenAI-style error answers: the APIError exception, safe messages and the app's error handlers.

Every error the server answers has the body ``{"error": {"message", "type", "param", "code"}}``.
Messages built from exceptions go through :func:`safe_message`: it removes server paths and
bounds the length, so a client never learns where files live and a huge input is never
echoed back whole.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from segkv.engine import EngineStopped, QueueFullError
from segkv.server.disconnect import ClientGone
from segkv.server.protocol import error_body

ECHO_CHARS = 100  # at most this much of a client's value is echoed in a message
MESSAGE_CHARS = 1000  # longer messages are cut (an exception may quote a large input)
MAX_LISTED_ERRORS = 5  # validation errors named in one message; the rest are counted
# absolute paths under the usual roots of a POSIX machine, as a last line of defence
_PATH = re.compile(r"(?<![\w.:/-])/(?:home|root|tmp|var|usr|opt|mnt|srv|data|work|etc|proc|dev|"
                   r"run|media|scratch|nfs|private|Users|Volumes|lib|lib64)(?:/[^\s'\":,)]*)?")


class APIError(Exception):
    """An error answered as an OpenAI error body with ``status``."""

    def __init__(self, status: int, message: str, type_: str, *, param: str | None = None, code=None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers
        self.body = error_body(_cut(message), type_, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


def echo(value: object, limit: int = ECHO_CHARS) -> str:
    """``value`` as text for a message, at most ``limit`` characters (an ellipsis marks a cut)."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _cut(message: str) -> str:
    return message if len(message) <= MESSAGE_CHARS else message[:MESSAGE_CHARS] + "…"


def _known_dirs() -> list[str]:
    dirs = {str(Path.cwd()), str(Path.home()), sys.prefix, tempfile.gettempdir()}
    return sorted((d for d in dirs if len(d) > 1), key=len, reverse=True)


def safe_message(exc: BaseException | str, *, extra_dirs: tuple[str, ...] = ()) -> str:
    """An exception's message without server paths (each becomes ``<path>``), length-bounded."""
    text = str(exc)
    for directory in sorted(extra_dirs, key=len, reverse=True) + _known_dirs():
        if directory:
            text = re.sub(re.escape(directory) + r"[^\s'\":,)]*", "<path>", text)
    return _cut(_PATH.sub("<path>", text))


def engine_error(exc: Exception) -> APIError:
    """The answer to an exception from the engine: 503 when it is full or stopping, 400 for
    invalid input, else 500 (with a message that names no server path)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(503, safe_message(exc), "service_unavailable_error", code="queue_full")
    if isinstance(exc, EngineStopped):
        return APIError(503, safe_message(exc) or "the server is shutting down", "service_unavailable_error",
                        code="engine_stopped")
    if isinstance(exc, (ValueError, TypeError, jinja2.TemplateError)):
        param = getattr(exc, "param", None)  # a FieldError names its field
        param = param if isinstance(param, str) else None
        return APIError(400, safe_message(exc), "invalid_request_error", param=param)
    return APIError(500, f"engine error: {safe_message(exc)}", "server_error")


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One message for pydantic's errors (the first few) and the first one's field."""
    def where(error: dict) -> str:
        return echo(".".join(str(x) for x in error.get("loc", ()) if x != "body"))

    first = errors[0] if errors else {}
    # pydantic prefixes a validator's own message with "Value error, ": the message says enough
    parts = [f"{where(e)}: {str(e.get('msg')).removeprefix('Value error, ')}" for e in errors[:MAX_LISTED_ERRORS]]
    if len(errors) > MAX_LISTED_ERRORS:
        parts.append(f"and {len(errors) - MAX_LISTED_ERRORS} more errors")
    return "; ".join(parts) or "invalid request", where(first) or None


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error in OpenAI's format: ours, validation, routing (404, 405) and any
    unexpected exception (a JSON 500 with a generic message; Starlette raises the exception on
    after the answer, so the server logs its traceback)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, exc: ClientGone) -> JSONResponse:
        # nobody reads it; 499 ("client closed request") keeps it apart from errors in logs
        return JSONResponse(error_body(str(exc), "client_closed_request"), status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":  # the body is not JSON: say so, and where it broke
            where = first.get("ctx", {}).get("error", "")
            return APIError(400, f"the request body is not valid JSON{f': {where}' if where else ''} "
                                 f"(at character {first.get('loc', ('body', '?'))[-1]})",
                            "invalid_request_error").response()
        if tuple(first.get("loc", ())) == ("body",):  # not an object at all (or not sent as JSON)
            return APIError(400, "the request body must be a JSON object, sent with content-type "
                                 "application/json", "invalid_request_error").response()
        message, param = _validation_message(errors)
        return APIError(400, message, "invalid_request_error", param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        route = f"{request.method} {echo(request.url.path)}"
        if exc.status_code == 404:  # OpenAI's words for a URL it does not serve
            message, code = f"Invalid URL ({route})", None
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow") or (exc.headers or {}).get("allow")
            message = f"Method Not Allowed ({route}){f'; allowed: {allowed}' if allowed else ''}"
            code = "method_not_allowed"
        else:
            message, code = safe_message(exc.detail), None
        type_ = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        return APIError(exc.status_code, message, type_, code=code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return APIError(500, "internal server error: the request failed unexpectedly; see the server log",
                        "server_error").response()
