"""EngineCore: the continuous-batching step loop with prefix reuse, preemption and abort."""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from segkv.cache.chain import KVChain
from segkv.cache.page_pool import OutOfPagesError
from segkv.cache.prefix_index import PrefixIndex
from segkv.engine.generation import Sequence
from segkv.engine.llm import LLM
from segkv.outputs import RequestOutput
from segkv.sampling_params import SamplingParams
from segkv.scheduler.scheduler import Scheduler, SchedulerConfig


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
        return RequestOutput(self.request_id, None, self.prompt_ids,
                             [s.result() for s in sorted(self.all_seqs(), key=lambda s: s.index)],
                             max(self.cached_tokens, 0))


class EngineCore:
    """Runs many requests together, one forward per :meth:`step`.

    New requests reuse cached history through the prefix index. When pages run out,
    unreferenced cached segments are evicted first; then the most recently admitted
    sequence is preempted (its rows are released and later recomputed, its outputs
    kept), so a request is never lost.
    """

    def __init__(self, llm: LLM, config: SchedulerConfig | None = None) -> None:
        self.llm = llm
        self.pool = llm.cache.pool
        self.prefix = PrefixIndex(self.pool)
        self.scheduler = Scheduler(config)
        self.config = self.scheduler.config
        self.requests: dict[str, EngineRequest] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._owner: dict[int, EngineRequest] = {}
        self._ids = itertools.count()
        self.num_preemptions = 0
        # Called with the number of pages still missing after cached segments were evicted;
        # each may release references it holds (e.g. idle sessions) and returns pages freed.
        self.pressure_hooks: list = []

    # -- requests ---------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str | None = None
                    ) -> EngineRequest:
        """Queue a request; ValueError for a bad prompt, QueueFullError when full."""
        if not prompt_ids:
            raise ValueError("a prompt must have at least one token")
        self.llm.check_prompt_length(len(prompt_ids))
        if self.pool.pages_for_rows(len(prompt_ids)) >= self.pool.num_pages:
            raise ValueError(f"a prompt of {len(prompt_ids)} tokens does not fit the KV cache of "
                             f"{self.pool.num_pages} pages of {self.pool.page_size} rows")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"the queue holds {len(self.waiting)} requests; try again later")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        # Waiting sequences hold no pages: the cached prefix is matched at admission.
        seq = self.llm.generator.new_sequence(0, self.llm.cache.new_chain(), prompt_ids, prompt_ids, params)
        request = EngineRequest(request_id, list(prompt_ids), params, [seq], time.monotonic(), -1)
        self.requests[request_id] = request
        self._owner[id(seq)] = request
        self.waiting.append(seq)
        return request

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its pages now; False if it is unknown or already done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        request.aborted = True
        for seq in request.all_seqs():
            self._drop(seq, keep=False)  # an aborted request's rows are not kept for reuse
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step ---------------------------------------------------------------------
    def step(self) -> list[EngineRequest]:
        """Run one forward; return requests that produced tokens or finished this step."""
        decision = self._decide()
        if not decision.work:
            return []
        for seq in decision.admitted:
            self.waiting.remove(seq)
            self.running.append(seq)
        # the next decode step may be launched before this one's tokens are read, unless requests
        # wait: the next step would then admit them and could not use it
        ready = self.llm.generator.step(decision.work, ahead_ok=not self.waiting)
        now = time.monotonic()
        touched: dict[str, EngineRequest] = {}
        for seq in ready:
            request = self._owner[id(seq)]
            for sib in seq.siblings:
                if id(sib) not in self._owner:
                    self._owner[id(sib)] = request
                    self.running.append(sib)
            if request.first_token_time is None:
                request.first_token_time = now
            request.token_times.append(now)
            touched[request.request_id] = request
        for seq in [s for s in self.running if s.finish_reason is not None]:
            self._drop(seq)
        for request in touched.values():
            if request.finished:
                request.finished_time = now
                self.requests.pop(request.request_id, None)
        return list(touched.values())

    def _decide(self):
        """A step that fits the free pages: admit new work only if it fits (after evicting
        cached segments); to keep running sequences going, preempt the youngest."""
        candidates = list(self.waiting)[: max(0, self.config.max_num_seqs - len(self.running))]
        for seq in candidates:
            self._match(seq)
        decision = self.scheduler.decide(self.running, candidates)
        if self._fits(decision.work):
            return decision
        for seq in candidates:  # not admitted now: give their cached prefixes back
            self._unmatch(seq)
        if not self.running and candidates:
            self._match(candidates[0])
        decision = self.scheduler.decide(self.running, [] if self.running else candidates[:1])
        while not self._fits(decision.work):
            if len(self.running) <= 1:
                raise OutOfPagesError(
                    f"the KV cache ({self.pool.num_pages} pages, {self.pool.num_free_pages} free) cannot "
                    "hold the next step of a single sequence; raise the KV memory budget")
            self._preempt(self.running[-1])
            decision = self.scheduler.decide(self.running, [])
        return decision

    def _fits(self, work) -> bool:
        """Whether the step's new pages are free, evicting unreferenced cached segments if needed."""
        need = sum(self._pages_needed(seq, n) for seq, n in work)
        return self.make_room(need - self.pool.num_free_pages)

    def make_room(self, pages_short: int) -> bool:
        """Free ``pages_short`` more pages if it can: unreferenced cached segments first, then
        what the pressure hooks give up (idle sessions' pins). True when they are free."""
        need = self.pool.num_free_pages + pages_short
        if pages_short > 0:
            self.prefix.evict(pages_short)
        for hook in self.pressure_hooks:
            short = need - self.pool.num_free_pages
            if short <= 0:
                break
            hook(short)
            self.prefix.evict(short)
        return need <= self.pool.num_free_pages

    def _pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        num_tokens -= self.llm.generator.rows_ahead(seq)  # rows a step launched ahead holds already
        chain = seq.chain
        ps = self.pool.page_size
        tail = chain.num_tail_rows
        room = (-tail) % ps if tail else 0
        return -(-max(0, num_tokens - room) // ps)

    def _preempt(self, seq: Sequence) -> None:
        """Release the sequence's rows (keeping them findable in the prefix index) and requeue it."""
        self._drop(seq)
        seq.chain = self.llm.cache.new_chain()
        self._unmatch(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _match(self, seq: Sequence) -> None:
        """Give a waiting sequence (holding no rows) the longest cached prefix of its tokens."""
        if seq.chain.num_rows:
            return
        tokens = seq.all_token_ids()
        seq.chain, cached = self._chain_for(tokens)
        seq.pending = tokens[cached:]
        request = self._owner[id(seq)]
        if request.cached_tokens < 0:
            request.cached_tokens = cached

    def _unmatch(self, seq: Sequence) -> None:
        """Drop a waiting sequence's references: it will recompute or rematch later."""
        seq.chain.release()
        seq.pending = seq.all_token_ids()

    def _drop(self, seq: Sequence, *, keep: bool = True) -> None:
        """Seal what the sequence computed into the prefix index (``keep``), then release its chain."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        chain = seq.chain
        if keep and chain.num_rows and chain.token_ids() is not None:
            chain.seal()
            self.prefix.insert(chain.refs)
        chain.release()

    def _chain_for(self, tokens: list[int]) -> tuple[KVChain, int]:
        """A chain holding the longest cached prefix of ``tokens`` (at least one left to compute)."""
        match = self.prefix.match(tokens[:-1])
        chain = KVChain(self.pool, refs=match.refs, copy_rows=self.llm.cache.storage.copy_rows,
                        compaction=self.llm.cache.compaction)
        return chain, match.num_tokens

    def pages_of_requests(self) -> int:
        """Pages the chains of unfinished requests hold (shared pages counted once)."""
        pages: set[int] = set()
        for request in self.requests.values():
            for seq in request.all_seqs():
                for ref in seq.chain.refs:
                    pages.update(ref.page_ids)
                if seq.chain.tail is not None:
                    pages.update(seq.chain.tail.page_ids)
        return len(pages)

    def stats(self) -> dict[str, object]:
        # pages_in_use = requests + cached only (evictable) + the rest (pinned, e.g. by sessions)
        return {**self.pool.stats(), "pages_requests": self.pages_of_requests(),
                "pages_cached_only": self.prefix.num_pages_held_only(),
                "running": len(self.running), "waiting": len(self.waiting),
                "preemptions": self.num_preemptions, "prefix": self.prefix.stats(),
                "steps_ahead": {"used": self.llm.generator.steps_ahead_used,
                                "cancelled": self.llm.generator.steps_ahead_cancelled},
                "routes": dict(self.llm.runner.route_counts)}
