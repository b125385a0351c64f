"""Triton kernel: matrix products of (row, expert) pairs grouped by expert on the device.

``out[n] = W[experts[n]] @ x[rows[n]]`` for stacked expert weights ``W (E, Out, In)``, the
contract of :func:`segkv.kernels.moe.expert_gemv.expert_gemv`, for batches with many pairs: the
pairs are sorted by expert on the device, and one program multiplies a tile of its expert's
weights against up to ``BLOCK_M`` gathered input rows with ``tl.dot``, so an expert's weights
are read about once per call instead of once per pair.

Nothing leaves the device and no shape depends on the expert ids, so a CUDA graph can
capture it: the grid has a fixed upper bound of ``cdiv(N, BLOCK_M) + min(E, N)`` row blocks
(each expert's pairs fill at most one partial block), and the blocks past the real work exit
at once. Float32 accumulation; the result is rounded once to the output dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from segkv.kernels.triton_import import tl, triton

from segkv.settings import SETTINGS

_INTERPRET = SETTINGS.triton_interpret
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(slots=True, frozen=True)
class ExpertGroups:
    """(row, expert) pairs sorted by expert and cut into blocks of ``block_m`` pairs of one
    expert; every tensor is int64 on the device, with a size fixed by ``num_pairs`` and
    ``num_experts`` alone.

    ``order (N,)``: pair indices, stably sorted by expert. ``bounds (E + 1,)``: the pairs of
    expert ``e`` are ``order[bounds[e]:bounds[e + 1]]``. ``block_end (E,)``: one past the last
    block of expert ``e`` (inclusive cumulative block counts). ``block_expert (max_blocks,)``:
    the expert of each block, ``E`` for the blocks past the real work.
    """

    order: torch.Tensor
    bounds: torch.Tensor
    block_end: torch.Tensor
    block_expert: torch.Tensor
    num_pairs: int
    num_experts: int
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.numel()


def default_block_m(num_pairs: int, num_experts: int) -> int:
    """Pairs per block: 16 (the smallest ``tl.dot`` tile) for decode, where an expert holds a
    few pairs; up to 128 when experts hold many, so weights are re-read less often."""
    per_expert = triton.cdiv(num_pairs, max(num_experts, 1))
    return min(128, max(16, triton.next_power_of_2(per_expert)))


def group_pairs_by_expert(experts: torch.Tensor, num_experts: int, *,
                          block_m: int | None = None) -> ExpertGroups:
    """``experts (N,)`` int ids in ``0..num_experts-1`` (not checked: that would synchronise) ->
    the :class:`ExpertGroups` that :func:`grouped_expert_gemm` runs on. Reuse it for every
    product over the same ids (a MoE layer's gate/up and down)."""
    if experts.dim() != 1 or experts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"experts must be (N,) int32/int64, got {tuple(experts.shape)} {experts.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be at least 1, got {num_experts}")
    num_pairs = experts.numel()
    block_m = block_m or default_block_m(num_pairs, num_experts)
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two of at least 16, got {block_m}")
    device = experts.device
    sorted_experts, order = torch.sort(experts.long(), stable=True)
    bounds = torch.searchsorted(sorted_experts, torch.arange(num_experts + 1, device=device))
    blocks = (bounds[1:] - bounds[:-1] + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, dim=0)
    # every expert with pairs adds at most one partial block to the full ones
    max_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=device), right=True)
    return ExpertGroups(order, bounds, block_end, block_expert, num_pairs, num_experts, block_m)


