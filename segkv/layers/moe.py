"""Mixture of experts as DeepSeek V2/V3 route it: scored top-k experts plus shared experts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from segkv.layers.activation import GatedMLP

SCORING_FUNCS = ("softmax", "sigmoid")
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
        if spec.has_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(spec.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
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
    it; the weighted expert outputs are summed in float32 and rounded once.
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in ids.unique().tolist():
            rows, slot = (ids == expert).nonzero(as_tuple=True)
            y = self.experts[expert](x[rows]).float() * weights[rows, slot].unsqueeze(-1)
            out.index_add_(0, rows, y)
        out = out.to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
