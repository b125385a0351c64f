"""KVChain: fork/restore/snapshot share without copying, trim, page growth, tokens, errors."""

from __future__ import annotations

import pytest
import torch

from segkv.cache import ChainSnapshot, OutOfPagesError, PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, KVLayout

PAGE_SIZES = [1, 16, 32, 64]
KINDS = ["mha", "mla"]
NO_COMPACTION = CompactionPolicy(enabled=False)


def make_cache(kind, page_size, *, num_pages=64, compaction=NO_COMPACTION):
    if kind == "mha":
        layout = KVLayout(num_layers=2, kind="mha", num_kv_heads=2, head_dim=3)
    else:
        layout = KVLayout(num_layers=2, kind="mla", kv_lora_rank=4, rope_dim=2)
    return PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=num_pages), compaction=compaction)


def row_width(layout):
    return 2 * layout.num_kv_heads * layout.head_dim if layout.kind == "mha" else layout.key_dim


def write(cache, slots, data):
    """Write ``data`` (n, num_layers, width) at ``slots`` in every layer."""
    lay = cache.layout
    for layer in range(lay.num_layers):
        x = data[:, layer]
        if lay.kind == "mha":
            hd = lay.num_kv_heads * lay.head_dim
            shape = (-1, lay.num_kv_heads, lay.head_dim)
            cache.storage.write(layer, slots, x[:, :hd].reshape(shape), x[:, hd:].reshape(shape))
        else:
            cache.storage.write(layer, slots, x)


def gather(cache, slots):
    """Read rows at ``slots`` back as (n, num_layers, width)."""
    layers = [
        torch.cat([t.flatten(1) for t in cache.storage.read(layer, list(slots))], dim=1)
        for layer in range(cache.layout.num_layers)
    ]
    return torch.stack(layers, dim=1)


def snap_slots(snap):
    return [s for ref in snap.refs for s in ref.slots()]


def fill(cache, chain, n, gen, *, tokens=None):
    """Append ``n`` rows, write fresh random data into every layer, return (slots, data)."""
    slots = chain.append(n, token_ids=tokens)
    data = torch.randn(n, cache.layout.num_layers, row_width(cache.layout), generator=gen)
    write(cache, slots, data)
    return slots, data



@pytest.fixture(params=[(k, p) for k in KINDS for p in PAGE_SIZES], ids=lambda kp: f"{kp[0]}-ps{kp[1]}")
def cache(request):
    return make_cache(*request.param)


def build_history(cache, gen, sizes):
    """A chain with one sealed segment per size; returns (chain, expected rows)."""
    chain = cache.new_chain()
    parts = []
    for n in sizes:
        parts.append(fill(cache, chain, n, gen)[1])
        chain.seal()
    return chain, torch.cat(parts)


def test_fork_and_restore_allocate_and_copy_nothing(cache, gen):
    ps = cache.page_size
    chain, expected = build_history(cache, gen, [2 * ps + 3, 5, 1])
    pool = cache.pool
    before = (pool.pages_allocated_total, pool.bytes_copied, pool.pages_in_use)
    assert before[2] == cache.pool.pages_for_rows(2 * ps + 3) + cache.pool.pages_for_rows(5) + 1
    child = chain.fork()
    snap = chain.snapshot()
    other = cache.new_chain()
    other.restore(snap)
    assert (pool.pages_allocated_total, pool.bytes_copied, pool.pages_in_use) == before
    assert child.slots() == chain.slots() == other.slots() == snap_slots(snap)
    for c in (chain, child, other):
        assert torch.equal(gather(cache, c.slots()), expected)
    assert torch.equal(gather(cache, snap_slots(snap)), expected)
    page = chain.refs[0].page_ids[0]
    assert pool.ref_count(page) == 4  # chain, child, snapshot, other
    for holder in (chain, child, other, snap):
        holder.release()
    assert pool.pages_in_use == 0


