"""PagePool: reference-counted KV pages, a free list and byte accounting (pure Python)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence


class OutOfPagesError(RuntimeError):
    """Raised when an allocation asks for more pages than the pool has free."""


class PagePool:
    """Owner of every KV page: who holds it, what is free, and how many bytes are used.

    Pages are integer ids ``0 .. num_pages-1``. A page is either free (reference count 0,
    on the free list) or held by one or more holders (segment references). The pool never
    touches tensors: ``bytes_per_page`` is the storage one page occupies across all layers,
    and copies made by the storage are reported through :meth:`record_copy` so every byte
    written twice is visible on the pool's counters.
    """

    def __init__(self, *, num_pages: int, page_size: int, bytes_per_page: int) -> None:
        if num_pages < 1 or page_size < 1 or bytes_per_page < 0:
            raise ValueError(
                f"invalid pool: num_pages={num_pages}, page_size={page_size}, "
                f"bytes_per_page={bytes_per_page}"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self.bytes_per_page = bytes_per_page
        self._ref_counts = [0] * num_pages
        # Lowest ids are handed out first (popped from the end), which keeps tests readable.
        self._free = list(range(num_pages - 1, -1, -1))
        self.peak_pages_in_use = 0
        self.pages_allocated_total = 0
        self.bytes_copied = 0
        self.rows_copied = 0
        # told the id of a sealed segment whose last holder let go (the cache's KV tiers then
        # forget any copy of its rows)
        self.on_segment_dropped: Callable[[int], None] | None = None

    # -- counters ---------------------------------------------------------------------
    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def bytes_in_use(self) -> int:
        return self.pages_in_use * self.bytes_per_page

    @property
    def peak_bytes_in_use(self) -> int:
        return self.peak_pages_in_use * self.bytes_per_page

    @property
    def bytes_allocated_total(self) -> int:
        return self.pages_allocated_total * self.bytes_per_page

    def reset_peak(self) -> None:
        """Start a new peak window at the current usage (e.g. at the start of a turn)."""
        self.peak_pages_in_use = self.pages_in_use

    def ref_count(self, page_id: int) -> int:
        return self._ref_counts[page_id]

    def pages_for_rows(self, num_rows: int) -> int:
        """Number of pages needed to hold ``num_rows`` rows starting at a page boundary."""
        return -(-num_rows // self.page_size)

    # -- allocation -------------------------------------------------------------------
    def allocate(self, num_pages: int) -> list[int]:
        """Take ``num_pages`` free pages, each with reference count 1."""
        if num_pages < 0:
            raise ValueError(f"cannot allocate {num_pages} pages")
        if num_pages > len(self._free):
            raise OutOfPagesError(
                f"KV cache is full: asked for {num_pages} pages, {len(self._free)} of "
                f"{self.num_pages} are free"
            )
        page_ids = [self._free.pop() for _ in range(num_pages)]
        for page_id in page_ids:
            self._ref_counts[page_id] = 1
        self.pages_allocated_total += num_pages
        self.peak_pages_in_use = max(self.peak_pages_in_use, self.pages_in_use)
        return page_ids

    def peek(self, num_pages: int) -> list[int] | None:
        """The pages the next ``allocate(num_pages)`` would return, in order, without taking
        them (None if fewer are free): lets a caller predict the layout of the next step."""
        if not 0 <= num_pages <= len(self._free):
            return None
        return self._free[len(self._free) - num_pages:][::-1]

    def incref(self, page_ids: Iterable[int]) -> None:
        """Add one holder to each page (all pages must be in use)."""
        counts = self._ref_counts
        for page_id in page_ids:
            assert counts[page_id] > 0, f"incref of free page {page_id}"
            counts[page_id] += 1

    def decref(self, page_ids: Iterable[int]) -> None:
        """Drop one holder from each page; a page whose count reaches 0 becomes free."""
        counts = self._ref_counts
        for page_id in page_ids:
            assert counts[page_id] > 0, f"decref of free page {page_id}"
            counts[page_id] -= 1
            if counts[page_id] == 0:
                self._free.append(page_id)

    def give_back(self, page_ids: Sequence[int]) -> list[int]:
        """Free ``page_ids`` whatever their holders, returning each page's reference count: their
        segment's rows moved to a lower KV tier, which counts its holders itself until
        :meth:`hold` gives the rows pages again."""
        counts = self._ref_counts
        before = [counts[page_id] for page_id in page_ids]
        for page_id, held in zip(page_ids, before):
            assert held > 0, f"give_back of free page {page_id}"
            counts[page_id] = 0
            self._free.append(page_id)
        return before

    def hold(self, page_ids: Sequence[int], counts: Sequence[int]) -> None:
        """Set the reference counts of newly allocated ``page_ids`` (count 1 each) to ``counts``
        (each at least 1): a segment brought back from a lower tier, with its holders."""
        for page_id, count in zip(page_ids, counts, strict=True):
            assert self._ref_counts[page_id] == 1 and count >= 1, (page_id, self._ref_counts[page_id], count)
            self._ref_counts[page_id] = count

    def segment_dropped(self, segment_id: int) -> None:
        """A sealed segment lost its last holder (``Segment.unhold``)."""
        if self.on_segment_dropped is not None:
            self.on_segment_dropped(segment_id)

    def record_copy(self, *, num_rows: int, row_bytes: int) -> None:
        """Account rows that the storage copied from one page to another."""
        self.rows_copied += num_rows
        self.bytes_copied += num_rows * row_bytes

    def stats(self) -> dict[str, int]:
        """A snapshot of the counters, for health reports, metrics and tests."""
        return {
            "num_pages": self.num_pages,
            "page_size": self.page_size,
            "pages_in_use": self.pages_in_use,
            "bytes_in_use": self.bytes_in_use,
            "peak_pages_in_use": self.peak_pages_in_use,
            "peak_bytes_in_use": self.peak_bytes_in_use,
            "pages_allocated_total": self.pages_allocated_total,
            "bytes_copied": self.bytes_copied,
        }
