"""Probe: the cascade's tall prefix programs written in Gluon, with each tile's P.V products in flight
while the next tile's scores and softmax run (GPU machine; ``--compile-only`` anywhere with Triton 3.6).

The Triton stage-1 kernel runs each tile as one chain per warpgroup: scores, wait, softmax, P.V
products, wait (Triton 3.6 issues every warpgroup MMA synchronously on sm_90a). Gluon
(``triton.experimental.gluon``) issues them asynchronously and waits with a count, so here the
loop issues tile t+1's scores and tile t's P.V products together, waits for the scores only (2
groups still outstanding), runs the softmax, and only then waits for the products
(``OVERLAP`` 1, or 2 naming the softmax's weights in that wait so they come before it; 3: the
weights keep a row's reference max until a tile passes it by 2^8, so the products are waited for
only when a row's reference moves, and otherwise run on into the next tile's; 0: the same kernel waits after each
product, as Triton does).

The probe: 16 forks of one 32K prefix (the Llama-3-8B shape: 32 query heads, 8 KV heads,
head_dim 128, pages of 16), each with one decode row at the prefix's end. The Gluon programs
(one per KV head and partition, 64 (row, head) pairs, 32- or 64-row tiles in cp.async buffers)
write float32 partials that the engine's merge kernel combines; segkv's Triton path runs the
planner's cascade plan of the same batch. Both are checked against float32 attention in torch and
timed in CUDA graphs (median, min and max of shuffled trials).

Where the programs' time goes, as timing variants of the same kernel: their math with the reads cut
after three tiles (``MATH_ONLY``), their reads alone (:func:`stream_prefix_kernel`, also with the
batch-1 decode's grid beside the engine's batch-1 call), P in one bf16 part (``SINGLE_P``, outside
the numerical contract), no exponentials (``NO_EXP``, wrong results), page indices carried a tile
ahead (``CARRY``), more buffers (``NBUF``), rows asked into L2 tiles ahead (``PREFETCH``), a
head-major copy of the pages, and a warp-specialised kernel (:func:`ws_prefix_kernel`: one
producer warp issues the copies into a ring of buffers handed over by mbarriers), and two independent
softmax chains a warp (:func:`dual_prefix_kernel`, even and odd tiles), and two or three consumer
warpgroups beside one producer warp in one program, issuing their products in turn or not
(:func:`pingpong_prefix_kernel`). ``--clocks`` samples the SM
clock and board power (nvidia-smi) while chosen variants replay; ``--once`` launches chosen variants
twice each and times nothing, for Nsight Compute (``scripts/ncu_prefix.sh``).

Usage: ``python3 scripts/gluon_tall_probe.py [--compile-only] [--trials 7]
[--groups tiles,math,ahead,residency,dual,layout,pingpong] [--skip-offline]
[--clocks a,b] [--once a,b]``
(Triton 3.6's Gluon API:
Triton 3.9 renamed ``async_copy_global_to_shared`` to ``async_load``). Results: docs/benchmarks.md,
"The tall programs in Gluon, a probe", "The cascade's prefix programs taken apart", "The prefix
programs' counters, two softmax chains, and the acceptance grid on an H100" and "Consumer warpgroups in
one program, taking turns or not".
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma, warpgroup_mma_init,
                                                              warpgroup_mma_wait)

LN2 = gl.constexpr(0.6931471805599453)
TAU = gl.constexpr(8.0)  # how far (base 2) a row's max may pass its reference before the rescale (OVERLAP 3)
LOG2E = 1.4426950408889634


@gluon.jit
def _exp2(x):
    """``2 ** x``, results below 2^-126 flushed to 0 (as the Triton kernels' ``exp2_ftz``)."""
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _tile_offsets(t, n_tiles, page_table, pg0, pg1, kvh, stride_kp, stride_kn, stride_kh, krows, PAGE: gl.constexpr,
                  PAGES_PER_TILE: gl.constexpr, MATH_ONLY: gl.constexpr = False):
    """Tile ``t``'s K/V row offsets ``(BLOCK_N,)`` through the page table, and which rows exist
    (none past the partition or the last tile; with ``MATH_ONLY`` none after the first three
    tiles, so later copies issue the same instructions masked off: zero fill, no DRAM traffic)."""
    entry = pg0 + t * PAGES_PER_TILE + krows // PAGE
    ok = (entry < pg1) & (t < n_tiles)
    if MATH_ONLY:
        ok = ok & (t < 3)
    page = gl.load(page_table + entry, mask=ok, other=0)
    return page * stride_kp + (krows % PAGE) * stride_kn + kvh * stride_kh, ok


@gluon.jit
def _copy_tile(k_smem, v_smem, buf, offset, ok, K, V, cols):
    """cp.async of the K and V rows at ``offset`` into buffer ``buf`` (zeros where not ``ok``), one commit group."""
    mask = ok[:, None] & (cols >= 0)[None, :]  # broadcast to the tile
    async_copy.async_copy_global_to_shared(k_smem.index(buf), K + offset[:, None] + cols[None, :], mask=mask)
    async_copy.async_copy_global_to_shared(v_smem.index(buf), V + offset[:, None] + cols[None, :], mask=mask)
    async_copy.commit_group()


@gluon.jit
def _issue_tile(k_smem, v_smem, buf, t, n_tiles, K, V, page_table, pg0, pg1, kvh, stride_kp, stride_kn, stride_kh,
                krows, cols, PAGE: gl.constexpr, PAGES_PER_TILE: gl.constexpr, MATH_ONLY: gl.constexpr = False):
    """Tile ``t``'s page indices, then its copy into buffer ``buf``: the copy waits for those loads."""
    offset, ok = _tile_offsets(t, n_tiles, page_table, pg0, pg1, kvh, stride_kp, stride_kn, stride_kh, krows, PAGE,
                               PAGES_PER_TILE, MATH_ONLY)
    _copy_tile(k_smem, v_smem, buf, offset, ok, K, V, cols)


@gluon.jit
def _l2_rows(K, V, page_table, pg0, pg1, tile, kvh, stride_kp, stride_kn, stride_kh, PAGE: gl.constexpr,
             PAGES_PER_TILE: gl.constexpr):
    """Tile ``tile``'s K and V rows of this KV head, one 256-byte row a thread: the pointers
    ``(PAGES_PER_TILE * PAGE * 2,)`` and which exist (the page index loads are the only wait)."""
    N: gl.constexpr = PAGES_PER_TILE * PAGE * 2
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    i = gl.arange(0, N, layout=lay)
    entry = pg0 + tile * PAGES_PER_TILE + i // (2 * PAGE)
    live = entry < pg1
    page = gl.load(page_table + entry, mask=live, other=0)
    off = page * stride_kp + ((i // 2) % PAGE) * stride_kn + kvh * stride_kh
    return gl.where(i % 2 == 0, K + off, V + off), live


@gluon.jit
def _l2_prefetch(ptrs, live):
    """Asks L2 for 256 bytes at each live pointer (``cp.async.bulk.prefetch.L2``; nothing waits on it)."""
    gl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], 256; "
                              "mov.u32 $0, 0; }", "=r,l,r", [ptrs, live.to(gl.int32)], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _softmax(s, m_i, l_i, t, pg0, pg1, scale2, BLOCK_N: gl.constexpr, PAGE: gl.constexpr,
             PAGES_PER_TILE: gl.constexpr, s_layout: gl.constexpr, NO_EXP: gl.constexpr = False):
    """Tile ``t``'s scores ``(BLOCK_M, BLOCK_N)`` masked to the partition's keys, folded into the
    running max (base-2 units) and sum: the weights, the rescale factor, the new max and sum.
    ``NO_EXP`` (a timing probe, wrong results): the exponent itself as the weight, no ``ex2``."""
    scol = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    live = (pg0 + t * PAGES_PER_TILE + scol // PAGE) < pg1
    s = gl.where(live[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale2)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    if NO_EXP:
        p = s * scale2 - m_safe[:, None]
        alpha = m_i - m_safe
    else:
        p = _exp2(s * scale2 - m_safe[:, None])
        alpha = _exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _partition(pages_per_part, num_pages, PAGES_PER_TILE: gl.constexpr):
    """This program's KV head, partition, page range ``[pg0, pg1)`` of the prefix and tile count."""
    kvh = gl.program_id(0)
    part = gl.program_id(1)
    pg0 = part * pages_per_part
    pg1 = gl.minimum(pg0 + pages_per_part, num_pages)
    return kvh, part, pg0, pg1, (pg1 - pg0 + PAGES_PER_TILE - 1) // PAGES_PER_TILE


@gluon.jit
def _query_in_shared(Q, kvh, stride_qr, stride_qh, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, D: gl.constexpr):
    """The ``BLOCK_M`` (row, head) query pairs of KV head ``kvh``, bf16 ``(BLOCK_M, D)``, in shared
    memory for the score products."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    pairs = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
    q = gl.load(Q + ((pairs // GROUP) * stride_qr + (kvh * GROUP + pairs % GROUP) * stride_qh)[:, None] + cols[None, :])
    return gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, D], sh, q)


@gluon.jit
def _store_partials(OUT, LSE, acc, m_i, l_i, part, kvh, stride_op, stride_oh, stride_lp, GROUP: gl.constexpr,
                    ROWS: gl.constexpr, BLOCK_M: gl.constexpr, D: gl.constexpr):
    """A program's float32 partials: ``acc / l`` at ``OUT[part * ROWS + row, head, :]`` and the
    natural LSE (``m`` and ``l`` in base 2) at ``LSE[part * ROWS + row, head]``."""
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_l))
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_l))
    out = acc / l_o[:, None]
    pairs_o = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_l))
    cols_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_l))
    partial = part * ROWS + pairs_o // GROUP
    head = kvh * GROUP + pairs_o % GROUP
    gl.store(OUT + (partial * stride_op + head * stride_oh)[:, None] + cols_o[None, :], out)
    gl.store(LSE + partial * stride_lp + head, (m_o + gl.log2(l_o)) * LN2)


@gluon.jit
def tall_prefix_kernel(Q, K, V, OUT, LSE, page_table, pages_per_part, num_pages,
                       stride_qr, stride_qh, stride_kp, stride_kn, stride_kh, stride_op, stride_oh, stride_lp,
                       scale2, GROUP: gl.constexpr, ROWS: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
                       BLOCK_N: gl.constexpr, OVERLAP: gl.constexpr, MATH_ONLY: gl.constexpr = False,
                       SINGLE_P: gl.constexpr = False, NO_EXP: gl.constexpr = False, CARRY: gl.constexpr = False,
                       NBUF: gl.constexpr = 3, PREFETCH: gl.constexpr = 0):
    """One program: the ``ROWS x GROUP`` (row, head) pairs of KV head ``program_id(0)`` over
    partition ``program_id(1)`` of the prefix's pages, every key visible. Writes float32 partial
    outputs ``OUT[part * ROWS + row, head, :]`` and natural LSEs ``LSE[part * ROWS + row, head]``.
    ``MATH_ONLY``: the same instructions with the memory reads cut after three tiles (a timing
    probe: how long the products and the softmax take without waiting for DRAM). With ``OVERLAP``
    0 or 1, ``SINGLE_P``: P.V from P rounded to bf16 once (stock attention's precision, outside the
    numerical contract), and ``NO_EXP``: no ``ex2`` (wrong results): what each costs. ``CARRY``: each
    tile's page indices loaded one iteration before its copy is issued, so the copy (and the
    products after it) do not wait for the page table. ``NBUF``: K/V buffers, ``NBUF - 1`` tiles
    in flight. ``PREFETCH``: tile ``t + PREFETCH``'s rows asked into L2 (256 bytes a thread) while
    tile ``t`` is multiplied, so more of the reads are under way than the buffers hold."""
    BLOCK_M: gl.constexpr = ROWS * GROUP
    PAGES_PER_TILE: gl.constexpr = BLOCK_N // PAGE
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    kvh, part, pg0, pg1, n_tiles = _partition(pages_per_part, num_pages, PAGES_PER_TILE)

    cols = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
    q_smem = _query_in_shared(Q, kvh, stride_qr, stride_qh, GROUP, BLOCK_M, D)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_N, D], sh)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_N, D], sh)
    krows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    for i in gl.static_range(NBUF - 1):
        _issue_tile(k_smem, v_smem, i, i, n_tiles, K, V, page_table, pg0, pg1, kvh, stride_kp, stride_kn,
                    stride_kh, krows, cols, PAGE, PAGES_PER_TILE, MATH_ONLY)
    async_copy.wait_group(NBUF - 2)
    fence_async_shared()
    gl.thread_barrier()
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_l),
                      use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    p, alpha, m_i, l_i = _softmax(s, gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_l)),
                                  gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_l)), 0, pg0, pg1, scale2,
                                  BLOCK_N, PAGE, PAGES_PER_TILE, s_l, NO_EXP)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_l)
    if OVERLAP == 3:
        acc = warpgroup_mma_init(acc)
        a_hi_prev = gl.zeros([BLOCK_M, BLOCK_N], gl.bfloat16, p_l)
        a_lo_prev = gl.zeros([BLOCK_M, BLOCK_N], gl.bfloat16, p_l)
    if PREFETCH > 0:
        for f in gl.static_range(NBUF - 1, PREFETCH):
            pf_ptrs, pf_live = _l2_rows(K, V, page_table, pg0, pg1, f, kvh, stride_kp, stride_kn, stride_kh, PAGE,
                                        PAGES_PER_TILE)
            _l2_prefetch(pf_ptrs, pf_live)
        pf_ptrs, pf_live = _l2_rows(K, V, page_table, pg0, pg1, PREFETCH, kvh, stride_kp, stride_kn, stride_kh, PAGE,
                                    PAGES_PER_TILE)
    off_next, ok_next = _tile_offsets(NBUF - 1, n_tiles, page_table, pg0, pg1, kvh, stride_kp, stride_kn, stride_kh,
                                      krows, PAGE, PAGES_PER_TILE, MATH_ONLY)
    for t in range(0, n_tiles - 1):
        gl.thread_barrier()  # every warp is done with the buffer the next copy overwrites (tile t - 1's)
        if CARRY:
            _copy_tile(k_smem, v_smem, (t + NBUF - 1) % NBUF, off_next, ok_next, K, V, cols)
            off_next, ok_next = _tile_offsets(t + NBUF, n_tiles, page_table, pg0, pg1, kvh, stride_kp, stride_kn,
                                              stride_kh, krows, PAGE, PAGES_PER_TILE, MATH_ONLY)
        else:
            _issue_tile(k_smem, v_smem, (t + NBUF - 1) % NBUF, t + NBUF - 1, n_tiles, K, V, page_table, pg0, pg1, kvh,
                        stride_kp, stride_kn, stride_kh, krows, cols, PAGE, PAGES_PER_TILE, MATH_ONLY)
        if PREFETCH > 0:  # this iteration's prefetch, and the next one's page indices
            _l2_prefetch(pf_ptrs, pf_live)
            pf_ptrs, pf_live = _l2_rows(K, V, page_table, pg0, pg1, t + 1 + PREFETCH, kvh, stride_kp, stride_kn,
                                        stride_kh, PAGE, PAGES_PER_TILE)
        async_copy.wait_group(NBUF - 2)  # tile t + 1 has landed
        fence_async_shared()
        gl.thread_barrier()
        # P's two bf16 parts as the register operand of the P.V products, kept alive until they end
        p_hi = p.to(gl.bfloat16)
        a_hi = gl.convert_layout(p_hi, p_l)
        if SINGLE_P:
            a_lo = a_hi
        else:
            a_lo = gl.convert_layout((p - p_hi.to(gl.float32)).to(gl.bfloat16), p_l)
        v_cur = v_smem.index(t % NBUF)
        if OVERLAP == 3:
            # lazy rescaling: the weights keep the row's reference max until a tile's max passes it by
            # TAU (base 2), so the accumulator is touched, and the P.V products waited for, only then
            s = warpgroup_mma(q_smem, k_smem.index((t + 1) % NBUF).permute((1, 0)), s, use_acc=False, is_async=True)
            acc = warpgroup_mma(a_hi, v_cur, acc, is_async=True)
            acc = warpgroup_mma(a_lo, v_cur, acc, is_async=True)
            # the scores and the previous tile's P.V products done; this tile's still in flight
            s, a_hi_prev, a_lo_prev = warpgroup_mma_wait(num_outstanding=2, deps=(s, a_hi_prev, a_lo_prev))
            scol = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
            s = gl.where(((pg0 + (t + 1) * PAGES_PER_TILE + scol // PAGE) < pg1)[None, :], s, float("-inf"))
            m_tile = gl.max(s, 1) * scale2
            grow = m_tile > m_i + TAU
            if gl.max(grow.to(gl.int32), 0) > 0:
                done = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_hi, a_lo))
                m_new = gl.where(grow, m_tile, m_i)
                alpha = _exp2(m_i - gl.where(m_new == float("-inf"), 0.0, m_new))
                acc = warpgroup_mma_init(done[0] * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None])
                l_i = l_i * alpha
                m_i = m_new
            p = _exp2(s * scale2 - gl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
            l_i = l_i + gl.sum(p, 1)
            a_hi_prev = a_hi
            a_lo_prev = a_lo
        elif OVERLAP:
            s = warpgroup_mma(q_smem, k_smem.index((t + 1) % NBUF).permute((1, 0)), s, use_acc=False, is_async=True)
            acc = warpgroup_mma(a_hi, v_cur, acc, is_async=True)
            if SINGLE_P:
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
            else:
                acc = warpgroup_mma(a_lo, v_cur, acc, is_async=True)
                s = warpgroup_mma_wait(num_outstanding=2, deps=(s,))  # the P.V products stay in flight
        else:
            acc = warpgroup_mma(a_hi, v_cur, acc, is_async=True)
            if not SINGLE_P:
                acc = warpgroup_mma(a_lo, v_cur, acc, is_async=True)
            acc, a_hi, a_lo = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_hi, a_lo))
            s = warpgroup_mma(q_smem, k_smem.index((t + 1) % NBUF).permute((1, 0)), s, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        if OVERLAP != 3:
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, t + 1, pg0, pg1, scale2, BLOCK_N, PAGE, PAGES_PER_TILE, s_l,
                                          NO_EXP)
            if OVERLAP == 1:
                acc, a_hi, a_lo = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_hi, a_lo))
            elif OVERLAP == 2:  # the softmax's results named too, so they are computed before the wait
                acc, a_hi, a_lo, p, l_i = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_hi, a_lo, p, l_i))
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
    p_hi = p.to(gl.bfloat16)
    a_hi = gl.convert_layout(p_hi, p_l)
    if SINGLE_P:
        a_lo = a_hi
    else:
        a_lo = gl.convert_layout((p - p_hi.to(gl.float32)).to(gl.bfloat16), p_l)
    v_cur = v_smem.index((n_tiles - 1) % NBUF)
    acc = warpgroup_mma(a_hi, v_cur, acc, is_async=True)
    if not SINGLE_P:
        acc = warpgroup_mma(a_lo, v_cur, acc, is_async=True)
    if OVERLAP == 3:
        acc, a_hi, a_lo, a_hi_prev, a_lo_prev = warpgroup_mma_wait(num_outstanding=0,
                                                                   deps=(acc, a_hi, a_lo, a_hi_prev, a_lo_prev))
    else:
        acc, a_hi, a_lo = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_hi, a_lo))
    async_copy.wait_group(0)

    _store_partials(OUT, LSE, acc, m_i, l_i, part, kvh, stride_op, stride_oh, stride_lp, GROUP, ROWS, BLOCK_M, D)


@gluon.jit
def dual_prefix_kernel(Q, K, V, OUT, LSE, page_table, pages_per_part, num_pages,
                       stride_qr, stride_qh, stride_kp, stride_kn, stride_kh, stride_op, stride_oh, stride_lp,
                       scale2, GROUP: gl.constexpr, ROWS: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
                       BLOCK_N: gl.constexpr, MATH_ONLY: gl.constexpr = False):
    """:func:`tall_prefix_kernel`'s work as two independent chains a warp: even tiles fold into
    one online softmax and accumulator, odd tiles into another, merged exactly at the end, so
    each step of one chain (products, row reductions, exponentials) can issue while the other's
    waits. Four buffers: a pair of tiles in use, the next pair in flight."""
    BLOCK_M: gl.constexpr = ROWS * GROUP
    PAGES_PER_TILE: gl.constexpr = BLOCK_N // PAGE
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    kvh, part, pg0, pg1, n_tiles = _partition(pages_per_part, num_pages, PAGES_PER_TILE)
    n_pairs = (n_tiles + 1) // 2
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
    q_smem = _query_in_shared(Q, kvh, stride_qr, stride_qh, GROUP, BLOCK_M, D)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_N, D], sh)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_N, D], sh)
    krows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    for i in gl.static_range(4):
        _issue_tile(k_smem, v_smem, i, i, n_tiles, K, V, page_table, pg0, pg1, kvh, stride_kp, stride_kn, stride_kh,
                    krows, cols, PAGE, PAGES_PER_TILE, MATH_ONLY)
    m_a = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
    l_a = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_l))
    m_b = m_a
    l_b = l_a
    acc_a = gl.zeros([BLOCK_M, D], gl.float32, o_l)
    acc_b = gl.zeros([BLOCK_M, D], gl.float32, o_l)
    for j in range(0, n_pairs):
        ta = 2 * j
        ba = ta % 4
        bb = (ta + 1) % 4
        async_copy.wait_group(2)  # the pair's two tiles have landed; the next pair may still be in flight
        fence_async_shared()
        gl.thread_barrier()
        s_a = warpgroup_mma(q_smem, k_smem.index(ba).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_l),
                            use_acc=False, is_async=True)
        s_b = warpgroup_mma(q_smem, k_smem.index(bb).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_l),
                            use_acc=False, is_async=True)
        s_a, s_b = warpgroup_mma_wait(num_outstanding=0, deps=(s_a, s_b))
        p_a, alpha_a, m_a, l_a = _softmax(s_a, m_a, l_a, ta, pg0, pg1, scale2, BLOCK_N, PAGE, PAGES_PER_TILE, s_l)
        p_b, alpha_b, m_b, l_b = _softmax(s_b, m_b, l_b, ta + 1, pg0, pg1, scale2, BLOCK_N, PAGE, PAGES_PER_TILE, s_l)
        acc_a = acc_a * gl.convert_layout(alpha_a, gl.SliceLayout(1, o_l))[:, None]
        acc_b = acc_b * gl.convert_layout(alpha_b, gl.SliceLayout(1, o_l))[:, None]
        hi_a = p_a.to(gl.bfloat16)
        hi_b = p_b.to(gl.bfloat16)
        a_hi_a = gl.convert_layout(hi_a, p_l)
        a_lo_a = gl.convert_layout((p_a - hi_a.to(gl.float32)).to(gl.bfloat16), p_l)
        a_hi_b = gl.convert_layout(hi_b, p_l)
        a_lo_b = gl.convert_layout((p_b - hi_b.to(gl.float32)).to(gl.bfloat16), p_l)
        acc_a = warpgroup_mma(a_hi_a, v_smem.index(ba), acc_a, is_async=True)
        acc_b = warpgroup_mma(a_hi_b, v_smem.index(bb), acc_b, is_async=True)
        acc_a = warpgroup_mma(a_lo_a, v_smem.index(ba), acc_a, is_async=True)
        acc_b = warpgroup_mma(a_lo_b, v_smem.index(bb), acc_b, is_async=True)
        acc_a, acc_b, a_hi_a, a_lo_a, a_hi_b, a_lo_b = warpgroup_mma_wait(
            num_outstanding=0, deps=(acc_a, acc_b, a_hi_a, a_lo_a, a_hi_b, a_lo_b))
        gl.thread_barrier()  # every warp is done with the pair's buffers before they refill
        _issue_tile(k_smem, v_smem, ba, ta + 4, n_tiles, K, V, page_table, pg0, pg1, kvh, stride_kp, stride_kn,
                    stride_kh, krows, cols, PAGE, PAGES_PER_TILE, MATH_ONLY)
        _issue_tile(k_smem, v_smem, bb, ta + 5, n_tiles, K, V, page_table, pg0, pg1, kvh, stride_kp, stride_kn,
                    stride_kh, krows, cols, PAGE, PAGES_PER_TILE, MATH_ONLY)
    async_copy.wait_group(0)
    # the two chains merged exactly (base 2): a chain that saw no key has m = -inf and weight 0
    m = gl.maximum(m_a, m_b)
    m_safe = gl.where(m == float("-inf"), 0.0, m)
    w_a = _exp2(m_a - m_safe)
    w_b = _exp2(m_b - m_safe)
    l_i = l_a * w_a + l_b * w_b
    acc = (acc_a * gl.convert_layout(w_a, gl.SliceLayout(1, o_l))[:, None]
           + acc_b * gl.convert_layout(w_b, gl.SliceLayout(1, o_l))[:, None])
    _store_partials(OUT, LSE, acc, m, l_i, part, kvh, stride_op, stride_oh, stride_lp, GROUP, ROWS, BLOCK_M, D)


@gluon.jit
def stream_prefix_kernel(K, V, page_table, pages_per_part, num_pages, stride_kp, stride_kn, stride_kh,
                         D: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, BUFFERS: gl.constexpr = 3):
    """The tall programs' reads alone (a timing probe): the same grid, page gather and cp.async
    buffers (``BUFFERS``, so ``BUFFERS - 1`` tiles in flight) as :func:`tall_prefix_kernel`, no
    products and no softmax."""
    PAGES_PER_TILE: gl.constexpr = BLOCK_N // PAGE
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    kvh, part, pg0, pg1, n_tiles = _partition(pages_per_part, num_pages, PAGES_PER_TILE)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
    krows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [BUFFERS, BLOCK_N, D], sh)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [BUFFERS, BLOCK_N, D], sh)
    for i in gl.static_range(BUFFERS - 1):
        _issue_tile(k_smem, v_smem, i, i, n_tiles, K, V, page_table, pg0, pg1, kvh, stride_kp, stride_kn,
                    stride_kh, krows, cols, PAGE, PAGES_PER_TILE)
    for t in range(0, n_tiles - 1):
        gl.thread_barrier()
        _issue_tile(k_smem, v_smem, (t + BUFFERS - 1) % BUFFERS, t + BUFFERS - 1, n_tiles, K, V, page_table, pg0,
                    pg1, kvh, stride_kp, stride_kn, stride_kh, krows, cols, PAGE, PAGES_PER_TILE)
        async_copy.wait_group(BUFFERS - 2)  # tile t + 1 has landed
        fence_async_shared()
        gl.thread_barrier()
    async_copy.wait_group(0)


@gluon.jit
def _ws_producer(k_smem, v_smem, ready, empty, K, V, page_table, pg0, pg1, n_tiles, kvh, stride_kp, stride_kn,
                 stride_kh, D: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr,
                 MATH_ONLY: gl.constexpr = False):
    """One warp: every tile's K and V copied page by page (one page index a page) into the ring of
    ``NBUF`` buffers, as far ahead as the consumer frees them; ``ready[buf]`` completes when a
    tile's copies have landed (each of the 32 threads arrives once its own copies are done).
    ``MATH_ONLY``: copies after the third tile masked off (zero fill, no DRAM traffic)."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])
    prow = gl.arange(0, PAGE, layout=gl.SliceLayout(1, ld))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
    within = prow[:, None] * stride_kn + cols[None, :]
    PAGES_PER_TILE: gl.constexpr = BLOCK_N // PAGE
    for t in range(0, n_tiles):
        buf = t % NBUF
        # the consumer is done with this buffer's last tile (t - NBUF); the first round finds it free
        mbarrier.wait(empty.index(buf), ((t // NBUF) + 1) & 1, pred=t >= NBUF)
        for c in gl.static_range(PAGES_PER_TILE):
            entry = pg0 + t * PAGES_PER_TILE + c
            live = entry < pg1
            if MATH_ONLY:
                live = live & (t < 3)
            page = gl.load(page_table + entry, mask=live, other=0)
            base = page * stride_kp + kvh * stride_kh
            mask = (prow < gl.where(live, PAGE, 0))[:, None] & (cols >= 0)[None, :]
            async_copy.async_copy_global_to_shared(k_smem.index(buf).slice(c * PAGE, PAGE), K + base + within,
                                                   mask=mask)
            async_copy.async_copy_global_to_shared(v_smem.index(buf).slice(c * PAGE, PAGE), V + base + within,
                                                   mask=mask)
        async_copy.mbarrier_arrive(ready.index(buf), increment_count=False)


@gluon.jit
def _ws_consumer(q_smem, k_smem, v_smem, ready, empty, n_tiles, pg0, pg1, scale2, BLOCK_M: gl.constexpr,
                 D: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr):
    """The default partition (one warpgroup): each tile's scores, softmax and two-part P.V products
    once the producer's copies landed; the buffer is handed back when its products are done.
    Returns the float32 accumulator ``(BLOCK_M, D)``, the running max (base 2) and sum."""
    PAGES_PER_TILE: gl.constexpr = BLOCK_N // PAGE
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_l))
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_l)
    for t in range(0, n_tiles):
        buf = t % NBUF
        mbarrier.wait(ready.index(buf), (t // NBUF) & 1)
        fence_async_shared()  # the copies' writes before the products read them
        s = warpgroup_mma(q_smem, k_smem.index(buf).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_l),
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, t, pg0, pg1, scale2, BLOCK_N, PAGE, PAGES_PER_TILE, s_l)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
        a_hi, a_lo = _p_parts(p, p_l)
        acc = warpgroup_mma(a_hi, v_smem.index(buf), acc, is_async=True)
        acc = warpgroup_mma(a_lo, v_smem.index(buf), acc, is_async=True)
        acc, a_hi, a_lo = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_hi, a_lo))
        mbarrier.arrive(empty.index(buf))
    return acc, m_i, l_i


@gluon.jit
def ws_prefix_kernel(Q, K, V, OUT, LSE, page_table, pages_per_part, num_pages,
                     stride_qr, stride_qh, stride_kp, stride_kn, stride_kh, stride_op, stride_oh, stride_lp,
                     scale2, GROUP: gl.constexpr, ROWS: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
                     BLOCK_N: gl.constexpr, NBUF: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """:func:`tall_prefix_kernel`'s work, warp-specialised: one producer warp issues the copies
    into a ring of ``NBUF`` buffers, the warpgroup runs only the products and the softmax, so the
    reads run ahead of the math instead of between its tiles (mbarriers hand the buffers over)."""
    BLOCK_M: gl.constexpr = ROWS * GROUP
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    kvh, part, pg0, pg1, n_tiles = _partition(pages_per_part, num_pages, BLOCK_N // PAGE)
    q_smem = _query_in_shared(Q, kvh, stride_qr, stride_qh, GROUP, BLOCK_M, D)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_N, D], sh)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_N, D], sh)
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(ready.index(i), count=32)  # the producer warp's threads
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()
    acc, m_i, l_i = gl.warp_specialize(
        [(_ws_consumer, (q_smem, k_smem, v_smem, ready, empty, n_tiles, pg0, pg1, scale2, BLOCK_M, D, PAGE, BLOCK_N,
                         NBUF)),
         (_ws_producer, (k_smem, v_smem, ready, empty, K, V, page_table, pg0, pg1, n_tiles, kvh, stride_kp, stride_kn,
                         stride_kh, D, PAGE, BLOCK_N, NBUF))],
        [1], [PRODUCER_REGS])
    _store_partials(OUT, LSE, acc, m_i, l_i, part, kvh, stride_op, stride_oh, stride_lp, GROUP, ROWS, BLOCK_M, D)


