"""Triton stage 1 for absorbed multi-head latent attention (MLA) over pieces of a latent cache.

Every cached row is ``[c_kv (rank), k_rope (rope)]``; the key is the whole row and the value
its first ``rank`` columns, so one read of a latent tile serves both products and all the
query heads of the program. Programs of the same work item are adjacent in launch order
(head blocks vary fastest), so the head blocks of one piece share its rows through L2 and
the piece is read from memory once. Partials, LSEs, the direct write of single-partial rows
and the merge follow ``paged_attention`` exactly (float32 throughout, rounded once).
"""

from __future__ import annotations

import dataclasses

import torch
from segkv.kernels.triton_import import tl, triton

from segkv.kernels.attention.attention_tiles import (
    fp8_values,
    key_mask_scores,
    next_tile_first,
    online_softmax_step,
    plan_reads,
    store_partials,
    tile_pages,
    tile_range,
    tile_rows_in_page,
    work_key_masks_of,
)
from segkv.kernels.attention.paged_attention import (
    _INTERPRET,
    LaunchConfig,
    attention_outputs,
    attention_pdl_options,
    key_mask_options,
    maxnreg_option,
    merge_into,
    stages_that_fit,
    tile_rows,
    wide_offsets,
)
from segkv.kernels.pdl import multiprocessors


@triton.jit
def _latent_scores(q, c, EXACT_FP32: tl.constexpr):
    """``q (BLOCK_M, W) . c (BLOCK_N, W)^T`` in float32 (bf16/fp16 products are exact in the
    float32 accumulators)."""
    if EXACT_FP32:
        return tl.dot(q.to(tl.float32), tl.trans(c.to(tl.float32)), input_precision="ieee")
    return tl.dot(q, tl.trans(c))


@triton.jit
def _add_scores(x, y):
    """``x + y`` for float32 score pieces, as ``fma(x, 1, y)``: the same float32 sum (``x * 1`` is
    exact, so it rounds once as the add does), which Triton's combine pass does not fold into a
    product's accumulator: products summed this way stay independent MMA chains instead of one
    chain through every column of the scores. With 16 pairs a program's scores are one 16-row MMA
    tile per warp; folded, the halves at 512 + 64 columns were a chain of 36 dependent mma.sync
    (k=16), whose latency a batch-1 plan's two warps per scheduler cannot hide; apart, the longest
    is the own share's 16."""
    return tl.fma(x, 1.0, y)


@triton.jit
def _latent_cols(tile, offs, in_page, RANK: tl.constexpr, KV_FP8: tl.constexpr, dtype: tl.constexpr):
    """Columns ``offs`` of a latent tile's valid rows (0 elsewhere); ``KV_FP8``: e4m3 bytes decoded
    to their unscaled values in ``dtype``."""
    cols = tl.load(tile + offs[None, :], mask=in_page[:, None] & (offs < RANK)[None, :], other=0.0)
    if KV_FP8:
        cols = fp8_values(cols, dtype)
    return cols


