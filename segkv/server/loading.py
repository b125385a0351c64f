"""LoadingGate: the ASGI app served while the model loads (503), then the real app, then 503 again
while the server shuts down."""

from __future__ import annotations

import json

from segkv.server.protocol import error_body


class LoadingGate:
    """Answers every HTTP request with 503 until :meth:`ready` installs the real app.

    The server listens at once, so health checks see "loading" instead of a refused
    connection; a load failure is reported the same way with its message. Once
    :meth:`drain` is called (shutdown), new requests get 503 again while the requests
    already inside the app finish.
    """

    def __init__(self) -> None:
        self.app = None
        self.failure: str | None = None
        self.draining = False

    def ready(self, app) -> None:
        self.app = app

    def failed(self, message: str) -> None:
        self.failure = message

    def drain(self) -> None:
        """Refuse new requests from now on (requests already admitted are not affected)."""
        self.draining = True

    async def __call__(self, scope, receive, send) -> None:
        if self.app is not None and not self.draining:
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        headers = [(b"content-type", b"application/json")]
        if self.draining:
            # no retry-after: this server will not come back; closing lets the client go elsewhere
            message, code = "the server is shutting down", "shutting_down"
            headers.append((b"connection", b"close"))
        elif self.failure:
            message, code = f"the model failed to load: {self.failure}", "loading"
            headers.append((b"retry-after", b"5"))
        else:
            message, code = "the model is loading", "loading"
            headers.append((b"retry-after", b"5"))
        body = json.dumps(error_body(message, "service_unavailable_error", code=code)).encode()
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})