@gluon.jit
def _pp_producer(loads, D: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr,
                 MATH_ONLY: gl.constexpr):
    """:func:`_ws_producer` with its runtime arguments in one tuple ``loads``."""
    k_smem, v_smem, ready, empty, K, V, page_table, pg0, pg1, n_tiles, kvh, stride_kp, stride_kn, stride_kh = loads
    _ws_producer(k_smem, v_smem, ready, empty, K, V, page_table, pg0, pg1, n_tiles, kvh, stride_kp, stride_kn,
                 stride_kh, D, PAGE, BLOCK_N, NBUF, MATH_ONLY)


@gluon.jit
def _p_parts(p, p_layout: gl.constexpr):
    """Float32 weights ``p`` as the two bf16 parts of the P.V products' register operand."""
    p_hi = p.to(gl.bfloat16)
    return gl.convert_layout(p_hi, p_layout), gl.convert_layout((p - p_hi.to(gl.float32)).to(gl.bfloat16), p_layout)


@gluon.jit
def _take_turn(turn, C: gl.constexpr, k):
    """Consumer ``C``'s turn to issue the products of its window ``k``: the previous consumer's
    window ``k`` issued (consumer 0: the last consumer's window ``k - 1``; its first window waits for none)."""
    if C == 0:
        mbarrier.wait(turn.index(0), (k - 1) & 1, pred=k > 0)
    else:
        mbarrier.wait(turn.index(C), k & 1)


