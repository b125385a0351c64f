"""Qwen3 (``Qwen3ForCausalLM``): the Llama decoder with per-head RMSNorm on queries and keys."""

from __future__ import annotations

from segkv.models.config_checks import qwen_sliding_window, qwen_uniform_window
from segkv.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3: q_norm and k_norm over each head before RoPE; no projection biases by default.

    A window over every layer (``use_sliding_window`` with ``max_window_layers`` 0, or
    ``layer_types`` all sliding) is attended as a window (``sliding_window``, the runner's plan
    bound); windows over some layers only are refused at load unless the window covers the whole
    model length (``config_checks.qwen_sliding_window``).
    """

    config_overrides = {"qk_norm": True}

    @classmethod
    def from_hf_config(cls, cfg: dict):
        model = super().from_hf_config(cfg)
        model.sliding_window = qwen_uniform_window(cfg)
        return model

    @classmethod
    def unimplemented_settings(cls, cfg: dict) -> list[str]:
        return super().unimplemented_settings(cfg) + qwen_sliding_window(cfg)
