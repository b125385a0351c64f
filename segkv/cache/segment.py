"""Segments (page lists with a row count) and SegRefs (held prefixes of a segment)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from segkv.cache.page_pool import PagePool

_segment_ids = itertools.count()


class Segment:
    """An ordered list of pages and the number of rows written into them.

    Rows start at offset 0 of the first page and fill pages in order. While unsealed a
    segment is a chain's tail: only its one owner appends to it. Once sealed it is
    immutable and may be shared by any number of :class:`SegRef` holders.
    ``token_ids`` mirrors the rows when every append supplied tokens, else it is None.

    ``released_pages``: leading pages given back to the pool while their one holder went on
    (rows outside every layer's sliding window, :meth:`KVChain.release_rows_before`); their
    ids read -1, their rows have no slots, and attention must plan them out.

    ``tier_holds``: None while the rows are in pages; while a sealed segment's rows are in a
    lower KV tier (:meth:`move_out`, ``PagedKVCache.offload``), every page id reads -1 and this
    counts each page's holders in the pool's stead, until :meth:`move_in` gives them pages.
    """

    __slots__ = ("segment_id", "pool", "page_ids", "num_rows", "sealed", "token_ids", "released_pages",
                 "tier_holds", "_holders", "_page_tuple")

    def __init__(self, pool: PagePool) -> None:
        self.segment_id = next(_segment_ids)
        self.pool = pool
        self.page_ids: list[int] = []  # change it through add_pages / drop_pages_from
        self.num_rows = 0
        self.sealed = False
        self.token_ids: list[int] | None = []
        self.released_pages = 0
        self.tier_holds: list[int] | None = None
        self._holders: dict[int, int] = {}  # pages a live SegRef holds -> how many such SegRefs
        self._page_tuple: tuple[int, ...] | None = None  # see page_tuple

    def page_tuple(self) -> tuple[int, ...]:
        """``page_ids`` as a tuple, kept until the pages change: the decode steps of a tail that
        opened no page reuse one object, so planning ahead and checking the plan made ahead
        compare it by identity instead of page by page (a long history has thousands)."""
        if self._page_tuple is None:
            self._page_tuple = tuple(self.page_ids)
        return self._page_tuple

    def add_pages(self, pages: list[int]) -> None:
        """Append ``pages`` (newly allocated, references held by this segment)."""
        self.page_ids.extend(pages)
        self._page_tuple = None

    def drop_pages_from(self, keep: int) -> None:
        """Forget every page after the first ``keep`` (the caller released their references)."""
        if keep < self.released_pages:
            raise ValueError(f"cannot keep {keep} pages: the first {self.released_pages} were released")
        del self.page_ids[keep:]
        self._page_tuple = None

    @property
    def live_page_ids(self) -> list[int]:
        """The pages still held (every page after the released ones)."""
        return self.page_ids[self.released_pages:]

    def release_leading_pages(self, count: int) -> None:
        """Mark pages ``released_pages .. count - 1`` released (ids -1); the caller, their one
        holder, gives their references back."""
        if not self.released_pages <= count <= len(self.page_ids):
            raise ValueError(f"cannot release up to page {count} of {len(self.page_ids)} "
                             f"({self.released_pages} released)")
        self.page_ids[self.released_pages:count] = [-1] * (count - self.released_pages)
        self.released_pages = count
        self._page_tuple = None

    # -- holders, and rows in a lower tier ---------------------------------------------------
    def hold(self, num_pages: int, *, adopt: bool = False) -> None:
        """A new holder of the first ``num_pages`` pages (a :class:`SegRef`): one more reference on
        each live one (``adopt``: it takes over references already counted)."""
        self._holders[num_pages] = self._holders.get(num_pages, 0) + 1
        if adopt:
            return
        if self.tier_holds is not None:
            for i in range(num_pages):
                self.tier_holds[i] += 1
        else:
            self.pool.incref(self.page_ids[self.released_pages:num_pages])

    def unhold(self, num_pages: int) -> None:
        """A holder of the first ``num_pages`` pages lets go."""
        left = self._holders[num_pages] - 1
        if left:
            self._holders[num_pages] = left
        else:
            del self._holders[num_pages]
        if self.tier_holds is None:
            self.pool.decref(self.page_ids[self.released_pages:num_pages])
        else:
            for i in range(num_pages):
                self.tier_holds[i] -= 1
        if not self._holders:  # no holder left: a copy in a lower tier is nobody's
            self.pool.segment_dropped(self.segment_id)

    @property
    def held_pages(self) -> int:
        """Pages some holder still covers (a shorter reference left the later pages to the pool)."""
        return max(self._holders, default=0)

    @property
    def in_lower_tier(self) -> bool:
        return self.tier_holds is not None

    def move_out(self) -> list[int]:
        """The rows are now in a lower tier: give the held pages back to the pool, counting their
        holders here instead, and return those pages (the caller copied them first). ValueError
        unless the segment is sealed, in pages, held, and has no released rows."""
        if not self.sealed or self.tier_holds is not None or self.released_pages or not self._holders:
            raise ValueError(f"segment {self.segment_id} cannot leave its pages (sealed {self.sealed}, "
                             f"in a lower tier {self.tier_holds is not None}, released pages "
                             f"{self.released_pages}, holders {sum(self._holders.values())})")
        pages = self.page_ids[:self.held_pages]
        self.tier_holds = self.pool.give_back(pages)
        self.page_ids = [-1] * len(pages)
        self._page_tuple = None
        return pages

    def move_in(self, pages: list[int]) -> None:
        """Newly allocated ``pages`` (count 1 each, one per page that left) hold the rows again,
        with their holders; pages no holder covers any more (holders let go while the rows came
        back) go back to the pool."""
        if self.tier_holds is None or len(pages) != len(self.tier_holds):
            raise ValueError(f"segment {self.segment_id} takes {len(self.tier_holds or ())} pages back, "
                             f"got {len(pages)}")
        held = self.held_pages
        self.pool.decref(pages[held:])
        self.pool.hold(pages[:held], self.tier_holds[:held])
        self.page_ids = list(pages[:held])
        self.tier_holds = None
        self._page_tuple = None

    @property
    def released_rows(self) -> int:
        """Rows at the head of the segment whose pages were released."""
        return min(self.released_pages * self.pool.page_size, self.num_rows)

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def slots(self, start: int, end: int) -> list[int]:
        """Flat storage slots (``page_id * page_size + offset``) of rows ``start..end-1``."""
        assert 0 <= start <= end <= self.num_rows, (start, end, self.num_rows)
        ps = self.page_size
        if start < self.released_pages * ps and start < end:
            raise ValueError(f"rows {start}..{end - 1} of segment {self.segment_id} include rows released "
                             f"outside the sliding window (its first {self.released_pages * ps} rows)")
        if self.tier_holds is not None and start < end:
            raise ValueError(f"rows {start}..{end - 1} of segment {self.segment_id} are in a lower KV tier: "
                             f"bring them back first")
        pages = self.page_ids
        return [pages[i // ps] * ps + i % ps for i in range(start, end)]

    def __repr__(self) -> str:
        state = "sealed" if self.sealed else "tail"
        return f"Segment(id={self.segment_id}, rows={self.num_rows}, pages={len(self.page_ids)}, {state})"


class SegRef:
    """"The first ``num_rows`` rows of a sealed segment", holding one reference per page.

    A SegRef holds exactly the pages its rows touch, so a reference to a mid-segment
    point (a fork or restore into the middle of a turn) keeps no later page alive. Create
    further references with :meth:`share`; give this one up with :meth:`release`.
    """

    __slots__ = ("segment", "num_rows", "_live", "_page_tuple", "_page_source")

    def __init__(self, segment: Segment, num_rows: int, *, _adopt: bool = False) -> None:
        assert segment.sealed, "only sealed segments can be referenced"
        assert 0 <= num_rows <= segment.num_rows, (num_rows, segment.num_rows)
        self.segment = segment
        self.num_rows = num_rows
        self._live = True
        self._page_tuple: tuple[int, ...] | None = None  # see page_tuple
        self._page_source: tuple[int, ...] | None = None  # the segment's tuple it was cut from
        # an adopting ref takes over references its creator already holds
        segment.hold(segment.pool.pages_for_rows(num_rows), adopt=_adopt)

    @property
    def page_ids(self) -> list[int]:
        """The pages this reference holds (released leading pages left out)."""
        segment = self.segment
        return segment.page_ids[segment.released_pages : segment.pool.pages_for_rows(self.num_rows)]

    @property
    def page_tuple(self) -> tuple[int, ...]:
        """The pages of the reference's rows as a tuple (released ones read -1), made once per
        release: a sealed segment's pages otherwise never change, so a decode step's spans reuse
        it (and comparing two steps' spans finds the same object). A reference to the whole
        segment shares the segment's own tuple."""
        source = self.segment.page_tuple()  # a new tuple once pages were released
        if self._page_source is not source:
            self._page_source = source
            self._page_tuple = source[: self.segment.pool.pages_for_rows(self.num_rows)]
        return self._page_tuple

    @property
    def live(self) -> bool:
        return self._live

    @property
    def token_ids(self) -> list[int] | None:
        tokens = self.segment.token_ids
        return None if tokens is None else tokens[: self.num_rows]

    def share(self, num_rows: int | None = None) -> SegRef:
        """A new reference to the first ``num_rows`` rows (default: all of this ref's rows)."""
        assert self._live, "share of a released SegRef"
        n = self.num_rows if num_rows is None else num_rows
        if not 0 <= n <= self.num_rows:
            raise ValueError(f"cannot share {n} rows of a reference to {self.num_rows} rows")
        return SegRef(self.segment, n)

    def release(self) -> None:
        """Drop this reference's pages (idempotent)."""
        if self._live:
            self._live = False
            self.segment.unhold(self.segment.pool.pages_for_rows(self.num_rows))

    def slots(self) -> list[int]:
        return self.segment.slots(0, self.num_rows)

    def __repr__(self) -> str:
        return f"SegRef(segment={self.segment.segment_id}, rows={self.num_rows})"


def reaches_released_rows(parts: Iterable[tuple[Segment, int]], position: int) -> bool:
    """Whether any row at or after ``position`` was released, over ``parts``: (segment, rows
    used from it) in chain order."""
    start = 0
    for segment, num_rows in parts:
        released = min(segment.released_rows, num_rows)
        if released and start + released > position:
            return True
        start += num_rows
    return False


@dataclass(slots=True, frozen=True)
class ChainSpan:
    """One run of a chain's rows as attention sees it (a SegRef or the tail).

    ``page_ids`` are the pages holding rows ``0 .. num_rows-1`` of the span, every page full
    except possibly the last; ``key_start`` is the absolute position of the span's first
    row in its sequence; ``segment_id`` identifies shared spans across sequences.
    ``released_pages``: leading pages given back outside the sliding window (ids -1): a plan
    must leave them out (the planner's window does, and refuses a span that still has any).
    ``in_lower_tier``: the rows are in a lower KV tier (every id -1) until brought back; the
    planner refuses the span.
    """

    segment_id: int
    page_ids: tuple[int, ...]
    num_rows: int
    key_start: int
    sealed: bool
    released_pages: int = 0
    in_lower_tier: bool = False

    def page_rows(self, page_size: int) -> tuple[int, ...]:
        """Valid rows in each page of the span."""
        if not self.page_ids:
            return ()
        last = self.num_rows - (len(self.page_ids) - 1) * page_size
        return (page_size,) * (len(self.page_ids) - 1) + (last,)
