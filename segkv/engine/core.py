"""EngineCore: requests and the step loop (schedule -> run -> postprocess), with abort."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from segkv.cache.kv_cache import PagedKVCache
from segkv.engine.generation import Generator, Sequence
from segkv.outputs import RequestOutput
from segkv.runner.layer_windows import history_window
from segkv.runner.model_runner import ModelRunner
from segkv.sampling_params import SamplingParams
from segkv.scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerOutput


class QueueFullError(RuntimeError):
    """The engine's waiting queue is full; the request was not added."""


class EngineStopped(RuntimeError):
    """The engine is shutting down: a new request is refused, a running one is ended."""


@dataclass(slots=True)
class EngineRequest:
    """A request in flight: its samples, timing and how much of its prompt came from cache."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival: float
    cached_tokens: int = 0
    cache_rows: bool = True  # finished rows stay in the prefix index (False: released)
    first_token_time: float | None = None
    finished_time: float | None = None
    aborted: bool = False
    token_times: list[float] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.aborted or all(s.finish_reason is not None for s in self.all_seqs())

    def all_seqs(self) -> list[Sequence]:
        return [x for s in self.seqs for x in (s, *s.siblings)]

    def output(self) -> RequestOutput:
        scores = self.seqs[0].prompt_logprobs
        return RequestOutput(self.request_id, None, self.prompt_ids,
                             [s.result() for s in sorted(self.all_seqs(), key=lambda s: s.index)],
                             max(self.cached_tokens, 0),
                             prompt_logprobs=None if scores is None else list(scores))


class EngineCore:
    """Runs many requests together, one forward per :meth:`step`, on a KV cache and the
    generator (runner, sampler, detokenizers) that steps sequences on it.

    The :class:`Scheduler` makes every decision (admission, cached prefixes, the token
    budget, eviction, preemption); the core keeps the requests, runs the scheduled work through
    the generator and records what it produced. ``LLM.generate`` and :class:`AsyncEngine` drive
    the same core: whoever steps it holds :attr:`lock`, and every step's touched requests go to
    the :attr:`step_listeners` (an async engine's streams), whoever ran it. ``fingerprint`` names
    the model's weights (written into and checked against snapshot files).
    """

    def __init__(self, cache: PagedKVCache, generator: Generator, config: SchedulerConfig | None = None, *,
                 fingerprint: str = "") -> None:
        self.cache = cache
        self.generator = generator
        self.fingerprint = fingerprint
        self.scheduler = Scheduler(cache, config, rows_ahead=generator.rows_ahead, draft_rows=generator.draft_rows)
        self.config = self.scheduler.config
        # verify windows' draft rows count against the step's token budget too
        generator.max_step_rows = self.config.max_num_batched_tokens
        self.pool = self.scheduler.pool
        self.prefix = self.scheduler.prefix
        # a model whose every layer attends a sliding window: rows behind it are given back
        self.window = history_window(generator.runner.model)
        self.prefix.window = self.window
        self.pressure_hooks = self.scheduler.pressure_hooks  # see Scheduler.make_room
        self.requests: dict[str, EngineRequest] = {}
        self._owner: dict[int, EngineRequest] = {}  # id(sequence) -> its request, while it runs
        self._ids = itertools.count()
        self.lock = threading.Lock()  # held by whoever adds, aborts or steps
        self.step_listeners: list[Callable[[list[EngineRequest]], None]] = []

    @property
    def runner(self) -> ModelRunner:
        return self.generator.runner

    @property
    def max_model_len(self) -> int:
        return self.generator.max_model_len

    def configure(self, config: SchedulerConfig) -> None:
        """Use ``config``'s limits from now on (while no request is in flight)."""
        if self.requests or self.has_unfinished():
            raise RuntimeError("the scheduler's limits change only while no request is in flight")
        self.scheduler.config = self.config = config

    @property
    def waiting(self) -> deque[Sequence]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # -- requests ---------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                    cache_rows: bool = True) -> EngineRequest:
        """Queue a request; ValueError for a bad prompt, QueueFullError when full.

        ``cache_rows=False``: the finished request's rows are released instead of staying in the
        prefix index for later requests (offline generation leaves no pages behind).
        """
        if not prompt_ids:
            raise ValueError("a prompt must have at least one token")
        self.generator.check_prompt_length(len(prompt_ids))
        if self.pool.pages_for_rows(len(prompt_ids)) >= self.pool.num_pages:
            raise ValueError(f"a prompt of {len(prompt_ids)} tokens does not fit the KV cache of "
                             f"{self.pool.num_pages} pages of {self.pool.page_size} rows")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"the queue holds {len(self.waiting)} requests; try again later")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        # Waiting sequences hold no pages: the cached prefix is matched at admission.
        seq = self.generator.new_sequence(0, self.cache.new_chain(), prompt_ids, prompt_ids, params)
        request = EngineRequest(request_id, list(prompt_ids), params, [seq], time.monotonic(), -1,
                                cache_rows=cache_rows)
        self.requests[request_id] = request
        self._owner[id(seq)] = request
        self.scheduler.add(seq)
        return request

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its pages now; False if it is unknown or already done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        request.aborted = True
        for seq in request.all_seqs():
            self.scheduler.free(seq, keep=False)  # an aborted request's rows are not kept for reuse
            self._owner.pop(id(seq), None)
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def make_room(self, pages_short: int) -> bool:
        """Free ``pages_short`` more pages if it can (see :meth:`Scheduler.make_room`)."""
        return self.scheduler.make_room(pages_short)

    def _preempt(self, seq: Sequence) -> None:
        self.scheduler.preempt(seq)

    # -- the step ---------------------------------------------------------------------
    def step(self) -> list[EngineRequest]:
        """Run one forward; return requests that produced tokens or finished this step (also
        given to the step listeners). Call it holding :attr:`lock` when another thread may too."""
        out = self.scheduler.schedule()
        self._note_cached(out)
        if not out.scheduled:
            return []
        ready = self.generator.step(out.scheduled, ahead_ok=out.ahead_ok)
        self._release_rows_behind_window()
        touched = self._postprocess(ready)
        for listener in self.step_listeners:
            listener(touched)
        return touched

    def _release_rows_behind_window(self) -> None:
        """Give back the pages of running chains that no future query can see: behind the
        window of a model whose every layer attends one (from the first future query: the row a
        step launched ahead holds, else the next one). Pages shared with a snapshot, a fork or
        the prefix index stay (left to its eviction)."""
        if self.window is None:
            return
        for seq in self.running:
            chain = seq.chain
            chain.release_rows_before(chain.num_rows - self.generator.rows_ahead(seq) - self.window + 1)

    def _note_cached(self, out: SchedulerOutput) -> None:
        """A request's cached tokens are those its first prefix match found."""
        for seq, cached in out.matched:
            request = self._owner[id(seq)]
            if request.cached_tokens < 0:  # a prompt-scoring request recomputes its cached prefix
                request.cached_tokens = 0 if request.params.prompt_logprobs is not None else cached

    def _postprocess(self, ready: list[Sequence]) -> list[EngineRequest]:
        """Record the step's tokens per request; forked samples join, finished sequences leave
        (their rows stay findable in the prefix index)."""
        now = time.monotonic()
        touched: dict[str, EngineRequest] = {}
        for seq in ready:
            request = self._owner[id(seq)]
            for sib in seq.siblings:
                if id(sib) not in self._owner:
                    self._owner[id(sib)] = request
                    self.scheduler.add_running(sib)
            if request.first_token_time is None:
                request.first_token_time = now
            request.token_times.append(now)
            touched[request.request_id] = request
        for seq in [s for s in self.running if s.finish_reason is not None]:
            self.scheduler.free(seq, keep=self._owner[id(seq)].cache_rows)
        for request in touched.values():
            if request.finished:
                request.finished_time = now
                self.requests.pop(request.request_id, None)
                for seq in request.all_seqs():
                    self._owner.pop(id(seq), None)
        return list(touched.values())

    def pages_of_requests(self) -> int:
        """Pages the chains of unfinished requests hold (shared pages counted once)."""
        pages: set[int] = set()
        for request in self.requests.values():
            for seq in request.all_seqs():
                for ref in seq.chain.refs:
                    pages.update(ref.page_ids)
                if seq.chain.tail is not None:
                    pages.update(seq.chain.tail.live_page_ids)
        return len(pages)

    def stats(self) -> dict[str, object]:
        # pages_in_use = requests + cached only (evictable) + the rest (pinned, e.g. by sessions)
        return {**self.pool.stats(), "pages_requests": self.pages_of_requests(),
                "pages_cached_only": self.prefix.num_pages_held_only(),
                "running": len(self.running), "waiting": len(self.waiting),
                "preemptions": self.num_preemptions, "prefix": self.prefix.stats(),
                "steps_ahead": {"used": self.generator.steps_ahead_used,
                                "cancelled": self.generator.steps_ahead_cancelled},
                "routes": dict(self.runner.route_counts), "precisions": dict(self.runner.precision_counts),
                "grammar_cache": self.generator.grammars.stats(),
                "kv_tiers": None if self.cache.tiers is None else {
                    **self.cache.tiers.stats(), "recomputed_rows": self.scheduler.num_tier_recomputed_rows}}
