"""Loading FP8 weights: which linear layers become :class:`~segkv.layers.fp8.Fp8Linear`, and their tensors.

Decided from the checkpoint's tensor headers before any weight is read. A linear projection
(``fp8_checkpoint.FP8_PROJECTIONS``) whose checkpoint weight is float8_e4m3fn loads as FP8 with
its scale; any other linear stored in FP8 (MLA's ``kv_b_proj``, read as per-head views by the
absorbed attention; ``lm_head``) is dequantized to the model dtype at load. A targeted module
stored unquantized loads unquantized. ``quantize=True`` (``quantization="fp8"``) quantizes the
remaining projections per output channel from the checkpoint's own values.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from segkv.layers.fp8 import Fp8Linear, dequantize, quantize_per_channel, scale_shape
from segkv.models.fp8_checkpoint import FP8_PROJECTIONS, INPUT_SCALE_SUFFIX, SCALE_SUFFIXES, Fp8Checkpoint

QUANTIZATIONS = ("fp8",)  # ``load_model(quantization=...)``, ``LLM(quantization=...)``, ``--quantization``
_E4M3, _FP8_KINDS = "F8_E4M3", ("F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0")


def check_quantization(quantization: str | None) -> str | None:
    """``quantization`` if segkv implements it (None: the checkpoint's own format), else a ValueError."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not implemented; segkv implements "
                         f"{', '.join(map(repr, QUANTIZATIONS))} (or None: the checkpoint's own format)")
    return quantization


