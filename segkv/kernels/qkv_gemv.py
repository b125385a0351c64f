"""Triton kernel: a decoder layer's first half at one row up to attention, in one launch.

For batch-1 decode of a grouped-query layer: the residual add and RMSNorm, the stacked q/k/v
product (the split-K GEMV of ``kernels.dense_gemv``), the per-head q/k RMSNorm where the model
has one (Qwen3), RoPE, and the write of the new key and value rows into the paged cache. The
separate RoPE-and-write kernel (``fused_ops.rope_and_write_kv``) disappears from the step.

The GEMV's partial sums meet per *head*: the ``SPLIT x head_dim / BLOCK_N`` programs of a head
share a ticket, and the last of them adds the head's partials in a fixed order, rounds the
product to the row's dtype (as the GEMV stores it), then normalizes, rotates and stores exactly
as ``rope_and_write_kv`` (and ``rms_norm`` for q/k norms) would on that stored product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from segkv.kernels.dense_gemv import INPUT_NORM, gemv_operands, gemv_slice, row_rms, store_slice, stored_product
from segkv.kernels.fused_ops import cos_sin_at, head_rms_norm, kind_of, rotate_pair, round_to_kind

_NORM_INPUT = tl.constexpr(INPUT_NORM)  # a global the compiled kernel may read


@triton.jit
def _qkv_rope_kernel(X, RES, G, RES_OUT, W, PART, TICKETS, stride_w, out_dim, in_dim, eps,
                     POS, COS_SIN, max_position, SLOTS, Q_OUT, K_CACHE, V_CACHE,
                     stride_ks, stride_kh, stride_vs, stride_vh, Q_NORM, K_NORM, qk_eps,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr,
                     HAS_RES: tl.constexpr, KIND: tl.constexpr, CACHE_KIND: tl.constexpr,
                     EVICT_FIRST: tl.constexpr, USE_PDL: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                     HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr):
    """Program ``(nb, kb)``: ``gemv_slice`` of the normed row, its partial and sum of squares
    stored, then the head's ticket (``TICKETS[head]``, back to 0 after); the head's last program
    finishes head ``nb // (HEAD_DIM / BLOCK_N)``: a query head rotated into ``Q_OUT``, a key head
    rotated and a value head as is, into cache row ``SLOTS[0]``."""
    nb = tl.program_id(0)
    kb = tl.program_id(1)
    part, square_sum = gemv_slice(X, RES, G, RES_OUT, W, stride_w, out_dim, in_dim, nb, kb, X, X, 0, BLOCK_N,
                                  BLOCK_K, _NORM_INPUT, HAS_RES, KIND, EVICT_FIRST, USE_PDL)
    store_slice(PART, part, square_sum, out_dim, nb, kb, BLOCK_N, SPLIT)
    BLOCKS_PER_HEAD: tl.constexpr = HEAD_DIM // BLOCK_N
    head = nb // BLOCKS_PER_HEAD
    ticket = tl.atomic_add(TICKETS + head, 1, sem="acq_rel", scope="gpu")
    if ticket == SPLIT * BLOCKS_PER_HEAD - 1:
        HALF: tl.constexpr = HEAD_DIM // 2
        d = tl.arange(0, HALF)
        lo_cols = head * HEAD_DIM + d
        rms = row_rms(PART, out_dim, in_dim, nb, eps, SPLIT, SPLIT_P2)
        # the product as the GEMV stores it (scaled, rounded once to the row's dtype)
        lo = stored_product(PART, out_dim, lo_cols, rms, KIND, SPLIT, SPLIT_P2)
        hi = stored_product(PART, out_dim, lo_cols + HALF, rms, KIND, SPLIT, SPLIT_P2)
        slot = tl.load(SLOTS).to(tl.int64)
        if head < HQ + HKV:
            if QK_NORM:
                if head < HQ:
                    lo, hi = head_rms_norm(lo, hi, Q_NORM, d, qk_eps, HEAD_DIM, HALF, KIND)
                else:
                    lo, hi = head_rms_norm(lo, hi, K_NORM, d, qk_eps, HEAD_DIM, HALF, KIND)
            cos, sin = cos_sin_at(POS, COS_SIN, 0, d, max_position, HALF)
            lo, hi = rotate_pair(lo, hi, cos, sin, KIND)
            if head < HQ:
                dst = Q_OUT + head * HEAD_DIM
                tl.store(dst + d, lo.to(Q_OUT.dtype.element_ty))
                tl.store(dst + HALF + d, hi.to(Q_OUT.dtype.element_ty))
            else:
                dst = K_CACHE + slot * stride_ks + (head - HQ) * stride_kh
                tl.store(dst + d, round_to_kind(lo, CACHE_KIND).to(K_CACHE.dtype.element_ty))
                tl.store(dst + HALF + d, round_to_kind(hi, CACHE_KIND).to(K_CACHE.dtype.element_ty))
        else:
            dst = V_CACHE + slot * stride_vs + (head - HQ - HKV) * stride_vh
            tl.store(dst + d, round_to_kind(lo, CACHE_KIND).to(V_CACHE.dtype.element_ty))
            tl.store(dst + HALF + d, round_to_kind(hi, CACHE_KIND).to(V_CACHE.dtype.element_ty))
        tl.store(TICKETS + head, 0)


def qkv_rope_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, *, num_heads: int, num_kv_heads: int, positions: torch.Tensor,
                  cos_sin: torch.Tensor, slots: torch.Tensor, key_rows: torch.Tensor, value_rows: torch.Tensor,
                  q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, qk_eps: float = 1e-6,
                  block_n: int = 16, block_k: int = 512, num_warps: int = 4,
                  workspace: tuple[torch.Tensor, torch.Tensor] | None = None, pdl: bool | None = None,
                  evict_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's residual add, RMSNorm, stacked q/k/v product, q/k norms, RoPE and cache write.

    ``x``, ``residual``: ``(1, hidden)`` (``residual`` None: ``h = x``); ``norm_weight
    (hidden,)``; ``weight ((Hq + 2 Hkv) D, hidden)`` stacking q, k, v; ``positions``, ``slots``:
    ``(1,)`` (the slot is trusted: checked by the caller); ``cos_sin (max_position, D)`` as
    ``RotaryEmbedding.cos_sin_table`` (half-split RoPE); ``key_rows``/``value_rows (slots, Hkv,
    D)``; ``q_norm``, ``k_norm (D,)`` per-head norms (both or neither). Returns ``(q (1, Hq, D)``
    rotated, ``h)``: ``h`` the next residual. ``block_n`` must divide ``D``; workspace as
    ``dense_gemv.workspace_size`` gives it, left zero."""
    name = "qkv_rope_gemv"
    out_dim, _ = weight.shape
    dim = cos_sin.shape[-1]
    if out_dim != (num_heads + 2 * num_kv_heads) * dim or dim % block_n or dim % 2 or (dim // 2) & (dim // 2 - 1):
        raise ValueError(f"{name}: weight {tuple(weight.shape)} for {num_heads} + 2 x {num_kv_heads} heads of "
                         f"{dim} (a power-of-two half, a multiple of {block_n})")
    if cos_sin.dtype != x.dtype or not cos_sin.is_contiguous():
        raise ValueError(f"{name}: the cos/sin table must be contiguous and in {x.dtype}")
    if key_rows.shape[1:] != (num_kv_heads, dim) or value_rows.shape[1:] != (num_kv_heads, dim) or \
            key_rows.stride(-1) != 1 or value_rows.stride(-1) != 1:
        raise ValueError(f"{name}: cache rows {tuple(key_rows.shape)} do not hold ({num_kv_heads}, {dim}) per slot")
    if positions.numel() != 1 or slots.numel() != 1:
        raise ValueError(f"{name}: one position and one slot expected")
    if (q_norm is None) != (k_norm is None) or (q_norm is not None and (q_norm.shape != (dim,)
                                                                           or k_norm.shape != (dim,))):
        raise ValueError(f"{name}: q and k norm weights of ({dim},), both or neither")
    ops = gemv_operands(name, x, weight, input_kind=INPUT_NORM, residual=residual, norm_weight=norm_weight,
                        block_n=block_n, block_k=block_k, workspace=workspace, pdl=pdl)
    q_out = torch.empty(1, num_heads, dim, dtype=x.dtype, device=x.device)
    _qkv_rope_kernel[(ops.blocks, ops.split)](
        ops.flat, ops.res, ops.g, q_out if ops.res_out is None else ops.res_out, weight, ops.part, ops.tickets,
        weight.stride(0), out_dim, weight.shape[1], float(eps), positions, cos_sin, cos_sin.shape[0], slots, q_out,
        key_rows, value_rows, key_rows.stride(0), key_rows.stride(1), value_rows.stride(0), value_rows.stride(1),
        q_out if q_norm is None else q_norm, q_out if k_norm is None else k_norm, float(qk_eps),
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=ops.split, SPLIT_P2=triton.next_power_of_2(ops.split),
        HAS_RES=ops.res_out is not None, KIND=ops.kind, CACHE_KIND=kind_of(key_rows.dtype), EVICT_FIRST=evict_first,
        HQ=num_heads, HKV=num_kv_heads, HEAD_DIM=dim, QK_NORM=q_norm is not None, num_warps=num_warps,
        **ops.options)
    return q_out, (x if ops.res_out is None else ops.res_out.view(x.shape))
