"""Triton building block: a decode program's scan of its work item with the tile's rows split
between its warps, each warp keeping its own online softmax, merged once after the scan.

A row-major decode program has at most 16 (query row, head) pairs: one MMA tile of rows, so its
warps split each tile's key rows among them. In the default scan (``paged_attention``) every tile
then needs the row maximum and sum across the warps and P's columns gathered from every warp for
P.V: reductions and a layout change through shared memory, with barriers, each tile. Here the
``BLOCK_N``-row tile is ``PARTS`` sub-tiles of ``BLOCK_N / PARTS`` rows, a batch dimension of the
products (Triton gives each batch entry its warps): each part's scores, softmax and P.V stay in
its warp, and the parts' float32 ``(max, sum, accumulator)`` are merged exactly once at the end.
The cost: each warp holds a whole ``(pairs, head_dim)`` float32 accumulator.
"""

from __future__ import annotations

import triton
import triton.language as tl

from segkv.kernels.attention_tiles import next_tile_pages, page_index, tile_kv_bases, tile_range, tile_rows_in_page


@triton.jit
def scan_warp_split(q, k_head, v_head, stride_kp, stride_kn, stride_vp, stride_vn, page_table, page_rows,
                    page_key_start, pg0, pg1, offset, valid, scale,
                    DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DK: tl.constexpr,
                    BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PARTS: tl.constexpr,
                    EXACT_FP32: tl.constexpr):
    """The scan of pages ``[pg0, pg1)`` for the pairs of ``q (BLOCK_M, BLOCK_DK)`` (causal
    ``offset`` and ``valid`` per pair), K and V rows of this KV head at ``k_head`` / ``v_head``.
    Returns the running maximum ``(BLOCK_M,)``, the sum ``(BLOCK_M,)`` and the float32
    accumulator ``(BLOCK_M, BLOCK_DV)``, as the default scan leaves them. Pairs that see no key
    keep maximum -inf and sum 0 (no NaN)."""
    PAGES: tl.constexpr = max(BLOCK_N // PAGE_SIZE, 1)  # whole pages a tile covers (1: a page spans tiles)
    SUB: tl.constexpr = (PAGE_SIZE + BLOCK_N - 1) // BLOCK_N  # tiles per page (1: a tile holds whole pages)
    PART_N: tl.constexpr = BLOCK_N // PARTS
    n = tl.arange(0, PARTS)[:, None] * PART_N + tl.arange(0, PART_N)[None, :]  # (PARTS, PART_N) tile rows
    slot = n // PAGE_SIZE
    row_in_page = tile_rows_in_page(n, PAGE_SIZE, PAGES, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    dk_ok = (offs_dk < DK)[None, None, :]
    dv_ok = (offs_dv < DV)[None, None, :]
    k_base = k_head + (row_in_page * stride_kn)[:, :, None] + offs_dk[None, None, :]
    v_base = v_head + (row_in_page * stride_vn)[:, :, None] + offs_dv[None, None, :]
    q_parts = tl.broadcast_to(q[None, :, :], (PARTS, BLOCK_M, BLOCK_DK))
    m_i = tl.full([PARTS, BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([PARTS, BLOCK_M], tl.float32)
    acc = tl.zeros([PARTS, BLOCK_M, BLOCK_DV], tl.float32)
    # the first tile's page indices, then each next tile's one tile ahead (loop-carried)
    page, rows, kst = page_index(page_table, page_rows, page_key_start, pg0 + slot, pg1)
    t0, t1 = tile_range(pg0, pg1, SUB)
    for t in range(t0, t1, PAGES):
        page_cur, rows_cur, kst_cur = page, rows, kst
        page, rows, kst = page_index(page_table, page_rows, page_key_start, next_tile_pages(t, slot, PAGES, SUB),
                                     pg1)
        row_cur, k_tile, v_tile = tile_kv_bases(t, row_in_page, k_base, v_base, stride_kn, stride_vn, SUB, BLOCK_N)
        in_page = row_cur < rows_cur
        k = tl.load(k_tile + (page_cur * stride_kp)[:, :, None], mask=in_page[:, :, None] & dk_ok, other=0.0)
        v = tl.load(v_tile + (page_cur * stride_vp)[:, :, None], mask=in_page[:, :, None] & dv_ok, other=0.0)
        if EXACT_FP32:
            s = tl.dot(q_parts.to(tl.float32), tl.permute(k.to(tl.float32), (0, 2, 1)), input_precision="ieee")
        else:
            s = tl.dot(q_parts, tl.permute(k, (0, 2, 1)))  # bf16/fp16 products are exact in float32
        s = s * scale
        kpos = kst_cur + row_cur
        visible = (kpos[:, None, :] <= offset[None, :, None]) & in_page[:, None, :] & valid[None, :, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 2))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, :, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 2)
        acc = acc * alpha[:, :, None]
        if EXACT_FP32:
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
        else:  # P split exactly into two half-precision parts, as the default scan does
            p_hi = p.to(v.dtype)
            p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
            acc = tl.dot(p_lo, v, tl.dot(p_hi, v, acc))
        m_i = m_new
    # the parts' exact merge: weights exp(m_part - m) (0 for a part that saw nothing)
    m_all = tl.max(m_i, 0)
    m_all_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    weight = tl.exp(m_i - m_all_safe[None, :])
    return m_all, tl.sum(l_i * weight, 0), tl.sum(acc * weight[:, :, None], 0)
