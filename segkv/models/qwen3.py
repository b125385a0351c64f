"""Qwen3 (``Qwen3ForCausalLM``): the Llama decoder with per-head RMSNorm on queries and keys."""

from __future__ import annotations

from segkv.models.config_checks import qwen_layer_windows, qwen_sliding_window
from segkv.models.decoder import DecoderForCausalLM, apply_layer_windows


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3: q_norm and k_norm over each head before RoPE; no projection biases by default.

    Sliding windows (``use_sliding_window``: the layers ``layer_types`` marks, or those from
    ``max_window_layers`` on) are attended as plan bounds: one over every layer as the model's
    ``sliding_window``, windows over some layers per layer (``decoder.apply_layer_windows``,
    ``config_checks.qwen_layer_windows``).
    """

    config_overrides = {"qk_norm": True}

    @classmethod
    def from_hf_config(cls, cfg: dict):
        model = super().from_hf_config(cfg)
        apply_layer_windows(model, qwen_layer_windows(cfg))
        return model

    @classmethod
    def unimplemented_settings(cls, cfg: dict) -> list[str]:
        return super().unimplemented_settings(cfg) + qwen_sliding_window(cfg)
