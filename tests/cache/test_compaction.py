"""Compaction: the merge policy on hand-made sizes, and merges in a real PagedKVCache."""

from __future__ import annotations

import math
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from segkv.cache import KVChain, OutOfPagesError, PagedKVCache, segments_to_merge
from segkv.config import CacheConfig, CompactionPolicy, KVLayout

P2 = CompactionPolicy(ratio=2.0, max_copy_rows=4096)


def make_cache(kind, page_size, policy, *, num_pages=256):
    if kind == "mha":
        layout = KVLayout(num_layers=3, kind="mha", num_kv_heads=2, head_dim=2)
    else:
        layout = KVLayout(num_layers=3, kind="mla", kv_lora_rank=3, rope_dim=2)
    return PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=num_pages), compaction=policy)


def width(layout):
    return 2 * layout.num_kv_heads * layout.head_dim if layout.kind == "mha" else layout.key_dim


def fill(cache, chain, n, gen):
    """Append ``n`` rows with fresh random data in every layer; return the (n, L, W) data."""
    lay = cache.layout
    slots = chain.append(n)
    data = torch.randn(n, lay.num_layers, width(lay), generator=gen)
    for layer in range(lay.num_layers):
        x = data[:, layer]
        if lay.kind == "mha":
            hd, shape = lay.num_kv_heads * lay.head_dim, (-1, lay.num_kv_heads, lay.head_dim)
            cache.storage.write(layer, slots, x[:, :hd].reshape(shape), x[:, hd:].reshape(shape))
        else:
            cache.storage.write(layer, slots, x)
    return data


def gather(cache, slots):
    return torch.stack(
        [
            torch.cat([t.flatten(1) for t in cache.storage.read(layer, list(slots))], dim=1)
            for layer in range(cache.layout.num_layers)
        ],
        dim=1,
    )



# -- the policy on hand-made sizes -------------------------------------------------------
@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ([], 0),
        ([7], 0),
        ([1, 1], 2),
        ([2, 1], 0),  # 2 >= 2 * 1: a binary counter keeps 2 + 1
        ([3, 2], 2),  # 3 < 2 * 2
        ([4, 2, 1], 0),
        ([4, 2, 1, 1], 4),  # 1+1 -> 2, 2+2 -> 4, 4+4 -> 8: the carry ripples through
        ([8, 2, 1, 1], 3),  # ... and stops at 8 >= 2 * 4
        ([100, 1, 1], 2),
    ],
)
def test_segments_to_merge_ratio_two(sizes, expected):
    assert segments_to_merge(sizes, P2) == expected


def test_binary_counter_of_unit_turns():
    sizes: list[int] = []
    for turn in range(1, 130):
        sizes.append(1)
        count = segments_to_merge(sizes, P2)
        if count >= 2:
            sizes[-count:] = [sum(sizes[-count:])]
        assert sizes == [1 << b for b in reversed(range(turn.bit_length())) if turn >> b & 1], turn


def test_ratio_changes_the_merge_threshold():
    p3 = CompactionPolicy(ratio=3.0)
    assert segments_to_merge([2, 1], p3) == 2
    assert segments_to_merge([3, 1], p3) == 0
    p1 = CompactionPolicy(ratio=1.0)
    assert segments_to_merge([1, 1], p1) == 0  # merge only while older < newer
    assert segments_to_merge([1, 2], p1) == 2


def test_max_copy_rows_bounds_every_merge():
    p = CompactionPolicy(ratio=2.0, max_copy_rows=4)
    assert segments_to_merge([2, 2], p) == 2  # exactly max_copy_rows rows copied
    assert segments_to_merge([3, 2], p) == 0  # 5 rows would be copied
    assert segments_to_merge([5, 1, 1], p) == 2  # the 5-row segment is never absorbed
    assert segments_to_merge([1, 5], p) == 0  # nor is a big newest one
    assert segments_to_merge([1, 1], CompactionPolicy(max_copy_rows=0)) == 0


def test_disabled_policy_never_merges():
    assert segments_to_merge([1, 1, 1, 1], CompactionPolicy(enabled=False)) == 0


def test_bad_policy_arguments():
    with pytest.raises(ValueError):
        CompactionPolicy(ratio=0.5)
    with pytest.raises(ValueError):
        CompactionPolicy(max_copy_rows=-1)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), max_size=12),
    ratio=st.sampled_from([1.0, 1.5, 2.0, 3.0]),
    cap=st.integers(0, 80),
)
def test_merge_respects_ratio_and_cap(sizes, ratio, cap):
    count = segments_to_merge(sizes, CompactionPolicy(ratio=ratio, max_copy_rows=cap))
    assert count == 0 or 2 <= count <= len(sizes)
    if count:
        merged = sizes[-count:]
        assert sum(merged) <= cap
        for i in range(len(merged) - 1):  # each absorbed older ref is small next to the run
            assert merged[i] < ratio * sum(merged[i + 1 :])


