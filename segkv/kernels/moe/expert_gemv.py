"""Triton kernel: matrix-vector products with per-row expert weights chosen on the device.

``out[n] = W[experts[n]] @ x[rows[n]]`` for stacked expert weights ``W (E, Out, In)``: the
expert ids stay on the device, so a mixture-of-experts decode step needs no host
synchronisation (CUDA graphs can capture it), and each (row, expert) pair reads exactly its
expert's weights. Float32 accumulation; the result is rounded once to the output dtype.

The same launch can also take a dense weight applied to every row (a MoE layer's shared experts,
:func:`expert_gemv_with_shared`), and ``[gate | up]`` weights whose products it stores as
``silu(gate) * up`` (``activation``): a MoE layer's experts are then two launches.
"""

from __future__ import annotations

import torch
from segkv.kernels.triton_import import tl, triton

from segkv.kernels.fused.fused_ops import kind_of, round_to_kind, silu_mul_rounded
from segkv.kernels.pdl import pdl_options
from segkv.kernels.moe.work_items import wait_full
import segkv.settings as settings

_INTERPRET = settings.SETTINGS.triton_interpret


@triton.jit
def _chunk_weights(w_rows, o_ok, i0, IN: tl.constexpr, BLOCK_I: tl.constexpr, EVICT_FIRST: tl.constexpr):
    """The weight block of inputs ``i0 .. i0 + BLOCK_I`` (``(BLOCK_O, BLOCK_I)``, float32)."""
    offs_i = i0 + tl.arange(0, BLOCK_I)
    i_ok = offs_i < IN
    return tl.load(w_rows[:, None] + offs_i[None, :], mask=o_ok[:, None] & i_ok[None, :], other=0.0,
                   eviction_policy="evict_first" if EVICT_FIRST else "").to(tl.float32)


@triton.jit
def _chunk_product(acc, x_row, w, i0, IN: tl.constexpr, BLOCK_I: tl.constexpr, X_CG: tl.constexpr = False):
    """``acc (BLOCK_O,)`` plus the product of weight block ``w`` with inputs ``i0 .. i0 + BLOCK_I``.
    ``X_CG``: the inputs are read through L2 (written by other programs of the same launch)."""
    offs_i = i0 + tl.arange(0, BLOCK_I)
    i_ok = offs_i < IN
    x = tl.load(x_row + offs_i, mask=i_ok, other=0.0, cache_modifier=".cg" if X_CG else "").to(tl.float32)
    return acc + tl.sum(w * x[None, :], axis=1)


