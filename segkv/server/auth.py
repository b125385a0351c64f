"""ApiKeyAuth: an ASGI middleware that asks for ``Authorization: Bearer <key>`` on the API.

As in vLLM, ``/v1/*`` needs the key and ``/health`` and ``/metrics`` stay open (probes and
scrapers carry no key). The dashboard page ``/`` holds no data and stays open; its data,
``/dashboard/stats``, needs the key, given as the bearer header or as ``?key=<key>`` (a page
opened as ``/?key=<key>`` can pass its own query on to its fetch). The query form is accepted
there only: on the API a key in the URL would end up in logs.
"""

from __future__ import annotations

import hmac
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Receive, Scope, Send

from segkv.server.errors import APIError

DASHBOARD_DATA = "/dashboard/stats"


def check_api_key(api_key: object) -> str:
    """``api_key`` if it is a usable key (ValueError otherwise: an empty key would open the API)."""
    if not isinstance(api_key, str) or not api_key.strip():
        raise ValueError("api_key must be a non-empty string")
    return api_key


class ApiKeyAuth:
    """Refuses requests to protected paths without the right ``api_key`` (401, OpenAI's body)."""

    def __init__(self, app: ASGIApp, *, api_key: str) -> None:
        self.app, self._key = app, check_api_key(api_key).encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not self._protects(scope["path"]):
            await self.app(scope, receive, send)
            return
        if self._authorized(scope):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "Incorrect or missing API key: send it as the header "
                              "'Authorization: Bearer <key>'", "invalid_request_error",
                         code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)

    @staticmethod
    def _protects(path: str) -> bool:
        return path == "/v1" or path.startswith("/v1/") or path == DASHBOARD_DATA

    def _authorized(self, scope: Scope) -> bool:
        given = b""
        for name, value in scope.get("headers", []):
            if name.lower() == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    given = token.strip()
        if not given and scope["path"] == DASHBOARD_DATA:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            given = query.get("key", [""])[0].encode("utf-8", "surrogateescape")
        # compare_digest: the time taken does not tell how much of a guess was right
        return bool(given) and hmac.compare_digest(given, self._key)
