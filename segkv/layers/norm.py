"""RMSNorm, computed in float32 and cast back (as the reference checkpoints do)."""

from __future__ import annotations

import torch
from torch import nn

from segkv.kernels.fused_ops import rms_norm


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim; ``x`` any shape ``(..., D)``."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False  # one Triton kernel (kernels/fused_ops.py) instead of the torch ops

    def use_fused(self) -> None:
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return rms_norm(x, self.weight, self.eps)[0]
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``: the residual add of a pre-norm block fused into
        the norm when ``fused``."""
        if self.fused:
            return rms_norm(x, self.weight, self.eps, residual=residual)
        total = residual + x
        return self(total), total