@pytest.mark.parametrize("k_of_ps", [(0, 1), (1, -1), (1, 0), (1, 1), (3, 2)])
def test_follow_up_turn_takes_fresh_pages(cache, gen, k_of_ps):
    ps = cache.page_size
    k = max(1, k_of_ps[0] * ps + k_of_ps[1])
    chain, expected = build_history(cache, gen, [ps + ps // 2 + 1])
    old_pages = set(chain.refs[0].page_ids)
    in_use = cache.pool.pages_in_use
    slots, data = fill(cache, chain, k, gen)
    assert cache.pool.pages_in_use == in_use + -(-k // ps)
    assert slots[0] % ps == 0  # the turn starts on a fresh page, not the history's last one
    assert not {s // ps for s in slots} & old_pages
    chain.seal()
    assert cache.pool.pages_in_use == in_use + -(-k // ps)
    assert chain.num_segments == 2 and chain.num_rows == expected.shape[0] + k
    assert torch.equal(gather(cache, chain.slots()), torch.cat([expected, data]))


def test_appends_within_a_turn_fill_the_tail_page(cache, gen):
    ps = cache.page_size
    chain = cache.new_chain()
    parts = [fill(cache, chain, n, gen)[1] for n in (1, ps // 2, ps, 3)]
    total = 1 + ps // 2 + ps + 3
    assert cache.pool.pages_in_use == cache.pool.pages_for_rows(total)
    assert chain.slots() == [chain.tail.page_ids[i // ps] * ps + i % ps for i in range(total)]
    assert torch.equal(gather(cache, chain.slots()), torch.cat(parts))


@pytest.mark.parametrize("trim_frac", [0.0, 0.1, 0.35, 0.5, 0.8, 1.0])
def test_trim_across_segments(cache, gen, trim_frac):
    ps = cache.page_size
    sizes = [2 * ps + 1, ps // 2 + 2, ps, 3]  # three sealed segments and a tail
    chain, expected = build_history(cache, gen, sizes[:3])
    expected = torch.cat([expected, fill(cache, chain, sizes[3], gen)[1]])
    total = sum(sizes)
    n = int(round(trim_frac * total))
    copied = cache.pool.bytes_copied
    chain.trim(n)
    keep = total - n
    assert chain.num_rows == keep
    assert cache.pool.bytes_copied == copied
    assert torch.equal(gather(cache, chain.slots()), expected[:keep])
    kept_rows = [max(0, min(s, keep - sum(sizes[:i]))) for i, s in enumerate(sizes)]
    assert cache.pool.pages_in_use == sum(cache.pool.pages_for_rows(r) for r in kept_rows)
    chain.release()
    assert cache.pool.pages_in_use == 0


def test_trim_keeps_pages_other_holders_need(cache, gen):
    ps = cache.page_size
    chain, expected = build_history(cache, gen, [3 * ps, 2 * ps])
    snap = chain.snapshot()
    second = chain.refs[1].page_ids
    chain.trim(2 * ps + ps + 1)  # all of the second segment and ps + 1 rows of the first
    assert cache.pool.pages_in_use == 5  # the snapshot still holds everything
    assert [cache.pool.ref_count(p) for p in second] == [1, 1]
    assert torch.equal(gather(cache, snap_slots(snap)), expected)
    assert torch.equal(gather(cache, chain.slots()), expected[: 2 * ps - 1])
    snap.release()
    assert cache.pool.pages_in_use == cache.pool.pages_for_rows(2 * ps - 1)
    assert all(cache.pool.ref_count(p) == 0 for p in second)


def test_trim_too_many_rows_changes_nothing(cache, gen):
    chain, expected = build_history(cache, gen, [cache.page_size + 1])
    fill(cache, chain, 2, gen)
    state = (chain.num_rows, chain.slots(), cache.pool.stats())
    for bad in (chain.num_rows + 1, -1):
        with pytest.raises(ValueError, match="trim"):
            chain.trim(bad)
        assert (chain.num_rows, chain.slots(), cache.pool.stats()) == state


def test_snapshot_never_aliases_the_tail(cache, gen):
    ps = cache.page_size
    chain = cache.new_chain()
    _, before = fill(cache, chain, ps + ps // 2 + 1, gen)
    snap = chain.snapshot()
    slots_before = snap_slots(snap)
    snap_pages = {s // ps for s in slots_before}
    more_slots, more = fill(cache, chain, ps // 2 + 2, gen)
    assert more_slots[0] % ps == 0 and not {s // ps for s in more_slots} & snap_pages
    assert torch.equal(gather(cache, chain.slots()), torch.cat([before, more]))
    chain.trim(more.shape[0] + 2)  # cut back into the snapshot's rows
    new_slots, again = fill(cache, chain, ps + 3, gen)
    assert not {s // ps for s in new_slots} & snap_pages
    assert snap_slots(snap) == slots_before
    assert torch.equal(gather(cache, slots_before), before)
    assert torch.equal(gather(cache, chain.slots()), torch.cat([before[:-2], again]))


@pytest.mark.parametrize("how", ["trim_fork", "restore_mid_page"])
def test_fork_from_mid_page_point(cache, gen, how):
    ps = cache.page_size
    parent = cache.new_chain()
    _, rows = fill(cache, parent, 2 * ps + 3, gen)
    if how == "trim_fork":
        parent.trim(1)
        child = parent.fork()
    else:
        snap = parent.snapshot()  # taken mid-page
        child = cache.new_chain()
        child.restore(snap)
        snap.release()
        parent.trim(1)
    parent_pages = {p for ref in parent.refs for p in ref.page_ids}
    child_slots, child_rows = fill(cache, child, ps + 2, gen)
    assert child_slots[0] % ps == 0
    assert not {s // ps for s in child_slots} & parent_pages
    parent_slots, parent_rows = fill(cache, parent, 4, gen)
    assert parent_slots[0] % ps == 0 and not set(parent_slots) & set(child_slots)
    kept = 2 * ps + 2 if how == "trim_fork" else 2 * ps + 3
    assert torch.equal(gather(cache, parent.slots()), torch.cat([rows[: 2 * ps + 2], parent_rows]))
    assert torch.equal(gather(cache, child.slots()), torch.cat([rows[:kept], child_rows]))


def test_restore_after_source_released(cache, gen):
    chain, expected = build_history(cache, gen, [cache.page_size + 2, 3])
    snap = chain.snapshot()
    in_use = cache.pool.pages_in_use
    chain.release()
    assert chain.num_rows == 0 and cache.pool.pages_in_use == in_use
    other = cache.new_chain()
    fill(cache, other, 5, gen)  # restore drops what the chain held
    other.restore(snap)
    assert cache.pool.pages_in_use == in_use
    snap.release()
    assert not snap.live
    assert torch.equal(gather(cache, other.slots()), expected)
    state = (other.slots(), cache.pool.stats())
    with pytest.raises(ValueError, match="released"):
        other.restore(snap)
    assert (other.slots(), cache.pool.stats()) == state
    other.release()
    assert cache.pool.pages_in_use == 0


def test_restoring_a_released_empty_snapshot_raises():
    cache = make_cache("mha", 16)
    snap = cache.new_chain().snapshot()
    snap.release()
    assert not snap.live
    with pytest.raises(ValueError):
        cache.new_chain().restore(snap)


def test_token_ids_tracked(gen):
    cache = make_cache("mla", 4, compaction=CompactionPolicy(ratio=2.0, max_copy_rows=4))
    chain = cache.new_chain()
    fill(cache, chain, 5, gen, tokens=[10, 11, 12, 13, 14])
    chain.seal()
    fill(cache, chain, 3, gen, tokens=[20, 21, 22])
    fill(cache, chain, 2, gen, tokens=[23, 24])
    assert chain.token_ids() == [10, 11, 12, 13, 14, 20, 21, 22, 23, 24]
    chain.trim(3)
    assert chain.token_ids() == [10, 11, 12, 13, 14, 20, 21]
    chain.seal()  # [5, 2]: not merged (5 > max_copy_rows); 2 more rows then merge [2, 2]
    fill(cache, chain, 2, gen, tokens=[30, 31])
    chain.seal()
    assert [r.num_rows for r in chain.refs] == [5, 4]
    assert cache.pool.rows_copied == 4
    child = chain.fork()
    child.trim(6)
    assert child.token_ids() == [10, 11, 12]
    assert chain.snapshot().token_ids() == [10, 11, 12, 13, 14, 20, 21, 30, 31]
    fill(cache, child, 2, gen)  # rows without tokens
    assert child.token_ids() is None
    assert chain.token_ids() == [10, 11, 12, 13, 14, 20, 21, 30, 31]
    with pytest.raises(ValueError, match="token ids"):
        chain.append(2, token_ids=[1])


def test_last_token_ids_set_after_the_rows(gen):
    """Rows appended before their tokens were known (placeholders) get their ids afterwards."""
    cache = make_cache("mla", 4)
    chain = cache.new_chain()
    fill(cache, chain, 5, gen, tokens=[10, 11, 12, 13, 14])
    chain.seal()
    fill(cache, chain, 3, gen, tokens=[-1, -1, -1])
    chain.set_last_token_ids([7, 8])
    assert chain.token_ids() == [10, 11, 12, 13, 14, -1, 7, 8]
    chain.set_last_token_id(9)
    assert chain.token_ids() == [10, 11, 12, 13, 14, -1, 7, 9]
    with pytest.raises(ValueError, match="tail holds 3 rows"):
        chain.set_last_token_ids([1, 2, 3, 4])
    assert chain.token_ids() == [10, 11, 12, 13, 14, -1, 7, 9]
    chain.seal()
    with pytest.raises(ValueError, match="tail holds 0 rows"):
        chain.set_last_token_id(1)


def test_out_of_pages_on_append_leaves_chain_unchanged(cache, gen):
    ps = cache.page_size
    small = make_cache(cache.layout.kind, ps, num_pages=3)
    chain, expected = build_history(small, gen, [ps])
    _, tail_rows = fill(small, chain, ps + 1, gen, tokens=list(range(ps + 1)))
    before = (chain.num_rows, chain.slots(), list(chain.tail.page_ids), chain.token_ids(), small.pool.stats())
    with pytest.raises(OutOfPagesError):
        chain.append(ps, token_ids=list(range(ps)))
    after = (chain.num_rows, chain.slots(), list(chain.tail.page_ids), chain.token_ids(), small.pool.stats())
    assert after == before
    assert torch.equal(gather(small, chain.slots()), torch.cat([expected, tail_rows]))
    # rows that fit the tail's last page need no new page, even with the pool full
    fill(small, chain, ps - 1, gen, tokens=list(range(ps - 1)))
    assert small.pool.pages_in_use == 3 and chain.num_rows == 3 * ps
    fresh = small.new_chain()
    with pytest.raises(OutOfPagesError):
        fresh.append(1)
    assert fresh.tail is None and fresh.num_rows == 0 and fresh.slots() == []


def test_bad_append_arguments(cache):
    chain = cache.new_chain()
    with pytest.raises(ValueError):
        chain.append(-1)
    with pytest.raises(ValueError):
        chain.append(2, token_ids=[1, 2, 3])
    assert chain.num_rows == 0 and chain.tail is None and cache.pool.stats()["pages_allocated_total"] == 0
    snap = chain.snapshot()
    assert isinstance(snap, ChainSnapshot) and snap.refs == () and snap.num_rows == 0


def test_sealed_spans_reuse_one_page_tuple_per_reference():
    """A sealed reference's pages never change: every ``spans()`` call (each decode step) returns
    the same tuple for it, while the tail's tuple follows its growth; a fork's shorter
    reference has its own, correct pages."""
    cache = make_cache("mha", 4)
    chain = cache.new_chain()
    chain.append(10)
    chain.seal()
    chain.append(3)
    first, second = chain.spans(), chain.spans()
    assert first[0].page_ids is second[0].page_ids and first[0].sealed
    assert list(first[0].page_ids) == chain.refs[0].page_ids and len(first[0].page_ids) == 3
    chain.append(2)  # the tail grows into a new page; the sealed span is untouched
    third = chain.spans()
    assert third[0].page_ids is first[0].page_ids and len(third[1].page_ids) == len(first[1].page_ids) + 1
    short = chain.refs[0].share(6)  # the first 6 rows: 2 pages of 4
    assert short.page_tuple == tuple(chain.refs[0].page_ids[:2])
    short.release()
    fork = chain.fork()  # the tail is sealed into a reference both chains hold
    assert [s.page_ids for s in fork.spans()] == [s.page_ids for s in chain.spans()]
    fork.release()



def test_tail_page_tuple_is_kept_until_its_pages_change():
    """Decode steps that open no page see the same tail tuple (compared by identity when the plan
    made ahead is checked); opening a page, trimming back and appending again each give a new,
    correct one."""
    cache = make_cache("mha", 4)
    chain = cache.new_chain()
    chain.append(5)  # 2 pages, room for 3 more rows
    first = chain.spans()[-1].page_ids
    chain.append(1)
    assert chain.spans()[-1].page_ids is first
    chain.append(3)  # opens a third page
    grown = chain.spans()[-1].page_ids
    assert grown is not first and grown == tuple(chain.tail.page_ids) and len(grown) == 3
    chain.trim(5)  # back to 4 rows: one page
    assert chain.spans()[-1].page_ids == tuple(chain.tail.page_ids) and len(chain.tail.page_ids) == 1
    chain.append(4)  # pages again, maybe others than before
    assert chain.spans()[-1].page_ids == tuple(chain.tail.page_ids) and len(chain.tail.page_ids) == 2
    chain.release()