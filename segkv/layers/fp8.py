"""FP8 weights: a linear layer whose weight is float8 e4m3 with float32 block scales.

One representation covers the published formats. The weight ``(N, K)`` is ``float8_e4m3fn`` and
``weight_scale`` is float32 ``(ceil(N / bn), ceil(K / bk))`` for a block ``(bn, bk)``: ``(N, K)``
is one scale per tensor, ``(1, K)`` one per output channel, ``(128, 128)`` DeepSeek-V3's tiles.
The dequantized weight is ``float(weight[n, k]) * weight_scale[n // bn, k // bk]`` (a checkpoint's
``weight_scale_inv`` and ``weight_scale`` both multiply). Activations are not quantized
(weight-only FP8): on CUDA in float16/bfloat16 the product runs in the Triton kernel
``kernels.quant.fp8_gemm`` (the weight dequantized tile by tile in registers); elsewhere the
weight is dequantized to the activation dtype and ``F.linear`` multiplies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# float32 activations take the dequantized weight and cuBLAS: the kernel's IEEE float32 tiles
# spill registers on Hopper (a float32 model is a testing configuration on CUDA anyway)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def scale_shape(out_features: int, in_features: int, block: tuple[int, int]) -> tuple[int, int]:
    """``(ceil(out / bn), ceil(in / bk))``: the scale grid of an ``(out, in)`` weight in ``block`` tiles."""
    return -(-out_features // block[0]), -(-in_features // block[1])


def expand_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """``scale (ceil(N/bn), ceil(K/bk))`` -> a tensor broadcasting against the ``(N, K)`` weight:
    the scale itself for one per tensor (``(1, 1)``) or per channel (``(N, 1)``), else each entry
    repeated over its block and cut to ``(N, K)``."""
    n, k = shape
    if scale.shape[1] == 1 and (scale.shape[0] == 1 or block[0] == 1):
        return scale
    return scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight (N, K)`` float8_e4m3fn times its float32 block ``scale`` -> ``(N, K)`` in ``dtype``
    (the product taken in float32, rounded once)."""
    return (weight.float() * expand_scale(scale.float(), tuple(weight.shape), block)).to(dtype)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight (N, K)`` (any float dtype) -> ``(float8_e4m3fn (N, K), float32 scale (N, 1))`` with
    each row's largest magnitude mapped to e4m3's largest value, 448 (round to nearest). An all-zero
    row gets scale 1."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def kernel_applies(x: torch.Tensor) -> bool:
    """Whether ``x`` takes the Triton FP8 product: activations on CUDA in a dtype it multiplies."""
    return x.is_cuda and x.dtype in _KERNEL_DTYPES


