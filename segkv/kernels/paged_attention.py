"""Triton kernels for attention over pieces: stage-1 partials, the exact LSE merge, the KV write.

Imports torch and triton only. The plan arrives as flat int32 tensors (see the launchers'
docstrings); every float accumulation is float32 and the output is rounded once, in the
merge kernel, so results equal float32 attention over the whole history rounded once.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _stage1_kernel(
    Q, K, V, OUT, LSE,
    page_table, page_rows, page_key_start, piece_page_start, work_piece, work_partial_start, partial_row,
    partial_offset,
    stride_qr, stride_qh, stride_kp, stride_kn, stride_kh, stride_vp, stride_vn, stride_vh,
    stride_op, stride_oh, stride_lp,
    scale,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, EXACT_FP32: tl.constexpr,
):
    """One program: a block of (query row, head-in-group) pairs of one work item and one KV head,
    scanning the work item's piece ``BLOCK_N`` rows (``BLOCK_N / PAGE_SIZE`` pages) at a time with
    an online softmax in float32. Q.K products of bf16/fp16 inputs are exact in float32; for P.V,
    P is split into two bf16/fp16 parts (about 16 significant bits) against the native V tile,
    accumulated in float32; float32 inputs use IEEE float32 throughout."""
    PAGES: tl.constexpr = BLOCK_N // PAGE_SIZE
    w = tl.program_id(0)
    kvh = tl.program_id(1)
    mb = tl.program_id(2)
    p0 = tl.load(work_partial_start + w)
    n_rows = tl.load(work_partial_start + w + 1) - p0
    if mb * BLOCK_M >= n_rows * GROUP:
        return
    pair = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    r = pair // GROUP
    valid = r < n_rows
    head = kvh * GROUP + pair % GROUP
    partial = p0 + tl.where(valid, r, 0)
    qrow = tl.load(partial_row + partial, mask=valid, other=0).to(tl.int64)
    offset = tl.load(partial_offset + partial, mask=valid, other=-1)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + qrow[:, None] * stride_qr + head[:, None] * stride_qh + offs_dk[None, :],
                mask=valid[:, None] & (offs_dk[None, :] < DK), other=0.0)

    piece = tl.load(work_piece + w)
    pg0 = tl.load(piece_page_start + piece)
    pg1 = tl.load(piece_page_start + piece + 1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    slot = offs_n // PAGE_SIZE
    row_in_page = offs_n % PAGE_SIZE
    for pg in range(pg0, pg1, PAGES):
        pidx = pg + slot
        in_range = pidx < pg1
        page = tl.load(page_table + pidx, mask=in_range, other=0).to(tl.int64)
        rows = tl.load(page_rows + pidx, mask=in_range, other=0)
        kpos = tl.load(page_key_start + pidx, mask=in_range, other=0) + row_in_page
        in_page = row_in_page < rows
        k = tl.load(K + page[:, None] * stride_kp + row_in_page[:, None] * stride_kn + kvh * stride_kh
                    + offs_dk[None, :], mask=in_page[:, None] & (offs_dk[None, :] < DK), other=0.0)
        v = tl.load(V + page[:, None] * stride_vp + row_in_page[:, None] * stride_vn + kvh * stride_vh
                    + offs_dv[None, :], mask=in_page[:, None] & (offs_dv[None, :] < DV), other=0.0)
        if EXACT_FP32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # bf16/fp16 products are exact in the float32 accumulator
        s = s * scale
        visible = (kpos[None, :] <= offset[:, None]) & in_page[None, :] & valid[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if EXACT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:  # P split exactly into two half-precision parts: about 16 bits of P, float32 sums
            p_hi = p.to(v.dtype)
            p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
            pv = tl.dot(p_hi, v) + tl.dot(p_lo, v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(OUT + partial[:, None] * stride_op + head[:, None] * stride_oh + offs_dv[None, :], out,
             mask=valid[:, None] & (offs_dv[None, :] < DV))
    tl.store(LSE + partial * stride_lp + head, lse, mask=valid)


@triton.jit
def _merge_kernel(
    PART_OUT, PART_LSE, OUT, OUT_LSE, reduce_ptr, reduce_partials,
    stride_pp, stride_ph, stride_lp, stride_or, stride_oh, stride_lr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """One program per (query row, head): the exact merge of its partials, rounded once."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(reduce_ptr + row)
    end = tl.load(reduce_ptr + row + 1)
    offs = tl.arange(0, BLOCK_DV)
    m = float("-inf")
    for i in range(start, end):
        p = tl.load(reduce_partials + i)
        m = tl.maximum(m, tl.load(PART_LSE + p * stride_lp + head))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = 0.0
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for i in range(start, end):
        p = tl.load(reduce_partials + i)
        lse = tl.load(PART_LSE + p * stride_lp + head)
        wgt = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m_safe))
        o = tl.load(PART_OUT + p * stride_pp + head * stride_ph + offs, mask=offs < DV, other=0.0)
        acc += wgt * tl.where(lse == float("-inf"), 0.0, o)
        total += wgt
    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)
    tl.store(OUT + row * stride_or + head * stride_oh + offs,
             out.to(OUT.dtype.element_ty, fp_downcast_rounding="rtne"), mask=offs < DV)
    tl.store(OUT_LSE + row * stride_lr + head, tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, total))))


