"""PagePool: allocation, reference counts, the free list and byte/copy accounting."""

from __future__ import annotations

import pytest

from segkv.cache import OutOfPagesError, PagePool


def _counters(pool: PagePool) -> dict:
    return {
        "stats": pool.stats(),
        "free": pool.num_free_pages,
        "refs": [pool.ref_count(p) for p in range(pool.num_pages)],
        "rows_copied": pool.rows_copied,
    }


def test_fresh_pool_is_empty():
    pool = PagePool(num_pages=5, page_size=16, bytes_per_page=100)
    assert pool.pages_in_use == 0
    assert pool.num_free_pages == 5
    assert pool.bytes_in_use == 0
    assert pool.peak_pages_in_use == 0
    assert pool.pages_allocated_total == 0
    assert pool.bytes_copied == 0 and pool.rows_copied == 0
    assert all(pool.ref_count(p) == 0 for p in range(5))


def test_allocate_hands_out_distinct_pages_with_refcount_one():
    pool = PagePool(num_pages=6, page_size=4, bytes_per_page=32)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert a == [0, 1] and b == [2, 3, 4]  # lowest ids first
    assert len(set(a + b)) == 5
    assert all(pool.ref_count(p) == 1 for p in a + b)
    assert pool.ref_count(5) == 0
    assert pool.pages_in_use == 5
    assert pool.num_free_pages == 1
    assert pool.bytes_in_use == 5 * 32
    assert pool.pages_allocated_total == 5
    assert pool.bytes_allocated_total == 5 * 32
    assert pool.allocate(0) == []
    assert pool.pages_allocated_total == 5


def test_incref_decref_and_free_list_reuse():
    pool = PagePool(num_pages=4, page_size=2, bytes_per_page=10)
    pages = pool.allocate(3)
    pool.incref([pages[0], pages[2]])
    assert [pool.ref_count(p) for p in pages] == [2, 1, 2]
    pool.decref(pages)
    assert [pool.ref_count(p) for p in pages] == [1, 0, 1]
    assert pool.pages_in_use == 2
    assert pool.num_free_pages == 2
    assert pool.bytes_in_use == 20
    # the freed page is on the free list again and comes back with a fresh count of 1
    again = pool.allocate(2)
    assert sorted(again) == sorted([pages[1], 3])
    assert all(pool.ref_count(p) == 1 for p in again)
    assert pool.num_free_pages == 0
    pool.decref([pages[0], pages[2], *again])
    assert pool.pages_in_use == 0
    assert all(pool.ref_count(p) == 0 for p in range(4))
    # allocated_total counts every allocation, including re-allocation of a freed page
    assert pool.pages_allocated_total == 5


def test_incref_or_decref_of_a_free_page_is_an_invariant_error():
    pool = PagePool(num_pages=2, page_size=1, bytes_per_page=1)
    with pytest.raises(AssertionError):
        pool.incref([0])
    with pytest.raises(AssertionError):
        pool.decref([1])
    assert pool.pages_in_use == 0


@pytest.mark.parametrize("held", [0, 3, 5])
def test_out_of_pages_leaves_pool_unchanged(held):
    pool = PagePool(num_pages=5, page_size=8, bytes_per_page=64)
    pages = pool.allocate(held)
    if pages:
        pool.incref(pages[:1])
    before = _counters(pool)
    with pytest.raises(OutOfPagesError, match="full"):
        pool.allocate(5 - held + 1)
    assert _counters(pool) == before
    # everything that is free can still be taken
    assert len(pool.allocate(5 - held)) == 5 - held
    assert pool.num_free_pages == 0
    with pytest.raises(OutOfPagesError):
        pool.allocate(1)


def test_out_of_pages_error_is_a_runtime_error():
    assert issubclass(OutOfPagesError, RuntimeError)


