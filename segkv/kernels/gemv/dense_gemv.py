"""Triton kernel: one row times a dense weight, split over the input dim (batch-1 decode).

``out = W @ a`` for ``W (Out, In)`` and one row ``a (In,)``: program ``(n, k)`` reads a
``BLOCK_N x BLOCK_K`` block of the weight, so even a small projection spreads its bytes over
hundreds of programs (cuBLAS's batch-1 kernels stream the 8 MB projections of a small model far
below the memory bandwidth). The ``SPLIT`` partial sums of an output block meet by an atomic
ticket: the block's last program adds them in a fixed order (no float atomics, so results do not depend on
timing), rounds once and resets the ticket to 0 for the next launch. A ticket costs its program a
release fence (one thread's ``MEMBAR.ALL.GPU`` before the atomic) and the atomic's round trip
before it ends: with one split (``BLOCK_K`` spanning the input, a few whole weight rows a
program: ``layers.linear.launch_for``'s launch for products of up to 4096 inputs) a program
stores its rows at once.

The row ``a`` is formed in the kernel from what the layer before left, so the small kernel that
would form it disappears from a decode step:

- ``INPUT_PLAIN``: ``a = x``;
- ``INPUT_GATED``: ``a = silu(gate) * up`` from ``x = [gate | up] (2 In,)``, rounded as
  ``fused_ops.silu_and_mul`` rounds (the down projection of a gated MLP);
- ``INPUT_NORM``: ``a = g * h / rms(h)`` with ``h = x + residual`` rounded to ``x``'s dtype (the
  residual add and RMSNorm of a pre-norm block). The mean square is a sum over the whole row, so
  each program keeps the sum of squares of its own slice beside its partial product, and the last
  program of an output block scales the block's sum by ``rsqrt(mean(h^2) + eps)``: ``a`` is
  never rounded (the separate norm kernel rounds ``h / rms`` and ``g * (h / rms)`` to the dtype
  first). The programs of output block 0 write ``h``, the next block's residual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from segkv.kernels.triton_import import tl, triton

from segkv.kernels.fused.fused_ops import kind_of, round_to_kind, silu_mul_rounded
from segkv.kernels.moe.moe_ops import check_combine, combine_row
from segkv.kernels.pdl import pdl_options

INPUT_PLAIN, INPUT_GATED, INPUT_NORM, INPUT_COMBINE = 0, 1, 2, 3


@triton.jit
def gemv_slice(X, RES, G, RES_OUT, W, stride_w, out_dim, in_dim, nb, kb, EXPERT_W, SHARED, stride_x,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INPUT: tl.constexpr, HAS_RES: tl.constexpr,
               KIND: tl.constexpr, EVICT_FIRST: tl.constexpr, USE_PDL: tl.constexpr,
               EXPERTS: tl.constexpr = 1, HAS_SHARED: tl.constexpr = False):
    """Program ``(nb, kb)``'s share: the float32 partial product ``(BLOCK_N,)`` of output block
    ``nb`` over input block ``kb``, and (``INPUT_NORM``/``INPUT_COMBINE``, else 0) the slice's sum
    of squares of ``h``; block ``nb == 0`` writes its slice of ``h`` to ``RES_OUT``.
    ``INPUT_COMBINE``: ``X`` holds ``EXPERTS`` expert output rows (row stride ``stride_x``)
    weighted by ``EXPERT_W`` (float32), plus ``SHARED`` (``HAS_SHARED``), combined as
    ``moe_ops.combine_experts`` combines them (up to FMA contraction of its products).

    With ``USE_PDL`` (programmatic dependent launch): the next kernel may be scheduled at once,
    and this one loads its weight block before waiting for the kernel before it (whose output
    ``X`` is): the weight's memory latency overlaps that kernel's tail. ``EVICT_FIRST``: the
    weight's lines leave the L2 cache first."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < out_dim
    cols = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    c_ok = cols < in_dim
    w = tl.load(W + rows[:, None].to(tl.int64) * stride_w + cols[None, :], mask=r_ok[:, None] & c_ok[None, :],
                other=0.0, eviction_policy="evict_first" if EVICT_FIRST else "")
    if INPUT >= 2:
        g = tl.load(G + cols, mask=c_ok, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if INPUT == 3:
        a = combine_row(X, EXPERT_W, SHARED, 0, cols, c_ok, stride_x, 0, EXPERTS, HAS_SHARED, KIND, BLOCK_K)
    elif INPUT == 1:
        a = silu_mul_rounded(tl.load(X + cols, mask=c_ok, other=0.0).to(tl.float32),
                             tl.load(X + in_dim + cols, mask=c_ok, other=0.0).to(tl.float32), KIND)
    else:
        a = tl.load(X + cols, mask=c_ok, other=0.0).to(tl.float32)
    square_sum = 0.0
    if INPUT >= 2:
        if HAS_RES:
            a = round_to_kind(a + tl.load(RES + cols, mask=c_ok, other=0.0).to(tl.float32), KIND)
            # block 0's programs write h; a predicated store, not a branch: the branch kept more
            # registers live, so fewer programs fit on an SM
            first_block = tl.zeros_like(cols) + nb == 0
            tl.store(RES_OUT + cols, a.to(RES_OUT.dtype.element_ty), mask=c_ok & first_block)
        square_sum = tl.sum(a * a, axis=0)
        a = a * g
    return tl.sum(w.to(tl.float32) * a[None, :], axis=1), square_sum


@triton.jit
def _splitk_gemv_kernel(X, RES, G, RES_OUT, W, OUT, PART, TICKETS, stride_w, out_dim, in_dim, eps,
                        EXPERT_W, SHARED, stride_x,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                        SPLIT_P2: tl.constexpr, INPUT: tl.constexpr, HAS_RES: tl.constexpr,
                        KIND: tl.constexpr, EVICT_FIRST: tl.constexpr, USE_PDL: tl.constexpr,
                        EXPERTS: tl.constexpr, HAS_SHARED: tl.constexpr):
    """Program ``(nb, kb)``: :func:`gemv_slice`, then the ticket. ``PART``: float32 partial sums
    ``(SPLIT, out_dim)``, then (``INPUT_NORM``) the slices' sums of squares ``(blocks, SPLIT)``."""
    nb = tl.program_id(0)
    kb = tl.program_id(1)
    part, square_sum = gemv_slice(X, RES, G, RES_OUT, W, stride_w, out_dim, in_dim, nb, kb, EXPERT_W, SHARED,
                                  stride_x, BLOCK_N, BLOCK_K, INPUT, HAS_RES, KIND, EVICT_FIRST, USE_PDL, EXPERTS,
                                  HAS_SHARED)
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < out_dim
    if SPLIT == 1:
        if INPUT >= 2:
            part = part / tl.sqrt(square_sum / in_dim + eps)
        tl.store(OUT + rows, round_to_kind(part, KIND).to(OUT.dtype.element_ty), mask=r_ok)
    else:
        store_slice(PART, part, square_sum, out_dim, nb, kb, BLOCK_N, SPLIT)
        ticket = tl.atomic_add(TICKETS + nb, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:
            total = partials_total(PART, out_dim, rows, r_ok, SPLIT, SPLIT_P2)
            if INPUT >= 2:
                total = total / row_rms(PART, out_dim, in_dim, nb, eps, SPLIT, SPLIT_P2)
            # rounded to nearest even by bits (Triton's interpreter truncates a float32 -> bf16 cast)
            tl.store(OUT + rows, round_to_kind(total, KIND).to(OUT.dtype.element_ty), mask=r_ok)
            tl.store(TICKETS + nb, 0)


@triton.jit
def store_slice(PART, part, square_sum, out_dim, nb, kb, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """Program ``(nb, kb)``'s partial product into ``PART (SPLIT, out_dim)`` and its slice's sum
    of squares into the ``(blocks, SPLIT)`` part after it; every thread's stores are made before
    the caller takes its ticket (which releases them)."""
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(PART + kb * out_dim + rows, part, mask=rows < out_dim)
    tl.store(PART + SPLIT * out_dim + nb * SPLIT + kb, square_sum)
    tl.debug_barrier()


@triton.jit
def partials_total(PART, out_dim, cols, ok, SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr):
    """Columns ``cols`` (where ``ok``) of the product: the ``SPLIT`` partial sums in a fixed order."""
    ks = tl.arange(0, SPLIT_P2)
    parts = tl.load(PART + ks[:, None] * out_dim + cols[None, :], mask=(ks[:, None] < SPLIT) & ok[None, :],
                    other=0.0, cache_modifier=".cg")
    return tl.sum(parts, axis=0)


@triton.jit
def stored_product(PART, out_dim, cols, rms, KIND: tl.constexpr, SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr):
    """Columns ``cols`` of the normed product as the norm GEMV stores them: the partials' total
    over ``rms``, rounded once to the dtype of ``KIND`` (float32 values)."""
    return round_to_kind(partials_total(PART, out_dim, cols, cols < out_dim, SPLIT, SPLIT_P2) / rms, KIND)


@triton.jit
def row_rms(PART, out_dim, in_dim, nb, eps, SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr):
    """``sqrt(mean(h^2) + eps)`` of the input row, from the slice sums of squares that output
    block ``nb``'s programs stored (every block's programs cover the whole row)."""
    ks = tl.arange(0, SPLIT_P2)
    squares = tl.load(PART + SPLIT * out_dim + nb * SPLIT + ks, mask=ks < SPLIT, other=0.0, cache_modifier=".cg")
    return tl.sqrt(tl.sum(squares, axis=0) / in_dim + eps)


def workspace_size(out_dim: int, in_dim: int, block_n: int, block_k: int) -> tuple[int, int]:
    """``(float32 elements, int32 tickets)`` of a workspace for ``W (out_dim, in_dim)``."""
    split, blocks = triton.cdiv(in_dim, block_k), triton.cdiv(out_dim, block_n)
    return split * (out_dim + blocks), blocks


def _unit_row(t: torch.Tensor, n: int, name: str, what: str) -> torch.Tensor:
    flat = t.reshape(-1)
    if flat.numel() != n or flat.stride(0) != 1:
        raise ValueError(f"{name}: {what} of {n} with unit stride expected, got {tuple(t.shape)}")
    return flat


@dataclass(frozen=True, slots=True)
class GemvOperands:
    """A checked one-row launch: the row ``flat``, residual and norm weight (or ``flat`` where
    absent), the residual output (or None), workspace, grid and PDL options."""

    flat: torch.Tensor
    res: torch.Tensor
    g: torch.Tensor
    res_out: torch.Tensor | None
    part: torch.Tensor
    tickets: torch.Tensor
    split: int
    blocks: int
    kind: int
    options: dict


def gemv_operands(name: str, x: torch.Tensor, weight: torch.Tensor, *, input_kind: int,
                  residual: torch.Tensor | None, norm_weight: torch.Tensor | None, block_n: int, block_k: int,
                  workspace: tuple[torch.Tensor, torch.Tensor] | None, pdl: bool | None) -> GemvOperands:
    """Check one row ``x`` against ``weight (Out, In)`` (clear errors naming ``name``), and make
    the residual output and, when None, the workspace."""
    out_dim, in_dim = weight.shape
    if weight.stride(1) != 1:
        raise ValueError(f"{name}: weight {tuple(weight.shape)} needs unit stride along its input dim")
    # a combine's rows are checked by moe_ops.check_combine (the caller)
    flat = x if input_kind == INPUT_COMBINE else _unit_row(x, 2 * in_dim if input_kind == INPUT_GATED else in_dim,
                                                           name, "one row")
    if weight.dtype != x.dtype:
        raise ValueError(f"{name}: weight of {weight.dtype} for a row of {x.dtype}")
    kind = kind_of(x.dtype)
    res = res_out = None
    if residual is not None:
        res = _unit_row(residual, in_dim, name, "a residual row")
        if residual.dtype != x.dtype:
            raise ValueError(f"{name}: residual of {residual.dtype} for a row of {x.dtype}")
        res_out = torch.empty_like(res)
    g = _unit_row(norm_weight, in_dim, name, "a norm weight") if norm_weight is not None else None
    split, blocks = triton.cdiv(in_dim, block_k), triton.cdiv(out_dim, block_n)
    floats, tickets_needed = workspace_size(out_dim, in_dim, block_n, block_k)
    if workspace is None:
        workspace = (torch.empty(floats, dtype=torch.float32, device=x.device),
                     torch.zeros(tickets_needed, dtype=torch.int32, device=x.device))
    part, tickets = workspace
    if part.numel() < floats or tickets.numel() < tickets_needed:
        raise ValueError(f"{name}: workspace of {part.numel()} floats and {tickets.numel()} tickets, "
                         f"{floats} and {tickets_needed} needed")
    options = pdl_options(x, pdl)
    return GemvOperands(flat, flat if res is None else res, flat if g is None else g, res_out, part, tickets, split,
                        blocks, kind, options)


def _launch(name: str, x: torch.Tensor, weight: torch.Tensor, *, input_kind: int, residual: torch.Tensor | None,
            norm_weight: torch.Tensor | None, eps: float, block_n: int, block_k: int, num_warps: int,
            workspace: tuple[torch.Tensor, torch.Tensor] | None, pdl: bool | None, evict_first: bool,
            expert_weights: torch.Tensor | None = None, shared: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    out_dim, in_dim = weight.shape
    ops = gemv_operands(name, x, weight, input_kind=input_kind, residual=residual, norm_weight=norm_weight,
                        block_n=block_n, block_k=block_k, workspace=workspace, pdl=pdl)
    out = torch.empty(out_dim, dtype=x.dtype, device=x.device)
    _splitk_gemv_kernel[(ops.blocks, ops.split)](
        ops.flat, ops.res, ops.g, out if ops.res_out is None else ops.res_out, weight, out, ops.part, ops.tickets,
        weight.stride(0), out_dim, in_dim, float(eps), ops.flat if expert_weights is None else expert_weights,
        ops.flat if shared is None else shared, x.stride(0) if input_kind == INPUT_COMBINE else 0,
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=ops.split, SPLIT_P2=triton.next_power_of_2(ops.split),
        INPUT=input_kind, HAS_RES=ops.res_out is not None, KIND=ops.kind, EVICT_FIRST=evict_first,
        EXPERTS=1 if expert_weights is None else expert_weights.numel(), HAS_SHARED=shared is not None,
        num_warps=num_warps, **ops.options)
    if input_kind == INPUT_COMBINE:
        return out.view(1, out_dim), ops.res_out
    return out.view(*x.shape[:-1], out_dim), ops.res_out


def splitk_gemv(x: torch.Tensor, weight: torch.Tensor, *, block_n: int = 32, block_k: int = 512, num_warps: int = 4,
                workspace: tuple[torch.Tensor, torch.Tensor] | None = None, pdl: bool | None = None,
                evict_first: bool = False) -> torch.Tensor:
    """``x (In,)`` or ``(1, In)`` times ``weight (Out, In)`` -> ``(Out,)`` / ``(1, Out)`` in ``x``'s
    dtype, float32 sums rounded once. ``workspace``: (float32 partials of at least
    :func:`workspace_size`, int32 zero tickets), left zero; allocated when None. ``pdl``:
    programmatic dependent launch (default: where ``kernels.pdl`` supports it). ``evict_first``:
    the weight's lines leave the L2 cache before other data."""
    return _launch("splitk_gemv", x, weight, input_kind=INPUT_PLAIN, residual=None, norm_weight=None, eps=0.0,
                   block_n=block_n, block_k=block_k, num_warps=num_warps, workspace=workspace, pdl=pdl,
                   evict_first=evict_first)[0]


def gated_splitk_gemv(gate_up: torch.Tensor, weight: torch.Tensor, *, block_n: int = 32, block_k: int = 512,
                      num_warps: int = 4, workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                      pdl: bool | None = None, evict_first: bool = False) -> torch.Tensor:
    """``weight (Out, I) @ silu(gate) * up`` for one row ``gate_up (2I,)`` or ``(1, 2I)`` holding
    ``[gate | up]``: a gated MLP's down projection with its activation, ``(Out,)`` / ``(1, Out)``.
    The activation is rounded as ``fused_ops.silu_and_mul`` rounds it; arguments as
    :func:`splitk_gemv`."""
    return _launch("gated_splitk_gemv", gate_up, weight, input_kind=INPUT_GATED, residual=None, norm_weight=None,
                   eps=0.0, block_n=block_n, block_k=block_k, num_warps=num_warps, workspace=workspace, pdl=pdl,
                   evict_first=evict_first)[0]


def norm_splitk_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor, *, block_n: int = 32, block_k: int = 512, num_warps: int = 4,
                     workspace: tuple[torch.Tensor, torch.Tensor] | None = None, pdl: bool | None = None,
                     evict_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's residual add, RMSNorm and the product after it, for one row:
    ``h = x + residual`` (rounded to ``x``'s dtype; ``h = x`` without a residual) and
    ``weight (Out, In) @ (norm_weight * h / sqrt(mean(h^2) + eps))`` in float32, rounded once.

    ``x``, ``residual``: ``(In,)`` or ``(1, In)``; ``norm_weight (In,)``. Returns ``(product
    (..., Out), h)``: ``h`` a new tensor (``x`` itself without a residual), the next residual.
    Other arguments as :func:`splitk_gemv`."""
    out, res_out = _launch("norm_splitk_gemv", x, weight, input_kind=INPUT_NORM, residual=residual,
                           norm_weight=norm_weight, eps=eps, block_n=block_n, block_k=block_k, num_warps=num_warps,
                           workspace=workspace, pdl=pdl, evict_first=evict_first)
    return out, (x if res_out is None else res_out.view(x.shape))


def combine_norm_splitk_gemv(parts: torch.Tensor, expert_weights: torch.Tensor, shared: torch.Tensor | None,
                             residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, *,
                             block_n: int = 32, block_k: int = 512, num_warps: int = 4,
                             workspace: tuple[torch.Tensor, torch.Tensor] | None = None, pdl: bool | None = None,
                             evict_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`norm_splitk_gemv` of one token whose ``x`` is a mixture-of-experts layer's output
    not formed yet (``layers.norm.PendingCombine``): ``parts (k, In)`` expert outputs weighted by
    ``expert_weights (1, k)`` float32, plus ``shared (1, In)`` or None, combined as
    ``moe_ops.combine_experts`` combines them (the GPU may contract its products into FMAs), then
    ``h = combined + residual (1, In)``. Returns ``(product (1, Out), h)``."""
    name = "combine_norm_splitk_gemv"
    check_combine(name, parts, expert_weights, shared, residual, norm_weight)
    if expert_weights.shape[0] != 1:
        raise ValueError(f"{name}: one token's experts expected, got weights {tuple(expert_weights.shape)}")
    if parts.shape[1] != weight.shape[1]:
        raise ValueError(f"{name}: rows of {parts.shape[1]} for a weight {tuple(weight.shape)}")
    out, h = _launch(name, parts, weight, input_kind=INPUT_COMBINE, residual=residual, norm_weight=norm_weight,
                     eps=eps, block_n=block_n, block_k=block_k, num_warps=num_warps, workspace=workspace, pdl=pdl,
                     evict_first=evict_first, expert_weights=expert_weights.contiguous(),
                     shared=None if shared is None else shared.reshape(-1))
    return out, h.view(residual.shape)
