"""Triton kernel: a latent-attention (MLA) layer's x product at one token, with RoPE and the
latent cache write in its launch.

For batch-1 decode of an MLA layer without a q LoRA (DeepSeek-V2-Lite): the previous MoE layer's
combine (or a plain row), the residual add and RMSNorm, the stacked ``[q | kv_a]`` product (the
split-K GEMV of ``kernels.gemv.dense_gemv``), then per group of output rows: a query head's no-RoPE
part stored for the absorbed product and its RoPE part rotated into the attention's query
buffer; the ``kv_a`` row normed by ``kv_a_layernorm``, its RoPE part rotated, both written into
the latent cache row. The separate RoPE-and-write kernel (``fused_ops.mla_rope_and_write_latent``)
disappears from the step.

The partial sums meet per group (a query head: ``nope + rope`` rows; the latent row: ``rank +
rope`` rows) by a ticket; the group's last program adds them in a fixed order, rounds the
product as the GEMV stores it, and continues exactly as the RoPE-and-write kernel does.
"""

from __future__ import annotations

import torch
from segkv.kernels.triton_import import tl, triton

from segkv.kernels.gemv.dense_gemv import (INPUT_COMBINE, INPUT_NORM, gemv_operands, gemv_slice, row_rms, store_slice,
                                      stored_product)
from segkv.kernels.fused.fused_ops import cos_sin_at, kind_of, rope_pairs, rotate_pair, round_to_kind
from segkv.kernels.moe.moe_ops import check_combine