def test_peak_and_reset_peak():
    pool = PagePool(num_pages=10, page_size=16, bytes_per_page=7)
    a = pool.allocate(6)
    pool.decref(a[:4])
    assert pool.pages_in_use == 2
    assert pool.peak_pages_in_use == 6
    assert pool.peak_bytes_in_use == 42
    b = pool.allocate(3)  # 5 in use: below the peak
    assert pool.peak_pages_in_use == 6
    pool.reset_peak()
    assert pool.peak_pages_in_use == 5
    assert pool.peak_bytes_in_use == 35
    pool.decref(b)
    assert pool.peak_pages_in_use == 5  # decref never moves the peak
    pool.allocate(4)  # 6 in use
    assert pool.peak_pages_in_use == 6
    pool.reset_peak()
    assert pool.peak_pages_in_use == 6


def test_incref_does_not_allocate():
    pool = PagePool(num_pages=3, page_size=4, bytes_per_page=8)
    pages = pool.allocate(2)
    pool.incref(pages)
    pool.incref(pages)
    assert pool.pages_in_use == 2
    assert pool.pages_allocated_total == 2
    assert pool.peak_pages_in_use == 2
    pool.decref(pages)
    pool.decref(pages)
    assert pool.pages_in_use == 2
    pool.decref(pages)
    assert pool.pages_in_use == 0


def test_record_copy_accumulates_rows_and_bytes():
    pool = PagePool(num_pages=2, page_size=4, bytes_per_page=8)
    pool.record_copy(num_rows=3, row_bytes=40)
    pool.record_copy(num_rows=5, row_bytes=12)
    assert pool.rows_copied == 8
    assert pool.bytes_copied == 3 * 40 + 5 * 12
    assert pool.stats()["bytes_copied"] == 180
    # copies never touch page accounting
    assert pool.pages_in_use == 0 and pool.pages_allocated_total == 0


@pytest.mark.parametrize(
    ("page_size", "rows", "pages"),
    [(1, 0, 0), (1, 5, 5), (16, 1, 1), (16, 16, 1), (16, 17, 2), (32, 64, 2), (64, 65, 2)],
)
def test_pages_for_rows(page_size, rows, pages):
    pool = PagePool(num_pages=1, page_size=page_size, bytes_per_page=1)
    assert pool.pages_for_rows(rows) == pages


def test_stats_match_properties():
    pool = PagePool(num_pages=8, page_size=32, bytes_per_page=3)
    pool.allocate(5)
    pool.decref([0, 1])
    pool.record_copy(num_rows=2, row_bytes=9)
    assert pool.stats() == {
        "num_pages": 8,
        "page_size": 32,
        "pages_in_use": 3,
        "bytes_in_use": 9,
        "peak_pages_in_use": 5,
        "peak_bytes_in_use": 15,
        "pages_allocated_total": 5,
        "bytes_copied": 18,
    }


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_pages": 0, "page_size": 16, "bytes_per_page": 1},
        {"num_pages": -1, "page_size": 16, "bytes_per_page": 1},
        {"num_pages": 4, "page_size": 0, "bytes_per_page": 1},
        {"num_pages": 4, "page_size": -16, "bytes_per_page": 1},
        {"num_pages": 4, "page_size": 16, "bytes_per_page": -1},
    ],
)
def test_bad_pool_arguments_raise_value_error(kwargs):
    with pytest.raises(ValueError, match="invalid pool"):
        PagePool(**kwargs)


def test_allocate_negative_raises_value_error_and_changes_nothing():
    pool = PagePool(num_pages=3, page_size=2, bytes_per_page=4)
    pool.allocate(1)
    before = _counters(pool)
    with pytest.raises(ValueError, match="-2"):
        pool.allocate(-2)
    assert _counters(pool) == before


def test_pool_arguments_are_keyword_only():
    with pytest.raises(TypeError):
        PagePool(4, 16, 1)  # type: ignore[misc]


def test_peek_names_the_pages_the_next_allocation_takes():
    pool = PagePool(num_pages=6, page_size=4, bytes_per_page=8)
    pool.allocate(2)
    ahead = pool.peek(3)
    assert ahead is not None and len(ahead) == 3 and pool.pages_in_use == 2  # nothing taken
    assert pool.allocate(3) == ahead
    assert pool.peek(2) is None and pool.peek(1) == pool.allocate(1)
