"""Gemma 3 text models (``Gemma3ForCausalLM``, transformers' ``Gemma3TextConfig``, ``gemma3_text``).

The grouped-query decoder with Gemma's differences, each as transformers computes it:

- embeddings multiplied by ``sqrt(hidden_size)`` rounded to the weight dtype;
- RMSNorms scaling by ``1 + weight`` in float32 (:class:`~segkv.layers.norm.GemmaRMSNorm`), four
  per layer (a "sandwich": the attention and MLP outputs are normed before their residual add),
  and per-head q/k norms before RoPE;
- a GELU-tanh gated MLP; attention scaled by ``query_pre_attn_scalar ** -0.5``;
- local layers (``sliding_attention``: a window of ``sliding_window`` positions, the token itself
  included) and global layers (``full_attention``), each type with its own RoPE
  (``rope_parameters[type]``, or the older ``rope_local_base_freq`` / ``rope_theta`` /
  ``rope_scaling``, scaling applying to global layers only);
- logits soft-capped, ``cap * tanh(logits / cap)``, where ``final_logit_softcapping`` is set.

Each layer's window reaches the runner through its ``PagedAttention.window`` and the model's
``layer_windows`` (one plan per distinct window). Attention-score soft-capping
(``attn_logit_softcapping``) and bidirectional attention are refused at load
(``config_fields``); so are RoPE types or layer types this module does not implement.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from segkv.attention.metadata import AttentionMetadata
from segkv.layers.activation import GeluTanhGatedMLP
from segkv.layers.attention import PagedAttention
from segkv.layers.norm import GemmaRMSNorm
from segkv.layers.rotary import SUPPORTED_ROPE_TYPES, RotaryEmbedding, rope_type_of
from segkv.models.base import CausalLM
from segkv.models.decoder import DecoderAttention, DecoderConfig, DecoderForCausalLM, apply_layer_windows
from segkv.models.hf_config import require, rope_settings

LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' defaults: Gemma3TextConfig.default_theta and the sliding_window_pattern of older files
DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
DEFAULT_PATTERN = 6


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """Each layer's type: ``layer_types``, else from ``sliding_window_pattern`` (default 6) as
    transformers derives it: layer ``i`` is global when ``(i + 1) % pattern == 0``."""
    types = cfg.get("layer_types")
    if types is not None:
        return list(types)
    pattern = int(cfg.get("sliding_window_pattern") or DEFAULT_PATTERN)
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(int(cfg["num_hidden_layers"]))]


def rope_parameters(cfg: dict[str, Any]) -> dict[str, dict]:
    """``{layer type: RoPE dict with rope_theta}``, as transformers' ``Gemma3TextConfig`` builds it:
    ``rope_parameters`` per layer type where the file has them; an older file's ``rope_scaling``
    updates the global dict; ``rope_theta`` (global) and ``rope_local_base_freq`` (local) fill in
    missing bases, else the defaults of :data:`DEFAULT_THETA`."""
    params = copy.deepcopy(cfg.get("rope_parameters") or {})
    if cfg.get("rope_scaling"):
        params.setdefault("full_attention", {"rope_type": "default"})
        params["full_attention"] = {**(params["full_attention"] or {}), **cfg["rope_scaling"]}
    bases = {"full_attention": cfg.get("rope_theta"), "sliding_attention": cfg.get("rope_local_base_freq")}
    for kind in LAYER_TYPES:
        params[kind] = dict(params.get(kind) or {"rope_type": "default"})
        base = bases[kind]
        params[kind].setdefault("rope_theta", DEFAULT_THETA[kind] if base is None else base)
        if rope_type_of(params[kind]) in ("llama3", "yarn"):  # transformers' default original length
            max_len = cfg.get("max_position_embeddings", 131_072)
            params[kind].setdefault("original_max_position_embeddings", max_len)
    return params


def unimplemented_gemma3_settings(cfg: dict[str, Any]) -> list[str]:
    """Gemma 3 layer and RoPE settings segkv does not implement (the field table's refusals and
    the common checks come on top): layer types other than local and global, a ``layer_types``
    of the wrong length, a ``rope_parameters`` not given per layer type, and per-type RoPE
    types or partial rotary factors the rotary embedding does not implement."""
    problems = []
    types = layer_types(cfg)
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        problems.append(f"layer_types with {', '.join(map(repr, unknown))}: Gemma 3 layers are "
                        "'sliding_attention' or 'full_attention'")
    if len(types) != int(cfg.get("num_hidden_layers") or 0):
        problems.append(f"layer_types has {len(types)} entries for {cfg.get('num_hidden_layers')} layers")
    given = cfg.get("rope_parameters")
    if isinstance(given, dict) and set(given) - set(LAYER_TYPES):
        problems.append("rope_parameters must hold one dict per layer type (sliding_attention, "
                        f"full_attention), not {sorted(given)}")
        return problems
    for kind, rope in rope_parameters(cfg).items():
        if rope_type_of(rope) not in SUPPORTED_ROPE_TYPES:
            problems.append(f"rope_parameters.{kind} with rope_type {rope_type_of(rope)!r}: segkv implements "
                            f"{', '.join(SUPPORTED_ROPE_TYPES)}")
        factor = rope.get("partial_rotary_factor")
        if factor is not None and float(factor) != 1.0:
            problems.append(f"rope_parameters.{kind}.partial_rotary_factor = {factor}: RoPE over part of "
                            "each head is not implemented")
    return problems


@dataclass(slots=True, frozen=True)
class Gemma3Config(DecoderConfig):
    """The decoder's fields plus Gemma's. ``rope_theta``/``rope_scaling`` are the global layers';
    ``qk_norm`` is False because the decoder's Llama-style q/k norms are off: :class:`Gemma3Attention`
    applies Gemma's own."""

    query_pre_attn_scalar: float
    layer_windows: tuple[int | None, ...]  # per layer: the sliding window, None for a global layer
    local_rope_theta: float
    local_rope_scaling: dict | None
    final_logit_softcapping: float | None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Gemma3Config:
        require(cfg, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
        heads, max_len = int(cfg["num_attention_heads"]), int(cfg.get("max_position_embeddings", 131_072))
        ropes = {kind: rope_settings({"rope_parameters": rope, "max_position_embeddings": max_len})
                 for kind, rope in rope_parameters(cfg).items()}
        window = cfg.get("sliding_window")
        # None or 0: no window; one covering the model length never binds (no plan of its own)
        window = int(window) if window and int(window) < max_len else None
        bias, cap = bool(cfg.get("attention_bias", False)), cfg.get("final_logit_softcapping")
        return cls(
            vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=ropes["full_attention"][0], rope_scaling=ropes["full_attention"][1],
            max_position_embeddings=max_len, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False,
            hidden_act=str(cfg.get("hidden_activation", "gelu_pytorch_tanh")),
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
            layer_windows=tuple(window if t == "sliding_attention" else None for t in layer_types(cfg)),
            local_rope_theta=ropes["sliding_attention"][0], local_rope_scaling=ropes["sliding_attention"][1],
            final_logit_softcapping=float(cap) if cap else None,
        )


class ScaledEmbedding(nn.Embedding):
    """Token embeddings ``(T,) -> (T, hidden)`` times ``scale`` rounded to the weight dtype, as
    transformers multiplies them (``sqrt(3072)`` = 55.43 becomes 55.5 in bfloat16)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = scale
        self._rounded: dict[torch.dtype, float] = {}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        dtype = self.weight.dtype
        if dtype not in self._rounded:
            self._rounded[dtype] = torch.tensor(self.scale, dtype=dtype).item()
        return super().forward(input_ids) * self._rounded[dtype]


class Gemma3Attention(DecoderAttention):
    """The decoder's attention with Gemma's q/k norms and scale.

    ``q (T, H, D)`` and ``k (T, KVH, D)`` go through :class:`GemmaRMSNorm` over each head, then
    RoPE of the layer's type; scores are scaled by ``query_pre_attn_scalar ** -0.5``.
    """

    def __init__(self, cfg: Gemma3Config, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer_index, rotary)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.attn = PagedAttention(layer_index, scale=cfg.query_pre_attn_scalar ** -0.5)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return super()._attend(self.q_norm(q), self.k_norm(k), v, positions, meta)


class Gemma3DecoderLayer(nn.Module):
    """``h = x + post_attention_norm(attn(input_norm(x)))``, then
    ``h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))``; ``x (T, hidden)``."""

    def __init__(self, cfg: Gemma3Config, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = Gemma3Attention(cfg, layer_index, rotary)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GeluTanhGatedMLP(hidden, cfg.intermediate_size)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out, residual = self.forward_with_residual(x, None, positions, meta)
        return residual + out

    def forward_with_residual(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                              meta: AttentionMetadata, *, defer_combine: bool = False
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block as ``CausalLM.forward`` chains it: the input is ``x + residual`` (``x`` alone
        when ``residual`` is None); returns ``(normed MLP output, its residual)``, whose sum is the
        block's output. ``defer_combine`` is for mixture-of-experts blocks and has no effect."""
        hidden = x if residual is None else residual + x
        attn = self.self_attn(self.input_layernorm(hidden), positions, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        out = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))
        return out, hidden