@gluon.jit
def _pp_consumer(shared, C: gl.constexpr, NCONS: gl.constexpr, GROUP: gl.constexpr, ROWS: gl.constexpr,
                 D: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr,
                 ORDERED: gl.constexpr):
    """Consumer warpgroup ``C`` of ``NCONS``: tiles ``C, C + NCONS, ...`` of the partition, with its
    own online softmax, each tile's scores issued together with the previous tile's two-part P.V
    products (as :func:`tall_prefix_kernel`'s ``OVERLAP`` 1). ``ORDERED``: the consumers take turns
    issuing their products (``turn[C]`` waited for, ``turn[C + 1]`` arrived at after the issue), so
    one warpgroup's softmax runs while another's products do. Writes its own float32 partials at
    partial ``part * NCONS + C``. ``shared``: the program's buffers, barriers and scalars, as
    :func:`pingpong_prefix_kernel` hands them to every consumer."""
    q_smem, k_smem, v_smem, ready, empty, turn, OUT, LSE, n_tiles, pg0, pg1, part, kvh, stride_op, stride_oh, \
        stride_lp, scale2 = shared
    BLOCK_M: gl.constexpr = ROWS * GROUP
    PAGES_PER_TILE: gl.constexpr = BLOCK_N // PAGE
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    n_mine = (n_tiles - C + NCONS - 1) // NCONS  # at least 1: partitions hold NCONS tiles or more
    nxt: gl.constexpr = (C + 1) % NCONS
    # window 0: the first tile's scores
    buf = C % NBUF
    mbarrier.wait(ready.index(buf), (C // NBUF) & 1)
    fence_async_shared()  # the copies' writes before the products read them
    if ORDERED:
        _take_turn(turn, C, 0)
    s = warpgroup_mma(q_smem, k_smem.index(buf).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_l),
                      use_acc=False, is_async=True)
    if ORDERED:
        mbarrier.arrive(turn.index(nxt))
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    p, alpha, m_i, l_i = _softmax(s, gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_l)),
                                  gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_l)), C, pg0, pg1, scale2,
                                  BLOCK_N, PAGE, PAGES_PER_TILE, s_l)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_l)
    for k in range(1, n_mine):
        t = C + k * NCONS
        prev = (t - NCONS) % NBUF
        buf = t % NBUF
        a_hi, a_lo = _p_parts(p, p_l)
        mbarrier.wait(ready.index(buf), (t // NBUF) & 1)
        fence_async_shared()
        if ORDERED:
            _take_turn(turn, C, k)
        s = warpgroup_mma(q_smem, k_smem.index(buf).permute((1, 0)), s, use_acc=False, is_async=True)
        acc = warpgroup_mma(a_hi, v_smem.index(prev), acc, is_async=True)
        acc = warpgroup_mma(a_lo, v_smem.index(prev), acc, is_async=True)
        if ORDERED:
            mbarrier.arrive(turn.index(nxt))
        s = warpgroup_mma_wait(num_outstanding=2, deps=(s,))  # the P.V products stay in flight
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, t, pg0, pg1, scale2, BLOCK_N, PAGE, PAGES_PER_TILE, s_l)
        acc, a_hi, a_lo = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_hi, a_lo))
        mbarrier.arrive(empty.index(prev))  # tile t - NCONS's buffer is free
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
    last = (C + (n_mine - 1) * NCONS) % NBUF
    a_hi, a_lo = _p_parts(p, p_l)
    acc = warpgroup_mma(a_hi, v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma(a_lo, v_smem.index(last), acc, is_async=True)
    acc, a_hi, a_lo = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_hi, a_lo))
    _store_partials(OUT, LSE, acc, m_i, l_i, part * NCONS + C, kvh, stride_op, stride_oh, stride_lp, GROUP, ROWS,
                    BLOCK_M, D)


