"""Gated MLP activation: SiLU(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: the SwiGLU feed-forward of Llama-style models.

    ``x``: ``(T, hidden)`` -> ``(T, hidden)``. Parameter names follow the checkpoints.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False,
                 activation: str = "silu") -> None:
        super().__init__()
        if activation != "silu":
            raise ValueError(f"unsupported hidden_act {activation!r}; segkv supports 'silu'")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