@triton.jit
def _latent_pairs(Q, LAT, OUT, LSE, FINAL, FINAL_LSE, page_table, page_rows, page_key_start, partial_direct,
                  stride_qr, stride_qh, stride_lp, stride_ln, stride_op, stride_oh, stride_lsp, stride_fr,
                  stride_fh, stride_flr, scale, valid, head, partial, qrow, offset, pg0, pg1, page_next,
                  rows_next, start_next, vb, key_mask_words, masked, word_base,
                  RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_ROPE: tl.constexpr,
                  BLOCK_M: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  EXACT_FP32: tl.constexpr, PARTS: tl.constexpr, WIDE: tl.constexpr,
                  KEY_MASKS: tl.constexpr, KV_FP8: tl.constexpr, KV_SCALE, FAST_PV: tl.constexpr = False):
    """A program's scan of its work item's latent rows and the store of its pairs' partials: the
    values' ``BLOCK_V`` columns from ``vb * BLOCK_V``, one of ``PARTS`` (1, 2 or 4) shares (with
    more than one the scores also take the other shares' columns, after its own, and only program
    ``vb == 0`` stores the LSE). The scores' pieces (the own share's columns, the RoPE columns,
    each other share's) are separate MMA chains, added (:func:`_add_scores`). ``KEY_MASKS``: a
    ``masked`` work item's scores keep only the keys its rows' mask bits set (words from
    ``word_base (M,)``, :func:`attention_tiles.key_mask_scores`). ``KV_FP8``: the latent rows are
    an FP8 cache's e4m3 bytes with one float32 scale at ``KV_SCALE``: tiles are decoded exactly to the
    query's dtype, the scale multiplies the softmax scale (keys) and the float32 accumulator
    (values). ``FAST_PV``: the contract's ``fast`` mode (:func:`attention_tiles.online_softmax_step`)."""
    PAGES: tl.constexpr = max(BLOCK_N // PAGE_SIZE, 1)  # whole pages a tile covers (1: a page spans tiles)
    SUB: tl.constexpr = (PAGE_SIZE + BLOCK_N - 1) // BLOCK_N  # tiles per page (1: a tile holds whole pages)
    offs_n = tl.arange(0, BLOCK_N)
    slot = offs_n // PAGE_SIZE
    row_in_page = tile_rows_in_page(offs_n, PAGE_SIZE, PAGES, BLOCK_N)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)  # this program's value columns
    offs_e = tl.arange(0, BLOCK_ROPE)
    v_ok = offs_v < RANK
    e_ok = offs_e < ROPE
    q_base = Q + qrow[:, None] * stride_qr + head[:, None] * stride_qh
    q_lat = tl.load(q_base + offs_v[None, :], mask=valid[:, None] & v_ok[None, :], other=0.0)
    q_rope = tl.load(q_base + RANK + offs_e[None, :], mask=valid[:, None] & e_ok[None, :], other=0.0)
    if PARTS > 1:  # the other shares' columns, for the scores
        offs_1 = ((vb + 1) % PARTS) * BLOCK_V + tl.arange(0, BLOCK_V)
        q_1 = tl.load(q_base + offs_1[None, :], mask=valid[:, None] & (offs_1 < RANK)[None, :], other=0.0)
    if PARTS == 4:
        offs_2 = ((vb + 2) % PARTS) * BLOCK_V + tl.arange(0, BLOCK_V)
        offs_3 = ((vb + 3) % PARTS) * BLOCK_V + tl.arange(0, BLOCK_V)
        q_2 = tl.load(q_base + offs_2[None, :], mask=valid[:, None] & (offs_2 < RANK)[None, :], other=0.0)
        q_3 = tl.load(q_base + offs_3[None, :], mask=valid[:, None] & (offs_3 < RANK)[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    qk_scale = scale
    if KV_FP8:
        qk_scale = scale * tl.load(KV_SCALE)
    row_base = LAT + (row_in_page * stride_ln)[:, None]
    t0, t1 = tile_range(pg0, pg1, SUB)
    for t in range(t0, t1, PAGES):
        page, rows, key_start = page_next, rows_next, start_next
        page_next, rows_next, start_next, _ = tile_pages(page_table, page_rows, page_key_start,
                                                         next_tile_first(t, PAGES, SUB), slot, pg1, WIDE, PAGES,
                                                         BLOCK_N, PAGE_SIZE)
        if SUB > 1:  # this tile's rows of a longer page
            sub_rows = (t % SUB) * BLOCK_N
            row_cur = row_in_page + sub_rows
            in_page = row_cur < rows
            tile = row_base + (page * stride_lp + sub_rows * stride_ln)[:, None]
        else:
            row_cur = row_in_page
            in_page = row_cur < rows
            tile = row_base + (page * stride_lp)[:, None]
        c = tl.load(tile + offs_v[None, :], mask=in_page[:, None] & v_ok[None, :], other=0.0)
        k_rope = tl.load(tile + RANK + offs_e[None, :], mask=in_page[:, None] & e_ok[None, :], other=0.0)
        if KV_FP8:
            c = fp8_values(c, q_lat.dtype)
            k_rope = fp8_values(k_rope, q_lat.dtype)
        s = _add_scores(_latent_scores(q_lat, c, EXACT_FP32), _latent_scores(q_rope, k_rope, EXACT_FP32))
        if PARTS > 1:
            s = _add_scores(s, _latent_scores(q_1, _latent_cols(tile, offs_1, in_page, RANK, KV_FP8, q_lat.dtype), EXACT_FP32))
        if PARTS == 4:
            s = _add_scores(s, _latent_scores(q_2, _latent_cols(tile, offs_2, in_page, RANK, KV_FP8, q_lat.dtype), EXACT_FP32))
            s = _add_scores(s, _latent_scores(q_3, _latent_cols(tile, offs_3, in_page, RANK, KV_FP8, q_lat.dtype), EXACT_FP32))
        kpos = key_start + row_cur
        if KEY_MASKS:
            if masked:
                s = key_mask_scores(s, key_mask_words, word_base, kpos, offset, in_page)
        m_i, l_i, acc = online_softmax_step(s, qk_scale, kpos, offset, in_page, c, m_i, l_i, acc, EXACT_FP32,
                                            True, FAST_PV)
    if KV_FP8:  # the weights' sum of unscaled values times the scale
        acc = acc * tl.load(KV_SCALE)
    # shares: the first program stores the LSE (the others' float32 scores summed their own share
    # first, so they may differ in the last bit); a vector mask, as the interpreter refuses a
    # vector & scalar one
    store_partials(acc, m_i, l_i, partial, head, valid, offs_v, v_ok, partial_direct, OUT, LSE, FINAL, FINAL_LSE,
                   stride_op, stride_oh, stride_lsp, stride_fr, stride_fh, stride_flr, valid & (head * 0 + vb == 0))


@triton.jit
def _mla_stage1_kernel(
    Q, LAT, OUT, LSE, FINAL, FINAL_LSE,
    page_table, page_rows, page_key_start, work_pages, work_partial_start, partial_row,
    partial_offset, partial_direct,
    stride_qr, stride_qh, stride_lp, stride_ln,
    stride_op, stride_oh, stride_lsp, stride_fr, stride_fh, stride_flr,
    scale, num_heads, num_work, split_max_partials,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_ROPE: tl.constexpr,
    BLOCK_M: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, EXACT_FP32: tl.constexpr,
    USE_PDL: tl.constexpr = False, VALUE_SPLIT: tl.constexpr = 1, ADAPTIVE: tl.constexpr = False,
    WIDE_OFFSETS: tl.constexpr = True,
    KEY_MASKS: tl.constexpr = False, work_key_masks=None, key_mask_words=None,
    KV_FP8: tl.constexpr = False, KV_SCALE=None, FAST_PV: tl.constexpr = False,
):
    """One program: ``BLOCK_M`` (query row, head) pairs of one work item, scanning its piece
    ``BLOCK_N`` latent rows at a time with an online softmax in float32 (:func:`_latent_pairs`).
    ``USE_PDL``: as the GQA stage 1 (``paged_attention.attention_pdl_options``). ``VALUE_SPLIT``: programs
    per pair block, each computing the whole scores and the output of its share of the values.
    ``ADAPTIVE`` (``VALUE_SPLIT`` 2): the shares follow the plan's partial count (read from the
    plan, so a graph's fixed grid follows each step's plan): 2 programs take a half each when the
    plan has at most ``split_max_partials`` partials, else the first takes all the values; programs
    without a share exit before the wait. Otherwise (forced, for tuning) the ``VALUE_SPLIT`` shares
    whatever the plan. A pair block's shares are neighbours in the grid's first dimension.
    ``KEY_MASKS``: as the GQA stage 1's (tree verify windows' masked work items); False compiles
    it away. ``KV_FP8``: an FP8 latent cache (uint8 view) with its float32 scale at ``KV_SCALE``
    (:func:`_latent_pairs`). ``FAST_PV``: the contract's ``fast`` mode, else ``exact``."""
    mb = tl.program_id(0) // VALUE_SPLIT
    vb = tl.program_id(0) % VALUE_SPLIT
    w = tl.program_id(1)
    p0 = tl.load(work_partial_start + w)
    n_rows = tl.load(work_partial_start + w + 1) - p0
    if mb * BLOCK_M >= n_rows * num_heads:  # also padding work items of fixed-size plan buffers
        return
    # the plan is the host's (written before the graph or launch): read it before the wait
    shares = VALUE_SPLIT
    if ADAPTIVE:
        partials = tl.load(work_partial_start + num_work)
        shares = tl.where(partials <= split_max_partials, 2, 1)
        if vb >= shares:  # nothing to do: leave before the wait, freeing the slot
            return
    valid, head, partial, qrow, offset, pg0, pg1, page_next, rows_next, start_next, _ = plan_reads(
        p0, n_rows, mb, w, 0, num_heads, partial_row, partial_offset, work_pages, page_table, page_rows,
        page_key_start, BLOCK_M, BLOCK_N, PAGE_SIZE, WIDE_OFFSETS)
    masked = False
    word_base = partial
    if KEY_MASKS:
        masked, word_base = work_key_masks_of(work_key_masks, w, partial, p0)
    if USE_PDL:  # queries, latent rows and outputs wait for the kernel before
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # which share this program computes: compile-time constants unless ADAPTIVE (annotated, or
    # Triton makes them runtime values and compiles every branch, including shares narrower than
    # a product's 16 columns)
    quarters: tl.constexpr = False
    halves: tl.constexpr = False
    if VALUE_SPLIT == 4:
        quarters = shares == 4
    if VALUE_SPLIT >= 2:
        halves = shares == 2
    if quarters:
        _latent_pairs(Q, LAT, OUT, LSE, FINAL, FINAL_LSE, page_table, page_rows, page_key_start, partial_direct,
                      stride_qr, stride_qh, stride_lp, stride_ln, stride_op, stride_oh, stride_lsp, stride_fr,
                      stride_fh, stride_flr, scale, valid, head, partial, qrow, offset, pg0, pg1,
                      page_next, rows_next, start_next, vb, key_mask_words, masked, word_base, RANK, ROPE,
                      BLOCK_R // 4, BLOCK_ROPE, BLOCK_M, PAGE_SIZE, BLOCK_N, EXACT_FP32, 4, WIDE_OFFSETS,
                      KEY_MASKS, KV_FP8, KV_SCALE, FAST_PV)
    elif halves:
        _latent_pairs(Q, LAT, OUT, LSE, FINAL, FINAL_LSE, page_table, page_rows, page_key_start, partial_direct,
                      stride_qr, stride_qh, stride_lp, stride_ln, stride_op, stride_oh, stride_lsp, stride_fr,
                      stride_fh, stride_flr, scale, valid, head, partial, qrow, offset, pg0, pg1,
                      page_next, rows_next, start_next, vb, key_mask_words, masked, word_base, RANK, ROPE,
                      BLOCK_R // 2, BLOCK_ROPE, BLOCK_M, PAGE_SIZE, BLOCK_N, EXACT_FP32, 2, WIDE_OFFSETS,
                      KEY_MASKS, KV_FP8, KV_SCALE, FAST_PV)
    else:  # one program, all the values
        _latent_pairs(Q, LAT, OUT, LSE, FINAL, FINAL_LSE, page_table, page_rows, page_key_start, partial_direct,
                      stride_qr, stride_qh, stride_lp, stride_ln, stride_op, stride_oh, stride_lsp, stride_fr,
                      stride_fh, stride_flr, scale, valid, head, partial, qrow, offset, pg0, pg1,
                      page_next, rows_next, start_next, 0, key_mask_words, masked, word_base, RANK, ROPE,
                      BLOCK_R, BLOCK_ROPE, BLOCK_M, PAGE_SIZE, BLOCK_N, EXACT_FP32, 1, WIDE_OFFSETS,
                      KEY_MASKS, KV_FP8, KV_SCALE, FAST_PV)


MLA_BLOCK_M = 16  # (row, head) pairs per program: a 16 x rank float32 accumulator fits in registers
# Latent programs per pair block of the automatic value split (halves; quarters and shares as a
# third grid dimension measured slower: docs/performance-notes.md).
AUTO_VALUE_SPLIT = 2


def default_mla_launch_config() -> LaunchConfig:
    """The measured launch (``docs/benchmarks.md``, "Latent (MLA) decode attention"): 32-row tiles (a
    32 x 576 latent tile per pipeline stage, 36 KB in bf16), 16 pairs, 4 warps, 3 stages (the next
    tile loads during this one's products), no register cap; the value split chosen per launch
    (:func:`mla_stage1_launch`) up to :data:`AUTO_VALUE_SPLIT` programs. Benchmarks pass their own
    :class:`LaunchConfig` (``value_split`` 1, 2 or 4 forces the split)."""
    return LaunchConfig(block_n=32, num_warps=4, num_stages=3, block_m=MLA_BLOCK_M, maxnreg=None,
                        value_split=0, value_split_max_partials=None)


# A plan of at most this many partials halves its values when the device is not a GPU (the
# interpreter): a 132-SM GPU's multiprocessors
INTERPRETER_SPLIT_MAX_PARTIALS = 132


def value_split_max_partials(launch: LaunchConfig, device: torch.device) -> int:
    """The most partials a plan may have for a value-split launch to halve its values: the
    launch's setting, else the device's multiprocessor count (one program per SM unsplit; at
    batch 1 the partials are the partitions)."""
    if launch.value_split_max_partials is not None:
        return launch.value_split_max_partials
    if device.type == "cuda":
        return multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    return INTERPRETER_SPLIT_MAX_PARTIALS


def mla_stage1_launch(*, dtype, rank: int, rope: int, num_heads: int, page_size: int, max_work_rows: int,
                      element_size: int, num_rows: int | None = None, launch: LaunchConfig | None = None,
                      cache_needs_int64: bool = False, fast: bool = False) -> dict:
    """The latent stage-1 kernel's constexprs and launch options for a plan of this shape (pipeline
    stages shrunk to what fits in shared memory); ``launch`` defaults to :func:`default_mla_launch_config`.
    ``launch.value_split`` 0 launches two programs per pair block when the batch's ``num_rows``
    query rows x heads fit one program (batch-1 decode of up to 16 heads); they halve the values
    when the plan has at most :func:`value_split_max_partials` partials (the kernel reads the
    count from the plan), so the plan's few programs do not leave most of each SM idle
    (docs/performance-notes.md: more partials, batches or heads made the halves slower).
    Forced 2 follows the plan as the automatic split
    does; forced 4 takes quarters whatever the plan (tuning). A split never leaves a share fewer
    than 16 value columns (the products' minimum), so ranks under 64 split less or not at all.
    ``cache_needs_int64``: the latent cache needs int64 element offsets (``paged_attention.wide_offsets``).
    ``fast`` (the contract's ``fast`` mode): work items of at least ``wide_latent_block_m`` pairs
    (many heads: compute-bound) take programs of that many pairs over ``wide_latent_warps`` warps,
    warp-group MMA tiles whose one P.V product fits the registers (exact's two spill), no value
    split."""
    launch = launch or default_mla_launch_config()
    if launch.value_split not in (0, 1, 2, 4):
        raise ValueError(f"the latent value split must be 0 (chosen per launch), 1, 2 or 4 programs, "
                         f"got {launch.value_split}")
    block_n = tile_rows(launch)
    wide = fast and max_work_rows * num_heads >= launch.wide_latent_block_m
    if wide:
        launch = dataclasses.replace(launch, block_m=launch.wide_latent_block_m, num_warps=launch.wide_latent_warps,
                                     value_split=1)
    block_m = max(16, min(launch.block_m, triton.next_power_of_2(max_work_rows * num_heads)))
    one_program = num_rows is not None and num_rows * num_heads <= block_m
    block_r = max(16, triton.next_power_of_2(rank))
    # each share's products need at least 16 value columns (small test models: rank 16 or 32)
    value_split = min(launch.value_split or (AUTO_VALUE_SPLIT if one_program else 1), block_r // 16)
    return dict(
        RANK=rank, ROPE=rope, BLOCK_R=block_r,
        BLOCK_ROPE=max(16, triton.next_power_of_2(rope)), BLOCK_M=block_m,
        PAGE_SIZE=page_size, BLOCK_N=block_n, EXACT_FP32=dtype == torch.float32 or _INTERPRET,
        num_warps=launch.num_warps, VALUE_SPLIT=value_split,
        # forced 2 and the automatic split follow the plan; forced 4 quarters whatever the plan
        ADAPTIVE=value_split > 1 and (launch.value_split == 2 or launch.value_split == 0),
        WIDE_OFFSETS=cache_needs_int64,
        **maxnreg_option(launch),
        num_stages=stages_that_fit(launch.num_stages, block_n * (rank + rope) * element_size),
    )


def mla_paged_attention(
    *, query, latent_cache, rank, page_table, page_rows, page_key_start, work_pages, work_partial_start,
    partial_row, partial_offset, partial_direct, reduce_ptr, reduce_partials,
    num_partials, max_work_rows, scale, out_dtype, needs_merge=True, launch: LaunchConfig | None = None,
    poison=False, workspace=None, work_key_masks=None, key_mask_words=None, kv_scale=None, fast=False,
):
    """Absorbed MLA over a plan: query ``(R, H, rank + rope)``, latent_cache ``(P, page_size,
    rank + rope)`` (or any view with unit column stride); the plan tensors and ``workspace`` as in
    ``paged_attention``; ``work_key_masks``/``key_mask_words``: tree verify windows' key masks
    (``paged_attention.key_mask_options``). ``kv_scale``: the cache is ``float8_e4m3fn`` with this
    ``(1,)`` float32 scale (keys and values): the kernel reads its bytes and attends ``fp8 * scale``.
    ``fast``: the contract's ``fast`` precision mode inside the pieces. Returns ``(out (R, H, rank) out_dtype, lse (R, H) float32)``.
    """
    fp8 = {}
    if kv_scale is not None:
        latent_cache = latent_cache.view(torch.uint8)
        fp8 = {"KV_FP8": True, "KV_SCALE": kv_scale}
    num_rows, num_heads, width = query.shape
    page_size = latent_cache.shape[1]
    rope = width - rank
    if latent_cache.shape[-1] != width or rope < 1 or latent_cache.stride(-1) != 1:
        raise ValueError(f"latent cache {tuple(latent_cache.shape)} does not match query width {width} "
                         f"with rank {rank}")
    out, lse, part_out, part_lse = attention_outputs(query, rank, num_partials, out_dtype, poison, workspace)
    num_work = work_pages.numel() // 2
    if num_work and num_partials:
        launch = launch or default_mla_launch_config()
        meta = mla_stage1_launch(dtype=query.dtype, rank=rank, rope=rope, num_heads=num_heads, page_size=page_size,
                                 max_work_rows=max_work_rows, element_size=latent_cache.element_size(),
                                 num_rows=num_rows, launch=launch,
                                 cache_needs_int64=wide_offsets(latent_cache), fast=fast)
        blocks = triton.cdiv(max_work_rows * num_heads, meta["BLOCK_M"])
        grid = (blocks * meta["VALUE_SPLIT"], num_work)
        _mla_stage1_kernel[grid](
            query, latent_cache, part_out, part_lse, out, lse,
            page_table, page_rows, page_key_start, work_pages, work_partial_start,
            partial_row, partial_offset, partial_direct,
            query.stride(0), query.stride(1), latent_cache.stride(0), latent_cache.stride(1),
            part_out.stride(0), part_out.stride(1), part_lse.stride(0), out.stride(0), out.stride(1),
            lse.stride(0),
            scale, num_heads, num_work, value_split_max_partials(launch, query.device), **meta,
            **attention_pdl_options(query), **key_mask_options(work_key_masks, key_mask_words), **fp8,
            FAST_PV=fast,
        )
    if num_rows and (needs_merge or not (num_work and num_partials)):
        merge_into(out, lse, part_out, part_lse, reduce_ptr, reduce_partials)
    return out.to(out_dtype), lse
