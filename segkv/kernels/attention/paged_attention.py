"""Triton kernels for attention over pieces: stage-1 partials, the exact LSE merge, the KV write.

The stage-1 program's building blocks are in ``attention_tiles`` (shared with the latent kernel)
and ``stage1_merge`` (the merge inside stage 1). Imports torch and triton only. The plan arrives as flat int32 tensors (see the launchers'
docstrings); every float accumulation is float32 and the output is rounded once, in the
merge kernel, so results equal float32 attention over the whole history rounded once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from segkv.kernels.triton_import import tl, triton

from segkv.kernels.attention import timeline
from segkv.kernels.attention.attention_tiles import (
    causal_page_end,
    fp8_values,
    full_tiles_known,
    key_mask_scores,
    load_kv,
    next_tile_first,
    online_softmax_step,
    pair_reads,
    plan_reads,
    store_partials,
    tile_pages,
    tile_seen_whole,
    window_page_start,
    tile_range,
    tile_rows_in_page,
    work_item_visible,
    work_key_masks_of,
)
from segkv.kernels.pdl import pdl_options
from segkv.kernels.attention.stage1_merge import merge_group_if_last, merge_if_last, zero_empty_rows
import segkv.settings as settings

_INTERPRET = settings.SETTINGS.triton_interpret


@triton.jit
def _stage1_kernel(
    Q, K, V, OUT, LSE, FINAL, FINAL_LSE,
    page_table, page_rows, page_key_start, work_pages, work_partial_start, partial_row,
    partial_offset, partial_direct, reduce_ptr, reduce_partials, COUNTERS,
    stride_qr, stride_qh, stride_kp, stride_kn, stride_kh, stride_vp, stride_vn, stride_vh,
    stride_op, stride_oh, stride_lp, stride_fr, stride_fh, stride_flr, stride_c,
    scale, num_rows,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, EXACT_FP32: tl.constexpr, MERGE: tl.constexpr,
    USE_PDL: tl.constexpr = False, PLAN_EARLY: tl.constexpr = False,
    MERGE_LANES: tl.constexpr = 1, WIDE_OFFSETS: tl.constexpr = True,
    SKIP: tl.constexpr = False, FOUR: tl.constexpr = False, STAMPS=None,
    KEY_MASKS: tl.constexpr = False, work_key_masks=None, key_mask_words=None,
    KV_FP8: tl.constexpr = False, K_SCALE=None, V_SCALE=None,
    CAUSAL_END: tl.constexpr = False, FAST_PV: tl.constexpr = False,
    KEY_LOWS: tl.constexpr = False, partial_low=None, SINKS=None,
):
    """One program: a block of (query row, head-in-group) pairs of one work item and one KV head,
    scanning the work item's piece ``BLOCK_N`` rows (its whole pages, or part of a longer page)
    at a time with an online softmax in float32. Q.K products of bf16/fp16 inputs are exact in float32; for P.V,
    P is split into two bf16/fp16 parts (about 16 significant bits) against the native V tile,
    accumulated in float32; float32 inputs use IEEE float32 throughout.

    A partial that is its row's only one (``partial_direct >= 0``, the row) is rounded once and
    stored straight into FINAL/FINAL_LSE; the others go to OUT/LSE for the merge. With ``MERGE > 0``
    (work items of one query row, at most ``MERGE`` partials per row) the last program of each
    (row, head) merges it (``merge_if_last``, tickets in COUNTERS ``(rows, heads)`` int32, all 0
    between launches) and the first work item's programs zero the rows without partials: no
    merge launch. ``PLAN_EARLY``
    (with ``USE_PDL``): the program's plan reads (:func:`plan_reads`) come before the wait. ``SKIP``
    (:func:`attention_tiles.full_tiles_known`): a tile whose rows all hold keys every valid pair sees
    skips the score mask. ``FOUR``: a tile of four pages loads their entries as scalars. ``STAMPS``: an int64 tensor of ``timeline.FIELDS`` values per program, where each
    program writes its timeline (diagnostics: ``scripts/stage1_timeline.py``); None compiles it away.
    ``KEY_MASKS``: the plan may hold masked work items (tree verify windows; ``work_key_masks``
    ``(2 W,)`` and ``key_mask_words`` int32, :func:`paged_attention`); a masked item's scores also
    keep only the keys its rows' mask bits set (:func:`attention_tiles.key_mask_scores`), the others
    read one flag per program. False compiles it away. ``KV_FP8``: K and V are an FP8 cache's e4m3
    bytes (uint8 views) with float32 scales per KV head in ``K_SCALE``/``V_SCALE`` ``(Hkv,)``: tiles
    are decoded exactly to the query's dtype (:func:`attention_tiles.fp8_values`), the key scale
    multiplies the softmax scale and the value scale the float32 accumulator, so the partials are
    float32 attention over ``fp8 * scale``. ``CAUSAL_END`` (prefill programs): the scan stops at
    the last page any pair sees (:func:`attention_tiles.causal_page_end`) and, with ``SKIP``, each
    tile every pair sees whole skips the mask (:func:`attention_tiles.tile_seen_whole`), so only
    the diagonal's tiles are masked. ``FAST_PV``: the contract's ``fast`` mode (P rounded to the
    K/V dtype before P.V, :func:`attention_tiles.online_softmax_step`); off: ``exact``.
    ``KEY_LOWS`` (sliding windows): ``partial_low`` int32 per partial, the first piece row the
    pair's row sees (0: from the first); the scan starts at the page holding the pairs' smallest
    (:func:`attention_tiles.window_page_start`) and every tile is masked. False compiles it away.
    ``SINKS``: attention sinks, ``(Hq,)`` float32 natural-log logits per query head, folded in
    float32 before the one rounding wherever stage 1 finishes a row (its only partial:
    :func:`attention_tiles.store_partials`; ``MERGE``: :mod:`stage1_merge`); None compiles them away."""
    PAGES: tl.constexpr = max(BLOCK_N // PAGE_SIZE, 1)  # whole pages a tile covers (1: a page spans tiles)
    SUB: tl.constexpr = (PAGE_SIZE + BLOCK_N - 1) // BLOCK_N  # tiles per page (1: a tile holds whole pages)
    if STAMPS is not None:
        st0 = timeline.global_ns()
        sc0 = timeline.sm_cycles()
    # launch order: a piece's KV heads side by side, as they share its pages
    kvh = tl.program_id(0)
    w = tl.program_id(1)
    mb = tl.program_id(2)
    p0 = tl.load(work_partial_start + w)
    n_rows = tl.load(work_partial_start + w + 1) - p0
    if PLAN_EARLY:  # the rest of the host's plan too, before the wait
        valid, head, partial, qrow, offset, pg0, pg1, page, rows, kst, full = plan_reads(
            p0, n_rows, mb, w, kvh * GROUP, GROUP, partial_row, partial_offset, work_pages, page_table, page_rows,
            page_key_start, BLOCK_M, BLOCK_N, PAGE_SIZE, WIDE_OFFSETS, FOUR)
    if USE_PDL:  # the plan is the host's; everything else read or written below waits for the kernel before
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if STAMPS is not None:
        st1 = timeline.global_ns()
        sc1 = timeline.sm_cycles()
    if MERGE > 0:
        if (w == 0) & (mb == 0):
            zero_empty_rows(reduce_ptr, num_rows, kvh, FINAL, FINAL_LSE, stride_fr, stride_fh, stride_flr,
                            GROUP, DV, BLOCK_DV, SINKS)
    if mb * BLOCK_M >= n_rows * GROUP:  # also the padding work items of fixed-size plan buffers
        return
    if not PLAN_EARLY:
        valid, head, partial, qrow, offset = pair_reads(p0, n_rows, mb, kvh * GROUP, GROUP, partial_row,
                                                        partial_offset, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    dk_ok = offs_dk < DK
    dv_ok = offs_dv < DV
    q = tl.load(Q + qrow[:, None] * stride_qr + head[:, None] * stride_qh + offs_dk[None, :],
                mask=valid[:, None] & dk_ok[None, :], other=0.0)
    if not PLAN_EARLY:  # the page range after the query
        pg0 = tl.load(work_pages + 2 * w)
        pg1 = tl.load(work_pages + 2 * w + 1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    qk_scale = scale
    if KV_FP8:  # scores of the unscaled keys times the head's key scale: one multiply per program
        qk_scale = scale * tl.load(K_SCALE + kvh)
    offs_n = tl.arange(0, BLOCK_N)
    slot = offs_n // PAGE_SIZE
    row_in_page = tile_rows_in_page(offs_n, PAGE_SIZE, PAGES, BLOCK_N)
    # loop-invariant parts of the K/V addresses: this KV head, the row within its page
    k_base = K + kvh * stride_kh + (row_in_page * stride_kn)[:, None] + offs_dk[None, :]
    v_base = V + kvh * stride_vh + (row_in_page * stride_vn)[:, None] + offs_dv[None, :]
    if not PLAN_EARLY:  # the first block's page indices (plan_reads), after the query and the K/V bases
        page, rows, kst, full = tile_pages(page_table, page_rows, page_key_start, pg0, slot, pg1, WIDE_OFFSETS, PAGES,
                                           BLOCK_N, PAGE_SIZE, FOUR)
    low = None
    scan0 = pg0
    if KEY_LOWS:  # a sliding window: no tile before the first key a pair sees
        low = tl.load(partial_low + partial, mask=valid, other=0)
        scan0 = window_page_start(page_key_start, pg0, pg1, valid, low)
        # the first tile's page indices from there
        page, rows, kst, full = tile_pages(page_table, page_rows, page_key_start, scan0, slot, pg1, WIDE_OFFSETS,
                                           PAGES, BLOCK_N, PAGE_SIZE, FOUR)
    if CAUSAL_END:  # no tile past the last key a pair sees; the mask only where a pair misses a key
        t0, t1 = tile_range(scan0, causal_page_end(page_key_start, pg0, pg1, valid, offset), SUB)
        min_offset = tl.min(tl.where(valid, offset, 2147483647), 0)
    else:
        t0, t1 = tile_range(scan0, pg1, SUB)
        if SKIP:  # every valid pair sees every key of the work item: full tiles need no mask
            visible = work_item_visible(page_rows, page_key_start, pg0, pg1, offset, valid)
    if KEY_MASKS:  # masked scores are wholly masked already (causal and page limits too): SKIP stays valid
        masked, word_base = work_key_masks_of(work_key_masks, w, partial, p0)
    for t in range(t0, t1, PAGES):
        if KEY_LOWS:
            needs_mask = True
        elif CAUSAL_END:
            needs_mask = tile_seen_whole(page_key_start, t, full, min_offset, BLOCK_N, SUB) == 0 if SKIP else True
        else:
            needs_mask = (visible & full) == 0 if SKIP else True
        page_cur, rows_cur, kst_cur = page, rows, kst
        page, rows, kst, full = tile_pages(page_table, page_rows, page_key_start, next_tile_first(t, PAGES, SUB), slot,
                                           pg1, WIDE_OFFSETS, PAGES, BLOCK_N, PAGE_SIZE, FOUR)
        if SUB > 1:  # this tile's rows of a longer page
            sub_rows = (t % SUB) * BLOCK_N
            row_cur = row_in_page + sub_rows
            k_cur, v_cur = load_kv(k_base + sub_rows * stride_kn, v_base + sub_rows * stride_vn, page_cur,
                                    stride_kp, stride_vp, row_cur < rows_cur, dk_ok, dv_ok)
        else:
            row_cur = row_in_page
            k_cur, v_cur = load_kv(k_base, v_base, page_cur, stride_kp, stride_vp, row_cur < rows_cur, dk_ok, dv_ok)
        in_page = row_cur < rows_cur
        kpos = kst_cur + row_cur
        if KV_FP8:
            k_cur = fp8_values(k_cur, q.dtype)
            v_cur = fp8_values(v_cur, q.dtype)
        if EXACT_FP32:
            s = tl.dot(q.to(tl.float32), tl.trans(k_cur.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k_cur))  # bf16/fp16 products are exact in the float32 accumulator
        if KEY_MASKS:
            if masked:
                s = key_mask_scores(s, key_mask_words, word_base, kpos, offset, in_page)
        m_i, l_i, acc = online_softmax_step(s, qk_scale, kpos, offset, in_page, v_cur, m_i, l_i, acc,
                                            EXACT_FP32, needs_mask, FAST_PV, low)
    if KV_FP8:  # the weights' sum of unscaled values times the head's value scale
        acc = acc * tl.load(V_SCALE + kvh)
    store_partials(acc, m_i, l_i, partial, head, valid, offs_dv, dv_ok, partial_direct, OUT, LSE, FINAL, FINAL_LSE,
                   stride_op, stride_oh, stride_lp, stride_fr, stride_fh, stride_flr, valid, SINKS)
    if STAMPS is not None:
        timeline.record(STAMPS, st0, sc0, st1, sc1)
    if MERGE > 8:
        merge_group_if_last(partial, head, valid, qrow, partial_direct, reduce_ptr, reduce_partials, COUNTERS,
                            stride_c, OUT, LSE, FINAL, FINAL_LSE, offs_dv, dv_ok, stride_op, stride_oh, stride_lp,
                            stride_fr, stride_fh, stride_flr, kvh, mb, MERGE, GROUP, MERGE_LANES, BLOCK_M, BLOCK_DV,
                            SINKS)
    elif MERGE > 0:
        merge_if_last(partial, head, valid, qrow, partial_direct, reduce_ptr, reduce_partials, COUNTERS, stride_c,
                      OUT, LSE, FINAL, FINAL_LSE, offs_dv, dv_ok, stride_op, stride_oh, stride_lp, stride_fr,
                      stride_fh, stride_flr, MERGE, SINKS)


@triton.jit
def _merge_kernel(
    PART_OUT, PART_LSE, OUT, OUT_LSE, reduce_ptr, reduce_partials,
    stride_pp, stride_ph, stride_lp, stride_or, stride_oh, stride_lr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_P: tl.constexpr, USE_PDL: tl.constexpr = False, STAMPS=None,
    SINKS=None,
):
    """One program per (query row, head, ``BLOCK_DV`` value columns): the exact merge of its
    partials, rounded once. Rows without partials get 0 and LSE -inf; rows with exactly one were
    written by stage 1. One pass over the partials, ``BLOCK_P`` at a time: each block's LSEs and
    outputs are loaded together (independent loads, no LSE-then-output chain) and folded into a
    running maximum, weight sum and weighted sum; with at most ``BLOCK_P`` partials (every decode
    plan) that is the contract's formula in one step. Column blocks keep wide values (latent
    attention: 512 columns) from leaving a batch-1 merge to a handful of programs that each stream
    every partial. The first block's partial ids (the host's plan) are read before the PDL wait
    for stage 1 (``USE_PDL``), and the next kernel may launch right after that wait. ``STAMPS``: as
    :func:`_stage1_kernel`'s (programs with nothing to merge write none). ``SINKS``: attention sinks,
    ``(Hq,)`` float32 natural-log logits per query head (None compiles them away): the running state
    starts as the head's sink (one more LSE term with a zero value, in lane 0), so a row's sink is
    folded in float32 before its rounding, and a row without partials gets 0 with LSE ``sink``."""
    if STAMPS is not None:
        st0 = timeline.global_ns()
        sc0 = timeline.sm_cycles()
    row = tl.program_id(0)
    head = tl.program_id(1)
    cb = tl.program_id(2)
    start = tl.load(reduce_ptr + row)
    end = tl.load(reduce_ptr + row + 1)
    # stage 1 already wrote a row's only partial, rounded once: nothing to do. Program (0, 0, 0)
    # still waits for stage 1 first (PDL): the next kernel waits only for this launch, so the
    # launch must not end before stage 1 has, even when no row needs merging (a graph's merge
    # replayed over a one-piece plan)
    nothing = end - start == 1
    if USE_PDL:
        nothing = nothing & (row + head + cb != 0)
    if nothing:
        return
    offs_p = tl.arange(0, BLOCK_P)
    # the partial ids one block ahead (loop-carried), the first block before the wait
    p_next = tl.load(reduce_partials + start + offs_p, mask=start + offs_p < end, other=0)
    if USE_PDL:  # the partials are complete once stage 1 is
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        if end - start == 1:  # program (0, 0, 0) with nothing to merge, after its wait
            return
    if STAMPS is not None:
        st1 = timeline.global_ns()
        sc1 = timeline.sm_cycles()
    offs = cb * BLOCK_DV + tl.arange(0, BLOCK_DV)
    col_ok = offs < DV
    m = tl.full([BLOCK_P], float("-inf"), tl.float32)  # running maximum (all lanes equal)
    total = tl.zeros([BLOCK_P], tl.float32)
    if SINKS is not None:  # the sink's state: max sink in every lane, its weight 1 in lane 0
        sink = tl.load(SINKS + head)
        m = tl.zeros([BLOCK_P], tl.float32) + sink
        total = tl.where((offs_p == 0) & (m != float("-inf")), 1.0, 0.0)
    acc = tl.zeros([BLOCK_P, BLOCK_DV], tl.float32)
    for i0 in range(start, end, BLOCK_P):
        ok = i0 + offs_p < end
        p = p_next
        p_next = tl.load(reduce_partials + i0 + BLOCK_P + offs_p, mask=i0 + BLOCK_P + offs_p < end, other=0)
        lse = tl.load(PART_LSE + p * stride_lp + head, mask=ok, other=float("-inf"))
        o = tl.load(PART_OUT + p[:, None] * stride_pp + head * stride_ph + offs[None, :],
                    mask=ok[:, None] & col_ok[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)  # rescales what earlier blocks summed; 0 while nothing was live
        live = lse != float("-inf")
        wgt = tl.where(live, tl.exp(lse - m_safe), 0.0)
        acc = acc * alpha[:, None] + wgt[:, None] * tl.where(live[:, None], o, 0.0)
        total = total * alpha + wgt
        m = m_new
    out = tl.sum(acc, 0)
    weight = tl.sum(total, 0)
    m_max = tl.max(m, 0)
    empty = weight == 0.0
    out = out / tl.where(empty, 1.0, weight)
    tl.store(OUT + row * stride_or + head * stride_oh + offs,
             out.to(OUT.dtype.element_ty, fp_downcast_rounding="rtne"), mask=col_ok)
    if cb == 0:
        tl.store(OUT_LSE + row * stride_lr + head,
                 tl.where(empty, float("-inf"), m_max + tl.log(tl.where(empty, 1.0, weight))))
    if STAMPS is not None:
        timeline.record(STAMPS, st0, sc0, st1, sc1)


@triton.jit
def _kv_write_kernel(SRC, DST, slots, stride_sn, stride_dn, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """Copy row ``i`` of SRC (``WIDTH`` contiguous elements) into flat slot ``slots[i]`` of DST."""
    i = tl.program_id(0)
    slot = tl.load(slots + i).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    row = tl.load(SRC + i * stride_sn + offs, mask=offs < WIDTH)
    tl.store(DST + slot * stride_dn + offs, row.to(DST.dtype.element_ty), mask=offs < WIDTH)


# The most query rows per work item of a tall (64-pair) decode program, launched with the
# tall_block_n / tall_maxnreg of LaunchConfig (the decode rows of forks sharing a prefix; prefill
# chunks hold more). The planner's attention.device.TALL_DECODE_MAX_ROWS is this.
TALL_DECODE_MAX_ROWS = 16

@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Stage-1 tile and launch parameters: KV rows per iteration, warps, pipeline stages."""

    block_n: int
    num_warps: int
    num_stages: int
    block_m: int = 64  # most (query row x head) pairs per program
    tall_warps: int = 4  # warps for programs of 64 or more pairs (8 measured slower for cascade)
    tall_block_n: int = 64  # KV rows per tile of tall decode programs (64 pairs from at most 16 query rows)
    tall_maxnreg: int | None = None  # register cap of tall decode programs
    maxnreg: int | None = None  # register cap per thread (more resident programs, maybe spills)
    value_split: int = 1  # latent programs per pair block, each with its share of the values (0: chosen per launch)
    value_split_max_partials: int | None = None  # the most partials of a plan whose latent programs halve the values
    # (query row x head) pairs of a prefill program (work items of over 16 rows): 256 over two warp
    # groups ran 1.2x 128 in both modes (H100, docs/benchmarks.md), though it spills a few registers
    prefill_block_m: int = 256
    prefill_warps: int = 8  # two warp groups: each holds half the pairs of the tile
    prefill_block_n: int = 64  # KV rows per tile of prefill programs
    wide_latent_block_m: int = 64  # latent pairs per fast-mode program of many heads (a warp-group MMA tile)
    wide_latent_warps: int = 8  # two warp groups: each holds half the 512 value columns


