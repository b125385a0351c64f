"""Triton kernel: a pre-norm gated MLP of one row in one launch (batch-1 decode of dense models).

The two split-K launches of ``kernels.dense_gemv`` (``norm_splitk_gemv`` for ``[gate | up]`` with
the residual add and RMSNorm, then ``gated_splitk_gemv`` for down with SiLU-and-mul) become work
items of one launch, taken in order from an atomic counter after the PDL wait
(``kernels.work_items``). The gate/up items come slice by slice: slice ``s`` is the gate and up
output blocks of the ``BLOCK_K`` inner columns that the down items of input block ``s`` read.
When an output block's last split finishes it (the split-K ticket), it counts itself in slice
``s``'s counter. Then the down items come, slice-major: each loads its weight block, waits until
its slice's gate and up blocks are all stored and reads them through L2. So the first slices'
down items stream while the last gate/up items run, and the launch has one tail instead of two.
Every item computes what its program in the two launches computes (``dense_gemv.gemv_slice``, the
same tickets and roundings).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from segkv.kernels.dense_gemv import INPUT_GATED, INPUT_NORM, finish_block, gemv_operands, gemv_slice
from segkv.kernels.work_items import claim_item, count_done, leave_zero_if_last

_FIXED_COUNTERS = tl.constexpr(2)  # [0] the work dispenser, [1] down items past their wait, [2 + s] slice s
_NORM_INPUT, _GATED_INPUT = tl.constexpr(INPUT_NORM), tl.constexpr(INPUT_GATED)


@triton.jit
def _gated_mlp_kernel(
    X, RES, G, RES_OUT, W_UP, H, PART_UP, TICKETS_UP, W_DOWN, OUT, PART_DOWN, TICKETS_DOWN, COUNTERS,
    stride_wu, stride_wd, eps,
    HIDDEN: tl.constexpr, INNER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_RES: tl.constexpr, KIND: tl.constexpr, EVICT_FIRST: tl.constexpr, COUNTERS_P2: tl.constexpr,
    UP_SPLIT_P2: tl.constexpr, DOWN_SPLIT_P2: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Items: ``H = [gate | up] (2 INNER,)`` of ``W_UP @ rms_norm(X + RES)`` (``RES_OUT`` the sum),
    slice by slice, then ``OUT (HIDDEN,) = W_DOWN @ silu(gate) * up``, input block by input block
    (``INNER`` a multiple of ``BLOCK_K``, itself a multiple of ``BLOCK_N``)."""
    UP_SPLIT: tl.constexpr = (HIDDEN + BLOCK_K - 1) // BLOCK_K
    DOWN_SPLIT: tl.constexpr = INNER // BLOCK_K  # = slices
    PER_SLICE: tl.constexpr = BLOCK_K // BLOCK_N  # gate (and up) output blocks a slice holds
    SLICE_ITEMS: tl.constexpr = 2 * PER_SLICE * UP_SPLIT
    UP_ITEMS: tl.constexpr = DOWN_SPLIT * SLICE_ITEMS
    DOWN_BLOCKS: tl.constexpr = (HIDDEN + BLOCK_N - 1) // BLOCK_N
    item = claim_item(COUNTERS, USE_PDL)
    if item < UP_ITEMS:
        s = item // SLICE_ITEMS
        r = item % SLICE_ITEMS
        kb = r % UP_SPLIT
        block = r // UP_SPLIT  # gate blocks of the slice, then its up blocks
        nb = (block // PER_SLICE) * (INNER // BLOCK_N) + s * PER_SLICE + block % PER_SLICE
        part, square_sum = gemv_slice(X, RES, G, RES_OUT, W_UP, stride_wu, 2 * INNER, HIDDEN, nb, kb, X, X, 0,
                                      BLOCK_N, BLOCK_K, _NORM_INPUT, HAS_RES, KIND, EVICT_FIRST, False)
        if finish_block(PART_UP, TICKETS_UP, H, nb, 2 * INNER, HIDDEN, eps, part, square_sum, kb, BLOCK_N,
                         UP_SPLIT, UP_SPLIT_P2, True, KIND):
            count_done(COUNTERS + _FIXED_COUNTERS + s)
    else:
        d = item - UP_ITEMS
        kb = d // DOWN_BLOCKS
        nb = d % DOWN_BLOCKS
        # the weight block loads before the wait for the slice's gate and up blocks
        part, _ = gemv_slice(H, H, H, H, W_DOWN, stride_wd, HIDDEN, INNER, nb, kb, H, H, 0, BLOCK_N, BLOCK_K,
                             _GATED_INPUT, False, KIND, EVICT_FIRST, False, 1, False, True,
                             COUNTERS + _FIXED_COUNTERS + kb, 2 * PER_SLICE)
        finish_block(PART_DOWN, TICKETS_DOWN, OUT, nb, HIDDEN, INNER, eps, part, 0.0, kb, BLOCK_N, DOWN_SPLIT,
                      DOWN_SPLIT_P2, False, KIND)
        leave_zero_if_last(COUNTERS + 1, DOWN_SPLIT * DOWN_BLOCKS, COUNTERS, DOWN_SPLIT + _FIXED_COUNTERS, COUNTERS_P2)


def counters_size(inner: int, block_k: int) -> int:
    """int32 counters a launch needs for ``inner`` columns in blocks of ``block_k`` (zeros; left zero)."""
    return inner // block_k + _FIXED_COUNTERS.value


def fits(hidden: int, inner: int, block_n: int, block_k: int) -> bool:
    """Whether the one launch takes this MLP with these blocks (whole slices of whole blocks)."""
    return inner % block_k == 0 and block_k % block_n == 0 and hidden > 0


def gated_mlp_one_row(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      gate_up: torch.Tensor, down: torch.Tensor, counters: torch.Tensor, *, block_n: int,
                      block_k: int, num_warps: int = 4, up_workspace=None, down_workspace=None,
                      pdl: bool | None = None, evict_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm_splitk_gemv(x, residual, norm_weight, eps, gate_up)`` then ``gated_splitk_gemv`` of
    its result with ``down (H, I)``, in one launch: ``x``, ``residual`` ``(1, H)`` (or ``(H,)``),
    ``gate_up (2I, H)`` (``[gate | up]`` rows), ``counters`` :func:`counters_size` int32 zeros
    (left zero), the workspaces as there (one per weight). Returns ``(down product (..., H), x +
    residual)`` as the two launches return them."""
    hidden, inner = down.shape
    if gate_up.shape != (2 * inner, hidden):
        raise ValueError(f"gated_mlp_one_row: gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not "
                         f"make an MLP")
    if not fits(hidden, inner, block_n, block_k):
        raise ValueError(f"gated_mlp_one_row: {inner} inner columns in blocks of {block_k} x {block_n}: whole blocks "
                         f"needed")
    if counters.dtype != torch.int32 or counters.numel() < counters_size(inner, block_k):
        raise ValueError(f"gated_mlp_one_row: {counters_size(inner, block_k)} int32 counters needed, got "
                         f"{counters.numel()} {counters.dtype}")
    up = gemv_operands("gated_mlp_one_row", x, gate_up, input_kind=INPUT_NORM, residual=residual,
                       norm_weight=norm_weight, block_n=block_n, block_k=block_k, workspace=up_workspace, pdl=pdl)
    h = torch.empty(2 * inner, dtype=x.dtype, device=x.device)
    dn = gemv_operands("gated_mlp_one_row", h, down, input_kind=INPUT_GATED, residual=None, norm_weight=None,
                       block_n=block_n, block_k=block_k, workspace=down_workspace, pdl=pdl)
    out = torch.empty(hidden, dtype=x.dtype, device=x.device)
    items = up.blocks * up.split + dn.blocks * dn.split
    options = dict(up.options)
    options.pop("maxnreg", None)  # the down items' register cap is not the norm's
    _gated_mlp_kernel[(items,)](
        up.flat, up.res, up.g, out if up.res_out is None else up.res_out, gate_up, h, up.part, up.tickets, down, out,
        dn.part, dn.tickets, counters, gate_up.stride(0), down.stride(0), float(eps),
        HIDDEN=hidden, INNER=inner, BLOCK_N=block_n, BLOCK_K=block_k, HAS_RES=up.res_out is not None,
        KIND=up.kind, EVICT_FIRST=evict_first, COUNTERS_P2=triton.next_power_of_2(counters_size(inner, block_k)),
        UP_SPLIT_P2=triton.next_power_of_2(up.split), DOWN_SPLIT_P2=triton.next_power_of_2(dn.split),
        num_warps=num_warps, **options)
    return out.view(*x.shape[:-1], hidden), (x if up.res_out is None else up.res_out.view(x.shape))
