"""MXFP4 checkpoints (gpt-oss's ``quant_method: "mxfp4"``): dequantized to the model dtype at load.

Only the experts' stacked weights are stored in MXFP4; a weight ``W`` of the model's layout
``(E, in, out)`` (``x @ W``) is stored transposed, as two tensors:

- ``<name>_blocks``: uint8 ``(E, out, in / 32, 16)``, two FP4 (E2M1) codes per byte, the low
  nibble first; code ``c`` is :data:`FP4_VALUES` ``[c]`` (bit 3 the sign);
- ``<name>_scales``: uint8 ``(E, out, in / 32)``, one E8M0 exponent per block of 32 values: the
  block's values are multiplied by ``2 ** (scale - 127)``.

segkv has no MXFP4 product, so the weights are dequantized once, exactly (a power-of-two multiple
of an FP4 value is exact in float32, and in bfloat16 within its range), and the model computes in
its own dtype: correct results, without MXFP4's memory saving.
"""

from __future__ import annotations

from typing import Any

import torch

METHOD = "mxfp4"
BLOCKS, SCALES = "_blocks", "_scales"
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Mxfp4Config's fields that do not change what loads (modules_to_not_convert: those modules are
# simply stored unquantized; dequantize: transformers' own choice to compute unquantized, as segkv does)
_KNOWN_KEYS = {"quant_method", "modules_to_not_convert", "dequantize"}


def is_mxfp4(cfg: dict[str, Any]) -> bool:
    quant = cfg.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == METHOD


def without_mxfp4(cfg: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``(cfg without an MXFP4 quantization_config, problems with that config)``; ``cfg`` itself and
    no problems when it is not MXFP4 (the FP8 checks then read it)."""
    if not is_mxfp4(cfg):
        return cfg, []
    quant = cfg["quantization_config"]
    unknown = sorted(set(quant) - _KNOWN_KEYS)
    problems = [f"quantization_config (quant_method 'mxfp4') with {', '.join(unknown)}: not implemented"] \
        if unknown else []
    return {k: v for k, v in cfg.items() if k != "quantization_config"}, problems


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``blocks`` uint8 ``(*lead, out, G, 16)`` and ``scales`` uint8 ``(*lead, out, G)`` -> the
    weight ``(*lead, G * 32, out)`` in ``dtype`` (the model's ``x @ W`` layout)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         "(blocks (..., out, G, 16), scales (..., out, G))")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # (..., G, B, 2): low nibble first
    values = lut[codes].flatten(-2)  # (..., out, G, 32)
    values = torch.ldexp(values, (scales.int() - 127).unsqueeze(-1).float())
    return values.flatten(-2).transpose(-1, -2).to(dtype).contiguous()


class Mxfp4Tensors:
    """Pairs a checkpoint's ``*_blocks`` / ``*_scales`` tensors as the loader reads them: each weight
    is dequantized as soon as both halves have been read (one weight's parts held at a time, not
    the whole checkpoint's)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._parts: dict[str, dict[str, torch.Tensor]] = {}

    @staticmethod
    def takes(name: str) -> bool:
        return name.endswith((BLOCKS, SCALES))

    def take(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """``(weight name, dequantized weight)`` once ``name`` completes its pair, else None."""
        suffix = BLOCKS if name.endswith(BLOCKS) else SCALES
        weight = name.removesuffix(suffix)
        parts = self._parts.setdefault(weight, {})
        parts[suffix] = tensor
        if len(parts) < 2:
            return None
        del self._parts[weight]
        return weight, dequantize(parts[BLOCKS], parts[SCALES], self.dtype)

    def finish(self) -> None:
        """A ValueError naming a weight whose blocks or scales never came."""
        for weight, parts in sorted(self._parts.items()):
            missing = BLOCKS if BLOCKS not in parts else SCALES
            raise ValueError(f"MXFP4 weight {weight!r} lacks its {weight}{missing} tensor")
