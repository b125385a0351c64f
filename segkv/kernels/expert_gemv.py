"""Triton kernel: matrix-vector products with per-row expert weights chosen on the device.

``out[n] = W[experts[n]] @ x[rows[n]]`` for stacked expert weights ``W (E, Out, In)``: the
expert ids stay on the device, so a mixture-of-experts decode step needs no host
synchronisation (CUDA graphs can capture it), and each (row, expert) pair reads exactly its
expert's weights. Float32 accumulation; the result is rounded once to the output dtype.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _expert_gemv_kernel(
    X, W, OUT, rows, experts,
    stride_xr, stride_we, stride_wo, stride_on,
    IN: tl.constexpr, OUT_DIM: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr,
    EXACT_FP32: tl.constexpr, PAIRS_PER_ROW: tl.constexpr,
):
    """One program: ``BLOCK_O`` outputs of pair ``n``, reading ``BLOCK_I`` input columns at a time.
    ``PAIRS_PER_ROW > 0``: pair ``n`` reads row ``n // PAIRS_PER_ROW`` (``rows`` is not read)."""
    n = tl.program_id(0)
    ob = tl.program_id(1)
    if PAIRS_PER_ROW > 0:
        row = (n // PAIRS_PER_ROW).to(tl.int64)
    else:
        row = tl.load(rows + n).to(tl.int64)
    expert = tl.load(experts + n).to(tl.int64)
    offs_o = ob * BLOCK_O + tl.arange(0, BLOCK_O)
    o_ok = offs_o < OUT_DIM
    acc = tl.zeros([BLOCK_O], tl.float32)
    w_rows = W + expert * stride_we + offs_o[:, None] * stride_wo
    for i0 in range(0, IN, BLOCK_I):
        offs_i = i0 + tl.arange(0, BLOCK_I)
        i_ok = offs_i < IN
        x = tl.load(X + row * stride_xr + offs_i, mask=i_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + offs_i[None, :], mask=o_ok[:, None] & i_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    if EXACT_FP32:
        tl.store(OUT + n * stride_on + offs_o, acc, mask=o_ok)
    else:
        tl.store(OUT + n * stride_on + offs_o, acc.to(OUT.dtype.element_ty, fp_downcast_rounding="rtne"), mask=o_ok)


# Measured on the H200 (scripts/expert_gemv_sweep.py, DeepSeek-V2-Lite shapes, 6 and 48 pairs):
# 16 outputs x 128 inputs per step, 4 warps, was fastest in all four cases (2.5-4.2 TB/s)
BLOCK_O, BLOCK_I, NUM_WARPS = 16, 128, 4


def expert_gemv(x: torch.Tensor, rows: torch.Tensor | int, experts: torch.Tensor, weight: torch.Tensor,
                *, out_dtype: torch.dtype | None = None, block_o: int = BLOCK_O, block_i: int = BLOCK_I,
                num_warps: int = NUM_WARPS) -> torch.Tensor:
    """``x (R, In)``, ``rows (N,)`` and ``experts (N,)`` int64/int32 on the device, ``weight
    (E, Out, In)`` with unit stride on In -> ``(N, Out)`` in ``out_dtype`` (default ``x``'s).
    ``rows`` may be an int ``r``: pair ``n`` reads row ``n // r`` (a token's ``r`` experts in a
    row, as a router returns them; no index tensor to build per step).
    ``block_o``/``block_i``/``num_warps``: the launch (default: the measured best; tuning runs
    set them)."""
    if weight.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("expert_gemv needs unit column strides")
    pairs_per_row = rows if isinstance(rows, int) else 0
    if isinstance(rows, int):
        if rows < 1:
            raise ValueError(f"rows as an int is the pairs per row, at least 1; got {rows}")
        rows = experts  # not read by the kernel
    if x.shape[1] != weight.shape[2] or rows.shape != experts.shape:
        raise ValueError(f"shapes do not match: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"rows {tuple(rows.shape)}, experts {tuple(experts.shape)}")
    n, out_dim, in_dim = rows.numel(), weight.shape[1], weight.shape[2]
    out_dtype = out_dtype or x.dtype
    # the interpreter truncates float32 -> bf16/fp16 stores: there it writes float32, torch rounds
    kernel_dtype = torch.float32 if _INTERPRET else out_dtype
    out = torch.empty(n, out_dim, dtype=kernel_dtype, device=x.device)
    if n:
        grid = (n, triton.cdiv(out_dim, block_o))
        _expert_gemv_kernel[grid](
            x, weight, out, rows, experts, x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
            IN=in_dim, OUT_DIM=out_dim, BLOCK_O=block_o, BLOCK_I=min(block_i, triton.next_power_of_2(in_dim)),
            EXACT_FP32=kernel_dtype == torch.float32, PAIRS_PER_ROW=pairs_per_row, num_warps=num_warps,
        )
    return out.to(out_dtype)
