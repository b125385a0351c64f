"""RequestGuard: an ASGI middleware that checks a request body before the app parses it.

The app's JSON parser fails badly on some bodies (a 500 for nesting deeper than Python's
recursion limit, a crash later for text with lone surrogates, which cannot be encoded), and a
body of any size would be read into memory. The guard reads the body once, up to a limit, and
answers a clear 400 or 413 in OpenAI's format when it is too large, not UTF-8, not JSON, nested
too deeply, or holds a string with a lone surrogate; otherwise it hands the same bytes on.
"""

from __future__ import annotations

import email.message
import json
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from segkv.server.errors import APIError, echo

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024  # 16 MiB: far above any prompt a context holds
MAX_JSON_DEPTH = 64  # OpenAI's bodies nest a few levels; deeper is an attack or a mistake
_BODY_METHODS = {"POST", "PUT", "PATCH"}
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # the only way a surrogate gets into UTF-8 JSON


def check_max_bytes(max_bytes: object) -> int:
    """``max_bytes`` if it is a positive integer (ValueError otherwise)."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_request_bytes must be a positive integer, got {max_bytes!r}")
    return max_bytes


class RequestGuard:
    """Checks HTTP request bodies of at most ``max_bytes`` bytes (see the module docstring)."""

    def __init__(self, app: ASGIApp, *, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self.app, self.max_bytes = app, check_max_bytes(max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:  # refused before a byte is read
            await self._too_large().response()(scope, receive, send)
            return
        if scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left while sending
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:  # a chunked body, or one longer than it said
                await self._too_large().response()(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            check_body(body, headers.get("content-type"))
        except APIError as exc:
            await exc.response()(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than this server's limit of {self.max_bytes} bytes",
                        "invalid_request_error", code="request_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` once, then the client's own messages (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _is_json(content_type: str | None) -> bool | None:
    """True for a JSON content type, None when there is none (it may still be JSON), else False."""
    if not content_type:
        return None
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def check_body(body: bytes, content_type: str | None) -> None:
    """APIError 400 if a JSON ``body`` is not UTF-8, not JSON, too deep or holds a lone surrogate.

    Bodies of other content types are left to the app (which refuses them); a body without a
    content type is checked only if it parses, as the app may read it as JSON.
    """
    is_json = _is_json(content_type)
    if not body or is_json is False:
        return
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        if is_json is None:
            return
        raise APIError(400, f"the request body is not valid UTF-8 (byte {exc.start}); JSON must be sent "
                            "as UTF-8", "invalid_request_error") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise APIError(400, f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep",
                       "invalid_request_error") from None
    except ValueError as exc:  # JSONDecodeError, or an integer of too many digits
        if is_json is None:
            return
        where = f" (at character {exc.pos})" if isinstance(exc, json.JSONDecodeError) else ""
        raise APIError(400, f"the request body is not valid JSON: {echo(getattr(exc, 'msg', str(exc)))}{where}",
                       "invalid_request_error") from None
    # a walk only when a surrogate escape or deep nesting is possible: most bodies skip it
    may_nest = text.count("[") + text.count("{") > MAX_JSON_DEPTH
    if may_nest or _SURROGATE_ESCAPE.search(text):
        check_json(data)


def check_json(data: object) -> None:
    """APIError 400 if ``data`` nests deeper than :data:`MAX_JSON_DEPTH` or a string (value or
    key) holds a lone surrogate; the message names the field."""
    stack: list[tuple[object, tuple, int]] = [(data, (), 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, (list, dict)):
            if depth >= MAX_JSON_DEPTH:
                raise APIError(400, f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep",
                               "invalid_request_error")
            if isinstance(value, dict):
                for key, item in value.items():
                    _check_text(key, path + (key,))
                    stack.append((item, path + (key,), depth + 1))
            else:
                stack.extend((item, path + (i,), depth + 1) for i, item in enumerate(value))


def _name(path: tuple) -> str:
    # a surrogate in a key is written as its escape, so the name itself can be encoded
    return echo(".".join(str(p) for p in path).encode("utf-8", "backslashreplace").decode("utf-8"))


def _check_text(text: str, path: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = _name(path) or "the request body"
        code = ord(text[exc.start])
        raise APIError(400, f"`{where}` is not valid Unicode: it holds a lone surrogate (\\u{code:04x}) at "
                            f"character {exc.start}", "invalid_request_error",
                       param=where if path else None, code="invalid_unicode") from None
