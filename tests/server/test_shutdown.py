"""``segkv serve`` on SIGTERM: new requests get 503, requests in flight get ``--shutdown-timeout``
seconds, then every stream left ends with an error event and ``data: [DONE]``; the exit status is 0.
A model that fails to load stops the server with status 1."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from server_helpers import free_port, spawned_server

SHUTTING_DOWN = "the server is shutting down"


@contextmanager
def serve(*flags: str):
    """``segkv serve`` of the built-in model on a free port; yields (process, base URL)."""
    port = free_port()
    command = [sys.executable, "-m", "segkv.cli", "serve", "--model", "default", "--port", str(port), *flags]
    with spawned_server(command, port) as (server, base):
        yield server, base


class Stream(threading.Thread):
    """One streaming chat completion, read to its end: its ``data:`` payloads and their arrival times."""

    def __init__(self, base: str, **body) -> None:
        super().__init__(daemon=True)
        self.base = base
        self.body = {"model": "default", "messages": [{"role": "user", "content": "count"}], "stream": True,
                     "ignore_eos": True, **body}
        self.events: list[tuple[float, str]] = []
        self.status: int | None = None
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.base}/v1/chat/completions", json=self.body, timeout=60) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append((time.monotonic(), line[len("data: "):]))
        except Exception as exc:  # noqa: BLE001 - asserted by the test
            self.error = exc

    @property
    def payloads(self) -> list[str]:
        return [payload for _, payload in self.events]

    def chunks(self) -> list[dict]:
        return [json.loads(p) for p in self.payloads if p != "[DONE]"]


def _start_streams(base: str, count: int, **body) -> list[Stream]:
    streams = [Stream(base, **body) for _ in range(count)]
    for s in streams:
        s.start()
    deadline = time.monotonic() + 60
    # each is running: it has streamed its opening chunk and some text
    while not all(len(s.events) >= 3 for s in streams):
        assert time.monotonic() < deadline and all(s.is_alive() for s in streams), \
            [(s.status, s.error, s.payloads[-2:]) for s in streams]
        time.sleep(0.02)
    return streams


def test_sigterm_ends_long_streams_with_an_error_event_and_done():
    with serve("--shutdown-timeout", "1") as (server, base):
        # no max_tokens: each would run to the model's length limit (2048), far past the timeout
        streams = _start_streams(base, 3)
        signalled = time.monotonic()
        server.send_signal(signal.SIGTERM)
        refused = _refused_while_draining(base)
        assert server.wait(timeout=30) == 0
        elapsed = time.monotonic() - signalled
        for s in streams:
            s.join(timeout=10)
        log = server.stdout.read()
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "shutting_down"
    assert refused.json()["error"]["message"] == SHUTTING_DOWN
    assert elapsed >= 1.0, elapsed  # the timeout was given
    # and not much more: every stream had its [DONE] soon after the timeout (the process's own
    # exit, torch's teardown included, is slow on a loaded machine, so it is not what is timed)
    ended = max(s.events[-1][0] for s in streams) - signalled
    assert 1.0 <= ended < 8, ended
    assert "Draining: 3 request(s) in flight get up to 1 s to finish" in log
    assert "Ended 3 request(s) still running after 1 s" in log
    assert "timeout graceful shutdown exceeded" not in log  # nothing left for uvicorn to cut
    for s in streams:
        assert s.error is None and s.status == 200
        assert s.payloads[-1] == "[DONE]"
        error = json.loads(s.payloads[-2])["error"]  # the event before [DONE]
        assert SHUTTING_DOWN in error["message"]
        text = [c for c in s.chunks()[:-1] if c["choices"][0].get("finish_reason") is not None]
        assert text == []  # no choice finished: the stream was ended, not completed
        assert s.events[-1][0] - signalled >= 1.0  # streamed on during the drain


def test_a_second_signal_cuts_the_wait_short():
    with serve("--shutdown-timeout", "120") as (server, base):
        streams = _start_streams(base, 2)
        signalled = time.monotonic()
        server.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        server.send_signal(signal.SIGINT)  # Ctrl-C, impatient
        assert server.wait(timeout=60) == 0
        elapsed = time.monotonic() - signalled
        for s in streams:
            s.join(timeout=10)
        log = server.stdout.read()
    assert elapsed < 30, elapsed  # not the 120 s
    assert "Ended 2 request(s) still running: a second signal cut the wait short" in log
    for s in streams:
        assert s.payloads[-1] == "[DONE]"
        assert json.loads(s.payloads[-2])["error"]["message"] == SHUTTING_DOWN


def test_sigterm_lets_requests_finish_within_the_timeout():
    with serve("--shutdown-timeout", "120") as (server, base):
        streams = _start_streams(base, 2, max_tokens=40)
        signalled = time.monotonic()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=150) == 0
        elapsed = time.monotonic() - signalled
        for s in streams:
            s.join(timeout=10)
        log = server.stdout.read()
    assert "Draining: 2 request(s) in flight get up to 120 s to finish" in log  # in flight at the signal
    assert "Ended" not in log
    assert elapsed < 100, elapsed  # it stopped when they finished, not at the timeout
    for s in streams:
        assert s.error is None and s.status == 200
        assert s.payloads[-1] == "[DONE]"
        chunks = s.chunks()
        assert all("error" not in c for c in chunks)
        finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
        assert finals == ["length"]  # max_tokens reached: completed, not cut


def test_a_model_that_fails_to_load_stops_the_server(tmp_path):
    missing = tmp_path / "no-model"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "segkv.cli", "serve", "--model", str(missing), "--port",
                           str(free_port())], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert time.monotonic() - started < 60
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("segkv: error:")]
    assert line.startswith("segkv: error: the model failed to load: ") and str(missing) in line
    assert "Traceback" not in done.stderr


def test_a_snapshot_dir_that_cannot_be_created_is_refused_before_loading(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for path, reason in [(blocker, "a file, not a directory, is in its place"),
                         (blocker / "sub", "cannot create the directory: Not a directory")]:
        command = [sys.executable, "-m", "segkv.cli", "serve", "--snapshot-dir", str(path), "--port",
                   str(free_port())]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2
        assert done.stderr.strip() == f"segkv: error: --snapshot-dir {path}: {reason}"
        assert "loading weights" not in done.stderr and "Uvicorn running" not in done.stderr


def test_a_missing_snapshot_dir_is_created(tmp_path):
    from segkv.cli import prepare_snapshot_dir

    path = tmp_path / "a" / "b"
    assert prepare_snapshot_dir(str(path)) == path and path.is_dir()
    assert prepare_snapshot_dir(str(path)) == path  # already there: fine
    assert prepare_snapshot_dir(None) is None


def test_engine_stops_admitting_then_aborts_what_runs(tmp_path):
    """The engine's side: after ``stop_admitting`` a new request raises EngineStopped; ``abort_all``
    ends a running stream with the given error and gives its pages back."""
    import asyncio

    from model_helpers import build_model_dir
    from segkv.engine import LLM, AsyncEngine, EngineStopped
    from segkv.sampling_params import SamplingParams

    build_model_dir(tmp_path, "llama")
    engine = AsyncEngine(LLM(tmp_path, page_size=8, num_pages=200))
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)

    async def scenario() -> tuple[int, int, str]:
        stream = engine.generate([1, 2, 3], params)
        await anext(stream)  # running: it has a token
        engine.stop_admitting()
        with pytest.raises(EngineStopped, match=SHUTTING_DOWN):
            await anext(engine.generate([1, 2, 3], params))
        tokens = 1
        assert engine.abort_all(EngineStopped(SHUTTING_DOWN)) == 1
        try:
            async for _ in stream:  # updates already queued still arrive, then the error
                tokens += 1
        except EngineStopped as exc:
            return tokens, engine.num_requests, str(exc)
        raise AssertionError("the stream ended without the error")

    try:
        tokens, left, message = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert message == SHUTTING_DOWN and left == 0 and tokens < 1000
    assert engine.llm.cache.pool.pages_in_use == 0 and not engine.admitting


def _refused_while_draining(base: str) -> httpx.Response:
    """A new request during the drain (which lasts 1 s): /health is polled until it says the
    drain has begun, then a completion is asked for."""
    deadline = time.monotonic() + 5
    while httpx.get(f"{base}/health", timeout=5).status_code == 200:
        assert time.monotonic() < deadline, "the drain did not begin"
        time.sleep(0.02)
    return httpx.post(f"{base}/v1/chat/completions", timeout=5,
                      json={"model": "default", "messages": [{"role": "user", "content": "hi"}]})
