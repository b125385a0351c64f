"""Mixture of experts as DeepSeek V2/V3 route it: scored top-k experts plus shared experts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from segkv.distributed.parallel import TensorParallel
from segkv.layers.activation import GatedMLP
from segkv.layers.fp8 import Fp8Linear
from segkv.layers.norm import PendingCombine, RMSNorm

SCORING_FUNCS = ("softmax", "sigmoid")
# fused routers take their float32 logits from one Triton launch up to this many tokens (decode),
# with the block's norm and the top-k in the same launch where the block allows; beyond, each
# token's programs reading the whole weight again would lose to cuBLAS
ROUTER_KERNEL_MAX_TOKENS = 16
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(slots=True, frozen=True)
class RouterSpec:
    """How a token picks its experts.

    ``scoring``: ``softmax`` (DeepSeek V2) or ``sigmoid`` (V3) of the router logits.
    ``topk_method``: ``greedy`` (top-k of all experts), ``group_limited_greedy`` (V2: only
    experts of the ``topk_groups`` groups with the highest max score), ``noaux_tc`` (V3:
    groups ranked by the sum of their top-2 bias-corrected scores, experts chosen by the
    bias-corrected score; the bias is the checkpoint's ``e_score_correction_bias``).
    Weights are the unbiased scores of the chosen experts, normalised to sum 1 when
    ``norm_topk_prob``, then multiplied by ``routed_scaling_factor``.
    """

    num_experts: int
    top_k: int
    scoring: str = "softmax"
    topk_method: str = "greedy"
    num_groups: int = 1
    topk_groups: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in SCORING_FUNCS:
            raise ValueError(f"unsupported scoring_func {self.scoring!r}; "
                             f"supported: {', '.join(SCORING_FUNCS)}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"unsupported topk_method {self.topk_method!r}; "
                             f"supported: {', '.join(TOPK_METHODS)}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in "
                             f"1..n_routed_experts={self.num_experts}")
        if self.grouped:
            if self.num_groups < 1 or self.num_experts % self.num_groups:
                raise ValueError(f"n_group={self.num_groups} must divide n_routed_experts={self.num_experts}")
            if not 1 <= self.topk_groups <= self.num_groups:
                raise ValueError(f"topk_group={self.topk_groups} must be in 1..n_group={self.num_groups}")
            if self.topk_groups * self.group_size < self.top_k:
                raise ValueError(f"topk_group={self.topk_groups} groups of {self.group_size} experts cannot "
                                 f"supply num_experts_per_tok={self.top_k} experts")
            if self.topk_method == "noaux_tc" and self.group_size < 2:
                raise ValueError("topk_method 'noaux_tc' scores groups by their top 2 experts; "
                                 f"groups of {self.group_size} are too small")

    @property
    def grouped(self) -> bool:
        return self.topk_method != "greedy"

    @property
    def group_size(self) -> int:
        return self.num_experts // self.num_groups

    @property
    def has_bias(self) -> bool:
        """Whether the router carries ``e_score_correction_bias`` (V3's aux-loss-free balancing)."""
        return self.topk_method == "noaux_tc"


class TopKRouter(nn.Module):
    """``gate.*`` of a MoE layer: ``x (T, hidden)`` -> weights ``(T, k)`` float32, expert ids ``(T, k)``.

    Routing is computed in float32 whatever the model dtype.
    """

    def __init__(self, hidden_size: int, spec: RouterSpec) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size))
        self.fused = False  # see use_fused
        self._tickets: torch.Tensor | None = None  # see tickets (not saved)
        if spec.has_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(spec.num_experts), requires_grad=False)

    def tickets(self, device: torch.device) -> torch.Tensor:
        """int32 zeros for the fused norm-and-route kernel's per-token tickets (every launch
        leaves them zero): allocated once per device, before any graph capture uses them."""
        if self._tickets is None or self._tickets.device != device:
            self._tickets = torch.zeros(ROUTER_KERNEL_MAX_TOKENS, dtype=torch.int32, device=device)
        return self._tickets

    def use_fused(self) -> None:
        """Scores, top-k, weights and scaling in one kernel (``kernels.moe.moe_ops.route_topk``) for
        routers that choose among all experts (``greedy``); grouped choices stay in torch."""
        self.fused = not self.spec.grouped

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        if self.fused:
            from segkv.kernels.moe.moe_ops import route_topk, router_logits

            if x.shape[0] <= ROUTER_KERNEL_MAX_TOKENS:  # decode: one launch for the float32 product
                logits = router_logits(x, self.weight)
            else:
                logits = F.linear(x.float(), self.weight.float())
            return route_topk(logits, s.top_k, scoring=s.scoring, norm_topk_prob=s.norm_topk_prob,
                              scaling=s.routed_scaling_factor)
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(dim=-1) if s.scoring == "softmax" else logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float() if s.has_bias else scores
        if s.grouped:
            grouped = choice.view(-1, s.num_groups, s.group_size)
            if s.topk_method == "group_limited_greedy":
                group_scores = grouped.amax(dim=-1)
            else:
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = group_scores.topk(s.topk_groups, dim=-1).indices
            allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~allowed.repeat_interleave(s.group_size, dim=1), float("-inf"))
        ids = choice.topk(s.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if s.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * s.routed_scaling_factor, ids


class MixtureOfExperts(nn.Module):
    """Routed experts (``experts.{i}.*``) weighted by ``gate``, plus ``shared_experts`` on every token.

    ``x``: ``(T, hidden)`` -> ``(T, hidden)``. Each expert runs once on the tokens routed to
    it; the weighted expert outputs are summed in float32 and rounded once. Unpacked layers
    loop over experts (a host synchronisation per layer); packed ones (:meth:`pack_experts`)
    stay on the device: a GEMV per (token, expert) pair up to ``PACKED_PAIRS_LIMIT`` pairs, a
    grouped GEMM per expert beyond it. Fused (GPU decode) with one token, every routed and shared
    expert of the layer runs in one launch (``kernels.moe.expert_mlp``: the down items start as each
    pair's gate/up items finish; measured faster than two launches: docs/performance-notes.md),
    where a batch-1 step of small experts is mostly launches.
    """

    def __init__(self, hidden_size: int, expert_size: int, spec: RouterSpec, *, num_shared: int = 0,
                 shared_bias: bool = False, activation: str = "silu") -> None:
        super().__init__()
        self.gate = TopKRouter(hidden_size, spec)
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, expert_size, activation=activation) for _ in range(spec.num_experts)
        )
        self.shared_experts = (
            GatedMLP(hidden_size, expert_size * num_shared, bias=shared_bias, activation=activation)
            if num_shared else None
        )
        self._packed: tuple[torch.Tensor, torch.Tensor] | None = None  # see pack_experts (not saved)
        self.tp: TensorParallel | None = None  # set by models/tensor_parallel.py (never packed then)
        self._counters: dict[tuple, torch.Tensor] = {}  # kernels.moe.expert_mlp's, per (device, pairs); left zero
        self.fused = False  # see use_fused

    # (token, expert) pairs up to which a packed layer runs one GEMV per pair: each pair reads
    # its expert's weights, which beats grouping the pairs by expert only for small batches
    PACKED_PAIRS_LIMIT = 64
    # tokens up to which the shared experts run in the routed GEMV launches: each token's programs
    # read the shared weights again, which cuBLAS reads once for all rows (measured faster at one
    # token, slower at a few: docs/performance-notes.md)
    SHARED_IN_GEMV_TOKENS = 1

    def pack_experts(self) -> None:
        """Stack the routed experts' weights, ``gate+up (E, 2I, H)`` and ``down (E, H, I)``, and
        make each expert's parameters views of the stacks (no second copy stays alive). Batches
        then dispatch on the device, without a host synchronisation (CUDA graphs)."""
        if self._packed is not None:
            return
        first = self.experts[0]
        if isinstance(first.gate_proj, Fp8Linear):
            self._unquantize_experts()
        inner, hidden = first.gate_proj.weight.shape
        like = {"dtype": first.gate_proj.weight.dtype, "device": first.gate_proj.weight.device}
        gate_up = torch.empty(len(self.experts), 2 * inner, hidden, **like)
        down = torch.empty(len(self.experts), hidden, inner, **like)
        with torch.no_grad():
            for i, expert in enumerate(self.experts):
                if expert.gate_proj.bias is not None or expert.down_proj.bias is not None:
                    raise ValueError("packed experts take no biases")
                gate_up[i, :inner].copy_(expert.gate_proj.weight)
                gate_up[i, inner:].copy_(expert.up_proj.weight)
                down[i].copy_(expert.down_proj.weight)
                expert.gate_proj.weight = nn.Parameter(gate_up[i, :inner], requires_grad=False)
                expert.up_proj.weight = nn.Parameter(gate_up[i, inner:], requires_grad=False)
                expert.down_proj.weight = nn.Parameter(down[i], requires_grad=False)
        self._packed = (gate_up, down)

    def _unquantize_experts(self) -> None:
        """FP8 routed experts become plain linears in the model dtype: the packed expert kernels
        read plain weights. Correct, but the experts lose FP8's memory saving while packed."""
        for expert in self.experts:
            for name in ("gate_proj", "up_proj", "down_proj"):
                fp8 = getattr(expert, name)
                if isinstance(fp8, Fp8Linear):
                    plain = nn.Linear(fp8.in_features, fp8.out_features, bias=fp8.bias is not None,
                                      device=fp8.weight.device, dtype=fp8.model_dtype)
                    with torch.no_grad():
                        plain.weight.copy_(fp8.dequantized())
                        if fp8.bias is not None:
                            plain.bias.copy_(fp8.bias)
                    plain.requires_grad_(False)
                    setattr(expert, name, plain)

    @property
    def packed(self) -> bool:
        return self._packed is not None

    def use_fused(self) -> None:
        """Combine the expert outputs, their weights and the shared experts' output in one kernel
        (packed layers; GPU decode). The router fuses its own part (``TopKRouter.use_fused``)."""
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self._experts(x, weights, ids)

    def forward_after_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, *, defer_combine: bool = False
                           ) -> tuple[torch.Tensor | PendingCombine, torch.Tensor]:
        """A pre-norm block's second half: ``(self(norm(x + residual)), x + residual)``. Fused
        with a few tokens (decode), the residual add, the norm, the router's logits and its top-k
        are one launch (``kernels.moe.moe_ops.norm_route_topk``). ``defer_combine``: a fused layer may
        return its output as a :class:`PendingCombine`, for the next block's norm to form in its
        own launch."""
        gate = self.gate
        defer = defer_combine
        if not (self.fused and gate.fused and norm.fused and x.dim() == 2
                and x.shape[0] <= ROUTER_KERNEL_MAX_TOKENS):
            h, residual = norm.add_and_norm(x, residual)
            weights, ids = self.gate(h)
            return self._experts(h, weights, ids, defer), residual
        from segkv.kernels.moe.moe_ops import norm_route_topk

        s = gate.spec
        block = self._block_in_one_launch(x, residual, norm)
        if block is not None:
            total, weights, ids, y, shared = block
            pending = PendingCombine(y, weights, shared)
            return (pending if defer else pending.materialize()), total
        h, residual, weights, ids = norm_route_topk(
            x, residual, norm.weight, norm.eps, gate.weight, s.top_k, gate.tickets(x.device),
            scoring=s.scoring, norm_topk_prob=s.norm_topk_prob, scaling=s.routed_scaling_factor)
        return self._experts(h, weights, ids, defer), residual

    def _block_in_one_launch(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple | None:
        """One token's norm, router, top-k and experts in one launch (shared experts stacked, a norm
        weight of ``x``'s dtype): ``moe_block_one_token``'s results, else None. The shared experts'
        items wait only for the normed row, the routed ones for the ids (measured level or slightly
        faster than two launches: docs/performance-notes.md)."""
        shared = self._stacked_shared_weights() if self._packed is not None else None
        if not (shared is not None and x.shape[0] == 1 and norm.weight.dtype == x.dtype):
            return None
        from segkv.kernels.moe.expert_mlp import moe_block_one_token

        s, k = self.gate.spec, self.gate.spec.top_k
        gate_up, down = self._packed
        return moe_block_one_token(
            x.contiguous(), residual.contiguous(), norm.weight, norm.eps, self.gate.weight, k,
            self.gate.tickets(x.device), gate_up, down, shared[0], shared[1], self._launch_counters(x.device, k),
            scoring=s.scoring, norm_topk_prob=s.norm_topk_prob, scaling=s.routed_scaling_factor)

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, defer_combine: bool = False
                 ) -> torch.Tensor | PendingCombine:
        """The routed experts' outputs weighted by ``weights (T, k)`` for ``ids (T, k)``, plus the
        shared experts' output: ``(T, hidden)``, or when fused and ``defer_combine`` the parts of
        that sum (:class:`PendingCombine`)."""
        if self._packed is None:
            out = self._looped_experts(x, weights, ids)
            out = out if self.shared_experts is None else out + self.shared_experts(x)
            # a tensor-parallel shard's experts hold 1/N of their columns: partial sums meet here
            return out if self.tp is None else self.tp.all_reduce(out)
        one_launch = self.fused and x.shape[0] <= self.SHARED_IN_GEMV_TOKENS
        shared_weights = self._stacked_shared_weights() if one_launch else None
        if shared_weights is not None:  # shared experts in the routed pairs' launches
            y, shared = self._packed_experts(x, ids, shared_weights)
        else:
            y = self._packed_experts(x, ids)[0] if ids.numel() <= self.PACKED_PAIRS_LIMIT \
                else self._grouped_experts(x, ids)
            shared = self.shared_experts(x) if self.shared_experts is not None else None
        if self.fused:
            pending = PendingCombine(y, weights, shared)
            return pending if defer_combine else pending.materialize()
        tokens, k = ids.shape
        out = (y.float() * weights.reshape(-1, 1)).view(tokens, k, -1).sum(dim=1).to(x.dtype)
        return out if shared is None else out + shared

    def _packed_experts(self, x: torch.Tensor, ids: torch.Tensor,
                        shared: tuple[torch.Tensor, torch.Tensor] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Device-side dispatch for few pairs: one GEMV per (token, expert) pair; pair ``n`` is
        token ``n // k`` (no index tensors to build). Returns the routed outputs ``(T k, H)``, and
        with ``shared`` (:meth:`_stacked_shared_weights`) the shared experts' ``(T, H)`` from the
        same launches (else None): one token's in one launch, else two. The gate/up launch writes
        ``silu(gate) * up`` and the down launch reads it plainly (measured faster than taking the
        activation in the down launch: docs/performance-notes.md)."""
        from segkv.kernels.moe.expert_gemv import expert_gemv, expert_gemv_with_shared

        gate_up, down = self._packed
        experts = ids.reshape(-1)
        x = x.contiguous()
        one = x.shape[0] == 1  # one token's experts are distinct: each weight read once
        if shared is not None and one:
            return self._one_launch(x, experts, shared)
        if shared is not None:
            h, shared_h = expert_gemv_with_shared(x, ids.shape[1], experts, gate_up, x, shared[0], distinct_experts=one,
                                                  activation=True)
            return expert_gemv_with_shared(h, 1, experts, down, shared_h, shared[1], distinct_experts=one)
        h = expert_gemv(x, ids.shape[1], experts, gate_up, distinct_experts=one, activation=True)  # (T k, I)
        return expert_gemv(h, 1, experts, down, distinct_experts=one), None

    def _one_launch(self, x: torch.Tensor, experts: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token's pairs and shared experts in one launch (``kernels.moe.expert_mlp``)."""
        from segkv.kernels.moe.expert_mlp import expert_mlp_one_token

        gate_up, down = self._packed
        return expert_mlp_one_token(x, experts, gate_up, down, shared[0], shared[1],
                                    self._launch_counters(x.device, experts.numel()))

    def _launch_counters(self, device: torch.device, pairs: int) -> torch.Tensor:
        """This layer's int32 counters for one-launch experts of ``pairs`` pairs (left zero by every
        launch; allocated at the first call, which precedes any graph capture replaying it)."""
        from segkv.kernels.moe.expert_mlp import counters_size

        key = (device, pairs)
        if key not in self._counters:
            self._counters[key] = torch.zeros(counters_size(pairs), dtype=torch.int32, device=device)
        return self._counters[key]

    def _stacked_shared_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shared experts' ``[gate | up] (2 S I, H)`` and ``down (H, S I)`` weights, when they
        can run in the routed pairs' launches (stacked by their ``use_fused``, no biases)."""
        shared = self.shared_experts
        if shared is None or shared.stacked_gate_up is None or shared.down_proj.bias is not None:
            return None
        weight, bias = shared.stacked_gate_up
        return (weight, shared.down_proj.weight) if bias is None else None

    def _grouped_experts(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Device-side dispatch for many pairs: the pairs sorted by expert on the device (one
        grouping shared by both products), each expert's weights read about once per product."""
        from segkv.kernels.moe.grouped_expert_gemm import group_pairs_by_expert, grouped_expert_gemm

        from segkv.kernels.fused.fused_ops import silu_and_mul

        gate_up, down = self._packed
        experts = ids.reshape(-1)
        groups = group_pairs_by_expert(experts, len(self.experts))
        h = grouped_expert_gemm(x.contiguous(), ids.shape[1], experts, gate_up, groups=groups)  # (T k, 2I)
        act = silu_and_mul(h)  # rounded as F.silu(gate) * up
        return grouped_expert_gemm(act, 1, experts, down, groups=groups)  # (T k, H)

    def _looped_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """One GEMM per chosen expert over its tokens. The (token, slot) pairs are grouped by
        expert with one stable sort, and the group sizes reach the host in one transfer per
        layer (not one per expert), in ascending token order within each expert."""
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order kept
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        rows_all = order // k
        weights_all = weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = rows_all[start:start + count]
                y = self.experts[expert](x[rows]).float() * weights_all[start:start + count]
                out.index_add_(0, rows, y)
                start += count
        return out.to(x.dtype)