def tile_rows(launch: LaunchConfig) -> int:
    """KV rows per stage-1 tile (``BLOCK_N``): the launch's rows (a power of two) whatever the page
    size, so a page longer than the tile is walked a tile at a time. A 64-row page keeps the latent
    kernel's 32-row tile (a 64-row one spills registers); tiles grown to the page measured much
    slower (docs/performance-notes.md)."""
    return triton.next_power_of_2(launch.block_n)


def default_launch_config(*, head_dim: int) -> LaunchConfig:
    """The measured launch (``docs/benchmarks.md``, "Decode attention kernels against torch
    SDPA"): 64-row tiles (32 for head dims above 128), 4 warps, 3 pipeline stages (the next tile loads during this one), at most 64
    pairs per program. Tall decode programs (64 pairs from at most 16 query rows: forks sharing a
    prefix) take 32-row tiles under 168 registers, so three fit an SM where two 64-row ones would;
    prefill chunks keep 64-row tiles and no cap. Benchmarks pass their own :class:`LaunchConfig`."""
    return LaunchConfig(
        block_n=32 if head_dim > 128 else 64,  # a longer page spans tiles (tile_rows)
        num_warps=4,
        num_stages=3,
        block_m=64,
        tall_warps=4,
        tall_block_n=32,
        tall_maxnreg=168,
    )


