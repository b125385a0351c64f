"""AsyncEngine: one background thread runs the step loop; asyncio callers stream their outputs."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from segkv.cache.chain import ChainSnapshot
from segkv.engine.core import EngineRequest, EngineStopped
from segkv.engine.llm import LLM
from segkv.outputs import RequestOutput
from segkv.sampling_params import SamplingParams
from segkv.scheduler.scheduler import SchedulerConfig
from segkv.sessions.snapshot_file import load_snapshot, save_snapshot


@dataclass(slots=True)
class StreamUpdate:
    """A snapshot of a request after a step: full outputs so far, and whether it is done."""

    output: RequestOutput
    finished: bool
    first_token_time: float | None
    arrival: float


class AsyncEngine:
    """Thread-safe front of an LLM's :class:`EngineCore` for async servers.

    It drives the core of ``llm`` (the one ``LLM.generate`` steps too, under the core's lock);
    ``config``, if given, sets that core's scheduler limits. ``generate`` yields a
    :class:`StreamUpdate` after every step that touched the request; cancelling the iterator (a
    client disconnect) aborts the request, and its pages are freed before the next step runs. To
    shut down, :meth:`stop_admitting` refuses new requests, and :meth:`abort_all` ends those still
    running with an error.
    """

    def __init__(self, llm: LLM, config: SchedulerConfig | None = None) -> None:
        self.llm = llm
        self.core = llm.core
        if config is not None:
            self.core.configure(config)
        self._lock = self.core.lock
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._admitting = True
        self.error: BaseException | None = None
        self.steps = 0
        self._token_times: deque[tuple[float, int]] = deque(maxlen=4096)  # (time, tokens sampled)
        self._ttfts: deque[float] = deque(maxlen=256)
        self.num_finished = 0
        self.core.step_listeners.append(self._on_step)  # whoever steps the core, streams get updates
        self._thread = threading.Thread(target=self._loop, name="segkv-engine", daemon=True)
        self._thread.start()

    # -- public API -------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, *,
                       request_id: str | None = None) -> AsyncIterator[StreamUpdate]:
        """Queue a request and yield its updates until it finishes (ValueError if invalid,
        :class:`EngineStopped` once the engine stops admitting requests)."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if not self._admitting:
                raise EngineStopped("the server is shutting down")
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

    # -- shutting down ------------------------------------------------------------------
    def stop_admitting(self) -> None:
        """Refuse new requests (``generate`` raises :class:`EngineStopped`); running ones go on."""
        with self._lock:
            self._admitting = False

    @property
    def admitting(self) -> bool:
        return self._admitting

    @property
    def num_requests(self) -> int:
        """Requests queued or running."""
        with self._lock:
            return len(self.core.requests)

    def abort_all(self, exc: BaseException) -> int:
        """Abort every request (their pages are freed) and raise ``exc`` in each one's stream;
        return how many were aborted."""
        with self._lock:
            return self._abort_all(exc)

    # -- references for sessions (all under the engine lock) ---------------------------
    def pin(self, token_ids: list[int]) -> tuple[ChainSnapshot, int]:
        """References to the longest cached prefix of ``token_ids`` (keeps it from eviction)."""
        with self._lock:
            match = self.core.prefix.match(token_ids)
            snapshot = ChainSnapshot(match.refs)
            match.release()
            return snapshot, snapshot.num_rows

    def share(self, snapshot: ChainSnapshot) -> ChainSnapshot:
        with self._lock:
            return ChainSnapshot(snapshot.refs)

    def release(self, snapshot: ChainSnapshot) -> None:
        with self._lock:
            snapshot.release()

    def save_snapshot(self, snapshot: ChainSnapshot, path, *, metadata: dict) -> None:
        with self._lock:
            save_snapshot(path, snapshot, self.core.cache, fingerprint=self.core.fingerprint,
                          metadata=metadata)

    def load_snapshot(self, path) -> tuple[ChainSnapshot, list[int], dict]:
        """Load a snapshot file into the cache and the prefix index; errors change nothing."""
        with self._lock:
            # cached segments and idle sessions' pins give way to the file, as to new requests
            loaded = load_snapshot(path, self.core.cache, fingerprint=self.core.fingerprint,
                                   make_room=self.core.make_room)
            self.core.prefix.insert(loaded.snapshot.refs)
            return loaded.snapshot, loaded.token_ids, loaded.metadata

    def add_pressure_hook(self, hook) -> None:
        with self._lock:
            self.core.pressure_hooks.append(hook)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        with self._lock:
            if self._on_step in self.core.step_listeners:
                self.core.step_listeners.remove(self._on_step)

    # -- the loop ---------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            if not self.core.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            with self._lock:
                try:
                    self.core.step()  # its requests' updates go out through _on_step
                except BaseException as exc:  # fail the in-flight requests, keep serving
                    self.error = exc
                    self._abort_all(RuntimeError(f"engine step failed: {exc}"))
            # the lock is not fair: taken again at once, it kept /health and new requests waiting
            # for seconds while requests ran; giving up the interpreter lets a waiting thread in
            time.sleep(0)

    def _on_step(self, touched: list[EngineRequest]) -> None:
        """After every step of the core (under its lock): stream updates and counters."""
        self.steps += 1
        self._record(touched)
        for request in touched:
            if request.request_id in self._streams:  # not the requests of LLM.generate
                self._deliver(request.request_id, self._update(request))

    def _record(self, touched: list[EngineRequest]) -> None:
        now = time.monotonic()
        self._token_times.append((now, len(touched)))
        for r in touched:
            if len(r.token_times) == 1 and r.first_token_time is not None:
                self._ttfts.append(r.first_token_time - r.arrival)
            if r.finished:
                self.num_finished += 1

    def live_stats(self, window: float = 5.0) -> dict[str, object]:
        """Recent throughput and latency for dashboards: decode tokens/s over ``window``
        seconds, time to first token (median of recent requests), and the engine's counters."""
        now = time.monotonic()
        recent = [n for t, n in list(self._token_times) if now - t <= window]
        ttfts = sorted(self._ttfts)
        stats = self.stats()
        stats.update(
            decode_tokens_per_s=sum(recent) / window,
            ttft_seconds_p50=ttfts[len(ttfts) // 2] if ttfts else None,
            requests_finished=self.num_finished,
            steps=self.steps,
        )
        return stats

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

    def _abort_all(self, exc: BaseException) -> int:
        """Under the lock: abort every request and deliver a copy of ``exc`` to each stream."""
        request_ids = list(self.core.requests)
        for request_id in request_ids:
            self.core.abort(request_id)
            # a copy each: one exception object raised in several tasks would pile up tracebacks
            self._deliver(request_id, copy.copy(exc))
        return len(request_ids)
