"""Llama 2, 3 and 3.1 (``LlamaForCausalLM``), including Llama 3.1 rope scaling."""

from __future__ import annotations

from segkv.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama: the shared decoder with the checkpoint's ``attention_bias`` and ``mlp_bias``."""
