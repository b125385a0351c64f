"""Full, wholly visible tiles without the score mask (``SEGKV_ATTENTION_SKIP_MASKS``,
``paged_attention.skip_masks``): the GQA stage 1 against the torch reference.

The histories end segments mid-page, so work items mix full pages with part-full ones; decode rows
see every key of their pieces, windows of several rows do not (their own piece is causal), and the
second sequence sees no key at all (0, LSE -inf). Outputs are poisoned before every launch."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl

from segkv.kernels import attention_tiles, paged_attention
from segkv.kernels.paged_attention import LaunchConfig
from test_triton_attention import DTYPES, check_with_the_second_sequence_masked


def test_which_launches_skip_masks(monkeypatch):
    """Only with the setting on, and only where a tile's pages tell whether it is full: one page
    that the tiles divide, or exactly two."""
    monkeypatch.setattr(attention_tiles, "SKIP_MASKS", 0)
    assert not paged_attention.skip_masks(16, 32)
    monkeypatch.setattr(attention_tiles, "SKIP_MASKS", 1)
    table = {(16, 32): True, (32, 32): True, (64, 32): True, (32, 64): True, (16, 64): False, (20, 32): False,
             (48, 64): False, (128, 64): True, (100, 64): False, (96, 32): True}
    assert {k: paged_attention.skip_masks(*k) for k in table} == table
    monkeypatch.setattr(attention_tiles, "PAGE_SCALARS", tl.constexpr(False))
    assert not paged_attention.skip_masks(16, 32)


def test_launch_constants_follow_the_setting(monkeypatch):
    def skip(page_size: int, rows: int) -> bool:
        return paged_attention.stage1_launch(dtype=torch.bfloat16, dk=64, dv=64, group=4, page_size=page_size,
                                             max_work_rows=rows, element_size=2,
                                             launch=LaunchConfig(32, 4, 3, tall_block_n=32))["SKIP"]

    monkeypatch.setattr(attention_tiles, "SKIP_MASKS", 0)
    assert not skip(16, 1) and not skip(16, 16)
    monkeypatch.setattr(attention_tiles, "SKIP_MASKS", 1)
    assert skip(16, 1) and skip(16, 16) and skip(32, 1) and not skip(20, 1)


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
def test_skipped_masks_give_the_reference(route, rows, page_size, block_n, dtype, gen, monkeypatch):
    monkeypatch.setattr(attention_tiles, "SKIP_MASKS", 1)
    check_with_the_second_sequence_masked(gen, DTYPES[dtype], route, rows=rows, ratio=4, page_size=page_size,
                                          partitions=3,
                                          launch=LaunchConfig(block_n, 4, 3, tall_block_n=block_n,
                                                              transposed_min_pairs=0))


@pytest.mark.parametrize("route", ["split", "cascade"])
def test_transposed_programs_skip_masks_too(route, gen, monkeypatch):
    monkeypatch.setattr(attention_tiles, "SKIP_MASKS", 1)
    check_with_the_second_sequence_masked(gen, torch.bfloat16, route, rows=1, ratio=8, page_size=16, partitions=3,
                                          launch=LaunchConfig(32, 4, 3, transposed_min_pairs=1))
