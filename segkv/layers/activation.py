"""Gated MLP activation: SiLU(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from segkv.kernels.fused.fused_ops import silu_and_mul
from segkv.layers.fp8 import Fp8Linear, set_stacked, stack_fp8
from segkv.layers.linear import RowProduct
from segkv.layers.parallel import RowParallelLinear
from segkv.layers.norm import RMSNorm


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
        self._gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None  # see use_fused (not saved)
        self._gate_up_fp8: Fp8Linear | None = None  # the same for FP8 projections (not saved)
        self._row_product = RowProduct()  # batch-1 decode (layers.linear)

    stacks_fp8 = True  # use_fused also stacks FP8 projections (CausalLM.use_fused_ops)

    def use_fused(self) -> None:
        """Stack ``gate_proj`` and ``up_proj`` into one ``(2I, hidden)`` weight (one GEMM instead of
        two; their parameters become views of it, so no second copy stays alive) and run
        SiLU-and-mul as one Triton kernel (kernels/fused/fused_ops.py). FP8 projections stack
        into one FP8 layer (``layers.fp8.stack_fp8``) where their scales allow."""
        fp8 = [isinstance(p, Fp8Linear) for p in (self.gate_proj, self.up_proj)]
        if all(fp8):
            if self._gate_up_fp8 is None:
                set_stacked(self, "_gate_up_fp8", stack_fp8(self.gate_proj, self.up_proj))
        elif self._gate_up is None and not any(fp8):
            self._gate_up = stack_linears(self.gate_proj, self.up_proj)

    @property
    def stacked_gate_up(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``([gate | up] (2I, hidden), bias or None)`` once :meth:`use_fused` stacked them, else None."""
        return self._gate_up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up_fp8 is not None:
            return self.down_proj(silu_and_mul(self._gate_up_fp8(x)))
        if self._gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(silu_and_mul(F.linear(x, *self._gate_up)))  # [gate | up] -> act

    def forward_after_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, *,
                           defer_combine: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """A pre-norm block's second half: ``(self(norm(x + residual)), x + residual)``. At one
        row on CUDA with gate and up stacked, the residual add and the norm run inside the gate/up
        product's launch and SiLU-and-mul inside the down product's (``layers.linear.RowProduct``).
        ``defer_combine`` is for mixture-of-experts MLPs and has no effect here."""
        rows = self._row_product
        if not (self._gate_up is not None and self._gate_up[1] is None and self.down_proj.bias is None
                and norm.fused and rows.applies(x, self._gate_up[0]) and self.down_proj.weight.stride(-1) == 1
                and self.down_proj.weight.dtype == x.dtype):
            h, residual = norm.add_and_norm(x, residual)
            return self(h), residual
        gate_up, residual = rows.after_norm(x, residual, norm.weight, norm.eps, self._gate_up[0])
        out = rows.gated(gate_up, self.down_proj.weight)
        if isinstance(self.down_proj, RowParallelLinear):  # a shard: the ranks' products summed
            out = self.down_proj.reduce(out)
        return out, residual


def stack_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One ``(sum of outputs, inputs)`` weight (and bias) holding ``linears`` in order; each
    linear's parameters become views of it (loading a checkpoint afterwards still works)."""
    weights = [lin.weight for lin in linears]
    if len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1:
        raise ValueError("stacked linears need the same input size, dtype and device")
    has_bias = [lin.bias is not None for lin in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("stacked linears need biases on all or none")
    with torch.no_grad():
        weight = torch.cat(weights).detach()
        bias = torch.cat([lin.bias for lin in linears]).detach() if all(has_bias) else None
        start = 0
        for lin in linears:
            rows = lin.weight.shape[0]
            lin.weight = nn.Parameter(weight[start:start + rows], requires_grad=lin.weight.requires_grad)
            if bias is not None:
                lin.bias = nn.Parameter(bias[start:start + rows], requires_grad=lin.bias.requires_grad)
            start += rows
    return weight, bias


class GeluTanhGatedMLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))``: the GeGLU feed-forward of Gemma models
    (``hidden_activation`` ``gelu_pytorch_tanh``: torch's tanh approximation of GELU, the op
    transformers calls).

    ``x``: ``(T, hidden)`` -> ``(T, hidden)`` in ``x.dtype``. Parameter names follow the checkpoints.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self._gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None  # see use_fused (not saved)

    def use_fused(self) -> None:
        """Stack ``gate_proj`` and ``up_proj`` into one ``(2I, hidden)`` weight: one GEMM instead of
        two (their parameters become views of it, so no second copy stays alive)."""
        if self._gate_up is None:
            self._gate_up = stack_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = F.linear(x, *self._gate_up).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)