class Fp8Linear(nn.Module):
    """``nn.Linear``'s ``y = x W^T + b`` with ``W`` stored as FP8 (see the module docstring).

    Parameters: ``weight (out, in)`` float8_e4m3fn, ``weight_scale`` float32 of
    :func:`scale_shape` for ``block``, ``bias (out,)`` in the model dtype or None. ``block``:
    ``(bn, bk)`` of the scale grid. ``model_dtype``: the dtype of the model's activations (the
    default of :meth:`dequantized`, for plain copies of the layer). ``x (..., in)`` -> ``(..., out)``
    in ``x``'s dtype. Model-wide dtype casts (``model.to(torch.bfloat16)``) leave the weight FP8
    and the scales float32.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 block: tuple[int, int] | None = None, device: torch.device | str | None = None,
                 model_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.model_dtype = model_dtype
        self.in_features, self.out_features = in_features, out_features
        self.block = tuple(block) if block is not None else (1, in_features)  # default: per channel
        if len(self.block) != 2 or min(self.block) < 1:
            raise ValueError(f"FP8 scale blocks are two positive sizes, got {block}")
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(
            torch.ones(scale_shape(out_features, in_features, self.block), dtype=torch.float32, device=device),
            requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None

    @classmethod
    def like(cls, linear: nn.Linear, block: tuple[int, int] | None = None,
             model_dtype: torch.dtype = torch.float32) -> Fp8Linear:
        """An FP8 layer of ``linear``'s shape and bias on ``linear``'s device (weights not copied)."""
        return cls(linear.in_features, linear.out_features, bias=linear.bias is not None, block=block,
                   device=linear.weight.device, model_dtype=model_dtype)

    @property
    def scheme(self) -> str:
        """``tensor``, ``channel`` or ``block`` (the scale grid's kind)."""
        if self.weight_scale.numel() == 1:
            return "tensor"
        if self.block == (1, self.in_features):
            return "channel"
        return "block"

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight ``(out, in)`` dequantized to ``dtype`` (default :attr:`model_dtype`)."""
        return dequantize(self.weight, self.weight_scale, self.block, dtype or self.model_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernel_applies(x):
            from segkv.kernels.quant.fp8_gemm import fp8_linear

            rows = x.reshape(-1, self.in_features)
            y = fp8_linear(rows if rows.stride(-1) == 1 else rows.contiguous(), self.weight, self.weight_scale,
                           self.block, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def _apply(self, fn, recurse: bool = True):
        # ``model.to(dtype)`` casts every floating-point parameter, FP8 included: the weight and
        # the scales take only the device part of ``fn`` (a bfloat16 scale would lose bits)
        own = {name: self._parameters.pop(name) for name in ("weight", "weight_scale")}
        super()._apply(fn, recurse)
        for name, param in own.items():
            moved = fn(param.data)
            if moved.dtype != param.dtype:
                moved = param.data.to(moved.device)
            self._parameters[name] = nn.Parameter(moved, requires_grad=False)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, fp8 {self.scheme} scales, block={self.block}")


def fp8_modules(model: nn.Module) -> list[Fp8Linear]:
    """The model's FP8 linear layers."""
    return [m for m in model.modules() if isinstance(m, Fp8Linear)]


def stack_fp8(*layers: Fp8Linear) -> Fp8Linear | None:
    """One FP8 layer whose output is ``layers``' outputs concatenated (q/k/v or gate/up: one
    product instead of several), or None where their scale grids do not stack.

    The stacked weight ``(sum of outputs, in)`` is their weights concatenated, and each layer's
    weight and scale become views of the stacked ones (no second copy stays alive). Scales stack
    row-wise: per-channel scales always (a per-tensor scale is repeated per channel first), block
    scales where the layers share one block and every layer but the last fills whole row blocks.
    Biases: on all layers or none."""
    first = layers[0]
    if len({(m.in_features, m.weight.device, m.model_dtype) for m in layers}) != 1:
        return None
    if any((m.bias is None) != (first.bias is None) for m in layers):
        return None
    per_channel = all(m.scheme in ("tensor", "channel") for m in layers)
    if not per_channel and (any(m.block != first.block for m in layers)
                            or any(m.out_features % m.block[0] for m in layers[:-1])):
        return None
    with torch.no_grad():
        if per_channel:  # (N, 1) each: one scale per output row
            scales = [m.weight_scale.float().expand(m.out_features, 1) for m in layers]
        else:
            scales = [m.weight_scale for m in layers]
        stacked = Fp8Linear(first.in_features, sum(m.out_features for m in layers), bias=first.bias is not None,
                            block=None if per_channel else first.block, device=first.weight.device,
                            model_dtype=first.model_dtype)
        stacked.weight = nn.Parameter(torch.cat([m.weight for m in layers]), requires_grad=False)
        stacked.weight_scale = nn.Parameter(torch.cat(scales).contiguous(), requires_grad=False)
        if first.bias is not None:
            stacked.bias = nn.Parameter(torch.cat([m.bias for m in layers]), requires_grad=False)
        row = scale_row = 0
        for m, scale in zip(layers, scales):
            rows, scale_rows = m.out_features, scale.shape[0]
            m.weight = nn.Parameter(stacked.weight[row:row + rows], requires_grad=False)
            m.weight_scale = nn.Parameter(stacked.weight_scale[scale_row:scale_row + scale_rows], requires_grad=False)
            if per_channel:
                m.block = (1, m.in_features)
            if m.bias is not None:
                m.bias = nn.Parameter(stacked.bias[row:row + rows], requires_grad=False)
            row, scale_row = row + rows, scale_row + scale_rows
    return stacked


def set_stacked(owner: nn.Module, name: str, stacked: Fp8Linear | None) -> None:
    """``owner.<name> = stacked`` without registering it as a submodule: its parameters are views
    of the pieces', which the state dict and parameter counts already hold once."""
    owner.__dict__[name] = stacked
