"""KVChain: one sequence's history as sealed SegRefs plus a growing tail; snapshots."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from segkv.cache.compaction import segments_to_merge
from segkv.cache.page_pool import PagePool
from segkv.cache.segment import ChainSpan, SegRef, Segment, reaches_released_rows
from segkv.config import CompactionPolicy

# copy_rows(src_slots, dst_slots): copy KV rows of every layer between storage slots.
RowCopier = Callable[[Sequence[int], Sequence[int]], None]


class ChainSnapshot:
    """An immutable chain value: the references of a chain at one moment.

    A snapshot holds its own references, so the rows it names stay alive and unchanged
    whatever the chain does next. Call :meth:`release` when it is no longer needed.
    """

    __slots__ = ("refs", "_released")

    def __init__(self, refs: Sequence[SegRef]) -> None:
        self.refs: tuple[SegRef, ...] = tuple(ref.share() for ref in refs)
        self._released = False

    @property
    def num_rows(self) -> int:
        return sum(ref.num_rows for ref in self.refs)

    @property
    def live(self) -> bool:
        return not self._released

    def token_ids(self) -> list[int] | None:
        return _concat_tokens(ref.token_ids for ref in self.refs)

    def release(self) -> None:
        """Give up the snapshot's references (idempotent)."""
        self._released = True
        for ref in self.refs:
            ref.release()


