"""Sealed segments leaving their pages for the KV tiers and coming back (``cache.tiers.offload``,
``bring_back``): the pool gets the pages back, the holders keep the segment, the planner refuses
it while it is out, and it comes back bit-identical with every holder's references; a bad copy
or a full pool changes nothing. On a GPU machine the pages are on the GPU: copies out run on a
side stream and come back from pinned memory."""

from __future__ import annotations

import logging

import pytest
import torch

from segkv.attention import AttentionShape, DeviceSpec, SequenceQuery, plan_attention
from segkv.cache import OutOfPagesError, PagedKVCache
from segkv.cache.prefix_index import PrefixIndex
from segkv.cache.tiers import SegmentTiers, bring_back, offload
from segkv.config import CacheConfig, CompactionPolicy, KVLayout
from tests.gpu_helpers import DEVICE, GPU

PAGE = 4


def make_cache(num_pages: int = 40, kind: str = "mha") -> PagedKVCache:
    layout = (KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32) if kind == "mha" else
              KVLayout(kind="mla", num_layers=2, kv_lora_rank=16, rope_dim=8, dtype=torch.bfloat16))
    cache = PagedKVCache(layout, CacheConfig(page_size=PAGE, num_pages=num_pages), device=DEVICE,
                         compaction=CompactionPolicy(enabled=False))
    cache.attach_tiers(SegmentTiers(host_bytes=1 << 20, pin_memory=GPU))
    return cache


def write_turn(cache, chain, n: int, gen) -> None:
    """Append ``n`` rows with random K/V (every layer) and token ids, then seal the turn."""
    slots = chain.append(n, token_ids=list(range(chain.num_rows, chain.num_rows + n)))
    for layer in range(cache.layout.num_layers):
        if cache.layout.kind == "mha":
            k, v = (torch.randn(n, 2, 8, generator=gen).to(DEVICE) for _ in range(2))
            cache.storage.write(layer, slots, k, v)
        else:
            cache.storage.write(layer, slots, torch.randn(n, 24, generator=gen).to(DEVICE, torch.bfloat16))
    chain.seal()


def chain_rows(cache, chain) -> list[torch.Tensor]:
    """Every row of ``chain``, every layer, gathered from the pages."""
    index = torch.tensor(chain.slots(), dtype=torch.long)
    return [t.clone() for layer in range(cache.layout.num_layers) for t in cache.storage.read(layer, index)]


def refcounts(cache, segment) -> list[int]:
    return [cache.pool.ref_count(p) for p in segment.page_ids[:segment.held_pages]]


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_a_segment_goes_out_and_comes_back_with_its_holders(kind, gen):
    cache = make_cache(kind=kind)
    chain = cache.new_chain()
    for n in (9, 7, 5):  # three sealed segments: 3, 2 and 2 pages
        write_turn(cache, chain, n, gen)
    snapshot = chain.snapshot()  # a second holder of every segment
    fork = chain.fork()  # a third
    before = chain_rows(cache, chain)
    middle = chain.refs[1].segment
    counts, in_use = refcounts(cache, middle), cache.pool.pages_in_use
    assert counts == [3, 3]

    assert offload(cache, middle)
    assert middle.in_lower_tier and middle.tier_holds == counts
    assert cache.pool.pages_in_use == in_use - 2 and cache.tiers.tier_of(middle.segment_id) == "host"
    assert chain.segments_in_lower_tiers() == [middle]
    spans = chain.spans()
    assert [s.in_lower_tier for s in spans] == [False, True, False] and set(spans[1].page_ids) == {-1}
    shape = AttentionShape(4, 2, 8, 8)
    with pytest.raises(ValueError, match="lower KV tier"):
        plan_attention([SequenceQuery.from_chain(chain, 1)], shape, DeviceSpec.cpu(), page_size=PAGE)
    with pytest.raises(ValueError, match="lower KV tier"):
        chain.slots()
    assert not offload(cache, middle)  # already out

    other = cache.new_chain()  # the freed pages serve someone else meanwhile
    write_turn(cache, other, 8, gen)
    fork.release()  # a holder lets go while the segment is out
    assert middle.tier_holds == [2, 2]

    assert cache.tiers.stats()["bytes_from_host"] == 0
    assert bring_back(cache, middle)
    assert not middle.in_lower_tier and refcounts(cache, middle) == [2, 2]
    stats = cache.tiers.stats()  # the copy back into pages is counted and timed
    assert stats["bytes_from_host"] == stats["bytes_to_host"] > 0 and stats["seconds_from_host"] > 0
    assert all(torch.equal(a, b) for a, b in zip(chain_rows(cache, chain), before))
    plan_attention([SequenceQuery.from_chain(chain, 1)], shape, DeviceSpec.cpu(), page_size=PAGE)
    for c in (chain, other):
        c.release()
    snapshot.release()
    assert cache.pool.pages_in_use == 0