@triton.jit
def _weight_rows(ob, BLOCK_O: tl.constexpr, OUT_DIM: tl.constexpr, ACT: tl.constexpr):
    """Program ``ob``'s weight rows ``(BLOCK_O,)`` and which exist: outputs ``ob * BLOCK_O ...``, or
    with ``ACT`` (a ``[gate | up]`` weight of ``OUT_DIM`` rows) the gate rows ``ob * BLOCK_O / 2
    ...`` followed by their up rows, ``OUT_DIM / 2`` further."""
    r = tl.arange(0, BLOCK_O)
    if ACT:
        j = ob * (BLOCK_O // 2) + r % (BLOCK_O // 2)
        rows = j + (r >= BLOCK_O // 2).to(tl.int32) * (OUT_DIM // 2)
        ok = j < OUT_DIM // 2
    else:
        rows = ob * BLOCK_O + r
        ok = rows < OUT_DIM
    return rows, ok


@triton.jit
def _store_activation(out_row, ob, acc, INNER: tl.constexpr, BLOCK_O: tl.constexpr, KIND: tl.constexpr,
                      EXACT_FP32: tl.constexpr):
    """``silu(gate) * up`` of a program's ``BLOCK_O / 2`` gate sums and their up sums (``acc``, in
    that order), each rounded as the product's output would be, then as ``silu_and_mul`` rounds:
    what ``silu_and_mul`` makes of the stored ``[gate | up]`` row."""
    gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_O // 2)), (1, 0)))
    act = silu_mul_rounded(round_to_kind(gate, KIND), round_to_kind(up, KIND), KIND)
    offs = ob * (BLOCK_O // 2) + tl.arange(0, BLOCK_O // 2)
    if EXACT_FP32:
        tl.store(out_row + offs, act, mask=offs < INNER)
    else:  # already rounded: the cast is exact
        tl.store(out_row + offs, act.to(out_row.dtype.element_ty), mask=offs < INNER)


@triton.jit
def _gemv_tile(x_row, w_rows, out_row, ob, IN: tl.constexpr, OUT_DIM: tl.constexpr, BLOCK_O: tl.constexpr,
               BLOCK_I: tl.constexpr, EXACT_FP32: tl.constexpr, KIND: tl.constexpr,
               UNROLL: tl.constexpr, EVICT_FIRST: tl.constexpr, ACT: tl.constexpr = False, X_CG: tl.constexpr = False, SPIN: tl.constexpr = False, spin_ptr=None,
               spin_need=0):
    """Outputs ``ob * BLOCK_O ...`` of one product: ``w_rows`` points at the weight's first
    column, one row per output of :func:`_weight_rows` (row stride folded in); ``x_row`` at the
    input row. ``ACT``: the weight is ``[gate | up]`` and the program stores ``silu(gate)
    * up`` of its rows (:func:`_store_activation`) instead of the products.
    ``UNROLL``: the input loop unrolled, so every chunk's weights can be requested at once.
    ``EVICT_FIRST``: the weight's lines leave L2 first (read once: no other pair wants them).
    ``X_CG``: the
    input row is read through L2 (other programs of the same launch wrote it). ``SPIN``: the
    program first waits until ``spin_ptr`` counts ``spin_need`` (``kernels.moe.work_items``): the input
    row is another program's."""
    offs_o, o_ok = _weight_rows(ob, BLOCK_O, OUT_DIM, ACT)
    acc = tl.zeros([BLOCK_O], tl.float32)
    if SPIN:
        wait_full(spin_ptr, spin_need)
    if UNROLL:
        for i0 in tl.static_range(0, IN, BLOCK_I):
            w = _chunk_weights(w_rows, o_ok, i0, IN, BLOCK_I, EVICT_FIRST)
            acc = _chunk_product(acc, x_row, w, i0, IN, BLOCK_I, X_CG)
    else:
        for i0 in range(0, IN, BLOCK_I):
            w = _chunk_weights(w_rows, o_ok, i0, IN, BLOCK_I, EVICT_FIRST)
            acc = _chunk_product(acc, x_row, w, i0, IN, BLOCK_I, X_CG)
    if ACT:
        _store_activation(out_row, ob, acc, OUT_DIM // 2, BLOCK_O, KIND, EXACT_FP32)
    elif EXACT_FP32:
        tl.store(out_row + offs_o, acc, mask=o_ok)
    else:
        tl.store(out_row + offs_o, acc.to(out_row.dtype.element_ty, fp_downcast_rounding="rtne"), mask=o_ok)


@triton.jit
def _expert_gemv_kernel(
    X, W, OUT, rows, experts, SX, SW, SOUT,
    stride_xr, stride_we, stride_wo, stride_on, stride_sxr, stride_swo, stride_son, num_pairs,
    IN: tl.constexpr, OUT_DIM: tl.constexpr, SHARED_IN: tl.constexpr, SHARED_OUT: tl.constexpr,
    BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, EXACT_FP32: tl.constexpr, PAIRS_PER_ROW: tl.constexpr,
    KIND: tl.constexpr, HAS_SHARED: tl.constexpr, UNROLL: tl.constexpr,
    USE_PDL: tl.constexpr, EVICT_FIRST: tl.constexpr = False, ACT: tl.constexpr = False,
):
    """Program ``t``: ``BLOCK_O`` outputs of one product. The first ``num_pairs x cdiv(OUT_DIM,
    BLOCK_O)`` programs serve the routed pairs (pair ``n``: expert ``experts[n]`` on row
    ``rows[n]``, or row ``n // PAIRS_PER_ROW`` when that is > 0), pairs fastest: the pairs of an
    expert that several tokens chose read each weight block at about the same time, so the
    second read hits L2 (blocks fastest measured 10% slower at batch 8). With ``HAS_SHARED`` the rest serve the shared weight ``SW (SHARED_OUT,
    SHARED_IN)`` on every row of ``SX``, ``BLOCK_O`` outputs a program. ``USE_PDL``:
    scheduled while the previous kernel finishes (``kernels.pdl``) and waits for it before any
    load. ``ACT``: the
    weights are ``[gate | up]`` stacks, and each program stores ``silu(gate) * up`` of half its
    outputs' gate rows and their up rows (``OUT (N, OUT_DIM / 2)``, ``SOUT (T, SHARED_OUT /
    2)``): the down product then reads the activation, not ``[gate | up]``."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0)
    ROUTED_BLOCKS: tl.constexpr = (OUT_DIM + BLOCK_O - 1) // BLOCK_O
    SHARED_BLOCKS: tl.constexpr = (SHARED_OUT + BLOCK_O - 1) // BLOCK_O
    routed_programs = num_pairs * ROUTED_BLOCKS
    if HAS_SHARED and t >= routed_programs:
        token = ((t - routed_programs) // SHARED_BLOCKS).to(tl.int64)
        ob = (t - routed_programs) % SHARED_BLOCKS
        shared_rows, _ = _weight_rows(ob, BLOCK_O, SHARED_OUT, ACT)  # not offs_o: one shape per name (Triton)
        _gemv_tile(SX + token * stride_sxr, SW + shared_rows.to(tl.int64) * stride_swo, SOUT + token * stride_son,
                   ob, SHARED_IN, SHARED_OUT, BLOCK_O, BLOCK_I, EXACT_FP32, KIND, UNROLL,
                   EVICT_FIRST, ACT)
    else:
        n = t % num_pairs
        ob = t // num_pairs
        if PAIRS_PER_ROW > 0:
            row = (n // PAIRS_PER_ROW).to(tl.int64)
        else:
            row = tl.load(rows + n).to(tl.int64)
        expert = tl.load(experts + n).to(tl.int64)
        offs_o, _ = _weight_rows(ob, BLOCK_O, OUT_DIM, ACT)
        _gemv_tile(X + row * stride_xr, W + expert * stride_we + offs_o.to(tl.int64) * stride_wo,
                   OUT + n.to(tl.int64) * stride_on, ob, IN, OUT_DIM, BLOCK_O, BLOCK_I, EXACT_FP32, KIND,
                   UNROLL, EVICT_FIRST, ACT)


# The measured launch (docs/performance-notes.md, "Figures behind the code's constants"): 16 outputs per program and 4 warps;
# 128 inputs per step for many pairs, 256 with the input loop unrolled for one token's few pairs.
BLOCK_O, BLOCK_I, NUM_WARPS = 16, 128, 4
WIDE_BLOCK_I = 256
# pairs up to which a launch reads WIDE_BLOCK_I inputs per step with the loop unrolled (one token's
# experts; at 48 pairs unrolling gained nothing)
FEW_PAIRS = 8


def default_unroll(pairs: int) -> bool:
    """Whether the input loop is unrolled for ``pairs`` pairs."""
    return pairs <= FEW_PAIRS


def default_block_i(pairs: int) -> int:
    """Inputs per step for ``pairs`` pairs: 256 for one token's few pairs, else 128."""
    return WIDE_BLOCK_I if pairs <= FEW_PAIRS else BLOCK_I


def expert_gemv(x: torch.Tensor, rows: torch.Tensor | int, experts: torch.Tensor, weight: torch.Tensor,
                *, out_dtype: torch.dtype | None = None, block_o: int | None = None,
                block_i: int | None = None, num_warps: int | None = None, unroll: bool | None = None,
                distinct_experts: bool = False, activation: bool = False) -> torch.Tensor:
    """``x (R, In)``, ``rows (N,)`` and ``experts (N,)`` int64/int32 on the device, ``weight
    (E, Out, In)`` with unit stride on In -> ``(N, Out)`` in ``out_dtype`` (default ``x``'s).
    ``rows`` may be an int ``r``: pair ``n`` reads row ``n // r`` (a token's ``r`` experts in a
    row, as a router returns them; no index tensor to build per step).
    ``block_o``/``block_i``/``num_warps``/``unroll``: the launch (default: the measured best,
    :data:`BLOCK_O`, :func:`default_block_i`, :data:`NUM_WARPS`, :func:`default_unroll`;
    benchmarks set them). ``distinct_experts``:
    no two pairs share an expert (one token's choice), so each weight is read once and its lines
    leave L2 first. ``activation``: ``weight`` is a ``(E, 2 I, In)``
    ``[gate | up]`` stack and the result is ``silu(gate) * up`` ``(N, I)``, equal to
    ``fused_ops.silu_and_mul`` of the plain product (each half rounded first, as it is stored)."""
    return _launch(x, rows, experts, weight, None, None, out_dtype, block_o, block_i, num_warps, unroll,
                   distinct_experts, activation)[0]


def expert_gemv_with_shared(x: torch.Tensor, rows: torch.Tensor | int, experts: torch.Tensor, weight: torch.Tensor,
                            shared_x: torch.Tensor, shared_weight: torch.Tensor, *,
                            distinct_experts: bool = False, activation: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`expert_gemv`, and in the same launch ``shared_weight (Out_s, In_s)`` (a MoE layer's
    shared experts, one dense weight) on every row of ``shared_x (T, In_s)``: returns ``(routed
    (N, Out), shared (T, Out_s))`` in ``x``'s dtype. At decode
    sizes each product is a few microseconds, so one launch for both halves the launches.
    ``distinct_experts`` and ``activation`` (for both weights) as in :func:`expert_gemv`."""
    if shared_weight.dim() != 2 or shared_x.dim() != 2 or shared_x.dtype != x.dtype:
        raise ValueError(f"shared weight (Out, In) and rows (T, In) of x's dtype expected, got "
                         f"{tuple(shared_weight.shape)} and {tuple(shared_x.shape)} {shared_x.dtype}")
    return _launch(x, rows, experts, weight, shared_x, shared_weight, None, None, None, None, None,
                   distinct_experts, activation)


def _launch(x, rows, experts, weight, shared_x, shared_weight, out_dtype, block_o, block_i, num_warps, unroll,
            distinct_experts, activation=False):
    """Checks, outputs and the launch of :func:`expert_gemv` / :func:`expert_gemv_with_shared`."""
    has_shared = shared_weight is not None
    block_o = block_o or BLOCK_O
    num_warps = num_warps or NUM_WARPS
    if block_o & (block_o - 1) or block_i is not None and (block_i < 16 or block_i & (block_i - 1)):
        raise ValueError(f"expert_gemv: block_o must be a power of two and block_i a power of two >= 16, "
                         f"got {block_o} and {block_i}")
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"expert_gemv: num_warps must be 1, 2, 4, 8 or 16, got {num_warps}")
    for name, t in (("x", x), ("weight", weight), ("shared x", shared_x), ("shared weight", shared_weight)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"expert_gemv needs unit column strides ({name})")
    pairs_per_row = rows if isinstance(rows, int) else 0
    if isinstance(rows, int):
        if rows < 1:
            raise ValueError(f"rows as an int is the pairs per row, at least 1; got {rows}")
        rows = experts  # not read by the kernel
    if x.shape[1] != weight.shape[2] or rows.shape != experts.shape or (
            has_shared and shared_x.shape[1] != shared_weight.shape[1]):
        raise ValueError(f"shapes do not match: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"rows {tuple(rows.shape)}, experts {tuple(experts.shape)}"
                         + (f", shared x {tuple(shared_x.shape)}, shared weight {tuple(shared_weight.shape)}"
                            if has_shared else ""))
    n, out_dim, in_dim = rows.numel(), weight.shape[1], weight.shape[2]
    if activation and (block_o < 2 or out_dim % 2 or (has_shared and shared_weight.shape[0] % 2)):
        raise ValueError(f"the activation takes [gate | up] weights of an even number of rows and at least 2 "
                         f"outputs per program: weight {tuple(weight.shape)}, block_o {block_o}"
                         + (f", shared weight {tuple(shared_weight.shape)}" if has_shared else ""))
    out_cols = out_dim // 2 if activation else out_dim
    out_dtype = out_dtype or x.dtype
    # the interpreter truncates float32 -> bf16/fp16 stores: there it writes float32, torch rounds
    kernel_dtype = torch.float32 if _INTERPRET else out_dtype
    out = torch.empty(n, out_cols, dtype=kernel_dtype, device=x.device)
    tokens = shared_x.shape[0] if has_shared else 0
    s_cols = (shared_weight.shape[0] // (2 if activation else 1)) if has_shared else 0
    shared_out = torch.empty(tokens, s_cols, dtype=kernel_dtype, device=x.device)
    s_out_dim, s_in_dim = shared_weight.shape if has_shared else (block_o, 1)
    programs = n * triton.cdiv(out_dim, block_o) + tokens * triton.cdiv(s_out_dim, block_o)
    if block_i is None:
        block_i = default_block_i(n)
    if programs:
        sx, sw = (shared_x, shared_weight) if has_shared else (x, weight)
        options = pdl_options(x)
        _expert_gemv_kernel[(programs,)](
            x, weight, out, rows, experts, sx, sw, shared_out,
            x.stride(0), weight.stride(0), weight.stride(1), out.stride(0), sx.stride(0),
            shared_weight.stride(0) if has_shared else 0, shared_out.stride(0), n,
            IN=in_dim, OUT_DIM=out_dim, SHARED_IN=s_in_dim, SHARED_OUT=s_out_dim, BLOCK_O=block_o,
            BLOCK_I=min(block_i, triton.next_power_of_2(max(in_dim, s_in_dim))),
            EXACT_FP32=kernel_dtype == torch.float32, PAIRS_PER_ROW=pairs_per_row,
            KIND=kind_of(x.dtype), HAS_SHARED=has_shared, num_warps=num_warps,
            UNROLL=default_unroll(n) if unroll is None else unroll, **options,
            EVICT_FIRST=distinct_experts, ACT=activation,
        )
    return out.to(out_dtype), shared_out.to(out_dtype)
