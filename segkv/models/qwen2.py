"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``): the Llama decoder with Q/K/V biases."""

from __future__ import annotations

from segkv.models.config_checks import qwen_sliding_window, qwen_uniform_window
from segkv.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2: biases on the Q, K and V projections, none on the output projection.

    A window over every layer (``use_sliding_window`` with ``max_window_layers`` 0, or
    ``layer_types`` all sliding) is attended as a window (``sliding_window``, the runner's plan
    bound); windows over some layers only are refused at load unless the window covers the whole
    model length (``config_checks.qwen_sliding_window``).
    """

    config_overrides = {"qkv_bias": True}

    @classmethod
    def from_hf_config(cls, cfg: dict):
        model = super().from_hf_config(cfg)
        model.sliding_window = qwen_uniform_window(cfg)
        return model

    @classmethod
    def unimplemented_settings(cls, cfg: dict) -> list[str]:
        return super().unimplemented_settings(cfg) + qwen_sliding_window(cfg)