def paged_attention(
    *, query, key_cache, value_cache, page_table, page_rows, page_key_start, work_pages, work_partial_start,
    partial_row, partial_offset, partial_direct, reduce_ptr, reduce_partials,
    num_partials, max_work_rows, scale, out_dtype, needs_merge=True, launch: LaunchConfig | None = None,
    poison=False, workspace=None, counters=None, merge_in_stage1=False,
    work_key_masks=None, key_mask_words=None, kv_scales=None, fast=False, partial_low=None, sinks=None,
):
    """Attention of a plan: stage-1 partials, then the exact merge, rounded once.

    query ``(R, Hq, Dk)``; key_cache ``(P, page_size, Hkv, Dk)``; value_cache
    ``(P, page_size, Hkv, Dv)`` (either may be a strided view, e.g. a head-major page layout);
    the int32 plan tensors: page_table/page_rows/page_key_start ``(total_pages,)`` (key_start:
    position of the page's first row within its piece), work_pages ``(2 W,)`` (each work item's
    ``[first, end)`` entries of the page arrays), work_partial_start ``(W + 1,)`` (padding items
    repeat the last start),
    partial_row/partial_offset/partial_direct ``(num_partials,)`` (direct: the output row when
    the partial is its row's only one, else -1), reduce_ptr ``(R + 1,)`` and reduce_partials
    (CSR rows -> partials). ``needs_merge=False`` (every row has exactly one partial) skips the
    merge launch. ``workspace``: a flat float32 buffer the partials may live in (attention_outputs).
    ``merge_in_stage1``: every work item holds one query row and no row has more than
    :data:`MERGE_IN_STAGE1_MAX_PARTIALS` partials (the caller's promise): stage 1 merges the rows
    itself, with ``counters``, int32 zeros of at least ``R * Hq`` entries that every launch leaves
    zero, and no merge kernel runs. ``work_key_masks`` ``(2 W,)`` and ``key_mask_words`` (int32,
    both or neither): tree verify windows' key masks (:func:`key_mask_options`). Returns ``(out
    (R, Hq, Dv) out_dtype, lse (R, Hq) float32)``; rows without partials are 0 with LSE -inf.
    ``kv_scales``: the caches are ``float8_e4m3fn`` with ``(k_scale, v_scale)`` ``(Hkv,)`` float32:
    the kernel reads their bytes and attends ``fp8 * scale`` (``_stage1_kernel``'s ``KV_FP8``).
    ``fast``: the contract's ``fast`` precision mode inside the pieces (P rounded to the K/V dtype
    before P.V); the merge and its single rounding are the same in both modes. ``partial_low``
    ``(num_partials,)`` int32 (sliding windows): each partial's first visible piece row.
    ``sinks``: attention sinks, ``(Hq,)`` float32 natural-log logits per query head (gpt-oss), or
    None: one more term ``exp(sinks[h])`` with a zero value in every row's softmax denominator,
    folded in float32 wherever a row is finished (stage 1's direct store or merge, or the merge
    kernel) before its one rounding; rows without partials are then 0 with LSE ``sinks[h]``. A
    per-call tensor, not part of the plan (fixed plan buffers and CUDA graphs are unchanged); None
    compiles the sink code away.
    """
    fp8 = {}
    if kv_scales is not None:
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
        fp8 = {"KV_FP8": True, "K_SCALE": kv_scales[0], "V_SCALE": kv_scales[1]}
    num_rows, num_heads, dk = query.shape
    page_size, num_kv = key_cache.shape[1], key_cache.shape[2]
    dv = value_cache.shape[3]
    group = num_heads // num_kv
    out, lse, part_out, part_lse = attention_outputs(query, dv, num_partials, out_dtype, poison, workspace)
    num_work = work_pages.numel() // 2
    merged = bool(num_work and num_partials and merge_in_stage1)
    if merged:
        if not (max_work_rows == 1 and MERGE_IN_STAGE1_MAX_PARTIALS
                and counters is not None and counters.numel() >= num_rows * num_heads):
            raise ValueError(f"merge in stage 1 needs work items of one row, at most "
                             f"{MERGE_IN_STAGE1_MAX_PARTIALS} partials per row and {num_rows * num_heads} counters")
    if num_work and num_partials:
        meta = stage1_launch(dtype=query.dtype, dk=dk, dv=dv, group=group, page_size=page_size,
                             max_work_rows=max_work_rows, element_size=key_cache.element_size(), launch=launch,
                             cache_needs_int64=wide_offsets(key_cache, value_cache), fast=fast)
        meta["MERGE"] = MERGE_IN_STAGE1_MAX_PARTIALS if merged else 0
        blocks = triton.cdiv(max_work_rows * group, meta["BLOCK_M"])
        grid = (num_kv, num_work, blocks)
        _stage1_kernel[grid](
            query, key_cache, value_cache, part_out, part_lse, out, lse,
            page_table, page_rows, page_key_start, work_pages, work_partial_start,
            partial_row, partial_offset, partial_direct, reduce_ptr, reduce_partials,
            counters if merged else reduce_ptr,
            query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            part_out.stride(0), part_out.stride(1), part_lse.stride(0), out.stride(0), out.stride(1),
            lse.stride(0), num_heads,
            scale, num_rows, **meta, **attention_pdl_options(query), **timeline_stamps("stage1"),
            **key_mask_options(work_key_masks, key_mask_words), **fp8,
            **({} if partial_low is None else {"KEY_LOWS": True, "partial_low": partial_low}),
            **({} if sinks is None else {"SINKS": sinks}),
        )
    if num_rows and not merged and (needs_merge or not (num_work and num_partials)):
        merge_into(out, lse, part_out, part_lse, reduce_ptr, reduce_partials, sinks)
    return out.to(out_dtype), lse


