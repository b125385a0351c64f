"""Qwen3 (``Qwen3ForCausalLM``): the Llama decoder with per-head RMSNorm on queries and keys."""

from __future__ import annotations

from segkv.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3: q_norm and k_norm over each head before RoPE; no projection biases by default."""

    config_overrides = {"qk_norm": True}
