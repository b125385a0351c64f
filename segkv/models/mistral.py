"""Mistral (``MistralForCausalLM``): the Llama decoder; sliding windows are refused if active."""

from __future__ import annotations

from typing import Any

from segkv.models.decoder import DecoderConfig, DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral with full attention.

    Checkpoints with a ``sliding_window`` attend at most that many past tokens. segkv
    attends the whole history, which is identical as long as a sequence is not longer than
    the window, so the model length is capped at the window.
    """

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> MistralForCausalLM:
        model = cls(DecoderConfig.from_hf(cfg))
        window = cfg.get("sliding_window")
        model.sliding_window = int(window) if window else None
        return model

    @property
    def max_model_len(self) -> int:
        window = getattr(self, "sliding_window", None)
        return min(self.cfg.max_position_embeddings, window) if window else self.cfg.max_position_embeddings