class KVChain:
    """The per-sequence KV history: ``[SegRef, ...] + tail``.

    ``append`` reserves rows in the tail and returns their storage slots; ``seal`` ends a
    turn (the tail becomes an immutable segment); ``snapshot``, ``fork`` and ``restore``
    share references and never allocate or copy; ``trim`` drops rows from the end without
    copying; ``release`` gives every page back. After a seal, trailing small segments are
    merged according to the compaction policy when a ``copy_rows`` callback is given.
    """

    def __init__(
        self,
        pool: PagePool,
        *,
        refs: Sequence[SegRef] = (),
        copy_rows: RowCopier | None = None,
        compaction: CompactionPolicy | None = None,
    ) -> None:
        self.pool = pool
        self.refs: list[SegRef] = list(refs)  # adopted: the caller's references move here
        self.tail: Segment | None = None
        self._copy_rows = copy_rows
        self._compaction = compaction or CompactionPolicy()

    # -- reading ----------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return sum(ref.num_rows for ref in self.refs) + self.num_tail_rows

    @property
    def num_tail_rows(self) -> int:
        return 0 if self.tail is None else self.tail.num_rows

    @property
    def num_segments(self) -> int:
        return len(self.refs) + (1 if self.num_tail_rows else 0)

    def spans(self) -> list[ChainSpan]:
        """The chain's rows in order: one span per sealed reference, then the tail."""
        spans, start = [], 0
        for ref in self.refs:
            pages = ref.page_tuple
            segment = ref.segment
            spans.append(ChainSpan(segment.segment_id, pages, ref.num_rows, start, True,
                                   min(segment.released_pages, len(pages)), segment.tier_holds is not None))
            start += ref.num_rows
        if self.num_tail_rows:
            tail = self.tail
            spans.append(ChainSpan(tail.segment_id, tail.page_tuple(), tail.num_rows, start, False,
                                   tail.released_pages))
        return spans

    def slots(self) -> list[int]:
        """Storage slots of all rows in order (for gathering the history densely); ValueError
        when rows were released (:meth:`release_rows_before`)."""
        out: list[int] = []
        for ref in self.refs:
            out.extend(ref.slots())
        if self.num_tail_rows:
            out.extend(self.tail.slots(0, self.tail.num_rows))
        return out

    def last_slots(self, num_rows: int) -> list[int]:
        """Storage slots of the last ``num_rows`` rows, in order."""
        if not 0 <= num_rows <= self.num_rows:
            raise ValueError(f"cannot take the last {num_rows} rows of a chain of {self.num_rows}")
        parts: list[list[int]] = []
        left = num_rows
        if left and self.num_tail_rows:
            take = min(left, self.tail.num_rows)
            parts.append(self.tail.slots(self.tail.num_rows - take, self.tail.num_rows))
            left -= take
        for ref in reversed(self.refs):
            if not left:
                break
            take = min(left, ref.num_rows)
            parts.append(ref.segment.slots(ref.num_rows - take, ref.num_rows))
            left -= take
        return [slot for part in reversed(parts) for slot in part]

    def segments_in_lower_tiers(self) -> list[Segment]:
        """The chain's sealed segments whose rows are in a lower KV tier (chain order, each once):
        they come back (``PagedKVCache.bring_back``) before the chain is attended."""
        out: list[Segment] = []
        for ref in self.refs:
            if ref.segment.tier_holds is not None and ref.segment not in out:
                out.append(ref.segment)
        return out

    def holds_rows_from(self, position: int) -> bool:
        """Whether every row from ``position`` on is live (none released)."""
        return not reaches_released_rows(self._parts(), position)

    @property
    def num_released_rows(self) -> int:
        """Rows whose pages were given back outside the sliding window (:meth:`release_rows_before`)."""
        released = sum(min(ref.segment.released_rows, ref.num_rows) for ref in self.refs)
        return released + (self.tail.released_rows if self.tail is not None else 0)

    def token_ids(self) -> list[int] | None:
        """Token ids of every row, or None if some rows were appended without tokens."""
        parts = [ref.token_ids for ref in self.refs]
        if self.tail is not None:
            parts.append(self.tail.token_ids)
        return _concat_tokens(parts)

    # -- writing ----------------------------------------------------------------------
    def append(self, num_rows: int, *, token_ids: Sequence[int] | None = None) -> list[int]:
        """Reserve ``num_rows`` new rows in the tail and return their storage slots.

        Pages are allocated only for rows that do not fit the tail's last page. On
        :class:`OutOfPagesError` the chain is unchanged.
        """
        if num_rows < 0:
            raise ValueError(f"cannot append {num_rows} rows")
        if token_ids is not None and len(token_ids) != num_rows:
            raise ValueError(f"{len(token_ids)} token ids given for {num_rows} rows")
        tail = self.tail
        if tail is None:
            tail = Segment(self.pool)
        start = tail.num_rows
        need = self.pool.pages_for_rows(start + num_rows) - len(tail.page_ids)
        if need > 0:
            tail.add_pages(self.pool.allocate(need))
        self.tail = tail
        tail.num_rows += num_rows
        if tail.token_ids is None or (token_ids is None and num_rows):
            tail.token_ids = None
        elif token_ids is not None:
            tail.token_ids.extend(int(t) for t in token_ids)
        return tail.slots(start, tail.num_rows)

    def set_last_token_id(self, token_id: int) -> None:
        """Record the token id of the last row (appended before its token was known on the host:
        a decode step launched from the device's samples)."""
        self.set_last_token_ids([token_id])

    def set_last_token_ids(self, token_ids: list[int]) -> None:
        """Record the token ids of the last ``len(token_ids)`` rows, all in the tail (appended
        before their tokens were known on the host)."""
        n = len(token_ids)
        if n > self.num_tail_rows:
            raise ValueError(f"the chain's tail holds {self.num_tail_rows} rows; cannot set {n} token ids")
        if n and self.tail.token_ids is not None:
            self.tail.token_ids[-n:] = [int(t) for t in token_ids]

    def seal(self) -> SegRef | None:
        """End the turn: the tail becomes a sealed segment; compaction may follow."""
        ref = self._seal_tail()
        if ref is not None:
            self._maybe_compact()
        return self.refs[-1] if ref is not None else None

    def _seal_tail(self) -> SegRef | None:
        """Seal the tail without compacting (snapshots and forks never allocate or copy)."""
        tail = self.tail
        self.tail = None
        if tail is None or tail.num_rows == 0:
            if tail is not None:
                self.pool.decref(tail.live_page_ids)
            return None
        tail.sealed = True
        ref = SegRef(tail, tail.num_rows, _adopt=True)  # the tail's own page references
        self.refs.append(ref)
        return ref

    def snapshot(self) -> ChainSnapshot:
        """Seal the tail (no compaction) and return an immutable value of the whole chain."""
        self._seal_tail()
        return ChainSnapshot(self.refs)

    def fork(self) -> KVChain:
        """Seal the tail (no compaction) and return a new chain sharing every reference."""
        self._seal_tail()
        return KVChain(
            self.pool,
            refs=[ref.share() for ref in self.refs],
            copy_rows=self._copy_rows,
            compaction=self._compaction,
        )

    def restore(self, snapshot: ChainSnapshot) -> None:
        """Make this chain equal to ``snapshot`` (references only; no copy)."""
        if not snapshot.live:
            raise ValueError("cannot restore a released snapshot")
        new_refs = [ref.share() for ref in snapshot.refs]
        self.release()
        self.refs = new_refs

    def trim(self, num_rows: int) -> None:
        """Drop the last ``num_rows`` rows (rejected speculative rows), copying nothing."""
        if not 0 <= num_rows <= self.num_rows:
            raise ValueError(f"cannot trim {num_rows} rows from a chain of {self.num_rows}")
        if num_rows == self.num_rows:
            self.release()
            return
        tail = self.tail
        if tail is not None and num_rows <= tail.num_rows:
            keep = self.pool.pages_for_rows(tail.num_rows - num_rows)
            if tail.released_pages and tail.num_rows - num_rows <= tail.released_rows:
                raise ValueError(f"cannot trim {num_rows} rows: the rows left would end among rows "
                                 f"released outside the sliding window")
            tail.num_rows -= num_rows
            self.pool.decref(tail.page_ids[keep:])
            tail.drop_pages_from(keep)
            if tail.token_ids is not None:
                del tail.token_ids[tail.num_rows :]
            return
        num_rows -= self.num_tail_rows
        self._release_tail()
        while num_rows > 0:
            ref = self.refs.pop()
            if num_rows < ref.num_rows:
                self.refs.append(ref.share(ref.num_rows - num_rows))
            num_rows -= ref.num_rows
            ref.release()

    def keep_last_rows(self, window: int, keep: Sequence[int]) -> int:
        """Of the last ``window`` rows (all in the tail), keep those at offsets ``keep`` (strictly
        ascending) as the window's first rows, in that order, and drop the rest: a tree verify
        window's accepted path, whose nodes need not follow each other. Only rows not already in
        place are copied (every layer, through the storage's ``copy_rows``); returns how many."""
        keep = [int(k) for k in keep]
        if not 0 <= window <= self.num_tail_rows:
            raise ValueError(f"a window of {window} rows is not inside the tail's {self.num_tail_rows}")
        if any(not 0 <= k < window for k in keep) or any(a >= b for a, b in zip(keep, keep[1:])):
            raise ValueError(f"rows to keep must be strictly ascending offsets in [0, {window}), got {keep}")
        tail = self.tail
        base = tail.num_rows - window
        moves = [(k, j) for j, k in enumerate(keep) if k != j]
        if moves:
            if self._copy_rows is None:
                raise ValueError("this chain has no row copier (a chain made by PagedKVCache.new_chain has one)")
            src = [tail.slots(base + k, base + k + 1)[0] for k, _ in moves]
            dst = [tail.slots(base + j, base + j + 1)[0] for _, j in moves]
            self._copy_rows(src, dst)  # a source lies after every destination before it: no overlap
            if tail.token_ids is not None:
                for k, j in moves:
                    tail.token_ids[base + j] = tail.token_ids[base + k]
        self.trim(window - len(keep))
        return len(moves)

    def release_rows_before(self, position: int) -> int:
        """Give back the pages wholly before ``position`` that this chain alone holds: rows no
        later query of a model whose every layer attends a sliding window can see (a query at
        position ``p`` sees ``p - window + 1 ..``). Returns the pages freed.

        Within each segment pages go from its first live page up to the first one held
        elsewhere too (a snapshot, a fork, the prefix index, another reference): those stay, so
        whoever shares them keeps every row. Released rows keep their token ids; their slots,
        and any plan that still reaches them, are refused."""
        freed, start = 0, 0
        ps = self.pool.page_size
        for segment, num_rows in self._parts():
            if start >= position:
                break
            held = self.pool.pages_for_rows(num_rows)
            before = held if start + num_rows <= position else min(held, (position - start) // ps)
            if not segment.sealed:  # the tail's last page takes the next rows: only full pages go
                before = min(before, num_rows // ps)
            if segment.in_lower_tier:  # no pages to give back
                before = 0
            count = segment.released_pages
            while count < before and self.pool.ref_count(segment.page_ids[count]) == 1:
                count += 1
            if count > segment.released_pages:
                pages = segment.page_ids[segment.released_pages:count]
                segment.release_leading_pages(count)
                self.pool.decref(pages)
                freed += len(pages)
            start += num_rows
        return freed

    def release_tail_head(self, num_rows: int) -> int:
        """Give back the tail's pages that lie wholly inside its first ``num_rows`` rows (all of
        them when that is every row): a rebuilt segment whose head was released before it was
        saved. Returns the pages freed."""
        tail = self.tail
        if tail is None or not 0 <= num_rows <= tail.num_rows:
            raise ValueError(f"cannot release the first {num_rows} rows of a tail of {self.num_tail_rows}")
        whole = self.pool.pages_for_rows(num_rows) if num_rows == tail.num_rows else num_rows // self.pool.page_size
        count = max(tail.released_pages, whole)
        pages = tail.page_ids[tail.released_pages:count]
        tail.release_leading_pages(count)
        self.pool.decref(pages)
        return len(pages)

    def release(self) -> None:
        """Give up every reference; the chain becomes empty and may be reused."""
        for ref in self.refs:
            ref.release()
        self.refs = []
        self._release_tail()

    # -- internals --------------------------------------------------------------------
    def _parts(self) -> list[tuple[Segment, int]]:
        """(segment, rows of it in the chain) in chain order, the tail last."""
        parts = [(ref.segment, ref.num_rows) for ref in self.refs]
        if self.tail is not None:
            parts.append((self.tail, self.tail.num_rows))
        return parts

    def _release_tail(self) -> None:
        if self.tail is not None:
            self.pool.decref(self.tail.live_page_ids)
            self.tail = None

    def _maybe_compact(self) -> None:
        if self._copy_rows is None:
            return
        count = segments_to_merge([ref.num_rows for ref in self.refs], self._compaction)
        if count < 2:
            return
        old = self.refs[-count:]
        if any(ref.segment.released_pages or ref.segment.in_lower_tier for ref in old):
            return  # released rows, or rows in a lower tier, have nothing to copy: they stay as they are
        total = sum(ref.num_rows for ref in old)
        if self.pool.pages_for_rows(total) > self.pool.num_free_pages:
            return  # compaction is an optimisation: never fail a seal for want of pages
        merged = self._copied(old)
        del self.refs[-count:]
        self.refs.append(merged)
        for ref in old:
            ref.release()

    def own_copy(self, index: int) -> None:
        """Replace reference ``index`` by a reference to a new sealed segment holding a copy of its
        rows (every layer, through ``copy_rows``), so the segment it shared no longer serves this
        chain (the KV tiers may then move that segment out while this chain runs).
        :class:`OutOfPagesError` when the pool lacks the pages (nothing changed)."""
        old = self.refs[index]
        self.refs[index] = self._copied([old])
        old.release()

    def _copied(self, refs: list[SegRef]) -> SegRef:
        """A reference to a new sealed segment holding ``refs``' rows in order (copied)."""
        total = sum(ref.num_rows for ref in refs)
        segment = Segment(self.pool)
        segment.add_pages(self.pool.allocate(self.pool.pages_for_rows(total)))
        segment.num_rows = total
        src: list[int] = []
        for ref in refs:
            src.extend(ref.slots())
        self._copy_rows(src, segment.slots(0, total))
        segment.token_ids = _concat_tokens(ref.token_ids for ref in refs)
        segment.sealed = True
        return SegRef(segment, total, _adopt=True)


def _concat_tokens(parts) -> list[int] | None:
    out: list[int] = []
    for part in parts:
        if part is None:
            return None
        out.extend(part)
    return out
