"""Running an app on uvicorn in a background thread for live HTTP tests."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn


@contextmanager
def live_server(app):
    """Serve ``app`` on 127.0.0.1 at a free port; yields the base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def slow_engine_steps(monkeypatch, seconds: float) -> None:
    """Every engine step takes at least ``seconds`` more: a long request stays long however fast
    the machine, so a test can act while it runs."""
    from segkv.engine.core import EngineCore

    step = EngineCore.step

    def slow_step(self):
        time.sleep(seconds)
        return step(self)

    monkeypatch.setattr(EngineCore, "step", slow_step)
