"""gpt-oss's mixture of experts: a biased top-k router and experts with a clamped SwiGLU.

It differs from the DeepSeek/Qwen/Mixtral experts of ``layers/moe.py`` in every part, so it is a
module of its own:

- the router's logits carry a bias; a token takes the top ``k`` logits and weighs those experts by
  the softmax over the ``k`` chosen logits only (not over all experts);
- each expert's projections carry biases and are stored stacked, as the checkpoints store them
  (``x @ W``: ``gate_up_proj (E, hidden, 2 I)``, ``down_proj (E, I, hidden)``), with the gate and up
  columns interleaved (gate ``0::2``, up ``1::2``);
- the activation is ``(up + 1) * gate * sigmoid(alpha * gate)`` with the gate clamped above at
  ``limit`` and up clamped to ``[-limit, limit]``; there is no shared expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def clamped_swiglu(gate_up: torch.Tensor, *, alpha: float, limit: float) -> torch.Tensor:
    """``(N, 2 I)`` interleaved gate/up -> ``(N, I)``, in the input dtype, as transformers'
    ``GptOssExperts._apply_gate`` computes it."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssRouter(nn.Module):
    """``router.*``: ``x (T, hidden)`` -> weights ``(T, k)`` float32, expert ids ``(T, k)`` int64.

    ``weight (E, hidden)``, ``bias (E,)``. The logits are computed in float32 whatever the model
    dtype (a choice must not flip with the weights' rounding); the weights are the softmax of the
    chosen ``k`` logits."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..num_local_experts={num_experts}")
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float(), self.bias.float())
        top, ids = logits.topk(self.top_k, dim=-1)
        return top.softmax(dim=-1), ids


class GptOssExperts(nn.Module):
    """``experts.*``: the ``E`` experts' stacked weights and biases (checkpoint layout).

    ``gate_up_proj (E, hidden, 2 I)``, ``gate_up_proj_bias (E, 2 I)``, ``down_proj (E, I, hidden)``,
    ``down_proj_bias (E, hidden)``. :meth:`forward` runs each chosen expert once over its tokens
    (one host synchronisation per layer for the group sizes) and sums the weighted outputs in
    float32, rounded once to the input dtype. The group sizes reach the host, so a CUDA graph
    cannot capture it (``GptOssForCausalLM.cuda_graphs_unsupported``)."""

    def __init__(self, hidden_size: int, expert_size: int, num_experts: int, *, alpha: float,
                 limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * expert_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * expert_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, expert_size, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``index`` on ``x (N, hidden)`` -> ``(N, hidden)`` in ``x.dtype``."""
        h = x @ self.gate_up_proj[index] + self.gate_up_proj_bias[index]
        act = clamped_swiglu(h, alpha=self.alpha, limit=self.limit)
        return act @ self.down_proj[index] + self.down_proj_bias[index]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x (T, hidden)``, ``weights (T, k)`` float32, ``ids (T, k)`` -> ``(T, hidden)``."""
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, token order kept
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        rows_all = order // k
        weights_all = weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for index, count in enumerate(counts):
            if count:
                rows = rows_all[start:start + count]
                y = self.expert(index, x[rows]).float() * weights_all[start:start + count]
                out.index_add_(0, rows, y)
                start += count
        return out.to(x.dtype)


class GptOssMoE(nn.Module):
    """A gpt-oss layer's MLP (``mlp.router.*``, ``mlp.experts.*``): ``x (T, hidden)`` -> ``(T, hidden)``."""

    def __init__(self, hidden_size: int, expert_size: int, num_experts: int, top_k: int, *,
                 alpha: float, limit: float) -> None:
        super().__init__()
        self.router = GptOssRouter(hidden_size, num_experts, top_k)
        self.experts = GptOssExperts(hidden_size, expert_size, num_experts, alpha=alpha, limit=limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        return self.experts(x, weights, ids)