@gluon.jit
def pingpong_prefix_kernel(Q, K, V, OUT, LSE, page_table, pages_per_part, num_pages,
                           stride_qr, stride_qh, stride_kp, stride_kn, stride_kh, stride_op, stride_oh, stride_lp,
                           scale2, GROUP: gl.constexpr, ROWS: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
                           BLOCK_N: gl.constexpr, NBUF: gl.constexpr, NCONS: gl.constexpr, ORDERED: gl.constexpr,
                           CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, MATH_ONLY: gl.constexpr = False):
    """:func:`ws_prefix_kernel`'s work with ``NCONS`` (2 or 3) consumer warpgroups in one program:
    more independent warps a scheduler than two programs of one warpgroup give, the reads issued by
    one producer warp into a ring of ``NBUF`` buffers (a multiple of ``NCONS``, so each buffer
    serves one consumer), and with ``ORDERED`` the consumers' products issued in turn. Each
    consumer writes its own partials: ``NCONS`` a partition. ``MATH_ONLY``: the producer's copies cut
    after three tiles."""
    gl.static_assert((NCONS == 2) | (NCONS == 3), "two or three consumers")
    # each buffer serves one consumer, and a consumer frees a buffer before it needs the one after
    gl.static_assert((NBUF % NCONS == 0) & (NBUF >= 2 * NCONS), "NBUF: a multiple of NCONS, at least 2 * NCONS")
    BLOCK_M: gl.constexpr = ROWS * GROUP
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    kvh, part, pg0, pg1, n_tiles = _partition(pages_per_part, num_pages, BLOCK_N // PAGE)
    q_smem = _query_in_shared(Q, kvh, stride_qr, stride_qh, GROUP, BLOCK_M, D)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_N, D], sh)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_N, D], sh)
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NCONS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(ready.index(i), count=32)  # the producer warp's threads
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(NCONS):
        mbarrier.init(turn.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()
    # every consumer's runtime arguments in one tuple; constexprs are written out in each call (a tuple
    # held in a variable or built with + inside the kernel loses them)
    shared = (q_smem, k_smem, v_smem, ready, empty, turn, OUT, LSE, n_tiles, pg0, pg1, part, kvh, stride_op,
              stride_oh, stride_lp, scale2)
    loads = (k_smem, v_smem, ready, empty, K, V, page_table, pg0, pg1, n_tiles, kvh, stride_kp, stride_kn, stride_kh)
    if NCONS == 2:
        gl.warp_specialize([(_pp_consumer, (shared, 0, NCONS, GROUP, ROWS, D, PAGE, BLOCK_N, NBUF, ORDERED)),
                            (_pp_consumer, (shared, 1, NCONS, GROUP, ROWS, D, PAGE, BLOCK_N, NBUF, ORDERED)),
                            (_pp_producer, (loads, D, PAGE, BLOCK_N, NBUF, MATH_ONLY))],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_pp_consumer, (shared, 0, NCONS, GROUP, ROWS, D, PAGE, BLOCK_N, NBUF, ORDERED)),
                            (_pp_consumer, (shared, 1, NCONS, GROUP, ROWS, D, PAGE, BLOCK_N, NBUF, ORDERED)),
                            (_pp_consumer, (shared, 2, NCONS, GROUP, ROWS, D, PAGE, BLOCK_N, NBUF, ORDERED)),
                            (_pp_producer, (loads, D, PAGE, BLOCK_N, NBUF, MATH_ONLY))],
                           [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


# (tile rows, buffers, consumers, ordered, consumer registers, the program's register cap): the producer's
# warp is padded to a warpgroup, so two consumers make 12 warps (at most 168 registers at launch), three 16
# (128); setmaxnreg then moves registers from the producer's warpgroup to the consumers
PINGPONG_CASES = ((64, 4, 2, True, 232, 168), (64, 4, 2, False, 232, 168), (32, 6, 3, True, 152, 128),
                  (32, 6, 3, False, 152, 128))


def compile_only() -> None:
    """Offline (no GPU): registers, shared memory and the loop's MMA / wait / ex2 order on sm_90a."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    names = ["Q", "K", "V", "OUT", "LSE", "page_table", "pages_per_part", "num_pages", "stride_qr", "stride_qh",
             "stride_kp", "stride_kn", "stride_kh", "stride_op", "stride_oh", "stride_lp", "scale2"]
    types = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "OUT": "*fp32", "LSE": "*fp32", "page_table": "*i32",
             "scale2": "fp32"}
    stream_names = ["K", "V", "page_table", "pages_per_part", "num_pages", "stride_kp", "stride_kn", "stride_kh"]
    cases = [(tall_prefix_kernel, names, {"BLOCK_N": block_n, "OVERLAP": overlap, "MATH_ONLY": math_only,
                                          "GROUP": 4, "ROWS": 16})
             for block_n, overlap, math_only in ((32, 0, False), (32, 1, False), (32, 2, False), (32, 3, False),
                                                 (16, 1, False), (64, 1, False), (64, 1, True))]
    cases += [(tall_prefix_kernel, names, {"BLOCK_N": 64, "OVERLAP": 1, "MATH_ONLY": False, "GROUP": 4, "ROWS": 16,
                                           "SINGLE_P": single_p, "NO_EXP": no_exp, "CARRY": carry, "NBUF": 3})
              for single_p, no_exp, carry in ((True, False, False), (False, True, False), (True, True, False),
                                              (False, False, True), (True, False, True))]
    cases += [(tall_prefix_kernel, names, {"BLOCK_N": block_n, "OVERLAP": 1, "MATH_ONLY": False, "GROUP": 4,
                                           "ROWS": 16, "SINGLE_P": False, "NO_EXP": False, "CARRY": False,
                                           "NBUF": nbuf})
              for block_n, nbuf in ((32, 4), (32, 6), (16, 8))]
    cases += [(tall_prefix_kernel, names, {"BLOCK_N": block_n, "PREFETCH": prefetch}) for block_n, prefetch in
              ((64, 4), (32, 8))]
    cases += [(stream_prefix_kernel, stream_names, {"BLOCK_N": 64, "BUFFERS": b}) for b in (2, 3, 4)]
    cases += [(dual_prefix_kernel, names, {"BLOCK_N": block_n}) for block_n in (32, 16)]
    cases += [(ws_prefix_kernel, names, {"BLOCK_N": block_n, "NBUF": nbuf, "PRODUCER_REGS": 40, "MAXNREG": 128})
              for block_n, nbuf in ((64, 3), (32, 6))]
    cases += [(pingpong_prefix_kernel, names, {"BLOCK_N": block_n, "NBUF": nbuf, "NCONS": ncons, "ORDERED": ordered,
                                               "CONSUMER_REGS": cregs, "PRODUCER_REGS": 40, "MAXNREG": maxnreg})
              for block_n, nbuf, ncons, ordered, cregs, maxnreg in PINGPONG_CASES]
    for fn, arg_names, case in cases:
        # every constexpr named, in the kernel's order (the offline source binds them by position)
        defaults = {"GROUP": 4, "ROWS": 16, "D": 128, "PAGE": 16, "OVERLAP": 1, "MATH_ONLY": False, "SINGLE_P": False,
                    "NO_EXP": False, "CARRY": False, "NBUF": 3, "BUFFERS": 3, "PRODUCER_REGS": 40, "PREFETCH": 0,
                    "NCONS": 2, "ORDERED": True, "CONSUMER_REGS": 232}
        params = [name for name in fn.arg_names if name not in arg_names]  # MAXNREG: a launch option
        consts = {name: case.get(name, defaults.get(name)) for name in params}
        sig = {n: types.get(n, "i32") for n in arg_names} | {n: "constexpr" for n in consts}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(arg_names)
                 if n.startswith(("stride", "Q", "K", "V", "OUT", "LSE", "page"))}
        options = {"num_warps": 4} | ({"maxnreg": case["MAXNREG"]} if "MAXNREG" in case else {})
        kernel = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                                options=options)
        with tempfile.TemporaryDirectory() as tmp:
            with open(f"{tmp}/k.ptx", "w") as f:
                f.write(kernel.asm["ptx"])
            usage = subprocess.run([f"{bin_dir}/ptxas", "-v", "--gpu-name=sm_90a", f"{tmp}/k.ptx", "-o", f"{tmp}/k.o"],
                                   capture_output=True, text=True).stderr
            sass = subprocess.run([f"{bin_dir}/nvdisasm", "-c", f"{tmp}/k.o"], capture_output=True, text=True).stdout
        order = []
        for line in sass.splitlines():
            tag = ("MMA" if "HGMMA" in line else "WAIT" + line.split("DEPBAR.LE")[1].split(",")[1].strip(" ;")
                   if "WARPGROUP.DEPBAR" in line else "EX2" if "MUFU.EX2" in line else None)
            if tag and (not order or order[-1][0] != tag):
                order.append([tag, 1])
            elif tag:
                order[-1][1] += 1
        for warning in sorted({line.strip() for line in usage.splitlines() if "wgmma" in line.lower()}):
            print("  ptxas:", warning)
        regs = re.search(r"Used (\d+) registers", usage).group(1)
        spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill", usage))
        copies = sum("LDGSTS" in line for line in sass.splitlines())
        print(f"{fn.fn.__name__} {case}: {regs} registers, {spills} bytes spilled, {kernel.metadata.shared} B shared, "
              f"{copies} LDGSTS; " + " ".join(f"{tag}x{n}" for tag, n in order))


def run(trials: int, selected: tuple[str, ...], clocks: tuple[str, ...] = (), once: tuple[str, ...] = ()) -> None:
    from segkv.attention import AttentionShape, DeviceSpec, SequenceQuery, plan_attention
    from segkv.attention.triton_backend import TritonBackend
    from benchmarks.decode_attention import Timer, _run_trials, forked_prefix, measured_read_bandwidth
    from segkv.kernels.paged_attention import merge_into

    device, forks, prefix, page, q_heads, kv_heads, dim = "cuda", 16, 32768, 16, 32, 8, 128
    gen = torch.Generator(device=device).manual_seed(0)
    cache, root, chains = forked_prefix(kv_heads=kv_heads, head_dim=dim, dtype=torch.bfloat16, forks=forks,
                                        prefix=prefix, suffix=0, page_size=page, generator=gen, device=device)
    queries = [SequenceQuery.from_chain(c, 1) for c in chains]
    kc, vc = cache.storage.key_cache(0), cache.storage.value_cache(0)
    q = torch.randn(forks, q_heads, dim, device=device, dtype=torch.bfloat16, generator=gen)
    scale = dim**-0.5
    shape = AttentionShape(q_heads, kv_heads, dim, dim)
    plan = plan_attention(queries, shape, DeviceSpec.cuda(), page_size=page)
    print(plan.describe())
    backend = TritonBackend(page_size=page, device=device)
    prepared = backend.prepare(plan)

    page_ids = [pid for span in SequenceQuery.from_chain(root, 1).spans for pid in span.page_ids]
    page_table = torch.tensor(page_ids, dtype=torch.int32, device=device)
    num_pages = len(page_ids)
    outs = {}
    kc_rm, vc_rm = kc, vc
    # the same pages, each head's rows of a page contiguous: (page, head, row, dim) seen through
    # (page, row, head, dim) strides, so the kernels take either
    kc_hm = kc.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    vc_hm = vc.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)

    def gluon_call(block_n: int, overlap: int, parts: int, math_only: bool = False, single_p: bool = False,
                   no_exp: bool = False, carry: bool = False, nbuf: int = 3, ws_regs: tuple[int, int] | None = None,
                   prefetch: int = 0, head_major: bool = False, dual: bool = False,
                   pingpong: tuple[int, bool, int, int] | None = None):
        """The Gluon stage 1 over ``parts`` partitions of the prefix, then the engine's merge
        (``math_only``: the reads cut after three tiles, a timing probe whose output is not checked;
        ``ws_regs``: the warp-specialised kernel, launched with (registers a thread, the producer's);
        ``head_major``: over a copy of the pages laid out (page, head, row, dim), each head's rows of a
        page contiguous; ``pingpong``: :func:`pingpong_prefix_kernel` with (consumers, ordered, consumer
        registers, the program's register cap), ``nbuf`` buffers, one partial a consumer)."""
        kc, vc = (kc_hm, vc_hm) if head_major else (kc_rm, vc_rm)
        pages_per_part = -(-num_pages // parts)
        parts = -(-num_pages // pages_per_part)
        if pingpong and pages_per_part * page < pingpong[0] * block_n:
            raise ValueError(f"{parts} partitions of {pages_per_part} pages leave a consumer of {pingpong[0]} "
                             f"without a {block_n}-row tile")
        partials = parts * (pingpong[0] if pingpong else 1)
        part_out = torch.empty(partials * forks, q_heads, dim, device=device, dtype=torch.float32)
        part_lse = torch.empty(partials * forks, q_heads, device=device, dtype=torch.float32)
        reduce_ptr = torch.arange(0, forks * partials + 1, partials, dtype=torch.int32, device=device)
        reduce_partials = torch.tensor([p * forks + r for r in range(forks) for p in range(partials)],
                                       dtype=torch.int32, device=device)
        out = torch.empty(forks, q_heads, dim, device=device, dtype=torch.bfloat16)
        lse = torch.empty(forks, q_heads, device=device, dtype=torch.float32)

        # the three stage-1 kernels share their arguments; each then takes its own constexprs
        args = (q, kc, vc, part_out, part_lse, page_table, pages_per_part, num_pages, q.stride(0), q.stride(1),
                kc.stride(0), kc.stride(1), kc.stride(2), part_out.stride(0), part_out.stride(1), part_lse.stride(0),
                scale * LOG2E)
        sizes = dict(GROUP=q_heads // kv_heads, ROWS=forks, D=dim, PAGE=page, BLOCK_N=block_n, num_warps=4)
        if pingpong:
            kernel, options = pingpong_prefix_kernel, dict(NBUF=nbuf, NCONS=pingpong[0], ORDERED=pingpong[1],
                                                           CONSUMER_REGS=pingpong[2], PRODUCER_REGS=40,
                                                           maxnreg=pingpong[3], MATH_ONLY=math_only)
        elif ws_regs:
            kernel, options = ws_prefix_kernel, dict(NBUF=nbuf, PRODUCER_REGS=ws_regs[1], maxnreg=ws_regs[0])
        elif dual:
            kernel, options = dual_prefix_kernel, dict(MATH_ONLY=math_only)
        else:
            kernel, options = tall_prefix_kernel, dict(OVERLAP=overlap, MATH_ONLY=math_only, SINGLE_P=single_p,
                                                       NO_EXP=no_exp, CARRY=carry, NBUF=nbuf, PREFETCH=prefetch)

        def call():
            kernel[(kv_heads, parts)](*args, **sizes, **options)
            merge_into(out, lse, part_out, part_lse, reduce_ptr, reduce_partials)
        name = (f"gluon_n{block_n}_o{overlap}_p{parts}" + ("_math" if math_only else "") + ("_1p" if single_p else "")
                + ("_noexp" if no_exp else "") + ("_carry" if carry else "") + (f"_b{nbuf}" if nbuf != 3 else "")
                + (f"_l2ahead{prefetch}" if prefetch else "") + ("_headmajor" if head_major else ""))
        if ws_regs:
            name = f"ws_n{block_n}_b{nbuf}_p{parts}_r{ws_regs[0]}_{ws_regs[1]}"
        if dual:
            name = f"dual_n{block_n}_p{parts}" + ("_math" if math_only else "")
        if pingpong:
            name = (f"pp{pingpong[0]}{'' if pingpong[1] else 'free'}_n{block_n}_b{nbuf}_p{parts}"
                    + ("_math" if math_only else ""))
        if not (math_only or no_exp):
            outs[name] = out
        return name, call

    def stream_call(block_n: int, parts: int, buffers: int = 3, head_major: bool = False):
        """The same programs' reads alone (no products, softmax, partials or merge)."""
        kc, vc = (kc_hm, vc_hm) if head_major else (kc_rm, vc_rm)
        pages_per_part = -(-num_pages // parts)
        parts = -(-num_pages // pages_per_part)

        def call():
            stream_prefix_kernel[(kv_heads, parts)](kc, vc, page_table, pages_per_part, num_pages, kc.stride(0),
                                                    kc.stride(1), kc.stride(2), D=dim, PAGE=page, BLOCK_N=block_n,
                                                    BUFFERS=buffers, num_warps=4)
        return f"stream_n{block_n}_p{parts}_b{buffers}" + ("_headmajor" if head_major else ""), call

    # batch-1 decode over the prefix alone (the planner's split): the same bytes with 1/16 of the math
    solo_query = [SequenceQuery.from_chain(root, 1)]
    solo_plan = plan_attention(solo_query, shape, DeviceSpec.cuda(), page_size=page)
    print("batch 1:", solo_plan.describe())
    solo_prepared = backend.prepare(solo_plan)
    q_solo = q[:1].clone()

    def triton_batch1():
        backend.run(solo_prepared, q_solo, kc, vc, scale=scale)

    def triton_call():
        outs["triton_cascade"] = backend.run(prepared, q, kc, vc, scale=scale)[0]

    calls = {"triton_cascade": triton_call}
    # the variants by question; the first group is the reference every question compares with
    groups = {
        "reference": lambda: [gluon_call(64, 1, 33), gluon_call(64, 1, 33, math_only=True), stream_call(64, 33),
                              ("triton_batch1", triton_batch1)],
        # tile rows, overlap modes and partitions (the first probe)
        "tiles": lambda: [gluon_call(block_n, overlap, parts) for block_n, overlap, parts in (
            (32, 0, 49), (32, 1, 49), (32, 3, 49), (32, 1, 33), (32, 1, 66), (16, 1, 49), (16, 1, 66), (16, 1, 99))],
        # where the time goes: the math without parts of it, alone and whole; batch 1's grid streamed
        "math": lambda: [gluon_call(32, 1, 49, math_only=True), stream_call(32, 49), stream_call(64, 66),
                         *(stream_call(64, 32, buffers) for buffers in (2, 3, 4)),
                         *(gluon_call(64, 1, 33, math_only=m, single_p=sp, no_exp=ne) for m in (False, True)
                           for sp, ne in ((True, False), (False, True), (True, True))),
                         gluon_call(64, 1, 33, carry=True), gluon_call(64, 1, 33, math_only=True, carry=True)],
        # reads further ahead of the math: a producer warp, more buffers, L2 prefetch
        "ahead": lambda: [gluon_call(64, 1, 33, ws_regs=(128, 40)), gluon_call(32, 1, 33, nbuf=6, ws_regs=(128, 40)),
                          *(gluon_call(32, 1, 49, nbuf=nbuf) for nbuf in (4, 5, 6)),
                          gluon_call(32, 1, 33, nbuf=6), gluon_call(16, 1, 64, nbuf=8),
                          *(gluon_call(64, 1, 33, prefetch=d) for d in (3, 4, 6)),
                          *(gluon_call(32, 1, 49, prefetch=d) for d in (4, 8))],
        # one program an SM (17 partitions), whole, math alone and reads alone: do two programs interfere
        "residency": lambda: [gluon_call(64, 1, 17), gluon_call(64, 1, 17, math_only=True), stream_call(64, 17),
                              *(gluon_call(64, 1, parts, math_only=m, single_p=True) for parts in (17, 33)
                                for m in (False, True))],
        # two independent chains a warp (even and odd tiles), merged at the end
        "dual": lambda: [gluon_call(block_n, 1, parts, math_only=m, dual=True) for block_n, parts in
                         ((32, 33), (16, 33), (32, 49)) for m in (False, True)],
        # two or three consumer warpgroups and a producer warp in one program an SM (16 partitions),
        # their products issued in turn or free; whole and math alone
        "pingpong": lambda: [gluon_call(block_n, 1, 16, math_only=m, nbuf=nbuf, pingpong=(ncons, ordered, cregs, cap))
                             for block_n, nbuf, ncons, ordered, cregs, cap in PINGPONG_CASES for m in (False, True)],
        # each head's rows of a page contiguous
        "layout": lambda: [gluon_call(64, 1, 33, head_major=True),
                           gluon_call(64, 1, 33, math_only=True, head_major=True),
                           stream_call(64, 33, head_major=True), gluon_call(64, 1, 33, single_p=True, head_major=True)],
    }
    for group in ("reference", *(g for g in groups if g != "reference" and g in selected)):
        calls.update(groups[group]())
    if once:  # for a profiler: the named variants launched twice each (the first compiles), nothing timed
        unknown = [name for name in once if name not in calls]
        if unknown:
            raise SystemExit(f"--once: no variant {', '.join(unknown)} in groups {','.join(selected)}; "
                             f"these are: {', '.join(calls)}")
        for name in once:
            for _ in range(2):
                calls[name]()
        torch.cuda.synchronize()
        return
    timers = {name: Timer.capture([fn]) for name, fn in calls.items()}

    # float32 attention over the whole prefix: every fork's row sees every key
    k_all = kc[page_table.long()].reshape(prefix, kv_heads, dim).float()
    v_all = vc[page_table.long()].reshape(prefix, kv_heads, dim).float()
    group = q_heads // kv_heads
    scores = torch.einsum("rhd,nhd->rhn", q.float(), k_all.repeat_interleave(group, dim=1)) * scale
    ref = torch.einsum("rhn,nhd->rhd", scores.softmax(-1), v_all.repeat_interleave(group, dim=1))
    for name, out in outs.items():
        err = (out.float() - ref).abs().max().item()
        print(f"{name}: max |out - float32 reference| = {err:.2e}, NaN: {bool(torch.isnan(out).any())}")

    samples = _run_trials(timers, trials)
    base = statistics.median(samples["triton_cascade"])
    print(f"{torch.cuda.get_device_name()}: {forks} forks x {prefix // 1024}K prefix (8B shape, pages of {page}), "
          f"{trials} trials, ms (gluon_n<tile rows>_o<OVERLAP>_p<partitions>)")
    prefix_bytes = 2 * prefix * kv_heads * dim * kc.element_size()
    copy_rate = measured_read_bandwidth()
    print(f"  the prefix's K/V: {prefix_bytes / 1e6:.1f} MB; copy rate {copy_rate / 1e12:.2f} TB/s "
          f"({prefix_bytes / copy_rate * 1e6:.1f} us for the prefix)")
    for name, times in samples.items():
        med = statistics.median(times)
        print(f"  {name:20s} {med:.4f} [{min(times):.4f}-{max(times):.4f}]  {base / med:.2f}x the Triton cascade, "
              f"{prefix_bytes / (med * 1e-3) / 1e12:.2f} TB/s of prefix")
    if clocks:
        print("  SM clock and board power while each variant replays for 2 s (nvidia-smi every 50 ms, median):")
        print(f"  {'idle':20s} {_clocks_during(None)}")
        for name in clocks:
            if name in timers:
                print(f"  {name:20s} {_clocks_during(timers[name])}")


def _clocks_during(timer, seconds: float = 2.0) -> str:
    """The SM and memory clocks (MHz), board power (W), temperature and clock-event reasons that
    nvidia-smi reports while ``timer`` replays for ``seconds`` (None: idle)."""
    import time
    fields = ["clocks.sm", "clocks.mem", "power.draw", "temperature.gpu"]
    known = subprocess.run(["nvidia-smi", "--help-query-gpu"], capture_output=True, text=True).stdout
    fields += [f for f in ("clocks_event_reasons.active", "clocks_throttle_reasons.active") if f in known][:1]
    sampler = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                                "-lms", "50"], stdout=subprocess.PIPE, text=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if timer is None:
            time.sleep(0.05)
        else:
            timer.ms()
    torch.cuda.synchronize()
    sampler.terminate()
    rows = [[v.strip() for v in line.split(",")] for line in sampler.communicate()[0].splitlines() if "," in line]
    rows = rows[len(rows) // 4: -max(1, len(rows) // 4)] or rows  # the steady middle
    med = [statistics.median(float(r[i]) for r in rows) for i in range(4)]
    reasons = sorted({r[4] for r in rows}) if len(fields) > 4 else ["n/a"]
    return (f"SM {med[0]:.0f} MHz, memory {med[1]:.0f} MHz, {med[2]:.0f} W, {med[3]:.0f} C, "
            f"clock-event reasons {'/'.join(reasons)} ({len(rows)} samples)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--skip-offline", action="store_true", help="time without the offline report first")
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--groups", default="tiles,math,ahead,residency,dual,layout",
                        help="variant groups to time beside the reference: tiles, math, ahead, residency, dual, "
                        "layout, pingpong")
    parser.add_argument("--clocks", default="", help="variants (comma-separated names) to replay under nvidia-smi")
    parser.add_argument("--once", default="", help="variants (comma-separated names) to launch twice each and "
                        "nothing else, for Nsight Compute (scripts/ncu_prefix.sh)")
    args = parser.parse_args()
    if args.once:
        run(0, tuple(args.groups.split(",")), once=tuple(args.once.split(",")))
    elif args.compile_only:
        compile_only()
    else:
        try:
            if not args.skip_offline:
                compile_only()
        except (OSError, RuntimeError, AttributeError) as exc:  # no ptxas / nvdisasm beside this Triton
            print(f"offline report skipped: {exc}")
        run(args.trials, tuple(args.groups.split(",")), tuple(args.clocks.split(",")) if args.clocks else ())


if __name__ == "__main__":
    main()
