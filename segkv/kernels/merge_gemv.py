"""Triton kernel: the attention output projection of one decode row that merges its input itself.

At batch 1 a decode layer's attention ends with a merge launch (16-33 partials per head) whose
only reader is the output projection; on the H200 that launch took 5.5 us of a Llama-3.1-8B
layer at 1K. Here program ``(n, h)`` of the split-K product over ``W (Out, H * Dv)`` takes head
``h``'s ``Dv`` input columns: it merges the head's partials (``partials_merge.merge_partials``,
the merge kernel's own loop), rounds them once to the output dtype as the merge does, and
multiplies its ``BLOCK_N x Dv`` weight block. A head whose only partial stage 1 wrote to the
output is read from there. The ``H`` partial products of an output block meet by an atomic
ticket, as in ``dense_gemv``. Each head is merged once per output block, so ``BLOCK_N`` sets how
often its partials are read (from L2). Switched by ``SEGKV_MERGE_INTO_O`` (off until measured).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from segkv.kernels.dense_gemv import partials_total, store_slice, workspace_size
from segkv.kernels.fused_ops import kind_of, round_to_kind
from segkv.kernels.partials_merge import PendingMerge, merge_partials
from segkv.kernels.pdl import pdl_options
from segkv.kernels.settings import env_int

MERGE_INTO_O = env_int("SEGKV_MERGE_INTO_O", 0) == 1
# Output rows per program, warps, and partials per merge step. A 128 x 128 weight block over 8
# warps reads each head's partials 32 times for a 4096-row projection (8-17 MB from L2 at 16-33
# partials); 16 partials a step: one step at 1K (16 partitions), 2-3 at 16K. Offline (Triton 3.6,
# sm_90a, head_dim 128, bf16): 77 registers, 3 programs per SM; 32 partials a step: 99, 2 per SM;
# 64 (the merge kernel's): 174, 1. 64 rows over 8 warps, 16 partials: 48 registers, 5 per SM.
MERGE_GEMV_BLOCK_N = env_int("SEGKV_MERGE_GEMV_BLOCK_N", 128)
MERGE_GEMV_WARPS = env_int("SEGKV_MERGE_GEMV_WARPS", 8)
MERGE_GEMV_BLOCK_P = env_int("SEGKV_MERGE_GEMV_BLOCK_P", 16)


@triton.jit
def _merge_gemv_kernel(FINAL, PART_OUT, PART_LSE, reduce_ptr, reduce_partials, W, OUT, PART, TICKETS,
                       stride_w, stride_pp, stride_ph, stride_lp, out_dim,
                       DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_P: tl.constexpr,
                       SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr, KIND: tl.constexpr,
                       EVICT_FIRST: tl.constexpr, USE_PDL: tl.constexpr):
    """Program ``(nb, head)``: output rows ``nb * BLOCK_N + [0, BLOCK_N)`` times head ``head``'s
    merged ``(DV,)`` input. With ``USE_PDL`` the weight block and the plan's partial ids load
    before the wait for stage 1 (the plan is the host's, complete before the launch)."""
    nb = tl.program_id(0)
    head = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < out_dim
    offs = tl.arange(0, BLOCK_DV)
    col_ok = offs < DV
    cols = head * DV + offs
    w = tl.load(W + rows[:, None].to(tl.int64) * stride_w + cols[None, :], mask=r_ok[:, None] & col_ok[None, :],
                other=0.0, eviction_policy="evict_first" if EVICT_FIRST else "")
    start = tl.load(reduce_ptr)
    end = tl.load(reduce_ptr + 1)
    single = end - start == 1  # stage 1 wrote the row's only partial to FINAL
    stop = tl.where(single, start, end)
    offs_p = tl.arange(0, BLOCK_P)
    p_next = tl.load(reduce_partials + start + offs_p, mask=start + offs_p < stop, other=0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    merged, weight, m_max = merge_partials(PART_OUT, PART_LSE, reduce_partials, start, stop, p_next, head, offs,
                                           col_ok, stride_pp, stride_ph, stride_lp, BLOCK_P, BLOCK_DV)
    single_cols = tl.zeros_like(offs) + (end - start) == 1  # a tensor mask (the interpreter takes no scalar)
    direct = tl.load(FINAL + cols, mask=col_ok & single_cols, other=0.0).to(tl.float32)
    # rounded once to the output dtype, as the merge kernel stores it (round to nearest even)
    a = round_to_kind(tl.where(single, direct, merged), KIND)
    part = tl.sum(w.to(tl.float32) * a[None, :], axis=1)
    if SPLIT == 1:
        tl.store(OUT + rows, round_to_kind(part, KIND).to(OUT.dtype.element_ty), mask=r_ok)
    else:
        store_slice(PART, part, 0.0, out_dim, nb, head, BLOCK_N, SPLIT)
        ticket = tl.atomic_add(TICKETS + nb, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:
            total = partials_total(PART, out_dim, rows, r_ok, SPLIT, SPLIT_P2)
            tl.store(OUT + rows, round_to_kind(total, KIND).to(OUT.dtype.element_ty), mask=r_ok)
            tl.store(TICKETS + nb, 0)


def merge_workspace_size(out_dim: int, num_heads: int, head_dim: int, block_n: int) -> tuple[int, int]:
    """``(float32 elements, int32 tickets)`` of a workspace for ``W (out_dim, num_heads * head_dim)``."""
    return workspace_size(out_dim, num_heads * head_dim, block_n, head_dim)


def merge_splitk_gemv(pending: PendingMerge, weight: torch.Tensor, *, block_n: int = MERGE_GEMV_BLOCK_N,
                      num_warps: int = MERGE_GEMV_WARPS, block_p: int = MERGE_GEMV_BLOCK_P,
                      workspace: tuple[torch.Tensor, torch.Tensor] | None = None, pdl: bool | None = None,
                      evict_first: bool = False) -> torch.Tensor:
    """``weight (Out, H * Dv) @ merged`` for one row whose attention merge is ``pending`` ->
    ``(1, Out)`` in ``pending.out_dtype``: the merged row rounded once, float32 sums rounded once.
    ``workspace``: (float32 partials of at least :func:`merge_workspace_size`, int32 zero
    tickets), left zero; allocated when None. ``block_p``: partials merged per step (a power of
    2). ``pdl``, ``evict_first``: as ``dense_gemv.splitk_gemv``."""
    name = "merge_splitk_gemv"
    rows, num_heads, dv = pending.out.shape
    out_dim, in_dim = weight.shape
    if rows != 1:
        raise ValueError(f"{name}: one query row expected, got {rows}")
    if in_dim != num_heads * dv:
        raise ValueError(f"{name}: weight {tuple(weight.shape)} for {num_heads} heads of {dv}")
    if weight.stride(1) != 1 or weight.dtype != pending.out_dtype:
        raise ValueError(f"{name}: weight of {weight.dtype} with unit input stride expected for "
                         f"{pending.out_dtype} rows")
    if not pending.out.is_contiguous() or pending.part_out.stride(2) != 1:
        raise ValueError(f"{name}: contiguous output and partial rows expected")
    floats, tickets_needed = merge_workspace_size(out_dim, num_heads, dv, block_n)
    if workspace is None:
        workspace = (torch.empty(floats, dtype=torch.float32, device=weight.device),
                     torch.zeros(tickets_needed, dtype=torch.int32, device=weight.device))
    part, tickets = workspace
    if part.numel() < floats or tickets.numel() < tickets_needed:
        raise ValueError(f"{name}: workspace of {part.numel()} floats and {tickets.numel()} tickets, "
                         f"{floats} and {tickets_needed} needed")
    out = torch.empty(out_dim, dtype=weight.dtype, device=weight.device)
    _merge_gemv_kernel[(triton.cdiv(out_dim, block_n), num_heads)](
        pending.out, pending.part_out, pending.part_lse, pending.reduce_ptr, pending.reduce_partials, weight, out,
        part, tickets, weight.stride(0), pending.part_out.stride(0), pending.part_out.stride(1),
        pending.part_lse.stride(0), out_dim,
        DV=dv, BLOCK_N=block_n, BLOCK_DV=triton.next_power_of_2(dv), BLOCK_P=block_p, SPLIT=num_heads,
        SPLIT_P2=triton.next_power_of_2(num_heads), KIND=kind_of(weight.dtype), EVICT_FIRST=evict_first,
        num_warps=num_warps, **pdl_options(weight, pdl))
    return out.view(1, out_dim)