# -- merges in a real cache ------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("page_size", [1, 16, 32, 64])
def test_many_turns_after_a_big_first_segment(kind, page_size, gen):
    policy = CompactionPolicy(ratio=2.0, max_copy_rows=64)
    cache = make_cache(kind, page_size, policy)
    pool, lay = cache.pool, cache.layout
    chain = cache.new_chain()
    written = [fill(cache, chain, 80, gen)]  # bigger than max_copy_rows: never copied
    chain.seal()
    first, first_pages = chain.refs[0].segment, list(chain.refs[0].page_ids)
    sizes, model_copied = [80], 0
    for turn in range(1, 32):
        written.append(fill(cache, chain, 2, gen))
        rows_before = pool.rows_copied
        chain.seal()
        sizes.append(2)
        count = segments_to_merge(sizes, policy)
        if count >= 2:
            model_copied += sum(sizes[-count:])
            sizes[-count:] = [sum(sizes[-count:])]
        assert pool.rows_copied - rows_before <= policy.max_copy_rows
        assert [ref.num_rows for ref in chain.refs] == sizes
        assert chain.num_segments <= 2 + int(math.log2(turn))
        assert chain.refs[0].segment is first and chain.refs[0].page_ids == first_pages
        assert pool.pages_in_use == sum(pool.pages_for_rows(n) for n in sizes)
        if turn % 8 == 0 or turn == 31:
            assert torch.equal(gather(cache, chain.slots()), torch.cat(written))
    assert pool.rows_copied == model_copied > 0
    assert pool.bytes_copied == pool.rows_copied * lay.row_bytes
    assert [pool.ref_count(p) for p in first_pages] == [1] * len(first_pages)
    chain.release()
    assert pool.pages_in_use == 0


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_snapshot_taken_before_compaction_keeps_its_contents(kind, gen):
    cache = make_cache(kind, 4, CompactionPolicy(ratio=2.0, max_copy_rows=32))
    chain = cache.new_chain()
    written = []
    for _ in range(3):
        written.append(fill(cache, chain, 3, gen))
        chain.seal()
    snap = chain.snapshot()  # refs [6, 3]: the next turn merges all of them
    snap_slots = [s for ref in snap.refs for s in ref.slots()]
    snap_segments = [ref.segment for ref in snap.refs]
    copied = cache.pool.rows_copied
    written.append(fill(cache, chain, 3, gen))
    chain.seal()
    assert cache.pool.rows_copied - copied == 12
    assert [ref.num_rows for ref in chain.refs] == [12]
    assert chain.refs[0].segment not in snap_segments
    assert torch.equal(gather(cache, snap_slots), torch.cat(written[:3]))
    assert torch.equal(gather(cache, chain.slots()), torch.cat(written))
    snap.release()
    assert cache.pool.pages_in_use == 3
    chain.release()
    assert cache.pool.pages_in_use == 0


def test_chain_without_a_copier_never_compacts(gen):
    cache = make_cache("mha", 2, CompactionPolicy())
    chain = KVChain(cache.pool, compaction=CompactionPolicy())
    for _ in range(5):
        fill(cache, chain, 1, gen)
        chain.seal()
    assert [ref.num_rows for ref in chain.refs] == [1] * 5
    assert cache.pool.rows_copied == 0


@pytest.mark.parametrize("op", ["snapshot", "fork"])
def test_snapshot_and_fork_of_an_open_tail_copy_nothing(op, gen):
    cache = make_cache("mha", 4, CompactionPolicy(ratio=2.0, max_copy_rows=64))
    chain = cache.new_chain()
    fill(cache, chain, 3, gen)
    chain.seal()
    fill(cache, chain, 3, gen)  # open tail; sealing it makes refs [3, 3] -> merge
    allocated, copied = cache.pool.pages_allocated_total, cache.pool.bytes_copied
    getattr(chain, op)()
    assert (cache.pool.pages_allocated_total, cache.pool.bytes_copied) == (allocated, copied)


def test_seal_succeeds_when_compaction_has_no_free_page(gen):
    cache = make_cache("mla", 4, CompactionPolicy(ratio=2.0, max_copy_rows=64), num_pages=2)
    chain = cache.new_chain()
    fill(cache, chain, 3, gen)
    chain.seal()
    fill(cache, chain, 3, gen)  # the pool is now full
    try:
        chain.seal()
    except OutOfPagesError:
        pytest.fail("seal raised OutOfPagesError although the turn itself needed no page")
    assert chain.tail is None and chain.num_rows == 6
