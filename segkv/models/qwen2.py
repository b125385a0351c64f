"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``): the Llama decoder with Q/K/V biases."""

from __future__ import annotations

from segkv.models.config_checks import qwen_sliding_window
from segkv.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2: biases on the Q, K and V projections, none on the output projection.

    Sliding-window layers (``use_sliding_window``, ``layer_types``) are refused at load unless the
    window covers the whole model length (``config_checks.qwen_sliding_window``).
    """

    config_overrides = {"qkv_bias": True}

    @classmethod
    def unimplemented_settings(cls, cfg: dict) -> list[str]:
        return super().unimplemented_settings(cfg) + qwen_sliding_window(cfg)
