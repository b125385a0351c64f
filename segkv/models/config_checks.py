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


def qwen_uniform_window(cfg: dict[str, Any]) -> int | None:
    """The window of a Qwen2/Qwen3 config whose every layer is windowed (``use_sliding_window``
    with ``sliding_window`` set, and ``max_window_layers`` 0 or ``layer_types`` all
    ``"sliding_attention"``): one plan bound serves every layer, so segkv attends it
    (``ModelRunner.plan``). None otherwise."""
    if not cfg.get("use_sliding_window") or not cfg.get("sliding_window"):
        return None
    num_layers = int(cfg.get("num_hidden_layers") or 0)
    types = cfg.get("layer_types")
    if types is not None:
        every = len(types) == num_layers and all(t == "sliding_attention" for t in types)
    else:
        every = int(cfg.get("max_window_layers") or 0) <= 0
    return int(cfg["sliding_window"]) if every and num_layers else None


def qwen_sliding_window(cfg: dict[str, Any]) -> list[str]:
    """Qwen2/Qwen3 windowed layers (``use_sliding_window``, ``max_window_layers``, ``layer_types``).

    transformers windows layer ``i`` when ``layer_types[i] == "sliding_attention"``; without
    ``layer_types``, the layers from ``max_window_layers`` on when ``use_sliding_window`` is set.
    segkv plans one window for every layer: a config whose every layer is windowed is attended as
    such (:func:`qwen_uniform_window`); one whose window covers the model length
    (``sliding_window >= max_position_embeddings``) is full attention anyway; anything else (some
    layers windowed, others not) is refused.
    """
    if qwen_uniform_window(cfg) is not None:
        return []
    num_layers = int(cfg.get("num_hidden_layers") or 0)
    use = bool(cfg.get("use_sliding_window", False))
    window = cfg.get("sliding_window") if use else None
    types = cfg.get("layer_types")
    if types is not None:
        unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
        if unknown:
            return [f"layer_types with {', '.join(map(repr, unknown))}: only full attention is implemented"]
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    elif window is not None:
        start = int(cfg.get("max_window_layers") or 0)
        sliding = list(range(start, num_layers))
    else:
        sliding = []
    if not sliding:
        return []
    max_len = int(cfg.get("max_position_embeddings", 4096))
    if window is not None and int(window) >= max_len:
        return []  # no sequence reaches past the window: every layer sees its whole history anyway
    layers = _ranges(sliding)
    if use:
        return [f"use_sliding_window: true (sliding_window {window}, max_window_layers "
                f"{cfg.get('max_window_layers')}; layers {layers} attend a window): sliding-window "
                "attention is not implemented for some layers only (segkv windows every layer or none)"]
    return [f"layer_types marks layers {layers} as 'sliding_attention': sliding-window attention "
            "is not implemented for some layers only (segkv windows every layer or none)"]


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