def test_a_copy_is_reused_and_forgotten_with_its_last_holder(gen):
    cache = make_cache()
    chain = cache.new_chain()
    write_turn(cache, chain, 10, gen)
    segment = chain.refs[0].segment
    assert offload(cache, segment) and bring_back(cache, segment)
    assert offload(cache, segment)  # sealed rows never change: the first copy serves again
    assert cache.tiers.stats()["stored"] == 1
    pin = chain.snapshot()
    chain.release()
    assert segment.segment_id in cache.tiers
    pin.release()  # the last holder of a segment that is out: its copy goes too
    assert segment.segment_id not in cache.tiers and cache.pool.pages_in_use == 0


def test_only_the_pages_a_holder_covers_leave(gen):
    """A shorter reference leaves a segment's later pages to the pool (another chain may hold
    them now): offloading copies and frees only the pages still held."""
    cache = make_cache()
    chain = cache.new_chain()
    write_turn(cache, chain, 12, gen)  # 3 pages
    segment = chain.refs[0].segment
    chain.trim(7)  # 5 rows left: the chain now holds 2 of the segment's 3 pages
    reused = cache.new_chain()
    write_turn(cache, reused, 4, gen)  # takes the freed page
    assert segment.held_pages == 2 and segment.page_ids[2] in reused.refs[0].segment.page_ids
    kept = chain_rows(cache, reused)
    assert offload(cache, segment) and segment.tier_holds == [1, 1]
    assert cache.pool.ref_count(reused.refs[0].segment.page_ids[0]) == 1  # the other chain's page untouched
    assert bring_back(cache, segment) and chain.num_rows == 5
    assert all(torch.equal(a, b) for a, b in zip(chain_rows(cache, reused), kept))


def test_a_bad_copy_or_a_full_pool_changes_nothing(gen, caplog):
    cache = make_cache(num_pages=8)
    chain = cache.new_chain()
    write_turn(cache, chain, 16, gen)  # 4 pages
    segment = chain.refs[0].segment
    assert offload(cache, segment)
    filler = cache.new_chain()
    filler.append(6 * PAGE)  # 6 of 8 pages: 4 cannot come back
    with pytest.raises(OutOfPagesError, match="needs 4 pages"):
        bring_back(cache, segment)
    assert segment.in_lower_tier and cache.pool.pages_in_use == 6
    filler.release()
    copy = cache.tiers.get(segment.segment_id)
    copy["1.0"][3, 0, 0] += 1.0  # the host copy changed after it was made
    with caplog.at_level(logging.WARNING, logger="segkv.cache.tiers"):
        assert not bring_back(cache, segment)
    assert "recomputed" in caplog.text and segment.in_lower_tier and cache.pool.pages_in_use == 0
    assert segment.segment_id not in cache.tiers
    assert not bring_back(cache, segment)  # no copy left: the caller recomputes
    chain.release()


def test_the_prefix_index_counts_holds_across_tiers(gen):
    cache = make_cache()
    index = PrefixIndex(cache.pool)
    chain = cache.new_chain()
    write_turn(cache, chain, 9, gen)
    index.insert(chain.refs)
    chain.release()  # the index alone holds it
    ref = index.match(list(range(9))).refs[0]
    held = ref.segment
    ref.release()
    assert index.num_pages_held_only() == 3 and index.num_evictable_pages() == 3
    assert offload(cache, held)
    assert index.num_pages_held_only() == 0 and index.num_evictable_pages() == 0 and not index.page_holds()
    match = index.match(list(range(9)))  # a match of a segment that is out: its holders grow
    assert match.num_tokens == 9 and held.tier_holds == [2, 2, 2]
    assert bring_back(cache, held)
    assert index.page_holds() == {p: 1 for p in held.page_ids}
    match.release()
    assert index.evict(3) == 3 and cache.pool.pages_in_use == 0


