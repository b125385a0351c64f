"""Rows behind a sliding window given back (``KVChain.release_rows_before``): which pages go,
which stay (shared ones), what a chain with released rows still does (tokens, last slots,
windowed plans, snapshot files) and what it refuses (slots, plans that reach them, trims into
them, prefix matches whose continuation would need them)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from segkv.attention.device import DeviceSpec
from segkv.attention.plan import AttentionShape, SequenceQuery
from segkv.attention.planner import plan_attention
from segkv.cache import PagedKVCache
from segkv.cache.prefix_index import PrefixIndex
from segkv.config import CacheConfig, CompactionPolicy, KVLayout
from segkv.sessions.snapshot_file import load_snapshot, save_snapshot

PAGE = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4)
SHAPE = AttentionShape(2, 1, 4, 4)


def make_cache(num_pages: int = 64, compaction: CompactionPolicy | None = None) -> PagedKVCache:
    return PagedKVCache(LAYOUT, CacheConfig(page_size=PAGE, num_pages=num_pages),
                        compaction=compaction or CompactionPolicy(enabled=False))


def fill(cache: PagedKVCache, chain, n: int, gen: torch.Generator, first_token: int = 0) -> torch.Tensor:
    """Append ``n`` rows of random keys and values (token ids counting from ``first_token``);
    returns them ``(layers, 2, n, 4)``."""
    slots = chain.append(n, token_ids=list(range(first_token, first_token + n)))
    rows = torch.randn(LAYOUT.num_layers, 2, n, 4, generator=gen)
    for layer in range(LAYOUT.num_layers):
        cache.storage.write(layer, slots, rows[layer, 0, :, None], rows[layer, 1, :, None])
    return rows


def test_pages_wholly_before_the_position_go_back_and_the_rest_stay(gen):
    cache = make_cache()
    chain = cache.new_chain()
    fill(cache, chain, 30, gen)
    last = chain.last_slots(9)
    assert cache.pool.pages_in_use == 8
    assert chain.release_rows_before(23) == 5  # rows 0..19: pages 0..4; page 5 holds row 23
    assert cache.pool.pages_in_use == 3 and chain.num_released_rows == 20
    assert chain.last_slots(9) == last  # the live rows keep their slots
    assert chain.token_ids() == list(range(30))  # released rows keep their tokens
    assert chain.release_rows_before(23) == 0  # idempotent
    assert chain.holds_rows_from(20) and not chain.holds_rows_from(19)
    span, = chain.spans()
    assert span.released_pages == 5 and span.page_ids[:5] == (-1,) * 5 and min(span.page_ids[5:]) >= 0
    with pytest.raises(ValueError, match="released"):
        chain.slots()
    with pytest.raises(ValueError, match="released"):
        chain.last_slots(11)
    with pytest.raises(ValueError, match="released"):
        chain.trim(12)  # would leave the tail ending among released rows
    chain.trim(3)  # a trim that stays among live rows is fine
    assert chain.num_rows == 27
    chain.release()
    assert cache.pool.pages_in_use == 0


def test_shared_pages_stay_until_their_other_holder_lets_go(gen):
    cache = make_cache()
    chain = cache.new_chain()
    fill(cache, chain, 24, gen)
    snap = chain.snapshot()  # the first segment is now held twice
    fill(cache, chain, 16, gen, first_token=24)
    assert chain.release_rows_before(37) == 3  # the tail's rows 24..35; the first segment is shared
    assert cache.pool.pages_in_use == 7
    snap.release()
    assert chain.release_rows_before(37) == 6  # now the first segment's pages go too
    assert cache.pool.pages_in_use == 1
    assert [s.released_pages for s in chain.spans()] == [6, 3]

    fork_source = cache.new_chain()
    fill(cache, fork_source, 24, gen)
    fork = fork_source.fork()
    assert fork.release_rows_before(24) == 0 and fork_source.release_rows_before(24) == 0
    fork.release()
    assert fork_source.release_rows_before(24) == 6
    for c in (chain, fork_source):
        c.release()
    assert cache.pool.pages_in_use == 0


def test_a_reference_to_part_of_a_segment_keeps_its_pages(gen):
    """Two references to one segment: pages the shorter one holds stay (they are held twice),
    and so does everything after them (a segment's released pages are its leading ones)."""
    cache = make_cache()
    chain = cache.new_chain()
    fill(cache, chain, 24, gen)
    snap = chain.snapshot()
    short = snap.refs[0].share(9)  # pages 0..2
    snap.release()
    assert chain.release_rows_before(24) == 0
    short.release()
    assert chain.release_rows_before(24) == 6
    chain.release()


def _plan(chain, rows: int, window: int | None):
    query = SequenceQuery(tuple(chain.spans()), rows)
    return plan_attention([query], SHAPE, DeviceSpec.cpu(), page_size=PAGE, window=window, route="single")


def test_windowed_plans_are_unchanged_and_plans_that_reach_released_rows_are_refused(gen):
    cache = make_cache()
    chain = cache.new_chain()
    fill(cache, chain, 41, gen)
    window = 10
    before = _plan(chain, 3, window)  # rows at 38..40 see positions 29.. (pages from 7 on)
    chain.release_rows_before(41 - 3 - window + 1)  # their lowest first position: 29
    assert chain.num_released_rows == 28
    after = _plan(chain, 3, window)
    assert after.pieces == before.pieces and after.work == before.work
    with pytest.raises(ValueError, match="released outside the sliding window"):
        _plan(chain, 3, None)
    with pytest.raises(ValueError, match="released outside the sliding window"):
        _plan(chain, 3, window + 8)  # a wider window would reach page 6
    chain.release()


def test_compaction_leaves_segments_with_released_rows_alone(gen):
    cache = make_cache(compaction=CompactionPolicy(ratio=100.0))
    for release in (False, True):
        copied = cache.pool.rows_copied
        chain = cache.new_chain()
        fill(cache, chain, 20, gen)
        chain.seal()
        fill(cache, chain, 6, gen, first_token=20)
        if release:
            chain.release_rows_before(21)
        chain.seal()  # merges both segments, unless the first has rows released (nothing to copy)
        assert [s.released_pages for s in chain.spans()] == ([5, 0] if release else [0])
        assert chain.token_ids() == list(range(26))
        assert cache.pool.rows_copied - copied == (0 if release else 26)
        chain.release()


def test_prefix_matches_whose_continuation_needs_released_rows_are_refused(gen):
    cache = make_cache()
    index = PrefixIndex(cache.pool)
    index.window = 8
    chain = cache.new_chain()
    fill(cache, chain, 40, gen)
    chain.release_rows_before(40 - 8 + 1)  # rows 0..31 released
    chain.seal()
    index.insert(chain.refs)
    chain.release()
    tokens = list(range(40))
    whole = index.match(tokens + [99])  # continues at 40: sees 33.. (the last query row 39 sees 32..)
    assert whole.num_tokens == 40
    whole.release()
    assert index.match(tokens[:36] + [99]).num_tokens == 0  # would continue at 36: needs 28.., released
    assert index.stats()["num_queries"] == 2
    index.window = None  # a model without windows never releases; the guard is off
    index.clear()


def test_snapshot_files_keep_released_rows_released(gen, tmp_path):
    """A saved chain with released rows holds only its live rows; loading rebuilds the same
    segments, their heads released, and the live rows read back bit for bit."""
    cache = make_cache()
    chain = cache.new_chain()
    fill(cache, chain, 22, gen)
    chain.seal()
    second = fill(cache, chain, 15, gen, first_token=22)
    chain.release_rows_before(30)  # segment 1 wholly (22 rows, 6 pages); segment 2's first 8 rows
    snap = chain.snapshot()
    path = tmp_path / "windowed.safetensors"
    save_snapshot(path, snap, cache, fingerprint="m")
    snap.release()
    chain.release()
    assert cache.pool.pages_in_use == 0
    with safe_open(path, framework="pt") as reader:  # the file holds the 7 live rows only
        assert {tuple(reader.get_slice(name).get_shape()) for name in reader.keys()} == {(7, 1, 4)}
    loaded = load_snapshot(path, cache, fingerprint="m")
    assert loaded.token_ids == list(range(22)) + list(range(22, 37)) and loaded.num_rows == 37
    refs = loaded.snapshot.refs
    assert [r.num_rows for r in refs] == [22, 15]
    assert [r.segment.released_pages for r in refs] == [6, 2]
    assert cache.pool.pages_in_use == 2  # only segment 2's rows 8..14
    slots = refs[1].segment.slots(8, 15)
    for layer in range(LAYOUT.num_layers):
        k, v = cache.storage.read(layer, slots)
        assert torch.equal(k[:, 0], second[layer, 0, 8:]) and torch.equal(v[:, 0], second[layer, 1, 8:])
    loaded.snapshot.release()
    assert cache.pool.pages_in_use == 0
    # another cache's page size: a page holding both released and live rows keeps zeros there
    other = PagedKVCache(LAYOUT, CacheConfig(page_size=3, num_pages=64))
    loaded = load_snapshot(path, other, fingerprint="m")
    refs = loaded.snapshot.refs
    assert [r.segment.released_pages for r in refs] == [8, 2] and other.pool.pages_in_use == 3
    for layer in range(LAYOUT.num_layers):
        k, v = other.storage.read(layer, refs[1].segment.slots(6, 15))
        assert not k[:2].any() and torch.equal(k[2:, 0], second[layer, 0, 8:])
        assert torch.equal(v[2:, 0], second[layer, 1, 8:])
    loaded.snapshot.release()
    assert other.pool.pages_in_use == 0
