"""Triton building block: the exact merge of one (query row, head)'s float32 partials, the loop
of the merge kernel (``paged_attention._merge_kernel``) and of the product that merges its input
row itself (``merge_gemv``), inlined by both; and :class:`PendingMerge`, an attention output
whose merge is left to that product."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def merge_partials(PART_OUT, PART_LSE, reduce_partials, start, end, p_next, head, offs, col_ok,
                   stride_pp, stride_ph, stride_lp, BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Partials ``reduce_partials[start:end]`` of ``head``, columns ``offs (BLOCK_DV,)`` (where
    ``col_ok``), merged by the numerical contract: returns the normalised float32 output
    ``(BLOCK_DV,)`` (0 without live partials), the weight sum and the largest LSE (the row's LSE
    is ``m_max + log(weight)``; -inf when ``weight == 0``). ``p_next``: the first ``BLOCK_P``
    partial ids, loaded by the caller (before or after its PDL wait). One pass, ``BLOCK_P``
    partials at a time: each block's LSEs and outputs load together (independent loads) and fold
    into a running maximum, weight sum and weighted sum; the next block's ids load one block ahead."""
    offs_p = tl.arange(0, BLOCK_P)
    m = tl.full([BLOCK_P], float("-inf"), tl.float32)  # running maximum (all lanes equal)
    total = tl.zeros([BLOCK_P], tl.float32)
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
    out = out / tl.where(weight == 0.0, 1.0, weight)
    return out, weight, m_max


@dataclass(frozen=True, slots=True)
class PendingMerge:
    """One query row's attention whose merge has not run yet: the product after it
    (``merge_gemv``) merges its input itself, so a batch-1 decode step loses the merge launch.

    ``out (1, H, Dv)``: the attention output where stage 1 wrote a head's only partial (in
    ``out_dtype``, or float32 in Triton's interpreter: unrounded); ``part_out (P, H, Dv)`` and
    ``part_lse (P, H)`` float32 partials; ``reduce_ptr (2,)`` / ``reduce_partials`` the plan's
    int32 CSR of the row's partials. :meth:`resolve` runs the merge launch instead."""

    out: torch.Tensor
    part_out: torch.Tensor
    part_lse: torch.Tensor
    reduce_ptr: torch.Tensor
    reduce_partials: torch.Tensor
    out_dtype: torch.dtype

    def resolve(self) -> torch.Tensor:
        """The merged output ``(1, H, Dv)`` in ``out_dtype`` (the merge launch, as without deferral)."""
        from segkv.kernels.paged_attention import merge_into

        lse = torch.empty(self.out.shape[:2], dtype=torch.float32, device=self.out.device)
        merge_into(self.out, lse, self.part_out, self.part_lse, self.reduce_ptr, self.reduce_partials)
        return self.out.to(self.out_dtype)