def test_eviction_keeps_segments_in_the_tiers_and_frees_resident_ones(gen):
    """Pages short after a spill: the index evicts what holds pages, least recently used first, and
    keeps a segment in the tiers (older, but dropping it would free nothing and lose its copy)."""
    cache = make_cache()
    index = PrefixIndex(cache.pool)
    segments = []
    for start in (0, 100):  # two cached histories of 9 tokens (3 pages each), the first older
        chain = cache.new_chain()
        tokens = list(range(start, start + 9))
        slots = chain.append(9, token_ids=tokens)
        for layer in range(cache.layout.num_layers):
            cache.storage.write(layer, slots, *(torch.randn(9, 2, 8, generator=gen).to(DEVICE) for _ in range(2)))
        chain.seal()
        index.insert(chain.refs)
        segments.append(chain.refs[0].segment)
        chain.release()
    older, newer = segments
    assert offload(cache, older)
    in_use = cache.pool.pages_in_use
    assert index.evict(1) == 3 and cache.pool.pages_in_use == in_use - 3  # the resident one went
    match = index.match(list(range(9)))
    assert match.num_tokens == 9 and match.refs[0].segment is older and older.in_lower_tier
    assert index.match(list(range(100, 109))).num_tokens == 0
    assert index.evict(1) == 0  # nothing left that holds pages: the one in the tiers stays
    assert bring_back(cache, older) and not older.in_lower_tier
    match.release()
    assert index.evict(3) == 3 and cache.pool.pages_in_use == 0


def test_a_chain_takes_its_own_copy_of_a_shared_prefix(gen):
    """``KVChain.own_copy``: a chain holding the first rows of a shared segment gets them in a new
    segment of its own (same rows and tokens), so the shared one can leave its pages while the
    chain runs; without free pages nothing changes."""
    cache = make_cache(num_pages=10)
    chain = cache.new_chain()
    write_turn(cache, chain, 20, gen)  # 5 pages
    shared = chain.refs[0].segment
    fork = cache.new_chain()
    fork.restore(chain.snapshot())
    fork.trim(14)  # the fork keeps the first 6 rows: 2 of the 5 pages
    before = chain_rows(cache, fork)
    fork.own_copy(0)
    assert fork.refs[0].segment is not shared and fork.token_ids() == list(range(6))
    assert all(torch.equal(a, b) for a, b in zip(chain_rows(cache, fork), before))
    assert refcounts(cache, shared) == [2, 2, 2, 2, 2]  # the chain and the snapshot it was made from
    assert offload(cache, shared) and not fork.segments_in_lower_tiers()
    assert all(torch.equal(a, b) for a, b in zip(chain_rows(cache, fork), before))
    filler = cache.new_chain()
    filler.append(cache.pool.num_free_pages * PAGE)
    other = cache.new_chain()
    other.restore(fork.snapshot())
    with pytest.raises(OutOfPagesError):
        other.own_copy(0)
    assert other.refs[0].segment is fork.refs[0].segment


def test_pages_rewritten_right_after_a_copy_out_leave_the_copy_as_it_was(gen):
    """The freed pages are written at once by the next step: on a GPU the copy out is still
    running on its side stream, and the writes must wait for it (the copy, its checksum and the
    rows that come back are the segment's, not the new rows)."""
    heads, dim, page = (8, 128, 16) if GPU else (2, 8, PAGE)  # on a GPU, 64 MiB to copy out
    layout = KVLayout(num_layers=4, num_kv_heads=heads, head_dim=dim, dtype=torch.float32)
    cache = PagedKVCache(layout, CacheConfig(page_size=page, num_pages=256), device=DEVICE,
                         compaction=CompactionPolicy(enabled=False))
    cache.attach_tiers(SegmentTiers(host_bytes=1 << 30, pin_memory=GPU))
    chain = cache.new_chain()
    rows = 128 * page  # half the pool
    slots = chain.append(rows, token_ids=list(range(rows)))
    for layer in range(layout.num_layers):
        cache.storage.write(layer, slots, *(torch.randn(rows, heads, dim, generator=gen).to(DEVICE) for _ in range(2)))
    chain.seal()
    before = chain_rows(cache, chain)
    segment = chain.refs[0].segment
    assert offload(cache, segment) and cache.pool.num_free_pages == 256
    other = cache.new_chain()
    other_slots = other.append(256 * page)  # every page, the segment's too
    for layer in range(layout.num_layers):
        cache.storage.write(layer, other_slots, *(torch.full((256 * page, heads, dim), -1.0, device=DEVICE),) * 2,
                            trusted_slots=True)
    other.release()
    assert bring_back(cache, segment) and cache.tiers.stats()["corrupt"] == 0
    after = chain_rows(cache, chain)
    assert all(torch.equal(a, b) for a, b in zip(after, before)) and not any(a.isnan().any() for a in after)