@triton.jit
def _mla_x_kernel(X, RES, G, RES_OUT, W, PART, TICKETS, stride_w, out_dim, in_dim, eps, EXPERT_W, SHARED, stride_x,
                  POS, COS_SIN, max_position, SLOTS, Q_NOPE, Q_ROPE, stride_rh, LATENT, KV_NORM, kv_eps,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr,
                  INPUT: tl.constexpr, HAS_RES: tl.constexpr, KIND: tl.constexpr, CACHE_KIND: tl.constexpr,
                  NORM_KIND: tl.constexpr, EVICT_FIRST: tl.constexpr, USE_PDL: tl.constexpr,
                  EXPERTS: tl.constexpr, HAS_SHARED: tl.constexpr, H: tl.constexpr, NOPE: tl.constexpr,
                  HALF: tl.constexpr, RANK: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Program ``(nb, kb)``: ``gemv_slice`` of the normed row, its partial and sum of squares
    stored, then its group's ticket (``TICKETS[group]``, back to 0 after): groups ``< H`` are the
    query heads (``NOPE + 2 HALF`` rows each), group ``H`` the latent row (``RANK + 2 HALF``)."""
    nb = tl.program_id(0)
    kb = tl.program_id(1)
    part, square_sum = gemv_slice(X, RES, G, RES_OUT, W, stride_w, out_dim, in_dim, nb, kb, EXPERT_W, SHARED,
                                  stride_x, BLOCK_N, BLOCK_K, INPUT, HAS_RES, KIND, EVICT_FIRST, USE_PDL, EXPERTS,
                                  HAS_SHARED)
    store_slice(PART, part, square_sum, out_dim, nb, kb, BLOCK_N, SPLIT)
    Q_ROWS: tl.constexpr = NOPE + 2 * HALF
    Q_BLOCKS: tl.constexpr = Q_ROWS // BLOCK_N
    KV_BLOCKS: tl.constexpr = (RANK + 2 * HALF) // BLOCK_N
    group = tl.minimum(nb // Q_BLOCKS, H)
    is_q = group < H
    count = tl.where(is_q, Q_BLOCKS, KV_BLOCKS) * SPLIT
    ticket = tl.atomic_add(TICKETS + group, 1, sem="acq_rel", scope="gpu")
    if ticket == count - 1:
        base = group * Q_ROWS
        rms = row_rms(PART, out_dim, in_dim, nb, eps, SPLIT, SPLIT_P2)
        d = tl.arange(0, HALF)
        i1, i2 = rope_pairs(d, HALF, INTERLEAVED)
        cos, sin = cos_sin_at(POS, COS_SIN, 0, d, max_position, HALF)
        if is_q:
            nope = tl.arange(0, NOPE)
            q_nope = stored_product(PART, out_dim, base + nope, rms, KIND, SPLIT, SPLIT_P2)
            tl.store(Q_NOPE + group * NOPE + nope, q_nope.to(Q_NOPE.dtype.element_ty))
            lo = stored_product(PART, out_dim, base + NOPE + i1, rms, KIND, SPLIT, SPLIT_P2)
            hi = stored_product(PART, out_dim, base + NOPE + i2, rms, KIND, SPLIT, SPLIT_P2)
            lo, hi = rotate_pair(lo, hi, cos, sin, KIND)
            tl.store(Q_ROPE + group * stride_rh + i1, lo.to(Q_ROPE.dtype.element_ty))
            tl.store(Q_ROPE + group * stride_rh + i2, hi.to(Q_ROPE.dtype.element_ty))
        else:
            row = LATENT + tl.load(SLOTS).to(tl.int64) * (RANK + 2 * HALF)
            lo = stored_product(PART, out_dim, base + RANK + i1, rms, KIND, SPLIT, SPLIT_P2)
            hi = stored_product(PART, out_dim, base + RANK + i2, rms, KIND, SPLIT, SPLIT_P2)
            lo, hi = rotate_pair(lo, hi, cos, sin, KIND)
            tl.store(row + RANK + i1, round_to_kind(lo, CACHE_KIND).to(LATENT.dtype.element_ty))
            tl.store(row + RANK + i2, round_to_kind(hi, CACHE_KIND).to(LATENT.dtype.element_ty))
            # kv_a_layernorm as the RMSNorm kernel: float32 statistics, h rounded, then weight * h
            cols = tl.arange(0, RANK)
            c = stored_product(PART, out_dim, base + cols, rms, KIND, SPLIT, SPLIT_P2)
            hn = round_to_kind(c * (1.0 / tl.sqrt(tl.sum(c * c, axis=0) / RANK + kv_eps)), KIND)
            w = tl.load(KV_NORM + cols).to(tl.float32)
            normed = round_to_kind(round_to_kind(w * hn, NORM_KIND), CACHE_KIND)
            tl.store(row + cols, normed.to(LATENT.dtype.element_ty))
        tl.store(TICKETS + group, 0)


def mla_x_rope_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, *, num_heads: int, nope_dim: int, kv_norm: tuple[torch.Tensor, float],
                    positions: torch.Tensor, cos_sin: torch.Tensor, slots: torch.Tensor, latent_rows: torch.Tensor,
                    q_rope_out: torch.Tensor, interleaved: bool, expert_weights: torch.Tensor | None = None,
                    shared: torch.Tensor | None = None, block_n: int = 32, block_k: int = 256, num_warps: int = 4,
                    workspace: tuple[torch.Tensor, torch.Tensor] | None = None, pdl: bool | None = None,
                    evict_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's residual add, RMSNorm, stacked MLA x product ``weight (H (nope + R) + r + R,
    hidden)`` (``[q | kv_a]``, no q LoRA), query RoPE, ``kv_a_layernorm`` and latent cache write.

    ``x``: ``(1, hidden)``, or with ``expert_weights (1, k)`` float32 the ``(k, hidden)`` expert
    outputs of the previous MoE layer (plus ``shared (1, hidden)`` or None), combined as
    ``dense_gemv.combine_norm_splitk_gemv`` combines them; ``residual (1, hidden)`` or None
    (``h = x``, a plain row only). ``kv_norm``: ``(weight (r,), eps)``; ``positions``, ``slots``:
    ``(1,)`` (the slot trusted: checked by the caller); ``cos_sin (max_position, R)`` as
    ``RotaryEmbedding.cos_sin_table``; ``latent_rows (slots, r + R)`` contiguous; ``q_rope_out (1,
    H, R)`` with a unit last stride, e.g. the rope columns of the absorbed attention's query.
    Returns ``(q_nope (1, H, nope), h)``: the query's no-RoPE part for the absorbed product and the
    next residual. ``block_n`` must divide ``nope + R`` and ``r + R``."""
    name = "mla_x_rope_gemv"
    out_dim, in_dim = weight.shape
    rope = cos_sin.shape[-1]
    rank = latent_rows.shape[-1] - rope
    q_rows = nope_dim + rope
    if (out_dim != num_heads * q_rows + rank + rope or q_rows % block_n or (rank + rope) % block_n
            or rope % 2 or (rope // 2) & (rope // 2 - 1) or rank & (rank - 1) or nope_dim & (nope_dim - 1)):
        raise ValueError(f"{name}: weight {tuple(weight.shape)} for {num_heads} heads of {nope_dim} + {rope} and a "
                         f"latent of {rank} + {rope} (power-of-two parts, multiples of {block_n})")
    if cos_sin.dtype != weight.dtype or not cos_sin.is_contiguous():
        raise ValueError(f"{name}: the cos/sin table must be contiguous and in {weight.dtype}")
    if latent_rows.dim() != 2 or not latent_rows.is_contiguous() or kv_norm[0].shape != (rank,):
        raise ValueError(f"{name}: latent rows {tuple(latent_rows.shape)} (contiguous) and a kv norm weight "
                         f"{tuple(kv_norm[0].shape)} for a latent of {rank}")
    if q_rope_out.shape != (1, num_heads, rope) or q_rope_out.stride(-1) != 1 or q_rope_out.dtype != weight.dtype:
        raise ValueError(f"{name}: q rope output {tuple(q_rope_out.shape)} {q_rope_out.dtype}, "
                         f"(1, {num_heads}, {rope}) of {weight.dtype} expected")
    if positions.numel() != 1 or slots.numel() != 1:
        raise ValueError(f"{name}: one position and one slot expected")
    combine = expert_weights is not None
    if combine:
        check_combine(name, x, expert_weights, shared, residual, norm_weight)
        if expert_weights.shape[0] != 1 or x.shape[1] != in_dim:
            raise ValueError(f"{name}: one token's expert outputs of {in_dim} expected, got {tuple(x.shape)}")
    ops = gemv_operands(name, x, weight, input_kind=INPUT_COMBINE if combine else INPUT_NORM, residual=residual,
                        norm_weight=norm_weight, block_n=block_n, block_k=block_k, workspace=workspace, pdl=pdl)
    dtype = weight.dtype
    q_nope = torch.empty(1, num_heads, nope_dim, dtype=dtype, device=weight.device)
    _mla_x_kernel[(ops.blocks, ops.split)](
        ops.flat, ops.res, ops.g, q_nope if ops.res_out is None else ops.res_out, weight, ops.part, ops.tickets,
        weight.stride(0), out_dim, in_dim, float(eps), expert_weights.contiguous() if combine else ops.flat,
        shared.reshape(-1) if shared is not None else ops.flat, x.stride(0) if combine else 0,
        positions, cos_sin, cos_sin.shape[0], slots, q_nope, q_rope_out, q_rope_out.stride(1), latent_rows,
        kv_norm[0], float(kv_norm[1]),
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=ops.split, SPLIT_P2=triton.next_power_of_2(ops.split),
        INPUT=INPUT_COMBINE if combine else INPUT_NORM, HAS_RES=ops.res_out is not None, KIND=ops.kind,
        CACHE_KIND=kind_of(latent_rows.dtype), NORM_KIND=kind_of(torch.result_type(kv_norm[0], q_nope)),
        EVICT_FIRST=evict_first, EXPERTS=expert_weights.numel() if combine else 1, HAS_SHARED=shared is not None,
        H=num_heads, NOPE=nope_dim, HALF=rope // 2, RANK=rank, INTERLEAVED=interleaved, num_warps=num_warps,
        **ops.options)
    return q_nope, (x if ops.res_out is None else ops.res_out.view(residual.shape))
