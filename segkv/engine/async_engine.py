"""AsyncEngine: one background thread runs the step loop; asyncio callers stream their outputs."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from segkv.engine.core import EngineCore, EngineRequest
from segkv.engine.llm import LLM
from segkv.outputs import RequestOutput
from segkv.sampling_params import SamplingParams
from segkv.scheduler.scheduler import SchedulerConfig


@dataclass(slots=True)
class StreamUpdate:
    """A snapshot of a request after a step: full outputs so far, and whether it is done."""

    output: RequestOutput
    finished: bool
    first_token_time: float | None
    arrival: float


class AsyncEngine:
    """Thread-safe front of :class:`EngineCore` for async servers.

    ``generate`` yields a :class:`StreamUpdate` after every step that touched the request;
    cancelling the iterator (a client disconnect) aborts the request, and its pages are
    freed before the next step runs.
    """

    def __init__(self, llm: LLM, config: SchedulerConfig | None = None) -> None:
        self.llm = llm
        self.core = EngineCore(llm, config)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self.error: BaseException | None = None
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="segkv-engine", daemon=True)
        self._thread.start()

    # -- public API -------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, *,
                       request_id: str | None = None) -> AsyncIterator[StreamUpdate]:
        """Queue a request and yield its updates until it finishes (ValueError if invalid)."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            request = self.core.add_request(prompt_ids, params, request_id=request_id)
            self._streams[request.request_id] = (asyncio.get_running_loop(), queue)
        self._wake.set()
        finished = False
        try:
            while not finished:
                update = await queue.get()
                if isinstance(update, BaseException):
                    raise update
                finished = update.finished
                yield update
        finally:
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            self._streams.pop(request_id, None)
            return self.core.abort(request_id)

    def stats(self) -> dict[str, object]:
        with self._lock:
            return self.core.stats()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    # -- the loop ---------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            if not self.core.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            with self._lock:
                try:
                    touched = self.core.step()
                    self.steps += 1
                except BaseException as exc:  # fail the in-flight requests, keep serving
                    self.error = exc
                    self._fail_all(exc)
                    continue
                updates = [(r, self._update(r)) for r in touched]
            for request, update in updates:
                self._deliver(request.request_id, update)

    def _update(self, request: EngineRequest) -> StreamUpdate:
        return StreamUpdate(request.output(), request.finished, request.first_token_time, request.arrival)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        loop, queue = stream
        if isinstance(item, StreamUpdate) and item.finished or isinstance(item, BaseException):
            self._streams.pop(request_id, None)
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is gone
            self.core.abort(request_id)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self.core.requests):
            self.core.abort(request_id)
            self._deliver(request_id, RuntimeError(f"engine step failed: {exc}"))
