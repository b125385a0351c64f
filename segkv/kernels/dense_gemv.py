"""Triton kernel: one row times a dense weight, split over the input dim (batch-1 decode).

``out = W @ x`` for ``W (Out, In)`` and one row ``x (In,)``: program ``(n, k)`` reads a
``BLOCK_N x BLOCK_K`` block of the weight, so even a small projection spreads its bytes over
hundreds of programs (cuBLAS's batch-1 kernels stream the 8 MB projections of a small model at
1.4-2.5 TB/s). The ``SPLIT`` partial sums of an output block meet by an atomic ticket: the
block's last program adds them in a fixed order (no float atomics, so results do not depend on
timing), rounds once and resets the ticket to 0 for the next launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from segkv.kernels.fused_ops import kind_of
from segkv.kernels.pdl import pdl_options


@triton.jit
def _splitk_gemv_kernel(X, W, OUT, PART, TICKETS, stride_w, out_dim, in_dim,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                        SPLIT_P2: tl.constexpr, USE_PDL: tl.constexpr):
    """With ``USE_PDL`` (programmatic dependent launch): the next kernel may be scheduled at once,
    and this one loads its weight block before waiting for the kernel before it (whose output
    ``X`` is): the weight's memory latency overlaps that kernel's tail."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    nb = tl.program_id(0)
    kb = tl.program_id(1)
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < out_dim
    cols = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    c_ok = cols < in_dim
    w = tl.load(W + rows[:, None].to(tl.int64) * stride_w + cols[None, :], mask=r_ok[:, None] & c_ok[None, :],
                other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(X + cols, mask=c_ok, other=0.0)
    part = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if SPLIT == 1:
        tl.store(OUT + rows, part.to(OUT.dtype.element_ty, fp_downcast_rounding="rtne"), mask=r_ok)
    else:
        tl.store(PART + kb * out_dim + rows, part, mask=r_ok)
        tl.debug_barrier()  # every thread's partials are stored before the ticket (released by it)
        ticket = tl.atomic_add(TICKETS + nb, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:
            ks = tl.arange(0, SPLIT_P2)
            parts = tl.load(PART + ks[:, None] * out_dim + rows[None, :], mask=(ks[:, None] < SPLIT) & r_ok[None, :],
                            other=0.0, cache_modifier=".cg")
            total = tl.sum(parts, axis=0)
            tl.store(OUT + rows, total.to(OUT.dtype.element_ty, fp_downcast_rounding="rtne"), mask=r_ok)
            tl.store(TICKETS + nb, 0)


def splitk_gemv(x: torch.Tensor, weight: torch.Tensor, *, block_n: int = 32, block_k: int = 512, num_warps: int = 4,
                workspace: tuple[torch.Tensor, torch.Tensor] | None = None, pdl: bool | None = None) -> torch.Tensor:
    """``x (In,)`` or ``(1, In)`` times ``weight (Out, In)`` -> ``(Out,)`` / ``(1, Out)`` in ``x``'s
    dtype, float32 sums rounded once. ``workspace``: (float32 partials of at least ``split x Out``,
    int32 zero tickets of at least ``cdiv(Out, block_n)``), left zero; allocated when None.
    ``pdl``: programmatic dependent launch (default: where ``kernels.pdl`` supports it)."""
    out_dim, in_dim = weight.shape
    flat = x.reshape(-1)
    if flat.numel() != in_dim or weight.stride(1) != 1 or flat.stride(0) != 1:
        raise ValueError(f"splitk_gemv: one row of {in_dim} with unit strides expected, got x {tuple(x.shape)} "
                         f"and weight {tuple(weight.shape)}")
    kind_of(x.dtype)
    split = triton.cdiv(in_dim, block_k)
    blocks = triton.cdiv(out_dim, block_n)
    if workspace is None:
        workspace = (torch.empty(split * out_dim, dtype=torch.float32, device=x.device),
                     torch.zeros(blocks, dtype=torch.int32, device=x.device))
    part, tickets = workspace
    out = torch.empty(out_dim, dtype=x.dtype, device=x.device)
    options = pdl_options(x) if pdl is None else ({"launch_pdl": True, "USE_PDL": True} if pdl else {"USE_PDL": False})
    _splitk_gemv_kernel[(blocks, split)](flat, weight, out, part, tickets, weight.stride(0), out_dim, in_dim,
                                         BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split,
                                         SPLIT_P2=triton.next_power_of_2(split), num_warps=num_warps, **options)
    return out.view(*x.shape[:-1], out_dim)