def prefill_programs(max_work_rows: int, dk: int, dv: int) -> bool:
    """Whether the GQA stage 1 of a plan whose work items hold up to ``max_work_rows`` query rows
    takes prefill programs (:func:`stage1_launch`): more than :data:`TALL_DECODE_MAX_ROWS` rows,
    values of at most 128 columns and keys of at most 256 (naive MLA's 192-wide keys with
    128-wide values). The planner's ``attention.device.prefill_programs`` is this."""
    return max_work_rows > TALL_DECODE_MAX_ROWS and dv <= 128 and dk <= 256


# Page offsets of the stage-1 programs: int32 wherever the cache allows, int64 only where its
# element offsets may pass int32 (wide_offsets): int32 offsets take a tile loop's sign extensions
# and 64-bit products away (docs/performance-notes.md).
def wide_offsets(*caches: torch.Tensor) -> bool:
    """Whether an element offset into any of ``caches`` (pages of K, V or latent rows, any strided
    view) may pass int32: the stage-1 kernels then need int64 page offsets (``WIDE_OFFSETS``)."""
    return any(sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()) if size) >= 2**31
               for t in caches)


def stage1_launch(*, dtype, dk: int, dv: int, group: int, page_size: int, max_work_rows: int, element_size: int,
                  launch: LaunchConfig | None = None, cache_needs_int64: bool = False, fast: bool = False) -> dict:
    """The stage-1 kernel's constexprs and launch options (``num_warps``, ``num_stages``, the
    register cap) for a plan of this shape: at most 64 (row x head) pairs per program (32 for
    heads wider than 128); prefill programs (:func:`prefill_programs`) take ``prefill_block_m``
    pairs with ``prefill_warps`` and ``prefill_block_n``-row tiles (half that for keys wider than
    128), and stop at their causal end (``CAUSAL_END``); tall (64-pair)
    programs with ``tall_warps``, and those of at most
    ``TALL_DECODE_MAX_ROWS`` query rows (decode rows of forks sharing a prefix) with
    ``tall_block_n`` rows per tile and ``tall_maxnreg`` registers (the planner's tall wave,
    ``DeviceSpec.tall_wave_size``, counts on them fitting 3 to an SM), and pipeline stages shrunk to what
    fits in shared memory. ``launch`` defaults to :func:`default_launch_config`;
    ``cache_needs_int64``: the caches need int64 element offsets (:func:`wide_offsets`), which the
    launch then takes. ``fast``: the contract's ``fast`` mode (``FAST_PV``), else ``exact``."""
    launch = launch or default_launch_config(head_dim=max(dk, dv))
    prefill = prefill_programs(max_work_rows, dk, dv)
    # float32 prefill programs keep decode's 64 pairs: 256 float32 query rows alone would take half
    # the shared memory, and float32 is the oracle's dtype, not a fast path
    prefill_pairs = launch.prefill_block_m if element_size < 4 else min(launch.prefill_block_m, launch.block_m)
    widest = prefill_pairs if prefill else 32 if max(dk, dv) > 128 else launch.block_m
    block_m = max(16, min(widest, triton.next_power_of_2(max_work_rows * group)))
    tall = block_m >= 64
    tall_decode = tall and max_work_rows <= TALL_DECODE_MAX_ROWS  # device.tall_decode_programs
    if prefill:  # keys wider than 128 (naive MLA's 192) halve the tile: the same registers and shared memory
        rows = launch.prefill_block_n if dk <= 128 else max(16, launch.prefill_block_n // 2)
        block_n = tile_rows(dataclasses.replace(launch, block_n=rows))
    else:
        block_n = tile_rows(dataclasses.replace(launch, block_n=launch.tall_block_n) if tall_decode else launch)
    warps = launch.prefill_warps if prefill and block_m > 64 else launch.tall_warps if tall else launch.num_warps
    return dict(
        GROUP=group, DK=dk, DV=dv, BLOCK_M=block_m, BLOCK_DK=max(16, triton.next_power_of_2(dk)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)), PAGE_SIZE=page_size, BLOCK_N=block_n,
        # IEEE float32 for float32 inputs, and in the interpreter (whose bf16 dots are unreliable)
        EXACT_FP32=dtype == torch.float32 or _INTERPRET,
        # the plan's reads before the PDL wait in decode programs of at most 16 pairs (tall ones,
        # cascade and prefill, were not measured with them)
        MERGE=0, PLAN_EARLY=block_m <= 16,
        MERGE_LANES=min(triton.next_power_of_2(group), block_m),
        WIDE_OFFSETS=cache_needs_int64,
        # full, wholly visible tiles skip the score mask where the tile's pages tell fullness; a
        # 64-row tile of 16-row pages takes its four page entries as scalars (attention_tiles)
        SKIP=full_tiles_known(page_size, block_n, four=True),
        FOUR=True,
        CAUSAL_END=prefill, FAST_PV=fast,
        num_warps=warps,
        num_stages=stages_that_fit(launch.num_stages, block_n * (dk + dv) * element_size),
        **maxnreg_option(dataclasses.replace(launch, maxnreg=launch.tall_maxnreg)
                         if tall_decode and launch.tall_maxnreg else launch),
    )


