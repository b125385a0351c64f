"""Full, wholly visible tiles without the score mask (the GQA stage 1's ``SKIP``,
``attention_tiles.full_tiles_known``): the GQA stage 1 against the torch reference.

The histories end segments mid-page, so work items mix full pages with part-full ones; decode rows
see every key of their pieces, windows of several rows do not (their own piece is causal), and the
second sequence sees no key at all (0, LSE -inf). Outputs are poisoned before every launch."""

from __future__ import annotations

import pytest
import torch

from segkv.kernels.attention import paged_attention
from segkv.kernels.attention.attention_tiles import full_tiles_known
from segkv.kernels.attention.paged_attention import LaunchConfig
from attention_helpers import triton_and_reference, write_rows, exact_attention  # noqa: F401
from segkv.attention import AttentionShape, DeviceSpec, SequenceQuery, plan_attention
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, KVLayout
from test_triton_attention import DEVICE, DTYPES, check, check_with_the_second_sequence_masked

# the exact contract's checks: exact plans on every device (attention_helpers.exact_attention)
pytestmark = pytest.mark.usefixtures("exact_attention")


def test_which_launches_skip_masks():
    """Only where a tile's pages tell whether it is full: one page that the tiles divide, or
    exactly two, or four (the GQA stage 1's four page scalars)."""
    table = {(16, 32): True, (32, 32): True, (64, 32): True, (32, 64): True, (16, 64): False, (20, 32): False,
             (48, 64): False, (128, 64): True, (100, 64): False, (96, 32): True}
    assert {k: full_tiles_known(*k) for k in table} == table
    assert full_tiles_known(16, 64, four=True) and full_tiles_known(8, 32, four=True)
    assert not full_tiles_known(8, 64, four=True)
    assert not full_tiles_known(20, 64, four=True)


def test_launch_constants():
    def skip(page_size: int, rows: int) -> bool:
        return paged_attention.stage1_launch(dtype=torch.bfloat16, dk=64, dv=64, group=4, page_size=page_size,
                                             max_work_rows=rows, element_size=2,
                                             launch=LaunchConfig(32, 4, 3, tall_block_n=32))["SKIP"]

    assert skip(16, 1) and skip(16, 16) and skip(32, 1) and not skip(20, 1)
    # 64-row decode tiles of 16-row pages: four page scalars, so fullness and skipped masks
    four = paged_attention.stage1_launch(dtype=torch.bfloat16, dk=128, dv=128, group=4, page_size=16,
                                         max_work_rows=1, element_size=2, launch=LaunchConfig(64, 4, 3))
    assert four["BLOCK_N"] == 64 and four["FOUR"] and four["SKIP"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("route,rows,page_size,block_n", [
    ("split", 1, 16, 32),     # decode, tiles of two pages
    ("cascade", 1, 32, 32),   # decode over a shared history, tiles of one page
    ("split", 1, 64, 32),     # pages longer than the tile
    ("split", 4, 16, 32),     # causal windows: the tail piece keeps its mask
    ("cascade", 16, 16, 32),  # 64 pairs (tall programs)
    ("split", 3, 20, 32),     # pages that do not tell fullness: the mask everywhere
    ("split", 1, 96, 32),     # pages of three tiles
])
def test_skipped_masks_give_the_reference(route, rows, page_size, block_n, dtype, gen):
    check_with_the_second_sequence_masked(gen, DTYPES[dtype], route, rows=rows, ratio=4, page_size=page_size,
                                          partitions=3,
                                          launch=LaunchConfig(block_n, 4, 3, tall_block_n=block_n))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3])
def test_four_page_tiles_give_the_reference(rows, dtype, gen):
    """64-row tiles of 16-row pages take their four page entries
    as scalars. The history's segments are 7 and 9 whole pages, then one ending mid-page, so tiles
    hold four full pages (masks skipped for decode rows), fewer pages, and part-full pages; a fork
    trimmed to end mid-page; windows of 3 rows keep the causal mask in their own piece."""
    page_size, head_dim = 16, 64
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=head_dim, dtype=DTYPES[dtype])
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=128), device=DEVICE,
                         compaction=CompactionPolicy(enabled=False))
    history = cache.new_chain()
    for n in (7 * page_size, 9 * page_size, 37):
        write_rows(cache, history, n, gen)
        history.seal()
    fork = history.fork()
    fork.trim(21)
    chains = [history, fork]
    for chain in chains:
        write_rows(cache, chain, rows + 50, gen)
    shape = AttentionShape(4, 1, head_dim, head_dim)
    queries = [SequenceQuery.from_chain(c, rows) for c in chains]
    query = torch.randn(2 * rows, 4, head_dim, generator=gen).to(DTYPES[dtype]).to(DEVICE)
    plan = plan_attention(queries, shape, DeviceSpec.cpu(), page_size=page_size, route="split",
                          num_partitions=2)
    assert plan.num_partitions == 2
    launch = LaunchConfig(64, 4, 3)
    meta = paged_attention.stage1_launch(dtype=DTYPES[dtype], dk=head_dim, dv=head_dim, group=4,
                                         page_size=page_size, max_work_rows=rows, element_size=2,
                                         launch=launch)
    assert meta["BLOCK_N"] == 64 and meta["FOUR"] and meta["SKIP"]
    storage = cache.storage
    out, lse, ref, ref_lse = triton_and_reference(plan, query, storage.key_cache(0), storage.value_cache(0),
                                                  page_size=page_size, scale=head_dim**-0.5, device=DEVICE,
                                                  launch=launch)
    check(out, lse, ref, ref_lse)
