"""Refusing ``config.json`` settings that change the computation and that segkv does not implement.

A setting the reference implementation (transformers) reads and segkv ignores would load and then
compute something else without a word (a Qwen2 config with ``use_sliding_window: true`` windowed
its upper layers in transformers and attended the full history here). Each family lists what it
refuses (``CausalLM.unimplemented_settings``); the loader raises one ValueError naming every
field. Settings the reference ignores (``pretraining_tp``: a sliced matmul, the same product)
or that only matter in training (dropout, auxiliary losses) are not refused.

``models/config_fields.py`` accounts for every field of each family's transformers config class
(handled, inert or refused); :func:`common_settings` runs its refusals too.
"""

from __future__ import annotations

from typing import Any

from segkv.layers.rotary import SUPPORTED_ROPE_TYPES
from segkv.models.config_fields import field_problems
from segkv.models.fp8_checkpoint import parse_quantization


def common_settings(cfg: dict[str, Any]) -> list[str]:
    """What no family implements: quantized checkpoints other than the FP8 formats
    (``models/fp8_checkpoint.py``), unknown RoPE types, partial rotary; then the refusals of the
    family's field table (``config_fields.field_problems``)."""
    problems = []
    try:
        parse_quantization(cfg)
    except ValueError as exc:
        problems.append(str(exc))
    field, rope = _rope_dict(cfg)
    if rope is not None:
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in SUPPORTED_ROPE_TYPES:
            problems.append(f"{field} with rope_type {kind!r}: segkv implements "
                            f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    for where, holder in (("partial_rotary_factor", cfg), (f"{field}.partial_rotary_factor", rope or {})):
        factor = holder.get("partial_rotary_factor")
        if factor is not None and float(factor) != 1.0:
            problems.append(f"{where} = {factor}: RoPE over part of each head is not implemented")
    return problems + field_problems(cfg)


def qwen_layer_windows(cfg: dict[str, Any]) -> tuple[int | None, ...] | None:
    """Each layer's sliding window in a Qwen2/Qwen3 config, as transformers applies them: with
    ``use_sliding_window`` and ``sliding_window`` set, layer ``i`` attends its last
    ``sliding_window`` positions when ``layer_types[i] == "sliding_attention"`` (without
    ``layer_types``: from ``max_window_layers`` on), else the full history. None when no layer is
    windowed, or the window covers ``max_position_embeddings`` (no sequence reaches past it)."""
    if not cfg.get("use_sliding_window") or not cfg.get("sliding_window"):
        return None
    window = int(cfg["sliding_window"])
    if window >= int(cfg.get("max_position_embeddings", 4096)):
        return None
    num_layers = int(cfg.get("num_hidden_layers") or 0)
    types = cfg.get("layer_types")
    if types is None:
        start = int(cfg.get("max_window_layers") or 0)
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(num_layers)]
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else None


def qwen_sliding_window(cfg: dict[str, Any]) -> list[str]:
    """Qwen2/Qwen3 window settings segkv does not implement: ``layer_types`` entries other than
    full and sliding attention, a ``layer_types`` of another length than the layers, and layers
    marked sliding without ``use_sliding_window`` (transformers then has no window to apply and
    its masks disagree between versions). The windows themselves are attended
    (:func:`qwen_layer_windows`)."""
    types = cfg.get("layer_types")
    if types is None:
        return []
    unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
    if unknown:
        return [f"layer_types with {', '.join(map(repr, unknown))}: only full and sliding attention are implemented"]
    num_layers = int(cfg.get("num_hidden_layers") or 0)
    if len(types) != num_layers:
        return [f"layer_types has {len(types)} entries for {num_layers} layers"]
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding and not (cfg.get("use_sliding_window") and cfg.get("sliding_window")):
        return [f"layer_types marks layers {_ranges(sliding)} as 'sliding_attention' without "
                "use_sliding_window and a sliding_window: no window to attend"]
    return []


def _rope_dict(cfg: dict[str, Any]) -> tuple[str, dict | None]:
    """The config's RoPE dict and its field name (``rope_parameters`` in newer files)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        return "rope_parameters", params
    scaling = cfg.get("rope_scaling")
    return "rope_scaling", scaling if isinstance(scaling, dict) else None


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out, start = [], indices[0]
    for prev, cur in zip(indices, indices[1:] + [None]):
        if cur != prev + 1:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = cur
    return ", ".join(out)