# Shared memory the pipelined K/V (latent) buffers may take: Hopper gives a program up to 227 KB,
# and the kernels keep some for the queries and layout conversions.
PIPELINE_SHARED_BYTES = 192 * 1024


def stages_that_fit(num_stages: int, tile_bytes: int) -> int:
    """At most ``num_stages``, fewer when the ``num_stages - 1`` buffers of one K/V (or latent)
    tile of ``tile_bytes`` would not fit in shared memory (float32 tiles of 64 rows x 256-wide
    heads: 128 KB each, so 2 stages, one buffer)."""
    return max(1, min(num_stages, 1 + PIPELINE_SHARED_BYTES // max(tile_bytes, 1)))


# Programmatic dependent launch for stage 1 and the merge (``kernels.pdl``): each is scheduled
# while the kernel before it finishes (at batch 1 a PDL GEMV that lets its successor in at once),
# reads only the host's plan before waiting for it, and lets its own successor in (the merge, the
# o GEMV, which loads its weights meanwhile) right after the wait (docs/performance-notes.md).
# On wherever the device supports it
# (kernels.pdl.pdl_supported); only the kernel benchmark turns it off (benchmarks.decode_attention
# --pdl 0: repeated calls in one timing graph would otherwise chain).
ATTENTION_PDL = True
# With PDL: the GQA stage 1 (decode programs of at most 16 pairs) and the merge read the host's plan
# (partial rows, pages, partial ids) before waiting for the kernel before them, so fewer dependent
# loads follow the wait (the latent stage 1 always does). The merge lets the next kernel (the o
# GEMV) launch right after its wait for stage 1, not at once: the GEMV's weight loads would compete
# with stage 1's K/V reads.


# Launch name ("stage1", "merge") -> an int64 tensor of timeline.FIELDS values per program: those
# launches of the GQA kernels write their programs' timelines there (scripts/stage1_timeline.py sets
# it around the calls it times); empty, as always elsewhere: none
TIMELINE_STAMPS: dict[str, torch.Tensor] = {}


def timeline_stamps(launch: str) -> dict:
    """The ``STAMPS`` argument of ``launch`` when :data:`TIMELINE_STAMPS` asks for a timeline."""
    stamps = TIMELINE_STAMPS.get(launch)
    return {} if stamps is None else {"STAMPS": stamps}


def key_mask_options(work_key_masks, key_mask_words) -> dict:
    """The stage-1 kernels' key-mask arguments (tree verify windows): none (``KEY_MASKS`` off,
    compiled away) unless both arrays are given. Their layout (``triton_backend.flatten_plan``):
    ``work_key_masks (2 W,)`` int32, per work item the index in ``key_mask_words`` of its first row's
    first word (-1: the item has no masks) and its words per row; ``key_mask_words`` int32, each
    masked row's bitmask over its piece's rows, 32 rows per word, lowest row in bit 0 of word 0."""
    if (work_key_masks is None) != (key_mask_words is None):
        raise ValueError("work_key_masks and key_mask_words go together")
    if work_key_masks is None:
        return {}
    return {"KEY_MASKS": True, "work_key_masks": work_key_masks, "key_mask_words": key_mask_words}


def attention_pdl_options(tensor: torch.Tensor) -> dict:
    """``launch_pdl`` and ``USE_PDL`` for an attention launch on ``tensor``'s device."""
    return pdl_options(tensor) if ATTENTION_PDL else {"USE_PDL": False}


def maxnreg_option(launch: LaunchConfig) -> dict:
    """The ``maxnreg`` launch option, only when set (older Triton builds lack it)."""
    return {} if launch.maxnreg is None else {"maxnreg": launch.maxnreg}


def attention_outputs(query, dv: int, num_partials: int, out_dtype, poison: bool, workspace=None):
    """Final ``out (R, H, dv)`` / ``lse (R, H)`` and float32 partial buffers ``(num_partials, H, dv)``
    / ``(num_partials, H)``; NaN-filled when ``poison`` (tests: what no kernel writes stays NaN).
    The partials are views of ``workspace`` (a flat float32 tensor) when it is large enough."""
    num_rows, num_heads = query.shape[0], query.shape[1]
    device = query.device
    # Triton's interpreter truncates float32 -> bf16/fp16 stores (even with "rtne"): there the
    # kernels write float32 and torch rounds once, to nearest even, as the GPU kernels do.
    kernel_dtype = torch.float32 if _INTERPRET else out_dtype
    out = torch.empty(num_rows, num_heads, dv, dtype=kernel_dtype, device=device)
    lse = torch.empty(num_rows, num_heads, dtype=torch.float32, device=device)
    need = num_partials * num_heads * (dv + 1)
    if workspace is not None and 0 < need <= workspace.numel():
        part_out = workspace[:num_partials * num_heads * dv].view(num_partials, num_heads, dv)
        part_lse = workspace[num_partials * num_heads * dv:need].view(num_partials, num_heads)
    else:
        part_out = torch.empty(num_partials, num_heads, dv, dtype=torch.float32, device=device)
        part_lse = torch.empty(num_partials, num_heads, dtype=torch.float32, device=device)
    if poison:
        for t in (out, lse, part_out, part_lse):
            t.fill_(float("nan"))
    return out, lse, part_out, part_lse


# Decode rows of at most this many partials (a power of 2) may be merged by stage 1's last
# program instead of a merge launch (the backend decides). Batch 16 splits rows in 2, batch 4 in 8,
# a history of 8 segments in 8 or more; batch 1 in 16-33, where a launch that reads all of a row's
# partials at once is faster (bounds of 4 and 64 measured slower: docs/performance-notes.md).
MERGE_IN_STAGE1_MAX_PARTIALS = 8

# Value columns per merge program: 64 for 128-wide GQA values; 32 for 512-wide latent values (16
# programs per row and head: a batch-1 latent merge reads 32-256 partials per row, latency the
# extra programs hide).
GQA_MERGE_BLOCK_DV, LATENT_MERGE_BLOCK_DV = 64, 32


def merge_block_dv(dv: int) -> int:
    """Value columns per merge program for ``dv``-wide values."""
    width = LATENT_MERGE_BLOCK_DV if dv >= 512 else GQA_MERGE_BLOCK_DV
    return min(max(16, triton.next_power_of_2(dv)), width)


def merge_into(out, lse, part_out, part_lse, reduce_ptr, reduce_partials, sinks=None) -> None:
    """Launch the merge: every row of ``out``/``lse`` from its partials (CSR ``reduce_ptr``);
    ``sinks`` ``(Hq,)`` float32 or None: attention sinks, one more LSE term per row (``_merge_kernel``)."""
    num_rows, num_heads, dv = out.shape
    block_dv = merge_block_dv(dv)
    _merge_kernel[(num_rows, num_heads, triton.cdiv(dv, block_dv))](
        part_out, part_lse, out, lse, reduce_ptr, reduce_partials,
        part_out.stride(0), part_out.stride(1), part_lse.stride(0),
        out.stride(0), out.stride(1), lse.stride(0),
        # 64 partials per step: a GQA decode row's partials (33 on a 132-SM GPU) in one step, a
        # 256-way latent split in four
        DV=dv, BLOCK_DV=block_dv, BLOCK_P=16 if block_dv > 256 else 64, **attention_pdl_options(out),
        **timeline_stamps("merge"), **({} if sinks is None else {"SINKS": sinks}),
    )


def write_rows(*, rows, cache, slots):
    """Write ``rows (n, ...)`` into flat ``slots (n,)`` int64 of ``cache (P, page_size, ...)``."""
    n = rows.shape[0]
    if n == 0:
        return
    src = rows.reshape(n, -1)
    width = src.shape[1]
    dst = cache.view(cache.shape[0] * cache.shape[1], -1)
    if not src.is_contiguous() or dst.stride(1) != 1:
        raise ValueError("write_rows needs contiguous rows and cache")
    _kv_write_kernel[(n,)](src, dst, slots, src.stride(0), dst.stride(0), WIDTH=width,
                           BLOCK=triton.next_power_of_2(width))
