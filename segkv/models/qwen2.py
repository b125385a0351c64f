"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``): the Llama decoder with Q/K/V biases."""

from __future__ import annotations

from segkv.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2: biases on the Q, K and V projections, none on the output projection."""

    config_overrides = {"qkv_bias": True}
