"""Phi-3 and Phi-4 (``Phi3ForCausalLM``: Phi-3-mini/medium, Phi-3.5-mini, Phi-4, Phi-4-mini).

The Llama decoder with the checkpoint's fused projections kept fused: ``self_attn.qkv_proj``
(``[q; k; v]`` rows) and ``mlp.gate_up_proj`` (``[gate; up]`` rows) load as they are stored, which
is the stacked layout the decoder's one-GEMM path uses. LongRoPE scaling (``rope_scaling`` type
``longrope``, or the older ``su`` / ``yarn`` names Phi-3 configs used for it) is implemented in
``layers/rotary.py``; RoPE over part of each head (``partial_rotary_factor`` < 1, Phi-4-mini) is
refused at load by the common checks.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from segkv.attention.metadata import AttentionMetadata
from segkv.layers.activation import GatedMLP
from segkv.layers.fp8 import Fp8Linear
from segkv.layers.norm import RMSNorm
from segkv.layers.rotary import RotaryEmbedding, rope_type_of
from segkv.models.base import CausalLM, PreNormBlock
from segkv.models.decoder import DecoderAttention, DecoderBody, DecoderConfig, DecoderForCausalLM

# Names Phi-3 configs have used for LongRoPE (transformers' Phi3Config maps them the same way).
_LONGROPE_NAMES = ("longrope", "su", "yarn")


def normalized_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with Phi-3's older RoPE type names (``su``, ``yarn``) read as ``longrope``."""
    cfg = copy.deepcopy(cfg)
    for field in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(field)
        if isinstance(rope, dict) and rope_type_of(rope) in _LONGROPE_NAMES:
            rope.pop("type", None)
            rope["rope_type"] = "longrope"
    return cfg


class Phi3Attention(DecoderAttention):
    """The decoder's attention with one ``qkv_proj`` ``((H + 2 * KVH) * D, hidden)`` weight.

    Positions go through :meth:`RotaryEmbedding.table_positions` first, so LongRoPE picks its
    short or long frequencies for the step on every path (the fused RoPE kernel reads table rows).
    """

    def __init__(self, cfg: DecoderConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer_index, rotary)
        del self.q_proj, self.k_proj, self.v_proj  # the checkpoint stores them as one tensor
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self._qkv_sizes()), bias=cfg.qkv_bias)

    def use_fused(self) -> None:
        """The weight is already stacked: the one-GEMM path uses it as it is (no copy)."""
        if self._qkv is None and not isinstance(self.qkv_proj, Fp8Linear):
            self._qkv = (self.qkv_proj.weight, self.qkv_proj.bias)
        self.fused = self._rope_fusable

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x (T, hidden)`` -> ``q (T, H, D)``, ``k, v (T, KVH, D)``."""
        if self._qkv is None:  # also an FP8 qkv_proj, which runs its own product
            return self._split_heads(*self.qkv_proj(x).split(self._qkv_sizes(), dim=-1))
        return super()._project(x)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return super()._attend(q, k, v, self.rotary.table_positions(positions), meta)


class Phi3MLP(GatedMLP):
    """``down(silu(gate) * up)`` with ``[gate; up]`` in one ``gate_up_proj`` ``(2I, hidden)`` weight."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, activation: str = "silu") -> None:
        super().__init__(hidden_size, intermediate_size, bias=False, activation=activation)
        del self.gate_proj, self.up_proj  # the checkpoint stores them as one tensor
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)

    def use_fused(self) -> None:
        """The weight is already stacked ``[gate | up]``: SiLU-and-mul reads it as it is (no copy)."""
        if self._gate_up is None and not isinstance(self.gate_up_proj, Fp8Linear):
            self._gate_up = (self.gate_up_proj.weight, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up is None:  # also an FP8 gate_up_proj
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(up * F.silu(gate))
        return super().forward(x)


class Phi3DecoderLayer(PreNormBlock):
    def __init__(self, cfg: DecoderConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Phi3Attention(cfg, layer_index, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Phi3MLP(cfg.hidden_size, cfg.intermediate_size, activation=cfg.hidden_act)


class Phi3Body(DecoderBody):
    """``model.*`` of the checkpoint: the decoder body with Phi-3's layers."""

    layer_class = Phi3DecoderLayer


class Phi3ForCausalLM(DecoderForCausalLM):
    """Phi-3 / Phi-4: no biases; tied embeddings where ``tie_word_embeddings`` says so.

    A ``sliding_window`` (Phi-3-mini: 2047) is attended as Mistral's (``models/mistral.py``):
    every layer sees the window, planned by the runner, and the model length stays
    ``max_position_embeddings``.
    """

    def __init__(self, cfg: DecoderConfig) -> None:
        CausalLM.__init__(self, cfg, Phi3Body(cfg))

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> Phi3ForCausalLM:
        # Phi-3 has no bias on any projection (transformers' Phi3 builds none)
        model = cls(DecoderConfig.from_hf(normalized_config(cfg), qkv_bias=False))
        window = cfg.get("sliding_window")
        model.sliding_window = int(window) if window else None
        return model

    @classmethod
    def unimplemented_settings(cls, cfg: dict) -> list[str]:
        """The common checks, with LongRoPE accepted (this family maps positions to its table rows)."""
        cfg = normalized_config(cfg)
        for field in ("rope_parameters", "rope_scaling"):
            rope = cfg.get(field)
            if isinstance(rope, dict) and rope_type_of(rope) == "longrope":
                rope["rope_type"] = "default"  # its factors are checked when the rotary is built
        return super().unimplemented_settings(cfg)
