"""LoadingGate: the ASGI app served while the model loads (503), then the real app."""

from __future__ import annotations

import json

from segkv.server.protocol import error_body


class LoadingGate:
    """Answers every HTTP request with 503 until :meth:`ready` installs the real app.

    The server listens at once, so health checks see "loading" instead of a refused
    connection; a load failure is reported the same way with its message.
    """

    def __init__(self) -> None:
        self.app = None
        self.failure: str | None = None

    def ready(self, app) -> None:
        self.app = app

    def failed(self, message: str) -> None:
        self.failure = message

    async def __call__(self, scope, receive, send) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        message = f"the model failed to load: {self.failure}" if self.failure else "the model is loading"
        body = json.dumps(error_body(message, "service_unavailable_error", code="loading")).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"5")]})
        await send({"type": "http.response.body", "body": body})
