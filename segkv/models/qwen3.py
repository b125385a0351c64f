"""Qwen3 (``Qwen3ForCausalLM``): the Llama decoder with per-head RMSNorm on queries and keys."""

from __future__ import annotations

from segkv.models.config_checks import qwen_sliding_window
from segkv.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3: q_norm and k_norm over each head before RoPE; no projection biases by default.

    Sliding-window layers (``use_sliding_window``, ``layer_types``) are refused at load unless the
    window covers the whole model length (``config_checks.qwen_sliding_window``).
    """

    config_overrides = {"qk_norm": True}

    @classmethod
    def unimplemented_settings(cls, cfg: dict) -> list[str]:
        return super().unimplemented_settings(cfg) + qwen_sliding_window(cfg)