def stored_tensors(files: list[Path]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every checkpoint tensor's safetensors dtype name (``BF16``, ``F8_E4M3``, ...) and shape, from
    the file headers (no data read)."""
    out = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                out[name] = (piece.get_dtype(), tuple(piece.get_shape()))
    return out


class Fp8Plan:
    """The FP8 decisions for one model and checkpoint (see the module docstring).

    ``fp8``: parameter prefix -> ``(scale tensor name, block)`` of layers loaded from FP8;
    ``dequant``: the same for FP8-stored layers loaded in the model dtype; ``online``: prefixes
    quantized at load. Keys are the model's module names (``param_name`` applied)."""

    def __init__(self) -> None:
        self.fp8: dict[str, tuple[str, tuple[int, int]]] = {}
        self.dequant: dict[str, tuple[str, tuple[int, int]]] = {}
        self.online: set[str] = set()
        self._aux: set[str] = set()  # checkpoint names of the scale tensors this plan reads
        self._scales: dict[str, torch.Tensor] = {}

    @classmethod
    def build(cls, model: nn.Module, stored: dict[str, tuple[str, tuple[int, ...]]], checkpoint: Fp8Checkpoint | None,
              *, quantize: bool, param_name=lambda name: name, ignores=lambda name: False) -> Fp8Plan:
        plan = cls()
        for name, (kind, shape) in stored.items():
            if kind in _FP8_KINDS and not ignores(name):
                plan._add_stored(model, name, kind, shape, stored, checkpoint, param_name)
        if quantize:
            taken = set(plan.fp8) | set(plan.dequant)
            plan.online = {n for n in plain_projections(model) if n not in taken}
        return plan

    def _add_stored(self, model, name, kind, shape, stored, checkpoint, param_name) -> None:
        """Plan the FP8 checkpoint tensor ``name``; a ValueError naming it if it cannot load."""
        if kind != _E4M3:
            raise ValueError(f"tensor {name!r} is {kind}: segkv loads float8_e4m3fn (F8_E4M3) FP8 weights only")
        if checkpoint is None:
            raise ValueError(f"tensor {name!r} is FP8 but config.json has no quantization_config saying how "
                             "it is scaled")
        module_name = name.removesuffix(".weight")
        target = param_name(name).removesuffix(".weight")
        module = _submodule(model, target) if name.endswith(".weight") else None
        if not isinstance(module, nn.Linear):
            raise ValueError(f"tensor {name!r} is FP8: segkv loads FP8 weights of linear layers only")
        fmt = checkpoint.format_for(module_name)
        if fmt is None:
            raise ValueError(f"tensor {name!r} is FP8 but quantization_config (quant_method "
                             f"{checkpoint.method!r}) ignores or does not target {module_name!r}")
        scales = [f"{module_name}.{s}" for s in SCALE_SUFFIXES if f"{module_name}.{s}" in stored]
        if len(scales) != 1:
            raise ValueError(f"tensor {name!r} is FP8 and needs one scale tensor, "
                             f"{module_name}.weight_scale_inv or {module_name}.weight_scale; the checkpoint has "
                             f"{scales or 'none'}")
        block = checkpoint.block_for(fmt, scales[0], stored[scales[0]][1], tuple(shape))
        self._aux.add(scales[0])
        input_scale = f"{module_name}.{INPUT_SCALE_SUFFIX}"
        if input_scale in stored:
            self._aux.add(input_scale)  # static activation scale: read, not used (weight-only FP8)
        elif fmt.static_input:
            raise ValueError(f"quantization_config (quant_method {checkpoint.method!r}) has static activation "
                             f"scales but the checkpoint lacks tensor {input_scale!r}")
        plans = self.fp8 if target.rsplit(".", 1)[-1] in FP8_PROJECTIONS else self.dequant
        plans[target] = (scales[0], block)

    @property
    def active(self) -> bool:
        return bool(self.fp8 or self.dequant or self.online)

    def install(self, model: nn.Module, dtype: torch.dtype) -> None:
        """Replace the planned ``nn.Linear`` modules of ``model`` (on the meta device) with FP8 layers
        for activations of ``dtype``."""
        blocks = {t: b for t, (_, b) in self.fp8.items()} | {t: None for t in self.online}
        for target, block in blocks.items():
            parent_name, _, leaf = target.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, leaf, Fp8Linear.like(getattr(parent, leaf), block, dtype))

    def takes(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` is a scale this plan reads (kept by :meth:`take`)."""
        return name in self._aux

    def take(self, name: str, tensor: torch.Tensor) -> None:
        self._scales[name] = tensor

    def owns(self, param: str) -> bool:
        """Whether parameter ``param``'s checkpoint tensor is kept as stored for :meth:`finish`."""
        prefix = param.removesuffix(".weight")
        return param.endswith(".weight") and (prefix in self.fp8 or prefix in self.dequant or prefix in self.online)

    def finish(self, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        """Turn the stored weights in ``state`` into what the model holds: FP8 weights and float32
        ``weight_scale`` grids, dequantized weights in ``dtype``, weights quantized per channel."""
        for target, (scale_name, block) in {**self.fp8, **self.dequant}.items():
            weight = state.get(f"{target}.weight")
            if weight is None:
                continue  # reported as missing by the loader
            scale = self._scales[scale_name].float().reshape(scale_shape(*weight.shape, block))
            if target in self.fp8:
                state[f"{target}.weight_scale"] = scale
            else:
                state[f"{target}.weight"] = dequantize(weight, scale, block, dtype)
        # layers the checkpoint lacks (DeepSeek MTP layers a converted checkpoint dropped) are not counted
        self.online = {t for t in self.online if f"{t}.weight" in state}
        for target in self.online:
            weight = state[f"{target}.weight"]
            state[f"{target}.weight"], state[f"{target}.weight_scale"] = quantize_per_channel(weight)

    def describe(self) -> str | None:
        """A short account for the start-up summary, e.g. ``fp8: 12 layers from the checkpoint``."""
        parts = [f"{len(layers)} layers {how}" for layers, how in (
            (self.fp8, "from the checkpoint"), (self.dequant, "dequantized at load"),
            (self.online, "quantized at load per channel")) if layers]
        return "fp8: " + ", ".join(parts) if parts else None


def plain_projections(model: nn.Module) -> list[str]:
    """Names of ``model``'s plain ``nn.Linear`` projections that FP8 quantization takes (``FP8_PROJECTIONS``)."""
    return [n for n, m in model.named_modules() if type(m) is nn.Linear and n.rsplit(".", 1)[-1] in FP8_PROJECTIONS]


def quantize_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Quantize a built model's projections (``FP8_PROJECTIONS``, plain ``nn.Linear``) in place to
    FP8 per output channel, one layer at a time (the full-precision weight of each is freed as
    its FP8 copy is made); ``dtype``: the activations' dtype. Returns the number of layers
    quantized. The loader does the same from a checkpoint (``quantization="fp8"``); this is for
    models built otherwise (benchmarks with random weights)."""
    targets = plain_projections(model)
    for target in targets:
        parent_name, _, leaf = target.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, leaf)
        layer = Fp8Linear.like(linear, None, dtype)
        with torch.no_grad():
            weight, scale = quantize_per_channel(linear.weight)
            layer.weight.data, layer.weight_scale.data = weight, scale
            if linear.bias is not None:
                layer.bias.data = linear.bias.detach()
        setattr(parent, leaf, layer)
    return len(targets)


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None
