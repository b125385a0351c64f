"""Segments (page lists with a row count) and SegRefs (held prefixes of a segment)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from segkv.cache.page_pool import PagePool

_segment_ids = itertools.count()


class Segment:
    """An ordered list of pages and the number of rows written into them.

    Rows start at offset 0 of the first page and fill pages in order. While unsealed a
    segment is a chain's tail: only its one owner appends to it. Once sealed it is
    immutable and may be shared by any number of :class:`SegRef` holders.
    ``token_ids`` mirrors the rows when every append supplied tokens, else it is None.
    """

    __slots__ = ("segment_id", "pool", "page_ids", "num_rows", "sealed", "token_ids", "_page_tuple")

    def __init__(self, pool: PagePool) -> None:
        self.segment_id = next(_segment_ids)
        self.pool = pool
        self.page_ids: list[int] = []  # change it through add_pages / drop_pages_from
        self.num_rows = 0
        self.sealed = False
        self.token_ids: list[int] | None = []
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
        del self.page_ids[keep:]
        self._page_tuple = None

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def slots(self, start: int, end: int) -> list[int]:
        """Flat storage slots (``page_id * page_size + offset``) of rows ``start..end-1``."""
        assert 0 <= start <= end <= self.num_rows, (start, end, self.num_rows)
        ps = self.page_size
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

    __slots__ = ("segment", "num_rows", "_live", "_page_tuple")

    def __init__(self, segment: Segment, num_rows: int, *, _adopt: bool = False) -> None:
        assert segment.sealed, "only sealed segments can be referenced"
        assert 0 <= num_rows <= segment.num_rows, (num_rows, segment.num_rows)
        self.segment = segment
        self.num_rows = num_rows
        self._live = True
        self._page_tuple: tuple[int, ...] | None = None  # see page_tuple
        if not _adopt:  # an adopting ref takes over references its creator already holds
            segment.pool.incref(self.page_ids)

    @property
    def page_ids(self) -> list[int]:
        return self.segment.page_ids[: self.segment.pool.pages_for_rows(self.num_rows)]

    @property
    def page_tuple(self) -> tuple[int, ...]:
        """:attr:`page_ids` as a tuple, made once: a sealed segment's pages never change, so a
        decode step's spans reuse it (and comparing two steps' spans finds the same object). A
        reference to the whole segment shares the segment's own tuple."""
        if self._page_tuple is None:
            self._page_tuple = self.segment.page_tuple()[: self.segment.pool.pages_for_rows(self.num_rows)]
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
            self.segment.pool.decref(self.page_ids)

    def slots(self) -> list[int]:
        return self.segment.slots(0, self.num_rows)

    def __repr__(self) -> str:
        return f"SegRef(segment={self.segment.segment_id}, rows={self.num_rows})"


@dataclass(slots=True, frozen=True)
class ChainSpan:
    """One run of a chain's rows as attention sees it (a SegRef or the tail).

    ``page_ids`` are the pages holding rows ``0 .. num_rows-1`` of the span, every page full
    except possibly the last; ``key_start`` is the absolute position of the span's first
    row in its sequence; ``segment_id`` identifies shared spans across sequences.
    """

    segment_id: int
    page_ids: tuple[int, ...]
    num_rows: int
    key_start: int
    sealed: bool

    def page_rows(self, page_size: int) -> tuple[int, ...]:
        """Valid rows in each page of the span."""
        if not self.page_ids:
            return ()
        last = self.num_rows - (len(self.page_ids) - 1) * page_size
        return (page_size,) * (len(self.page_ids) - 1) + (last,)
