"""Running an app on uvicorn in a background thread for live HTTP tests."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_healthy(server, base: str, *, timeout: float = 120) -> None:
    """Until ``base``'s /health answers 200; fails if the ``server`` process exits first."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert server.poll() is None, f"the server exited: {server.stdout.read() if server.stdout else ''}"
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


@contextmanager
def spawned_server(command: list[str], port: int):
    """Run ``command`` (a server listening on ``port``) until /health answers; yields (process,
    base URL) and kills it afterwards if it still runs."""
    import subprocess

    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, base)
        yield server, base
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@contextmanager
def live_server(app):
    """Serve ``app`` on 127.0.0.1 at a free port; yields the base URL."""
    port = free_port()
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
