"""Triton kernel: one token's mixture-of-experts MLP (routed pairs and shared experts) in one launch.

At batch 1 a MoE layer's experts were two GEMV launches (``expert_gemv_with_shared``): gate/up
writing ``silu(gate) * up``, then down. The down launch is short (46 MB for DeepSeek-V2-Lite), so
its ramp and tail weigh: alone it streams well below gate/up's rate. Here both products are
work items of one launch, in this order: the shared experts' gate/up blocks, each routed pair's
gate/up blocks (pair after pair), then the shared down blocks and each pair's down blocks. A
gate/up item counts itself in its expert's counter when its activation is stored; a down item
waits (spins) until its expert's counter is full, then reads the activation through L2. The
first pairs' down items thus stream while later pairs' gate/up items still run, and the launch
has one tail instead of two.

Programs take their work item from an atomic counter, not from their program id, so the items
are started in order whatever order the GPU starts programs in: a program holding a down item
knows every gate/up item is held by a running program, and its wait ends (no deadlock, whatever
the occupancy). The last down item to pass its wait sets the counters back to 0 for the next
launch. Each item computes what the two-launch path computes (same blocks, float32 sums, same
roundings).

:func:`moe_block_one_token` (the default for a fused MoE block at one token) puts the router's
programs (residual add, RMSNorm, logits, top-k) before these items in the same launch: the shared
experts' gate/up items wait for the normed row, the routed ones for the ids too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from segkv.kernels.triton_import import tl, triton

from segkv.kernels.moe.expert_gemv import _gemv_tile, _weight_rows
from segkv.kernels.fused.fused_ops import kind_of
from segkv.kernels.moe.moe_ops import norm_route_program, prepare_norm_route
from segkv.kernels.pdl import pdl_options
from segkv.kernels.moe.work_items import claim_item, count_done, leave_zero_if_last, wait_full
import segkv.settings as settings

_INTERPRET = settings.SETTINGS.triton_interpret

# counters: [0] the work dispenser, [1] down items past their wait, [2 + n] pair n's gate/up
# items done, [2 + pairs] the shared experts', [3 + pairs] the normed row stored (the router's
# block 0), [4 + pairs] the top-k ids stored (the router's last block)
_FIXED_COUNTERS = tl.constexpr(2)
_ROUTE_COUNTERS = tl.constexpr(2)


@triton.jit
def _mlp_item(item, X, GU, DOWN, ACT, OUT, experts, SGU, SDOWN, SACT, SOUT, COUNTERS,
              stride_gue, stride_guo, stride_de, stride_do, stride_sguo, stride_sdo,
              PAIRS: tl.constexpr, HIDDEN: tl.constexpr, INNER: tl.constexpr, S_INNER: tl.constexpr,
              BLOCK_O: tl.constexpr, BLOCK_I_UP: tl.constexpr, BLOCK_I_DOWN: tl.constexpr, EXACT_FP32: tl.constexpr,
              KIND: tl.constexpr, EVICT_FIRST: tl.constexpr, COUNTERS_P2: tl.constexpr, UNROLL: tl.constexpr,
              ROUTED: tl.constexpr):
    """Expert work item ``item`` (see the module docstring): ``X (1, HIDDEN)``; routed ``GU (E,
    2 INNER, HIDDEN)`` ``[gate | up]`` stacks and ``DOWN (E, HIDDEN, INNER)`` for the ``PAIRS``
    experts ``experts[n]``, activations into ``ACT (PAIRS, INNER)``, results into ``OUT (PAIRS,
    HIDDEN)``; shared ``SGU (2 S_INNER, HIDDEN)``, ``SDOWN (HIDDEN, S_INNER)``, ``SACT (S_INNER,)``,
    ``SOUT (HIDDEN,)``. ``ROUTED``: ``X`` and ``experts`` are written by the router's programs of
    the same launch: the gate/up items wait for their counters and read them through L2."""
    UP_BLOCKS: tl.constexpr = (INNER + BLOCK_O // 2 - 1) // (BLOCK_O // 2)
    S_UP_BLOCKS: tl.constexpr = (S_INNER + BLOCK_O // 2 - 1) // (BLOCK_O // 2)
    DOWN_BLOCKS: tl.constexpr = (HIDDEN + BLOCK_O - 1) // BLOCK_O
    UP_ITEMS: tl.constexpr = S_UP_BLOCKS + PAIRS * UP_BLOCKS
    ITEMS: tl.constexpr = UP_ITEMS + (PAIRS + 1) * DOWN_BLOCKS
    NORM_READY: tl.constexpr = _FIXED_COUNTERS + PAIRS + 1
    CG: tl.constexpr = ".cg" if ROUTED else ""
    if item < UP_ITEMS:
        if item < S_UP_BLOCKS:  # the shared experts' gate/up: not routed, so first
            rows, _ = _weight_rows(item, BLOCK_O, 2 * S_INNER, True)
            # routed: the normed row is the router's block 0's
            _gemv_tile(X, SGU + rows.to(tl.int64) * stride_sguo, SACT, item, HIDDEN, 2 * S_INNER, BLOCK_O,
                       BLOCK_I_UP, EXACT_FP32, KIND, UNROLL, EVICT_FIRST, True,
                       ROUTED, ROUTED, COUNTERS + NORM_READY, 1)
            count_done(COUNTERS + _FIXED_COUNTERS + PAIRS)
        else:
            n = (item - S_UP_BLOCKS) // UP_BLOCKS
            ob = (item - S_UP_BLOCKS) % UP_BLOCKS
            if ROUTED:  # the normed row, then the ids (each released by its own count)
                wait_full(COUNTERS + NORM_READY, 1)
                wait_full(COUNTERS + NORM_READY + 1, 1)
            expert = tl.load(experts + n, cache_modifier=CG).to(tl.int64)
            rows, _ = _weight_rows(ob, BLOCK_O, 2 * INNER, True)
            _gemv_tile(X, GU + expert * stride_gue + rows.to(tl.int64) * stride_guo, ACT + n * INNER, ob, HIDDEN,
                       2 * INNER, BLOCK_O, BLOCK_I_UP, EXACT_FP32, KIND, UNROLL, EVICT_FIRST,
                       True, ROUTED)
            count_done(COUNTERS + _FIXED_COUNTERS + n)
    else:
        d = item - UP_ITEMS
        ob = d % DOWN_BLOCKS
        rows = ob * BLOCK_O + tl.arange(0, BLOCK_O)
        if d < DOWN_BLOCKS:  # the shared experts' down: their gate/up items came first
            _gemv_tile(SACT, SDOWN + rows.to(tl.int64) * stride_sdo, SOUT, ob, S_INNER, HIDDEN, BLOCK_O,
                       BLOCK_I_DOWN, EXACT_FP32, KIND, UNROLL, EVICT_FIRST, False, True,
                       True, COUNTERS + _FIXED_COUNTERS + PAIRS, S_UP_BLOCKS)
        else:
            n = d // DOWN_BLOCKS - 1
            if ROUTED:  # the ids first: the weights' address needs them
                wait_full(COUNTERS + NORM_READY + 1, 1)
            expert = tl.load(experts + n, cache_modifier=CG).to(tl.int64)
            _gemv_tile(ACT + n * INNER, DOWN + expert * stride_de + rows.to(tl.int64) * stride_do,
                       OUT + n * HIDDEN, ob, INNER, HIDDEN, BLOCK_O, BLOCK_I_DOWN, EXACT_FP32, KIND, UNROLL,
                       EVICT_FIRST, False, True, True, COUNTERS + _FIXED_COUNTERS + n, UP_BLOCKS)
        leave_zero_if_last(COUNTERS + 1, ITEMS - UP_ITEMS, COUNTERS, PAIRS + _FIXED_COUNTERS + 1 + _ROUTE_COUNTERS,
                           COUNTERS_P2)


@triton.jit
def _expert_mlp_kernel(
    X, GU, DOWN, ACT, OUT, experts, SGU, SDOWN, SACT, SOUT, COUNTERS,
    stride_gue, stride_guo, stride_de, stride_do, stride_sguo, stride_sdo,
    PAIRS: tl.constexpr, HIDDEN: tl.constexpr, INNER: tl.constexpr, S_INNER: tl.constexpr,
    BLOCK_O: tl.constexpr, BLOCK_I_UP: tl.constexpr, BLOCK_I_DOWN: tl.constexpr, EXACT_FP32: tl.constexpr,
    KIND: tl.constexpr, EVICT_FIRST: tl.constexpr, COUNTERS_P2: tl.constexpr, USE_PDL: tl.constexpr,
    UNROLL: tl.constexpr = True,
):
    """One expert work item per program (:func:`_mlp_item`); ``COUNTERS``: int32 zeros, left zero."""
    item = claim_item(COUNTERS, USE_PDL)
    _mlp_item(item, X, GU, DOWN, ACT, OUT, experts, SGU, SDOWN, SACT, SOUT, COUNTERS,
              stride_gue, stride_guo, stride_de, stride_do, stride_sguo, stride_sdo, PAIRS, HIDDEN, INNER, S_INNER,
              BLOCK_O, BLOCK_I_UP, BLOCK_I_DOWN, EXACT_FP32, KIND, EVICT_FIRST, COUNTERS_P2, UNROLL, False)


@triton.jit
def _moe_block_kernel(
    XO, RES, NORM_W, RES_OUT, X, ROUTER_W, LOGITS, WEIGHTS, experts, TICKETS,
    stride_xo, stride_r, stride_ro, stride_h, stride_w, stride_l, num_experts, eps, scale,
    GU, DOWN, ACT, OUT, SGU, SDOWN, SACT, SOUT, COUNTERS,
    stride_gue, stride_guo, stride_de, stride_do, stride_sguo, stride_sdo,
    X_KIND: tl.constexpr, H_KIND: tl.constexpr, BLOCK_H: tl.constexpr, ONE_STEP: tl.constexpr,
    BLOCK_E: tl.constexpr, ALL_E: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr, SOFTMAX: tl.constexpr,
    NORM: tl.constexpr, BY_RANK: tl.constexpr, ROUTER_BLOCKS: tl.constexpr,
    HIDDEN: tl.constexpr, INNER: tl.constexpr, S_INNER: tl.constexpr,
    BLOCK_O: tl.constexpr, BLOCK_I_UP: tl.constexpr, BLOCK_I_DOWN: tl.constexpr, EXACT_FP32: tl.constexpr,
    KIND: tl.constexpr, EVICT_FIRST: tl.constexpr, COUNTERS_P2: tl.constexpr, USE_PDL: tl.constexpr,
    UNROLL: tl.constexpr = True,
):
    """One token's whole MoE block: the first ``ROUTER_BLOCKS`` items are the router's programs
    (``moe_ops.norm_route_program``: the residual add ``RES_OUT = XO + RES``, its RMSNorm ``X``, the
    logits and the top-k ``experts`` / ``WEIGHTS``, signalling the counters the expert items wait
    on), the rest the expert items of :func:`_mlp_item` with ``K`` pairs."""
    item = claim_item(COUNTERS, USE_PDL)
    if item < ROUTER_BLOCKS:
        norm_route_program(XO, RES, NORM_W, RES_OUT, X, ROUTER_W, LOGITS, WEIGHTS, experts, TICKETS,
                           stride_xo, stride_r, stride_ro, stride_h, stride_w, stride_l, HIDDEN, num_experts, eps,
                           scale, 0, item, ROUTER_BLOCKS, COUNTERS + _FIXED_COUNTERS + K + 1,
                           COUNTERS + _FIXED_COUNTERS + K + 2, X_KIND, H_KIND, BLOCK_H, ONE_STEP, BLOCK_E, ALL_E, K,
                           BLOCK_K, SOFTMAX, NORM, BY_RANK, False, True)
    else:
        _mlp_item(item - ROUTER_BLOCKS, X, GU, DOWN, ACT, OUT, experts, SGU, SDOWN, SACT, SOUT, COUNTERS,
                  stride_gue, stride_guo, stride_de, stride_do, stride_sguo, stride_sdo, K, HIDDEN, INNER, S_INNER,
                  BLOCK_O, BLOCK_I_UP, BLOCK_I_DOWN, EXACT_FP32, KIND, EVICT_FIRST, COUNTERS_P2, UNROLL, True)


# 16 outputs a program (8 gate rows with their 8 up rows), 512 inputs a step, 8 warps, the input
# loop unrolled, 3 pipeline stages: the fastest measured (docs/performance-notes.md, "Figures
# behind the code's constants").
BLOCK_O, BLOCK_I, NUM_WARPS = 16, 512, 8


def counters_size(pairs: int) -> int:
    """int32 counters one launch for ``pairs`` routed pairs needs (zeros; the launch leaves them zero)."""
    return pairs + _FIXED_COUNTERS.value + 1 + _ROUTE_COUNTERS.value


def _activation_buffer(shape: tuple, dtype: torch.dtype, device: torch.device, poison: bool) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device) if poison else torch.empty(
        shape, dtype=dtype, device=device)


@dataclass
class _ExpertLaunch:
    """Outputs (``act``, ``s_act``, ``out``, ``s_out``, in the kernels' dtype), item count, weight
    strides and constexprs of the expert items of one token."""

    act: torch.Tensor
    s_act: torch.Tensor
    out: torch.Tensor
    s_out: torch.Tensor
    items: int
    strides: tuple[int, ...]
    meta: dict


def _prepare_experts(name: str, x: torch.Tensor, pairs: int, gate_up: torch.Tensor, down: torch.Tensor,
                     shared_gate_up: torch.Tensor, shared_down: torch.Tensor, counters: torch.Tensor,
                     poison: bool) -> _ExpertLaunch:
    """Checks (a clear error naming ``name``) and buffers of the expert items for the row ``x (1, H)``."""
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1:
        raise ValueError(f"{name} takes one contiguous row, got x {tuple(x.shape)}")
    hidden = x.shape[1]
    num_experts, two_inner, _ = gate_up.shape
    inner, s_inner = two_inner // 2, shared_gate_up.shape[0] // 2
    if (gate_up.shape[2] != hidden or two_inner % 2 or down.shape != (num_experts, hidden, inner)
            or shared_gate_up.shape != (2 * s_inner, hidden) or shared_down.shape != (hidden, s_inner)):
        raise ValueError(f"{name}: shapes do not match: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down "
                         f"{tuple(down.shape)}, shared gate_up {tuple(shared_gate_up.shape)}, shared down "
                         f"{tuple(shared_down.shape)}")
    for what, t in (("gate_up", gate_up), ("down", down), ("shared gate_up", shared_gate_up),
                    ("shared down", shared_down)):
        if t.stride(-1) != 1 or t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{name}: {what} needs unit column stride and x's dtype and device, "
                             f"got strides {t.stride()} {t.dtype} on {t.device}")
    if counters.dtype != torch.int32 or counters.numel() < counters_size(pairs) or counters.device != x.device:
        raise ValueError(f"{name}: {counters_size(pairs)} int32 counters on {x.device} needed, got "
                         f"{counters.numel()} {counters.dtype} on {counters.device}")
    # the interpreter truncates float32 -> bf16/fp16 stores: there it writes float32, torch rounds
    kernel_dtype = torch.float32 if _INTERPRET else x.dtype
    block_i = BLOCK_I
    items = (triton.cdiv(s_inner, BLOCK_O // 2) + pairs * triton.cdiv(inner, BLOCK_O // 2)
             + (pairs + 1) * triton.cdiv(hidden, BLOCK_O))
    meta = dict(HIDDEN=hidden, INNER=inner, S_INNER=s_inner, BLOCK_O=BLOCK_O,
                BLOCK_I_UP=min(block_i, triton.next_power_of_2(hidden)),
                BLOCK_I_DOWN=min(block_i, triton.next_power_of_2(max(inner, s_inner))),
                EXACT_FP32=kernel_dtype == torch.float32, KIND=kind_of(x.dtype), EVICT_FIRST=True,
                COUNTERS_P2=triton.next_power_of_2(counters_size(pairs)),
                UNROLL=True, num_warps=NUM_WARPS, num_stages=3)
    return _ExpertLaunch(
        _activation_buffer((pairs, inner), kernel_dtype, x.device, poison),
        _activation_buffer((s_inner,), kernel_dtype, x.device, poison),
        torch.empty(pairs, hidden, dtype=kernel_dtype, device=x.device),
        torch.empty(1, hidden, dtype=kernel_dtype, device=x.device), items,
        (gate_up.stride(0), gate_up.stride(1), down.stride(0), down.stride(1), shared_gate_up.stride(0),
         shared_down.stride(0)), meta)


def expert_mlp_one_token(x: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                         shared_gate_up: torch.Tensor, shared_down: torch.Tensor, counters: torch.Tensor,
                         *, pdl: bool | None = None, poison: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's experts in one launch: ``x (1, H)``; ``experts (k,)`` int ids on the device;
    routed ``gate_up (E, 2 I, H)`` (``[gate | up]`` rows) and ``down (E, H, I)``; shared
    ``shared_gate_up (2 S, H)`` and ``shared_down (H, S)``; ``counters``: :func:`counters_size`
    int32 zeros on the device (kept between launches: each launch leaves them zero). Returns
    ``(routed (k, H), shared (1, H))`` in ``x``'s dtype: ``down[e] @ silu(gate) * up`` per pair and
    the same for the shared weights, as ``expert_gemv_with_shared``'s gate/up launch with
    ``activation=True`` followed by its plain down launch computes them (to float32 summation
    order). ``poison``: the activation buffers start as NaN (tests: a down item that read them
    before they were complete shows)."""
    launch = _prepare_experts("expert_mlp_one_token", x, experts.numel(), gate_up, down, shared_gate_up, shared_down,
                              counters, poison)
    _expert_mlp_kernel[(launch.items,)](
        x, gate_up, down, launch.act, launch.out, experts, shared_gate_up, shared_down, launch.s_act, launch.s_out,
        counters, *launch.strides, PAIRS=experts.numel(), **launch.meta, **pdl_options(x, pdl))
    return launch.out.to(x.dtype), launch.s_out.to(x.dtype)


def moe_block_one_token(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        router_weight: torch.Tensor, top_k: int, tickets: torch.Tensor, gate_up: torch.Tensor,
                        down: torch.Tensor, shared_gate_up: torch.Tensor, shared_down: torch.Tensor,
                        counters: torch.Tensor, *, scoring: str = "softmax", norm_topk_prob: bool = False,
                        scaling: float = 1.0, pdl: bool | None = None, poison: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token's whole MoE block in one launch: ``moe_ops.norm_route_topk`` (residual add, RMSNorm,
    router logits, top-k; its arguments) and then :func:`expert_mlp_one_token` on the normed row
    and the chosen experts, whose items wait for the router's programs of the same launch (the
    shared experts' only for the normed row). ``counters`` as there, for ``top_k`` pairs. Returns
    ``(x + residual (1, H), weights (1, k) float32, ids (1, k) int64, routed (k, H), shared (1,
    H))``, each as the two launches compute it."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"moe_block_one_token takes one contiguous row, got x {tuple(x.shape)}")
    route = prepare_norm_route(x, residual, norm_weight, router_weight, top_k, tickets, scoring=scoring,
                               norm_topk_prob=norm_topk_prob, name="moe_block_one_token")
    if route.h.dtype != x.dtype:
        raise ValueError(f"moe_block_one_token: the normed row ({route.h.dtype}) feeds experts of {x.dtype}: "
                         f"a norm weight of {norm_weight.dtype} does not fit")
    launch = _prepare_experts("moe_block_one_token", x, top_k, gate_up, down, shared_gate_up, shared_down, counters,
                              poison)
    _moe_block_kernel[(route.blocks + launch.items,)](
        x, residual, norm_weight, route.total, route.h, router_weight, route.logits, route.weights, route.ids,
        tickets, *route.strides(x, residual, router_weight), router_weight.shape[0], float(eps), float(scaling),
        gate_up, down, launch.act, launch.out, shared_gate_up, shared_down, launch.s_act, launch.s_out, counters,
        *launch.strides, **route.meta, ROUTER_BLOCKS=route.blocks, **launch.meta, **pdl_options(x, pdl))
    return route.total, route.weights, route.ids, launch.out.to(x.dtype), launch.s_out.to(x.dtype)
