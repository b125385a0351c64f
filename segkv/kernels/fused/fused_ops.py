"""Triton kernels that fuse a decode step's small operations (one launch instead of several).

* :func:`rms_norm`: ``weight * round(x / sqrt(mean(x^2) + eps))``, optionally on ``x + residual``
  (the residual add of a pre-norm block), also returning the sum.
* :func:`silu_and_mul`: ``silu(gate) * up`` over the packed ``(T, 2I)`` gate/up product.
* :func:`rope_and_write_kv`: rotary position encoding of q and k (half-split layout, Llama/Qwen)
  and the write of the rotated k and of v into the paged cache at the step's slots; cos and sin
  come from a table that torch computed (the GPU's fast sin/cos would round differently).

Each kernel computes in float32 and rounds where the unfused torch code rounds (every
intermediate torch op with a bf16/fp16 result), so it gives the same values as the layers'
torch path up to the last bit of float32 sums and of ``exp`` (SiLU). Rounding to bf16 and fp16
is done on the bits (round to nearest even), which Triton's interpreter also gets right and
no compiler folds away; stores then write values that are already representable.
"""

from __future__ import annotations

import torch
from segkv.kernels.triton_import import tl, triton

from segkv.kernels.pdl import pdl_options, wait_then_release

_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def kind_of(dtype: torch.dtype) -> int:
    if dtype not in _KIND:
        raise ValueError(f"fused ops support float32, float16 and bfloat16, not {dtype}")
    return _KIND[dtype]


@triton.jit
def round_to_kind(x, KIND: tl.constexpr):
    """``x`` (float32) rounded to the dtype of ``KIND`` (0 float32, 1 float16, 2 bfloat16), as float32.

    Done on the bits (round to nearest even of the mantissa: 7 bits for bf16, 10 for fp16), since
    the compiler may fold a float16 round trip ``x.to(f16).to(f32)`` into ``x``. fp16's subnormal
    range (below 2^-14, a fixed spacing of 2^-24) rounds by adding and removing 0.75, whose float32
    spacing is 2^-24; beyond 65504 it overflows to infinity, as a float16 cast does.
    """
    y = x
    if KIND != 0:
        DROP: tl.constexpr = 16 if KIND == 2 else 13
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)
        y = ((bits >> DROP) << DROP).to(tl.float32, bitcast=True)
        if KIND == 1:
            y = tl.where(tl.abs(x) < 6.103515625e-05, (x + 0.75) - 0.75, y)
            y = tl.where(tl.abs(y) > 65504.0, tl.where(x > 0, float("inf"), float("-inf")), y)  # overflow
    return y


