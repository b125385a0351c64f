"""Continuous-batching decisions (admission, prefix match, token budget, eviction, preemption)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Protocol

from segkv.cache.chain import KVChain
from segkv.cache.kv_cache import PagedKVCache
from segkv.cache.page_pool import OutOfPagesError
from segkv.cache.prefix_index import PrefixIndex
from segkv.cache.tiers import Arrival, land, offload, start_bring_back, trim_from


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """Limits of one engine step (vLLM's names).

    ``max_num_seqs``: sequences running at once. ``max_num_batched_tokens``: tokens one
    forward may process (decodes first, then prefill chunks). ``max_waiting``: queued
    requests before new ones are refused.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class Schedulable(Protocol):
    """What the scheduler reads and changes of a sequence (the engine's ``Sequence``)."""

    chain: KVChain
    pending: list[int]  # token ids that still need KV rows

    @property
    def num_pending(self) -> int: ...  # 1 when decoding

    def all_token_ids(self) -> list[int]: ...


@dataclass(slots=True)
class SchedulerOutput:
    """One step's decisions, for the engine to run.

    ``scheduled``: ``(sequence, num_tokens)`` pairs in batch order (decodes, prefill chunks,
    then admissions). ``admitted``: waiting sequences that joined the running ones.
    ``preempted``: running sequences whose rows were released this step (back at the head of
    the queue, recomputed later). ``matched``: ``(sequence, cached_tokens)`` for each cached
    prefix matched on admission, in order. ``num_evicted_pages``: unreferenced cached pages
    evicted to fit the step; ``num_offloaded_pages``: pages freed by moving idle segments to the
    KV tiers; ``num_restored_pages``: pages their segments began coming back into this step.
    ``ahead_ok``: the next decode step may be launched before this one's tokens are read
    (nobody waits: a waiting request would be admitted next step).
    """

    scheduled: list[tuple[Any, int]] = field(default_factory=list)
    admitted: list[Any] = field(default_factory=list)
    preempted: list[Any] = field(default_factory=list)
    matched: list[tuple[Any, int]] = field(default_factory=list)
    num_evicted_pages: int = 0
    num_offloaded_pages: int = 0
    num_restored_pages: int = 0
    ahead_ok: bool = False

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """Decode-first continuous batching with chunked prefill under a token budget, over the
    pages of one KV cache.

    It owns the queues (``waiting``, ``running``), the prefix index and the pressure hooks.
    Waiting sequences hold no pages: the longest cached prefix is matched on admission. When a
    step's new pages are not free, unreferenced cached segments are evicted first, then what
    the pressure hooks give up; new work is admitted only if it fits, and to keep running
    sequences going the most recently admitted one is preempted (its rows sealed into the
    index, released and later recomputed, its outputs kept), so a request is never lost.
    ``rows_ahead(seq)``: rows a step launched ahead already holds for ``seq``. ``draft_rows``:
    rows each decode's verify window may add (speculative decoding), counted in the token budget.
    """

    def __init__(self, cache: PagedKVCache, config: SchedulerConfig | None = None, *,
                 rows_ahead: Callable[[Any], int] = lambda seq: 0, draft_rows: int = 0) -> None:
        self.config = config or SchedulerConfig()
        # rows a decode's verify window may add (its drafts), kept free in the token budget so
        # that prefills scheduled beside decodes do not crowd the drafts out
        self.draft_rows = draft_rows
        self.cache = cache
        self.pool = cache.pool
        self.prefix = PrefixIndex(self.pool)
        self.rows_ahead = rows_ahead
        self.waiting: deque[Schedulable] = deque()
        self.running: list[Schedulable] = []
        self.num_preemptions = 0
        # rows recomputed because their segment's copy in the KV tiers was lost or bad
        self.num_tier_recomputed_rows = 0
        # segments on their way back from the KV tiers (by segment id): their sequences wait
        # while other sequences' steps run, and join a step once the copies are complete
        self.arrivals: dict[int, Arrival] = {}
        # Called with the number of pages still missing after cached segments were evicted;
        # each may release references it holds (e.g. idle sessions) and returns pages freed.
        self.pressure_hooks: list[Callable[[int], Any]] = []

    # -- queues -----------------------------------------------------------------------
    def add(self, seq: Schedulable) -> None:
        """Queue a new sequence (holding no rows)."""
        self.waiting.append(seq)

    def add_running(self, seq: Schedulable) -> None:
        """A sequence forked from a running one (a sibling sample) runs from now on."""
        self.running.append(seq)

    def free(self, seq: Schedulable, *, keep: bool = True) -> None:
        """Take the sequence out of the queues; seal what it computed into the prefix index
        (``keep``), then release its chain."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        chain = seq.chain
        if keep and chain.num_rows and chain.token_ids() is not None:
            chain.seal()
            self.prefix.insert(chain.refs)
        chain.release()
        if any(not a.segment.held_pages for a in self.arrivals.values()):  # nobody waits for them now
            self._land(wait=True)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """This step's work, fitted into the free pages; admitted sequences move to running."""
        out = SchedulerOutput()
        self._land(wait=False)
        candidates = list(islice(self.waiting, max(0, self.config.max_num_seqs - len(self.running))))
        for seq in candidates:
            self._match(seq, out)
        work, admitted = self._pick(self.running, candidates)
        if not self._fits(work, out):
            for seq in candidates:  # not admitted now: give their cached prefixes back
                self._unmatch(seq)
            if not self.running and candidates:
                self._match(candidates[0], out)
            work, admitted = self._pick(self.running, [] if self.running else candidates[:1])
            while not self._fits(work, out):
                if len(self.running) <= 1:
                    raise OutOfPagesError(
                        f"the KV cache ({self.pool.num_pages} pages, {self.pool.num_free_pages} free) "
                        "cannot hold the next step of a single sequence; raise the KV memory budget")
                self._preempt(self.running[-1], out)
                work, admitted = self._pick(self.running, [])
        for seq in admitted:
            self.waiting.remove(seq)
            self.running.append(seq)
        # the pages were made free for them: rows in the KV tiers come back, and a sequence
        # whose rows are still on their way waits for a later step unless nothing else would run
        ready = [(seq, n) for seq, n in work if self._bring_back(seq, out)]
        if work and not ready:
            self._land(wait=True)
            ready = [(seq, n) for seq, n in work if self._bring_back(seq, out)]
        out.scheduled, out.admitted = ready, admitted
        out.ahead_ok = not self.waiting and len(ready) == len(work)
        return out

    def _pick(self, running: Sequence[Schedulable], waiting: Sequence[Schedulable]
              ) -> tuple[list[tuple[Schedulable, int]], list[Schedulable]]:
        """Running decodes first (one token each), then running prefills, then admissions.

        Every scheduled sequence gets at least one token while budget remains; prefills are
        cut to the remaining budget (chunked prefill). Waiting sequences are admitted in
        arrival order while ``max_num_seqs`` allows.
        """
        budget = self.config.max_num_batched_tokens
        work = []
        decodes = [s for s in running if s.num_pending == 1]
        prefills = [s for s in running if s.num_pending > 1]
        for seq in decodes + prefills:
            if budget <= 0:
                break
            take = min(seq.num_pending, budget)
            work.append((seq, take))
            budget -= take + (self.draft_rows if seq.num_pending == 1 else 0)
        admitted = []
        slots = self.config.max_num_seqs - len(running)
        for seq in waiting:
            if budget <= 0 or slots <= 0:
                break
            take = min(seq.num_pending, budget)
            work.append((seq, take))
            admitted.append(seq)
            budget -= take
            slots -= 1
        return work, admitted

    # -- pages ------------------------------------------------------------------------
    def _fits(self, work: list[tuple[Schedulable, int]], out: SchedulerOutput) -> bool:
        """Whether the step's new pages are free, evicting unreferenced cached segments if needed."""
        need = sum(self._pages_needed(seq, n) for seq, n in work)
        busy = [*self.running, *(seq for seq, _ in work)]
        return self._make_room(need - self.pool.num_free_pages, out, busy)

    # -- KV tiers ---------------------------------------------------------------------
    def _spill(self, pages_short: int, busy: Sequence[Schedulable]) -> int:
        """Move indexed segments that no ``busy`` sequence attends to the KV tiers, least recently
        used first, until ``pages_short`` pages are free; returns the pages freed. Their holders
        (the index, sessions' pins, snapshots) keep them, so they come back instead of being
        recomputed."""
        in_use = {id(ref.segment) for seq in busy for ref in seq.chain.refs}  # segments busy chains attend
        before = self.pool.num_free_pages
        for segment in self.prefix.segments_by_last_use():
            if self.pool.num_free_pages - before >= pages_short:
                break
            if segment.in_lower_tier:
                continue
            if id(segment) in in_use and not self._copy_out_of(segment, busy):
                continue
            offload(self.cache, segment)
        return self.pool.num_free_pages - before

    def _copy_out_of(self, segment, busy: Sequence[Schedulable]) -> bool:
        """Give each busy chain that holds the first rows of ``segment`` its own copy of them,
        when the copies together fit the free pages and free more pages than they take (histories
        forked from another's first rows), so the segment can leave its pages; whether it did."""
        # every busy chain holding it takes a copy (a chain listed twice in busy, once)
        copies = {(id(seq.chain), i): (seq.chain, i, self.pool.pages_for_rows(ref.num_rows))
                  for seq in busy for i, ref in enumerate(seq.chain.refs) if ref.segment is segment}
        cost = sum(pages for _, _, pages in copies.values())
        if 2 * cost >= segment.held_pages or cost > self.pool.num_free_pages:
            return False
        for chain, i, _ in copies.values():
            chain.own_copy(i)
        return True

    def _bring_back(self, seq: Schedulable, out: SchedulerOutput) -> bool:
        """Start bringing ``seq``'s segments in the KV tiers back into pages (counted free by
        :meth:`_pages_needed`); a segment whose copy is gone or bad is recomputed instead, with
        every row after it. True when every row ``seq`` attends is in pages; False while some are
        still on their way (copies on a GPU's side stream)."""
        if self.cache.tiers is None:  # no segment can be out of its pages
            return True
        chain = seq.chain
        on_the_way = False
        for segment in chain.segments_in_lower_tiers():
            if segment.segment_id in self.arrivals:
                on_the_way = True
                continue
            arrival = start_bring_back(self.cache, segment)
            if arrival is not None:
                out.num_restored_pages += len(arrival.pages)
                if not arrival.complete():
                    self.arrivals[segment.segment_id] = arrival
                    on_the_way = True
                    continue
                if land(self.cache, arrival):
                    continue
            self.num_tier_recomputed_rows += trim_from(chain, segment)  # no good copy
            seq.pending = seq.all_token_ids()[chain.num_rows:]
            break
        return not on_the_way

    def _land(self, *, wait: bool) -> None:
        """Segments whose copies back from the KV tiers are complete (all of them, waiting for
        them, when ``wait``) go back into their pages, or out for good when they came back
        different (their chains recompute them when next scheduled)."""
        for segment_id, arrival in list(self.arrivals.items()):
            if wait or arrival.complete():
                del self.arrivals[segment_id]
                land(self.cache, arrival)

    def make_room(self, pages_short: int) -> bool:
        """Free ``pages_short`` more pages if it can: idle segments moved to the KV tiers (when the
        cache has them) first, then unreferenced cached segments, then what the pressure hooks
        give up (idle sessions' pins). True when they are free."""
        return self._make_room(pages_short, SchedulerOutput(), [*self.running, *self.waiting])

    def _make_room(self, pages_short: int, out: SchedulerOutput, busy: Sequence[Schedulable] = ()) -> bool:
        need = self.pool.num_free_pages + pages_short
        if pages_short > 0 and self.cache.tiers is not None:
            out.num_offloaded_pages += self._spill(pages_short, busy)
            pages_short = need - self.pool.num_free_pages
        if pages_short > 0:
            out.num_evicted_pages += self.prefix.evict(pages_short)
        for hook in self.pressure_hooks:
            short = need - self.pool.num_free_pages
            if short <= 0:
                break
            hook(short)
            out.num_evicted_pages += self.prefix.evict(short)
        return need <= self.pool.num_free_pages

    def _pages_needed(self, seq: Schedulable, num_tokens: int) -> int:
        num_tokens -= self.rows_ahead(seq)  # rows a step launched ahead holds already
        ps = self.pool.page_size
        tail = seq.chain.num_tail_rows
        room = (-tail) % ps if tail else 0
        pages = -(-max(0, num_tokens - room) // ps)
        if self.cache.tiers is not None:  # segments in the tiers come back into pages first
            pages += sum(len(s.tier_holds) for s in seq.chain.segments_in_lower_tiers()
                         if s.segment_id not in self.arrivals)  # (those on their way have theirs)
        return pages

    def preempt(self, seq: Schedulable) -> None:
        """Release a running sequence's rows (keeping them findable in the prefix index) and
        requeue it at the head of the waiting queue."""
        self._preempt(seq, SchedulerOutput())

    def _preempt(self, seq: Schedulable, out: SchedulerOutput) -> None:
        self.free(seq)
        seq.chain = self.cache.new_chain()
        self._unmatch(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    # -- prefix match -----------------------------------------------------------------
    def _match(self, seq: Schedulable, out: SchedulerOutput) -> None:
        """Give a waiting sequence (holding no rows) the longest cached prefix of its tokens
        (at least one token is left to compute)."""
        if seq.chain.num_rows:
            return
        tokens = seq.all_token_ids()
        match = self.prefix.match(tokens[:-1])
        seq.chain = KVChain(self.pool, refs=match.refs, copy_rows=self.cache.copy_rows,
                            compaction=self.cache.compaction)
        seq.pending = tokens[match.num_tokens:]
        out.matched.append((seq, match.num_tokens))

    def _unmatch(self, seq: Schedulable) -> None:
        """Drop a waiting sequence's references: it will recompute or rematch later."""
        seq.chain.release()
        seq.pending = seq.all_token_ids()