@triton.jit
def _kv_write_kernel(SRC, DST, slots, stride_sn, stride_dn, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """Copy row ``i`` of SRC (``WIDTH`` contiguous elements) into flat slot ``slots[i]`` of DST."""
    i = tl.program_id(0)
    slot = tl.load(slots + i).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    row = tl.load(SRC + i * stride_sn + offs, mask=offs < WIDTH)
    tl.store(DST + slot * stride_dn + offs, row.to(DST.dtype.element_ty), mask=offs < WIDTH)


def attention_partials(
    *, query, key_cache, value_cache, page_table, page_rows, page_key_start, piece_page_start, work_piece,
    work_partial_start, partial_row, partial_offset, num_partials, max_work_rows, scale, block_m=64,
    poison=False,
):
    """Stage 1: float32 partial outputs and LSEs of every (work item, row) pair.

    query ``(R, Hq, Dk)``; key_cache ``(P, page_size, Hkv, Dk)``; value_cache
    ``(P, page_size, Hkv, Dv)`` (may be a strided view); the int32 plan tensors:
    page_table/page_rows/page_key_start ``(total_pages,)`` (key_start: position of the page's
    first row within its piece), piece_page_start ``(pieces + 1,)``,
    work_piece ``(W,)``, work_partial_start ``(W + 1,)``, partial_row/partial_offset
    ``(num_partials,)``. Returns ``(out (num_partials, Hq, Dv) float32, lse (num_partials, Hq) float32)``.
    """
    num_heads, dk = query.shape[1], query.shape[2]
    page_size, num_kv = key_cache.shape[1], key_cache.shape[2]
    dv = value_cache.shape[3]
    group = num_heads // num_kv
    out = torch.empty(num_partials, num_heads, dv, dtype=torch.float32, device=query.device)
    lse = torch.empty(num_partials, num_heads, dtype=torch.float32, device=query.device)
    if poison:  # tests: anything the kernel fails to write stays NaN
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    num_work = work_piece.numel()
    if num_work == 0:
        return out, lse
    wide = max(dk, dv) > 128
    block_m = max(16, min(32 if wide else block_m, triton.next_power_of_2(max_work_rows * group)))
    block_n = max(page_size, int(os.environ.get("SEGKV_TRITON_BLOCK_N", 32 if wide else 64)))
    grid = (num_work, num_kv, triton.cdiv(max_work_rows * group, block_m))
    _stage1_kernel[grid](
        query, key_cache, value_cache, out, lse,
        page_table, page_rows, page_key_start, piece_page_start, work_piece, work_partial_start, partial_row,
        partial_offset,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        out.stride(0), out.stride(1), lse.stride(0),
        scale,
        GROUP=group, DK=dk, DV=dv, BLOCK_M=block_m, BLOCK_DK=max(16, triton.next_power_of_2(dk)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)), PAGE_SIZE=page_size, BLOCK_N=block_n,
        # IEEE float32 for float32 inputs, and in the interpreter (whose bf16 dots are unreliable)
        EXACT_FP32=query.dtype == torch.float32 or _INTERPRET,
        num_warps=int(os.environ.get("SEGKV_TRITON_WARPS", 4)), num_stages=int(os.environ.get("SEGKV_TRITON_STAGES", 2)),
    )
    return out, lse


def merge_partials(*, partial_out, partial_lse, reduce_ptr, reduce_partials, num_rows, out_dtype, poison=False):
    """Stage 2: merge partials per row (CSR ``reduce_ptr (R + 1,)``, ``reduce_partials (P,)`` int32).

    Returns ``(out (R, Hq, Dv) out_dtype, lse (R, Hq) float32)``; rows without partials are 0, -inf.
    """
    num_heads, dv = partial_out.shape[1], partial_out.shape[2]
    # Triton's interpreter truncates float32 -> bf16/fp16 stores (even with "rtne"): there the
    # kernel writes float32 and torch rounds once, to nearest even, as the GPU kernel does.
    kernel_dtype = torch.float32 if _INTERPRET else out_dtype
    out = torch.empty(num_rows, num_heads, dv, dtype=kernel_dtype, device=partial_out.device)
    lse = torch.empty(num_rows, num_heads, dtype=torch.float32, device=partial_out.device)
    if poison:
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    if num_rows:
        _merge_kernel[(num_rows, num_heads)](
            partial_out, partial_lse, out, lse, reduce_ptr, reduce_partials,
            partial_out.stride(0), partial_out.stride(1), partial_lse.stride(0),
            out.stride(0), out.stride(1), lse.stride(0),
            DV=dv, BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        )
    return out.to(out_dtype), lse


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