@triton.jit
def _rms_norm_kernel(
    X, RES, W, OUT, RES_OUT,
    stride_x, stride_r, stride_o, stride_ro,
    N, eps,
    HAS_RES: tl.constexpr, X_KIND: tl.constexpr, OUT_KIND: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per row of ``N`` columns."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(RES + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        x = round_to_kind(x + r, X_KIND)
        tl.store(RES_OUT + row * stride_ro + cols, x, mask=ok)
    var = tl.sum(x * x, axis=0) / N
    h = round_to_kind(x * (1.0 / tl.sqrt(var + eps)), X_KIND)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, round_to_kind(w * h, OUT_KIND), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dim of ``x (..., N)``; with ``residual`` (same shape and dtype) the
    norm is of ``s = x + residual`` (rounded to ``x.dtype``).

    Returns ``(out, s)``: ``out`` in ``promote(weight.dtype, x.dtype)`` (as ``weight * h``
    promotes), ``s`` None without a residual.
    """
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight of shape {tuple(weight.shape)} for rows of {n}")
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.result_type(weight, x), device=x.device)
    res = res_out = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("residual must have x's shape and dtype")
        res = residual.reshape(-1, n).contiguous()
        res_out = torch.empty_like(res)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res if res is not None else rows, weight, out, res_out if res_out is not None else out,
            rows.stride(0), res.stride(0) if res is not None else 0, out.stride(0),
            res_out.stride(0) if res_out is not None else 0, n, float(eps),
            HAS_RES=residual is not None, X_KIND=kind_of(x.dtype), OUT_KIND=kind_of(out.dtype),
            BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 4096 else 8,
        )
    out = out.view(x.shape)
    return out, (res_out.view(x.shape) if res_out is not None else None)


@triton.jit
def _silu_and_mul_kernel(X, OUT, stride_x, stride_o, INNER, KIND: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, block): ``BLOCK`` outputs of one row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INNER
    g = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + INNER + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, silu_mul_rounded(g, u, KIND), mask=ok)


@triton.jit
def silu_mul_rounded(g, u, KIND: tl.constexpr):
    """``silu(g) * u`` (float32 in, float32 out) rounded as ``F.silu(gate) * up`` rounds in the
    dtype of ``KIND``: the activation, then the product."""
    act = round_to_kind(g / (1.0 + tl.exp(-g)), KIND)
    return round_to_kind(act * u, KIND)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x (T, 2I)`` holding ``[gate | up]`` -> ``silu(gate) * up`` ``(T, I)`` in ``x.dtype``."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul takes (T, 2I), got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    inner = x.shape[1] // 2
    out = torch.empty(x.shape[0], inner, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inner))
    if x.shape[0]:
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(inner, block))](
            x, out, x.stride(0), out.stride(0), inner, KIND=kind_of(x.dtype), BLOCK=block, num_warps=4)
    return out


@triton.jit
def cos_sin_at(POS, COS_SIN, t, d, max_position, HALF: tl.constexpr):
    """cos and sin (float32) of token ``t``'s position, columns ``d``, from the ``[cos | sin]``
    table. Positions beyond the table (invalid input) read its last row, not foreign memory."""
    pos = tl.minimum(tl.maximum(tl.load(POS + t).to(tl.int64), 0), max_position - 1)
    cos = tl.load(COS_SIN + pos * (2 * HALF) + d).to(tl.float32)
    sin = tl.load(COS_SIN + pos * (2 * HALF) + HALF + d).to(tl.float32)
    return cos, sin


@triton.jit
def _rotate(src, i1, i2, cos, sin, KIND: tl.constexpr, mask=None):
    """RoPE of the head(s) at ``src``, pairs ``(x[i1], x[i2])`` (half-split: ``d, HALF + d``;
    interleaved: ``2d, 2d + 1``): ``(x1 cos - x2 sin, x2 cos + x1 sin)``, each product and sum
    rounded as the torch ops round. ``mask``: the elements that exist (others read as 0)."""
    if mask is None:
        x1 = tl.load(src + i1)
        x2 = tl.load(src + i2)
    else:
        x1 = tl.load(src + i1, mask=mask, other=0.0)
        x2 = tl.load(src + i2, mask=mask, other=0.0)
    return rotate_pair(x1.to(tl.float32), x2.to(tl.float32), cos, sin, KIND)


@triton.jit
def rope_pairs(d, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The columns of RoPE pairs ``d``: ``(2d, 2d + 1)`` interleaved (DeepSeek), else the halves'
    ``(d, HALF + d)``."""
    if INTERLEAVED:
        i1 = 2 * d
        i2 = 2 * d + 1
    else:
        i1 = d
        i2 = HALF + d
    return i1, i2


@triton.jit
def rotate_pair(x1, x2, cos, sin, KIND: tl.constexpr):
    """``(x1 cos - x2 sin, x2 cos + x1 sin)`` of float32 values, each product and sum rounded as
    the torch ops round in the dtype of ``KIND``."""
    lo = round_to_kind(round_to_kind(x1 * cos, KIND) - round_to_kind(x2 * sin, KIND), KIND)
    hi = round_to_kind(round_to_kind(x2 * cos, KIND) + round_to_kind(x1 * sin, KIND), KIND)
    return lo, hi


@triton.jit
def head_rms_norm(lo, hi, W, d, eps, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, KIND: tl.constexpr):
    """RMSNorm of one head held as halves ``lo, hi (HALF,)`` float32, weight ``W (HEAD_DIM,)``,
    rounded as :func:`rms_norm` rounds (``h / rms``, then ``w * h``), as float32."""
    inv = 1.0 / tl.sqrt((tl.sum(lo * lo, axis=0) + tl.sum(hi * hi, axis=0)) / HEAD_DIM + eps)
    w_lo = tl.load(W + d).to(tl.float32)
    w_hi = tl.load(W + HALF + d).to(tl.float32)
    return (round_to_kind(w_lo * round_to_kind(lo * inv, KIND), KIND),
            round_to_kind(w_hi * round_to_kind(hi * inv, KIND), KIND))


@triton.jit
def _normed_rotated_head(src, d, W, eps, cos, sin, NORM: tl.constexpr, HALF: tl.constexpr, KIND: tl.constexpr):
    """One half-split head at ``src``, RMS-normed by ``W`` first when ``NORM``, then rotated:
    its halves ``(lo, hi)`` float32."""
    lo = tl.load(src + d).to(tl.float32)
    hi = tl.load(src + HALF + d).to(tl.float32)
    if NORM:
        lo, hi = head_rms_norm(lo, hi, W, d, eps, 2 * HALF, HALF, KIND)
    return rotate_pair(lo, hi, cos, sin, KIND)


@triton.jit
def _rope_kv_kernel(
    Q, K, V, POS, COS_SIN, SLOTS, Q_OUT, K_CACHE, V_CACHE, Q_NORM, K_NORM,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_cs, stride_ch, stride_vs, stride_vch,
    max_position, q_eps, k_eps,
    HQ: tl.constexpr, HALF: tl.constexpr, KIND: tl.constexpr, CACHE_KIND: tl.constexpr,
    QK_NORM: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (token, head): heads ``< HQ`` rotate a query head into ``Q_OUT``; the others rotate
    key head ``h - HQ`` and write it, with the value head, into the cache row ``SLOTS[token]``.
    ``COS_SIN (max_position, 2 HALF)`` holds ``[cos | sin]`` already in the q dtype. With
    ``QK_NORM`` (Qwen3) each query / key head is RMS-normed by ``Q_NORM`` / ``K_NORM`` first."""
    # letting the next launch be scheduled before the wait measured level (docs/benchmarks.md)
    wait_then_release(USE_PDL)  # q, k, v come from the launch before
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, HALF)
    cos, sin = cos_sin_at(POS, COS_SIN, t, d, max_position, HALF)
    if h < HQ:
        lo, hi = _normed_rotated_head(Q + t * stride_qt + h * stride_qh, d, Q_NORM, q_eps, cos, sin, QK_NORM, HALF,
                                      KIND)
        dst = Q_OUT + t * stride_ot + h * stride_oh
        tl.store(dst + d, lo)
        tl.store(dst + HALF + d, hi)
    else:
        kv = h - HQ
        slot = tl.load(SLOTS + t).to(tl.int64)
        lo, hi = _normed_rotated_head(K + t * stride_kt + kv * stride_kh, d, K_NORM, k_eps, cos, sin, QK_NORM, HALF,
                                      KIND)
        dst = K_CACHE + slot * stride_cs + kv * stride_ch
        # the cache rounds once more to its own dtype (as ``.to(cache dtype)`` does)
        tl.store(dst + d, round_to_kind(lo, CACHE_KIND))
        tl.store(dst + HALF + d, round_to_kind(hi, CACHE_KIND))
        v_src = V + t * stride_vt + kv * stride_vh
        v_dst = V_CACHE + slot * stride_vs + kv * stride_vch
        tl.store(v_dst + d, round_to_kind(tl.load(v_src + d).to(tl.float32), CACHE_KIND))
        tl.store(v_dst + HALF + d, round_to_kind(tl.load(v_src + HALF + d).to(tl.float32), CACHE_KIND))


def rope_fusable(head_dim: int, *, interleaved: bool) -> bool:
    """Whether :func:`rope_and_write_kv` implements a RoPE of ``head_dim``: half-split pairs
    (not interleaved) and a power-of-two half width."""
    return not interleaved and mla_rope_fusable(head_dim)


def mla_rope_fusable(rope_dim: int) -> bool:
    """Whether :func:`mla_rope_and_write_latent` implements a RoPE of ``rope_dim`` (either pairing):
    an even width whose half is a power of two."""
    half = rope_dim // 2
    return rope_dim % 2 == 0 and half > 0 and half & (half - 1) == 0


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin: torch.Tensor, slots: torch.Tensor, key_rows: torch.Tensor,
                      value_rows: torch.Tensor, *, q_norm: torch.Tensor | None = None,
                      k_norm: torch.Tensor | None = None, q_eps: float = 1e-6, k_eps: float = 1e-6,
                      pdl: bool | None = None) -> torch.Tensor:
    """Rotate ``q (T, Hq, D)`` and ``k (T, Hkv, D)`` at ``positions (T,)`` (half-split RoPE; the
    ``cos_sin (max_position, D)`` table ``[cos | sin]`` in ``q.dtype``, e.g.
    ``RotaryEmbedding.cos_sin_table``) and write the rotated k and ``v (T, Hkv, D)`` into
    ``key_rows``/``value_rows (slots, Hkv, D)`` at ``slots (T,)``. Returns the rotated q
    ``(T, Hq, D)`` in ``q.dtype``. Inputs may be strided views (the packed QKV product); the
    last dim must be contiguous. Slots are trusted (checked by the caller); positions are
    clamped to the table.

    ``q_norm``, ``k_norm (D,)`` in ``q.dtype`` (both or neither; Qwen3): each head is first
    RMS-normed as :func:`rms_norm` with ``q_eps`` / ``k_eps`` would, in the same launch. ``pdl``
    forces programmatic dependent launch on or off (default: where the device has it)."""
    t, hq, dim = q.shape
    hkv = k.shape[1]
    if dim % 2 or cos_sin.shape[1:] != (dim,) or k.shape != (t, hkv, dim) or v.shape != (t, hkv, dim):
        raise ValueError(f"rope_and_write_kv: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"cos_sin {tuple(cos_sin.shape)}")
    if cos_sin.dtype != q.dtype or not cos_sin.is_contiguous():
        raise ValueError(f"the cos/sin table must be contiguous and in q's dtype {q.dtype}, not {cos_sin.dtype}")
    if key_rows.shape[1:] != (hkv, dim) or value_rows.shape[1:] != (hkv, dim):
        raise ValueError(f"cache rows {tuple(key_rows.shape)} do not hold ({hkv}, {dim}) per slot")
    half = dim // 2
    if half & (half - 1):
        raise ValueError(f"rope_and_write_kv needs a power-of-two head_dim / 2, got {half}")
    if (q_norm is None) != (k_norm is None) or any(
            w is not None and (w.shape != (dim,) or w.dtype != q.dtype or not w.is_contiguous())
            for w in (q_norm, k_norm)):
        raise ValueError(f"rope_and_write_kv: q and k norm weights of ({dim},) in {q.dtype}, both or neither")
    for name, x in (("q", q), ("k", k), ("v", v), ("key_rows", key_rows), ("value_rows", value_rows)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit stride on its last dim")
    q_out = torch.empty(t, hq, dim, dtype=q.dtype, device=q.device)
    if t:
        _rope_kv_kernel[(t, hq + hkv)](
            q, k, v, positions, cos_sin, slots, q_out, key_rows, value_rows,
            q_out if q_norm is None else q_norm, q_out if k_norm is None else k_norm,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1), key_rows.stride(0), key_rows.stride(1),
            value_rows.stride(0), value_rows.stride(1), cos_sin.shape[0], float(q_eps), float(k_eps),
            HQ=hq, HALF=half, KIND=kind_of(q.dtype), CACHE_KIND=kind_of(key_rows.dtype),
            QK_NORM=q_norm is not None, num_warps=1,
            enable_fp_fusion=False,  # a*c - b*s as an FMA rounds once; torch rounds each product
            **pdl_options(q, pdl),
        )
    return q_out


@triton.jit
def _mla_rope_latent_kernel(
    Q_PE, K_PE, C_KV, POS, COS_SIN, SLOTS, Q_OUT, LATENT, NORM_W,
    stride_qt, stride_qh, stride_kt, stride_ct, stride_ot, stride_oh, stride_ls,
    max_position, RANK, eps,
    H: tl.constexpr, H_P2: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr,
    KIND: tl.constexpr, CACHE_KIND: tl.constexpr, NORM: tl.constexpr, C_KIND: tl.constexpr,
    NORM_KIND: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program ``token``: rotates the rope part of each of its ``H`` query heads into ``Q_OUT``
    (all heads as one tile), then writes the latent row ``[c_kv | rope(k_pe)]`` at
    ``SLOTS[token]``, with ``c_kv`` first RMS-normalised by ``NORM_W`` when ``NORM`` (then
    ``BLOCK_R`` covers the whole row)."""
    wait_then_release(USE_PDL)  # q_pe, k_pe, c_kv come from the launch before
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF)
    cos, sin = cos_sin_at(POS, COS_SIN, t, d, max_position, HALF)
    i1, i2 = rope_pairs(d, HALF, INTERLEAVED)
    heads = tl.arange(0, H_P2)
    h_ok = (heads < H)[:, None]
    lo, hi = _rotate(Q_PE + t * stride_qt + heads[:, None] * stride_qh, i1[None, :], i2[None, :], cos[None, :],
                     sin[None, :], KIND, h_ok)
    dst = Q_OUT + t * stride_ot + heads[:, None] * stride_oh
    tl.store(dst + i1[None, :], lo, mask=h_ok)
    tl.store(dst + i2[None, :], hi, mask=h_ok)
    # the latent row
    row = LATENT + tl.load(SLOTS + t).to(tl.int64) * stride_ls
    lo, hi = _rotate(K_PE + t * stride_kt, i1, i2, cos, sin, KIND)
    tl.store(row + RANK + i1, round_to_kind(lo, CACHE_KIND))
    tl.store(row + RANK + i2, round_to_kind(hi, CACHE_KIND))
    if NORM:  # as the RMSNorm kernel: float32 statistics, h rounded to c's dtype, then weight * h
        cols = tl.arange(0, BLOCK_R)
        ok = cols < RANK
        c = tl.load(C_KV + t * stride_ct + cols, mask=ok, other=0.0).to(tl.float32)
        var = tl.sum(c * c, axis=0) / RANK
        hn = round_to_kind(c * (1.0 / tl.sqrt(var + eps)), C_KIND)
        w = tl.load(NORM_W + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(row + cols, round_to_kind(round_to_kind(w * hn, NORM_KIND), CACHE_KIND), mask=ok)
    else:
        for r0 in range(0, RANK, BLOCK_R):
            cols = r0 + tl.arange(0, BLOCK_R)
            ok = cols < RANK
            c = tl.load(C_KV + t * stride_ct + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(row + cols, round_to_kind(c, CACHE_KIND), mask=ok)


def mla_rope_and_write_latent(q_pe: torch.Tensor, k_pe: torch.Tensor, c_kv: torch.Tensor, positions: torch.Tensor,
                              cos_sin: torch.Tensor, slots: torch.Tensor, latent_rows: torch.Tensor, *,
                              interleaved: bool, norm: tuple[torch.Tensor, float] | None = None,
                              out: torch.Tensor | None = None) -> torch.Tensor:
    """Multi-head latent attention's RoPE and cache write in one kernel: rotate ``q_pe (T, H, R)``
    and ``k_pe (T, R)`` at ``positions (T,)`` (``cos_sin (max_position, R)`` ``[cos | sin]`` in
    q's dtype, e.g. ``RotaryEmbedding.cos_sin_table``; ``interleaved``: pairs ``(x[2i], x[2i+1])``
    as DeepSeek's, else the halves) and write ``[c_kv (T, r) | rope(k_pe)]`` into
    ``latent_rows (slots, r + R)`` at ``slots (T,)``. ``norm``: ``(weight (r,), eps)`` of the
    ``kv_a_layernorm`` RMSNorm, applied to ``c_kv`` first (as ``rms_norm`` computes it). Returns the
    rotated ``q_pe (T, H, R)``, in ``out`` when given (e.g. the rope columns of the attention's
    query buffer, which then needs no concatenation). The rope parts are rounded as the torch
    layers round (bit-equal). Inputs may be strided views with a unit last stride; slots are
    trusted (checked by the caller), positions clamped to the table."""
    t, heads, rope = q_pe.shape
    rank = c_kv.shape[-1] if c_kv.dim() == 2 else -1
    if (rope % 2 or k_pe.shape != (t, rope) or c_kv.shape != (t, rank) or cos_sin.shape[1:] != (rope,)
            or latent_rows.dim() != 2 or latent_rows.shape[1] != rank + rope
            or (norm is not None and norm[0].shape != (rank,))):
        raise ValueError(f"mla_rope_and_write_latent: q_pe {tuple(q_pe.shape)}, k_pe {tuple(k_pe.shape)}, "
                         f"c_kv {tuple(c_kv.shape)}, cos_sin {tuple(cos_sin.shape)}, latent rows "
                         f"{tuple(latent_rows.shape)}" + ("" if norm is None else f", norm weight {tuple(norm[0].shape)}"))
    if cos_sin.dtype != q_pe.dtype or not cos_sin.is_contiguous():
        raise ValueError(f"the cos/sin table must be contiguous and in q's dtype {q_pe.dtype}, not {cos_sin.dtype}")
    half = rope // 2
    if half & (half - 1):
        raise ValueError(f"mla_rope_and_write_latent needs a power-of-two rope_dim / 2, got {half}")
    if out is not None and (out.shape != q_pe.shape or out.dtype != q_pe.dtype):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} does not match q_pe {tuple(q_pe.shape)} {q_pe.dtype}")
    for name, x in (("q_pe", q_pe), ("k_pe", k_pe), ("c_kv", c_kv), ("latent_rows", latent_rows), ("out", out)):
        if x is not None and x.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit stride on its last dim")
    q_out = torch.empty(t, heads, rope, dtype=q_pe.dtype, device=q_pe.device) if out is None else out
    if t:
        weight, eps = norm if norm is not None else (latent_rows, 0.0)  # the weight is unused without a norm
        whole_row = triton.next_power_of_2(max(rank, 16))
        _mla_rope_latent_kernel[(t,)](
            q_pe, k_pe, c_kv, positions, cos_sin, slots, q_out, latent_rows, weight,
            q_pe.stride(0), q_pe.stride(1), k_pe.stride(0), c_kv.stride(0), q_out.stride(0), q_out.stride(1),
            latent_rows.stride(0), cos_sin.shape[0], rank, float(eps),
            H=heads, H_P2=triton.next_power_of_2(max(heads, 1)), HALF=half, INTERLEAVED=interleaved,
            BLOCK_R=whole_row if norm is not None else min(512, whole_row),
            KIND=kind_of(q_pe.dtype), CACHE_KIND=kind_of(latent_rows.dtype), NORM=norm is not None,
            C_KIND=kind_of(c_kv.dtype),
            NORM_KIND=kind_of(torch.result_type(weight, c_kv)) if norm is not None else kind_of(c_kv.dtype),
            num_warps=1 if norm is None or rank <= 1024 else 4,
            enable_fp_fusion=False,  # a*c - b*s as an FMA rounds once; torch rounds each product
            **pdl_options(q_pe),
        )
    return q_out
