"""Triton kernel: one row per head times that head's weight (batch-1 latent attention).

Absorbed MLA decode multiplies each head's query part by its slice of ``kv_b_proj`` before
attention (``q_nope (H, nope) -> (H, r)`` through ``W_uk (H, nope, r)``) and each head's latent
output by another slice after it (``(H, r) -> (H, v)`` through ``W_uv (H, v, r)``). At one token
these are 2 MB products (DeepSeek-V2-Lite) that a batched GEMM runs latency-bound; here program
``(h, ob)`` holds head ``h``'s ``BLOCK_O x In`` weight block whole, so each program makes one
round trip to memory. The weight may be strided either way (``W_uk`` is read through a transposed
view: its output dim is the contiguous one), so no re-laid copy is kept. With programmatic
dependent launch the block loads before the wait for the kernel that wrote the rows.
"""

from __future__ import annotations

import torch
from segkv.kernels.triton_import import tl, triton

from segkv.kernels.fused.fused_ops import kind_of, round_to_kind
from segkv.kernels.pdl import pdl_options, wait_then_release


@triton.jit
def _head_gemv_kernel(X, W, OUT, stride_xh, stride_wh, stride_wo, stride_wi, stride_oh, out_dim, in_dim,
                      IN_P2: tl.constexpr, BLOCK_O: tl.constexpr, KIND: tl.constexpr, USE_PDL: tl.constexpr):
    """Program ``(h, ob)``: ``OUT[h, o] = sum_i W[h, o, i] X[h, i]`` for ``BLOCK_O`` outputs ``o``,
    float32 sums rounded once to ``OUT``'s dtype (``KIND``)."""
    h = tl.program_id(0).to(tl.int64)
    offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_ok = offs_o < out_dim
    offs_i = tl.arange(0, IN_P2)
    i_ok = offs_i < in_dim
    w = tl.load(W + h * stride_wh + offs_o[:, None].to(tl.int64) * stride_wo + offs_i[None, :] * stride_wi,
                mask=o_ok[:, None] & i_ok[None, :], other=0.0)
    wait_then_release(USE_PDL)  # the weight is constant: loaded before waiting for the rows' writer
    x = tl.load(X + h * stride_xh + offs_i, mask=i_ok, other=0.0).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(OUT + h * stride_oh + offs_o, round_to_kind(acc, KIND).to(OUT.dtype.element_ty), mask=o_ok)


MAX_IN = 1024  # inputs per head: a 16 x 1024 block is 32 KB in bf16, 128 registers' worth per thread


def block_outputs(in_dim: int) -> int:
    """Outputs per program: a weight block of about 8K elements (16 KB in bf16), at least 16 rows."""
    return max(16, triton.next_power_of_2(max(1, 8192 // triton.next_power_of_2(in_dim))))


def head_gemv(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None,
              pdl: bool | None = None) -> torch.Tensor:
    """``x (H, In)`` (unit stride on In) and ``weight (H, Out, In)`` (any strides, e.g. a
    transposed view) -> ``(H, Out)`` in ``x``'s dtype: ``out[h] = weight[h] @ x[h]``, float32 sums
    rounded once. ``out``: an ``(H, Out)`` destination with unit stride on Out (e.g. a view of a
    larger buffer); a new tensor when None. ``pdl``: programmatic dependent launch (default:
    where ``kernels.pdl`` supports it)."""
    if x.dim() != 2 or weight.dim() != 3 or weight.shape[0] != x.shape[0] or weight.shape[2] != x.shape[1]:
        raise ValueError(f"head_gemv: rows (H, In) and weights (H, Out, In) expected, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.stride(1) != 1:
        raise ValueError(f"head_gemv: rows need unit stride along In, got strides {x.stride()}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"head_gemv: weight of {weight.dtype} on {weight.device} for rows of {x.dtype} on {x.device}")
    heads, out_dim, in_dim = weight.shape
    if in_dim > MAX_IN:
        raise ValueError(f"head_gemv: a program holds a head's weight block whole: at most {MAX_IN} inputs, "
                         f"got {in_dim}")
    if out is None:
        out = torch.empty(heads, out_dim, dtype=x.dtype, device=x.device)
    elif out.shape != (heads, out_dim) or out.stride(1) != 1 or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"head_gemv: out {tuple(out.shape)} {out.dtype} with strides {out.stride()}; "
                         f"({heads}, {out_dim}) of {x.dtype} with unit stride along Out expected")
    if heads == 0 or out_dim == 0:
        return out
    block_o = block_outputs(in_dim)
    options = pdl_options(x, pdl)
    _head_gemv_kernel[(heads, triton.cdiv(out_dim, block_o))](
        x, weight, out, x.stride(0), weight.stride(0), weight.stride(1), weight.stride(2), out.stride(0), out_dim,
        in_dim, IN_P2=triton.next_power_of_2(in_dim), BLOCK_O=block_o, KIND=kind_of(x.dtype), num_warps=4, **options)
    return out
