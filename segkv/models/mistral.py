"""Mistral (``MistralForCausalLM``): the Llama decoder with an optional sliding window."""

from __future__ import annotations

from typing import Any

from segkv.models.decoder import DecoderConfig, DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral: the Llama decoder, every layer attending one ``sliding_window``.

    With a ``sliding_window`` of ``W`` each token attends its last ``W`` positions, itself
    included (transformers' semantics); the runner plans attention with the window
    (``model.sliding_window``, shared by every layer), so the model length stays
    ``max_position_embeddings``. None, 0 or an absent window mean full attention.
    """

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> MistralForCausalLM:
        model = cls(DecoderConfig.from_hf(cfg))
        window = cfg.get("sliding_window")
        model.sliding_window = int(window) if window else None
        return model