@triton.jit
def _grouped_expert_gemm_kernel(
    X, W, OUT, ROWS, ORDER, BOUNDS, BLOCK_END, BLOCK_EXPERT,
    stride_xr, stride_we, stride_wo, stride_on,
    IN: tl.constexpr, OUT_DIM: tl.constexpr, NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP32_INPUTS: tl.constexpr, UPCAST: tl.constexpr, EXACT_FP32: tl.constexpr, PAIRS_PER_ROW: tl.constexpr,
):
    """One program: ``BLOCK_N`` outputs of up to ``BLOCK_M`` pairs of one expert.
    ``PAIRS_PER_ROW > 0``: pair ``n`` reads row ``n // PAIRS_PER_ROW`` (``ROWS`` is not read)."""
    block = tl.program_id(0)
    nb = tl.program_id(1)
    expert = tl.load(BLOCK_EXPERT + block)
    if expert >= NUM_EXPERTS:  # past the real work: the grid is an upper bound
        return
    pair_lo = tl.load(BOUNDS + expert)
    pair_hi = tl.load(BOUNDS + expert + 1)
    first_block = tl.load(BLOCK_END + expert) - (pair_hi - pair_lo + BLOCK_M - 1) // BLOCK_M
    offs_m = pair_lo + (block - first_block) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < pair_hi
    pairs = tl.load(ORDER + offs_m, mask=m_ok, other=0)
    if PAIRS_PER_ROW > 0:
        rows = (pairs // PAIRS_PER_ROW).to(tl.int64)
    else:
        rows = tl.load(ROWS + pairs, mask=m_ok, other=0).to(tl.int64)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < OUT_DIM
    x_rows = X + rows[:, None] * stride_xr
    w_cols = W + expert * stride_we + offs_n[None, :] * stride_wo  # (BLOCK_K, BLOCK_N) tiles of W^T
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, IN, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < IN
        x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter multiplies bf16 bits as integers: products of float32 copies are exact
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if FP32_INPUTS:  # no TF32: float32 products as exact as expert_gemv's
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:  # bf16/fp16 products are exact in the float32 accumulator
            acc = tl.dot(x, w, acc)
    out = OUT + pairs.to(tl.int64)[:, None] * stride_on + offs_n[None, :]
    out_ok = m_ok[:, None] & n_ok[None, :]
    if EXACT_FP32:
        tl.store(out, acc, mask=out_ok)
    else:
        tl.store(out, acc.to(OUT.dtype.element_ty, fp_downcast_rounding="rtne"), mask=out_ok)


def _check_inputs(x: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor,
                  weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 3 or rows.dim() != 1 or x.shape[1] != weight.shape[2] \
            or rows.shape != experts.shape:
        raise ValueError(f"shapes do not match: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"rows {tuple(rows.shape)}, experts {tuple(experts.shape)}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"grouped_expert_gemm needs x and weight of one dtype among float32, float16 "
                         f"and bfloat16, got {x.dtype} and {weight.dtype}")
    if rows.dtype not in (torch.int32, torch.int64) or experts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows and experts must be int32/int64, got {rows.dtype} and {experts.dtype}")
    if weight.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("grouped_expert_gemm needs unit column strides")
    if weight.shape[0] < 1:
        raise ValueError("weight holds no experts")


def _tile(block_m: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(BLOCK_N, BLOCK_K)``. Decode blocks (a few pairs each) are bound by the weight reads:
    narrow output tiles give many programs and long K steps keep loads in flight (64 x 128
    measured to stream the weights well: docs/performance-notes.md). Blocks of many pairs take
    wider output tiles, so each input row is re-read less often, with K steps that keep the pipelined
    shared-memory buffers well inside the 227 KiB a program may use (float32 tiles are twice
    the bytes)."""
    if block_m <= 32:
        return 64, 128
    return 128, 32 if dtype == torch.float32 else 64


def grouped_expert_gemm(x: torch.Tensor, rows: torch.Tensor | int, experts: torch.Tensor, weight: torch.Tensor,
                        *, out_dtype: torch.dtype | None = None,
                        groups: ExpertGroups | None = None) -> torch.Tensor:
    """``out[n] = weight[experts[n]] @ x[rows[n]]``.

    ``x (R, In)`` float32/float16/bfloat16 and ``weight (E, Out, In)`` of the same dtype, both
    with unit stride on In; ``rows (N,)`` and ``experts (N,)`` int32/int64 on the device ->
    ``(N, Out)`` in ``out_dtype`` (default ``x``'s). Expert ids must lie in ``0..E-1``; they
    are not checked, since that would synchronise (rows of pairs with other ids stay
    unwritten). ``rows`` may be an int ``r``: pair ``n`` reads row ``n // r``, as in
    :func:`~segkv.kernels.moe.expert_gemv.expert_gemv`. ``groups``: :func:`group_pairs_by_expert`
    of ``experts``, when the caller shares it between several products over the same ids.
    """
    pairs_per_row = rows if isinstance(rows, int) else 0
    if isinstance(rows, int):
        if rows < 1:
            raise ValueError(f"rows as an int is the pairs per row, at least 1; got {rows}")
        rows = experts  # not read by the kernel
    _check_inputs(x, rows, experts, weight)
    num_experts, out_dim, in_dim = weight.shape
    n = rows.numel()
    if groups is None:
        groups = group_pairs_by_expert(experts, num_experts)
    elif groups.num_pairs != n or groups.num_experts != num_experts:
        raise ValueError(f"groups of {groups.num_pairs} pairs over {groups.num_experts} experts do not "
                         f"match {n} pairs over {num_experts} experts")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in _DTYPES:
        raise ValueError(f"grouped_expert_gemm writes float32, float16 or bfloat16, not {out_dtype}")
    # the interpreter truncates float32 -> bf16/fp16 stores: there it writes float32, torch rounds
    kernel_dtype = torch.float32 if _INTERPRET else out_dtype
    out = torch.empty(n, out_dim, dtype=kernel_dtype, device=x.device)
    if n:
        block_n, block_k = _tile(groups.block_m, x.dtype)
        grid = (groups.max_blocks, triton.cdiv(out_dim, block_n))
        _grouped_expert_gemm_kernel[grid](
            x, weight, out, rows, groups.order, groups.bounds, groups.block_end, groups.block_expert,
            x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
            IN=in_dim, OUT_DIM=out_dim, NUM_EXPERTS=num_experts,
            BLOCK_M=groups.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            FP32_INPUTS=x.dtype == torch.float32, UPCAST=_INTERPRET and x.dtype != torch.float32,
            EXACT_FP32=kernel_dtype == torch.float32, PAIRS_PER_ROW=pairs_per_row,
            num_warps=4,
        )
    return out.to(out_dtype)
