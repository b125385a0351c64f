"""RMSNorm, computed in float32 and cast back (as the reference checkpoints do)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from segkv.kernels.fused.fused_ops import rms_norm


@dataclass(frozen=True, slots=True)
class PendingCombine:
    """A mixture-of-experts layer's output not formed yet: ``sum_j weights[t, j] * parts[t k + j]``
    in float32, rounded once, plus ``shared`` (``kernels.moe.moe_ops.combine_experts``). The next
    block's norm forms it inside its own launch (:meth:`RMSNorm.add_and_norm`).

    ``parts (T k, H)``, ``weights (T, k)`` float32, ``shared (T, H)`` or None."""

    parts: torch.Tensor
    weights: torch.Tensor
    shared: torch.Tensor | None

    def materialize(self) -> torch.Tensor:
        from segkv.kernels.moe.moe_ops import combine_experts

        return combine_experts(self.parts, self.weights, self.shared)


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim; ``x`` any shape ``(..., D)``."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False  # one Triton kernel (kernels/fused/fused_ops.py) instead of the torch ops

    def use_fused(self) -> None:
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return rms_norm(x, self.weight, self.eps)[0]
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_and_norm(self, x: torch.Tensor | PendingCombine, residual: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``: the residual add of a pre-norm block fused into
        the norm when ``fused``; a :class:`PendingCombine` ``x`` is formed in the same launch."""
        if isinstance(x, PendingCombine):
            if not self.fused:
                x = x.materialize()
            else:
                from segkv.kernels.moe.moe_ops import combine_add_rms_norm

                return combine_add_rms_norm(x.parts, x.weights, x.shared, residual, self.weight, self.eps)
        if self.fused:
            return rms_norm(x, self.weight, self.eps, residual=residual)
        total = residual + x
        return self(total), total


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + weight)`` over the last dim, ``x`` any
    shape ``(..., D)``, returned in ``x.dtype``.

    Unlike :class:`RMSNorm` (normalise in float32, round, then scale), the scale is applied in
    float32 before the single rounding, as transformers' Gemma norms do; checkpoints store
    ``weight`` centred on 0 (a zero weight is the identity). It has no fused kernel (the Triton
    norms scale by ``weight`` after rounding), so ``use_fused`` leaves it on the torch ops.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.fused = False  # read by blocks that fuse norms into products: never for this norm

    def use_fused(self) -> None:
        """No fused kernel computes the ``(1 + weight)`` scale in float32: stay on the torch ops."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``."""
        total = residual + x
        return self(total), total
