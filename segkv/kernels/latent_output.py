"""Triton kernel: one query row's latent merge and each head's output product in one launch.

Absorbed MLA decode at one token merges each head's partials into its latent output ``(H, r)``
(``paged_attention``'s merge, rounded once), then multiplies each head's row by its slice of
``kv_b_proj`` (``W_uv (H, v, r)``, ``head_gemv``): two launches of a few microseconds each. Here
both are work items of one launch, taken in order from an atomic counter after the PDL wait: first
the merge's (head, column block) items, each counting itself in its head's counter once its
columns are stored; then the product's (head, output block) items, which load their weight block,
wait until their head's count is full and read the merged row through L2. The product items thus
hold their weights while the merge runs, and there is one launch boundary less. A program holding
a product item knows every merge item is held by a running program, so its wait ends at any
occupancy; the last product item past its wait sets the counters back to 0. Each item computes
what the two launches compute (the merge's program, ``head_gemv``'s program).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from segkv.kernels.fused_ops import kind_of, round_to_kind
from segkv.kernels.head_gemv import MAX_IN, block_outputs
from segkv.kernels.paged_attention import merge_block_dv, merge_program
from segkv.kernels.pdl import pdl_options
from segkv.kernels.work_items import claim_item, count_done, leave_zero_if_last, wait_full

_FIXED_COUNTERS = tl.constexpr(2)  # [0] the work dispenser, [1] product items past their wait, [2 + h] head h


@triton.jit
def _merge_head_gemv_kernel(
    PART_OUT, PART_LSE, LAT, LSE, reduce_ptr, reduce_partials, W, OUT, COUNTERS,
    stride_pp, stride_ph, stride_lp, stride_lat_h, stride_wh, stride_wo, stride_wi, stride_oh,
    HEADS: tl.constexpr, RANK: tl.constexpr, RANK_P2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_P: tl.constexpr,
    V_DIM: tl.constexpr, BLOCK_O: tl.constexpr, KIND: tl.constexpr, COUNTERS_P2: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Items ``< HEADS x cdiv(RANK, BLOCK_DV)``: the merge program ``(row 0, head, column block)``
    into ``LAT (1, HEADS, RANK)`` / ``LSE (1, HEADS)``. Then items ``(head, output block)``:
    ``OUT[h, o] = sum_i W[h, o, i] LAT[0, h, i]`` for ``BLOCK_O`` outputs, float32 sums rounded once."""
    MERGE_BLOCKS: tl.constexpr = (RANK + BLOCK_DV - 1) // BLOCK_DV
    OUT_BLOCKS: tl.constexpr = (V_DIM + BLOCK_O - 1) // BLOCK_O
    item = claim_item(COUNTERS, USE_PDL)
    if item < HEADS * MERGE_BLOCKS:
        head = item // MERGE_BLOCKS
        merge_program(PART_OUT, PART_LSE, LAT, LSE, reduce_ptr, reduce_partials, stride_pp, stride_ph, stride_lp,
                      0, stride_lat_h, 0, 0, head, item % MERGE_BLOCKS, RANK, BLOCK_DV, BLOCK_P, False, False, 1)
        count_done(COUNTERS + _FIXED_COUNTERS + head)
    else:
        g = item - HEADS * MERGE_BLOCKS
        h = (g // OUT_BLOCKS).to(tl.int64)
        offs_o = (g % OUT_BLOCKS) * BLOCK_O + tl.arange(0, BLOCK_O)
        o_ok = offs_o < V_DIM
        offs_i = tl.arange(0, RANK_P2)
        i_ok = offs_i < RANK
        w = tl.load(W + h * stride_wh + offs_o[:, None].to(tl.int64) * stride_wo + offs_i[None, :] * stride_wi,
                    mask=o_ok[:, None] & i_ok[None, :], other=0.0)  # constant: loaded before the wait
        wait_full(COUNTERS + _FIXED_COUNTERS + h, MERGE_BLOCKS)
        # the merged row as stored in the weights' dtype (a float32 row: the interpreter's, rounded here)
        x = round_to_kind(tl.load(LAT + h * stride_lat_h + offs_i, mask=i_ok, other=0.0,
                                  cache_modifier=".cg").to(tl.float32), KIND)
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        tl.store(OUT + h * stride_oh + offs_o, round_to_kind(acc, KIND).to(OUT.dtype.element_ty), mask=o_ok)
        leave_zero_if_last(COUNTERS + 1, HEADS * OUT_BLOCKS, COUNTERS, HEADS + _FIXED_COUNTERS, COUNTERS_P2)


def counters_size(heads: int) -> int:
    """int32 counters a launch over ``heads`` heads needs (zeros; the launch leaves them zero)."""
    return heads + _FIXED_COUNTERS.value


def merge_with_head_gemv(lat: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor,
                         reduce_ptr: torch.Tensor, reduce_partials: torch.Tensor, weight: torch.Tensor,
                         counters: torch.Tensor, *, pdl: bool | None = None) -> torch.Tensor:
    """The merge of one query row (``paged_attention.merge_into``'s arguments: ``lat (1, H, r)``,
    ``lse (1, H)``, the float32 partials and the plan's CSR) and ``head_gemv(lat[0], weight)`` for
    ``weight (H, v, r)`` (any strides), in one launch. ``counters``: :func:`counters_size` int32
    zeros, left zero. Returns ``(H, v)`` in ``weight``'s dtype; ``lat`` and ``lse`` hold the merge
    (``lat`` may be float32 for a half-precision weight: the interpreter's kernels write that, and
    the product rounds the row to the weight's dtype first, as the stored row is rounded)."""
    if lat.dim() != 3 or lat.shape[0] != 1 or lat.stride(2) != 1:
        raise ValueError(f"merge_with_head_gemv: one query row (1, H, r) with unit column stride expected, got "
                         f"{tuple(lat.shape)} with strides {lat.stride()}")
    _, heads, rank = lat.shape
    if (weight.dim() != 3 or weight.shape[0] != heads or weight.shape[2] != rank
            or lat.dtype not in (weight.dtype, torch.float32)):
        raise ValueError(f"merge_with_head_gemv: weights (H, v, r) of the rows' dtype for rows {tuple(lat.shape)} "
                         f"{lat.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    if rank > MAX_IN:
        raise ValueError(f"merge_with_head_gemv: at most {MAX_IN} latent columns, got {rank}")
    if counters.dtype != torch.int32 or counters.numel() < counters_size(heads) or counters.device != lat.device:
        raise ValueError(f"merge_with_head_gemv: {counters_size(heads)} int32 counters on {lat.device} needed, got "
                         f"{counters.numel()} {counters.dtype} on {counters.device}")
    v_dim = weight.shape[1]
    out = torch.empty(heads, v_dim, dtype=weight.dtype, device=lat.device)
    block_dv, block_o = merge_block_dv(rank), block_outputs(rank)
    items = heads * (triton.cdiv(rank, block_dv) + triton.cdiv(v_dim, block_o))
    _merge_head_gemv_kernel[(items,)](
        part_out, part_lse, lat, lse, reduce_ptr, reduce_partials, weight, out, counters,
        part_out.stride(0), part_out.stride(1), part_lse.stride(0), lat.stride(1), weight.stride(0), weight.stride(1),
        weight.stride(2), out.stride(0),
        HEADS=heads, RANK=rank, RANK_P2=triton.next_power_of_2(rank), BLOCK_DV=block_dv,
        BLOCK_P=16 if block_dv > 256 else 64, V_DIM=v_dim, BLOCK_O=block_o, KIND=kind_of(weight.dtype),
        COUNTERS_P2=triton.next_power_of_2(counters_size(heads)), num_warps=4, **pdl_options(lat, pdl),
    )
    return out