class Gemma3Body(nn.Module):
    """``model.*`` of the checkpoint: scaled embeddings, layers with their type's RoPE, final norm."""

    def __init__(self, cfg: Gemma3Config) -> None:
        super().__init__()
        max_len = cfg.max_position_embeddings
        rotary = {None: RotaryEmbedding(cfg.head_dim, base=cfg.rope_theta, max_position=max_len,
                                        scaling=cfg.rope_scaling)}  # global layers
        if any(w is not None for w in cfg.layer_windows):
            rotary["local"] = RotaryEmbedding(cfg.head_dim, base=cfg.local_rope_theta, max_position=max_len,
                                              scaling=cfg.local_rope_scaling)
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, scale=cfg.hidden_size ** 0.5)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i, rotary[None if w is None else "local"])
                                    for i, w in enumerate(cfg.layer_windows))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma 3 (1B text model and text-only checkpoints of the family); tied embeddings by default.

    Windows, as the runner plans them: local and global layers mixed (every real checkpoint) put
    each layer's window (None for a global layer) on its ``PagedAttention.window`` and list them in
    ``layer_windows``; one window over every layer (a config of local layers only) is the model's
    ``sliding_window`` instead (one plan bounds every layer). ``compute_logits`` soft-caps the
    float32 logits where ``final_logit_softcapping`` is set.
    """

    config_class = Gemma3Config

    def __init__(self, cfg: Gemma3Config) -> None:
        CausalLM.__init__(self, cfg, Gemma3Body(cfg))
        apply_layer_windows(self, cfg.layer_windows)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> Gemma3ForCausalLM:
        return cls(Gemma3Config.from_hf(cfg))

    @classmethod
    def unimplemented_settings(cls, cfg: dict) -> list[str]:
        return super().unimplemented_settings(cfg) + unimplemented_gemma3_settings(cfg)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``(N, vocab)`` of ``hidden (N, hidden)``, soft-capped in float32 (where
        transformers caps in the model dtype: the same values in float32, closer in bfloat16)."""
        logits = super().compute_logits(hidden)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
