"""EAGLE-3 draft heads (``LlamaForCausalLMEagle3``): the module over a target's fused hidden states.

An EAGLE-3 head (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models
via Training-Time Test", 2025) drafts tokens from three of the target's hidden states (a low, a
middle and a high layer) with one decoder layer of its own. The checkpoint layout is the one
vLLM and SGLang load:

- ``fc.weight (hidden, 3 * target_hidden)``: fuses the three target states into one;
- ``midlayer.*``: one Llama decoder layer whose attention reads ``2 * hidden`` columns,
  ``[input_layernorm(embedding) ; hidden_norm(hidden)]``, with the un-normed ``hidden`` as
  its residual (q/k/v_proj ``(heads * head_dim, 2 * hidden)``, o_proj, the gated MLP,
  post_attention_layernorm);
- ``norm.weight``, ``lm_head.weight (draft_vocab_size, hidden)``;
- ``d2t (draft_vocab_size,)`` int64: target id = draft id + ``d2t[draft id]``;
  ``t2d (vocab_size,)`` bool: which target ids the draft vocabulary covers;
- optionally ``embed_tokens.weight (vocab_size, hidden)``; without it the target's embedding
  is shared.

Step 0 of a draft feeds ``fuse(aux)`` (the target's states at the positions) and the embeddings
of the next tokens; deeper steps feed the head's own previous output instead of ``fuse(aux)``
("training-time test" trains exactly that reuse). The layer attends through the ordinary
:class:`AttentionMetadata` path as one cache layer of its own (``layer_index``, 0 by default,
with :meth:`Eagle3Head.kv_layout`), so any backend and storage that serve a decoder layer serve
it. Loading and validation: ``segkv.models.eagle3_loading``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from segkv.attention.metadata import AttentionMetadata
from segkv.attention.plan import AttentionShape
from segkv.config import KVLayout
from segkv.layers.activation import GatedMLP
from segkv.layers.linear import float32_logits
from segkv.layers.norm import RMSNorm
from segkv.layers.rotary import RotaryEmbedding
from segkv.models.decoder import DecoderAttention, DecoderConfig
from segkv.models.hf_config import require, rope_settings

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's and SGLang's pick when a checkpoint names none: the inputs of layers 2, L // 2, L - 3."""
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclass(slots=True, frozen=True)
class Eagle3Config:
    """The fields of an EAGLE-3 ``config.json`` that shape the head.

    ``aux_layer_ids``: the target layers whose inputs are fused (vLLM's numbering, see
    ``CausalLM.set_aux_hidden_layers``); None: :func:`default_aux_layer_ids` of the target."""

    vocab_size: int
    draft_vocab_size: int
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    aux_layer_ids: tuple[int, ...] | None

    def __post_init__(self) -> None:
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"EAGLE-3 config: draft_vocab_size {self.draft_vocab_size} must be in "
                             f"[1, vocab_size {self.vocab_size}]")
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != 3:
            raise ValueError(f"EAGLE-3 config: eagle_aux_hidden_state_layer_ids must name 3 target layers, "
                             f"got {list(self.aux_layer_ids)}")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Eagle3Config:
        names = cfg.get("architectures") or []
        if ARCHITECTURE not in names:
            raise ValueError(f"not an EAGLE-3 head: config.json architectures {names}, "
                             f"expected [{ARCHITECTURE!r}]")
        require(cfg, "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")
        layers = int(cfg.get("num_hidden_layers", 1))
        if layers != 1:
            raise ValueError(f"EAGLE-3 config: num_hidden_layers {layers}; segkv loads one-layer heads")
        if cfg.get("norm_before_residual"):
            raise ValueError("EAGLE-3 config: norm_before_residual is not implemented")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eagle = cfg.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids", cfg.get("eagle_aux_hidden_state_layer_ids"))
        theta, scaling = rope_settings(cfg)
        vocab = int(cfg["vocab_size"])
        return cls(
            vocab_size=vocab, draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab),
            hidden_size=hidden, target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
            intermediate_size=int(cfg["intermediate_size"]), num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            aux_layer_ids=tuple(int(i) for i in aux) if aux else None,
        )

    def decoder_config(self) -> DecoderConfig:
        """The Llama layer settings of the head's ``midlayer`` (its q/k/v then widen to 2 * hidden)."""
        return DecoderConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=1, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=False,
            qkv_bias=self.attention_bias, o_bias=self.attention_bias, mlp_bias=self.mlp_bias, qk_norm=False,
            hidden_act=self.hidden_act)


class Eagle3Attention(DecoderAttention):
    """The decoder attention with q/k/v over ``2 * hidden`` input columns ([embedding ; hidden])."""

    def __init__(self, cfg: DecoderConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer_index, rotary)
        wide, d = 2 * cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(wide, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(wide, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(wide, cfg.num_kv_heads * d, bias=cfg.qkv_bias)


class Eagle3Layer(nn.Module):
    """``midlayer``: attention over ``[input_layernorm(e) ; hidden_norm(h)]`` with residual ``h``,
    then the gated MLP; returns ``(mlp output, residual)``, whose sum is the layer's output."""

    def __init__(self, cfg: Eagle3Config, layer_index: int) -> None:
        super().__init__()
        dcfg = cfg.decoder_config()
        rotary = RotaryEmbedding(cfg.head_dim, base=cfg.rope_theta, max_position=cfg.max_position_embeddings,
                                 scaling=cfg.rope_scaling)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(dcfg, layer_index, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias,
                            activation=cfg.hidden_act)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        attn = self.self_attn(x, positions, meta)
        h, residual = self.post_attention_layernorm.add_and_norm(attn, hidden)
        return self.mlp(h), residual


class Eagle3Head(nn.Module):
    """An EAGLE-3 draft head (parameter names are the checkpoint's).

    ``fuse(aux (T, 3 * target_hidden))`` -> ``(T, hidden)``;
    ``forward(hidden (T, hidden), next_ids (T,), positions (T,), meta)`` -> ``(T, hidden)``, the
    layer's output before the final norm (what the next draft step takes as ``hidden``);
    ``compute_logits(h (N, hidden))`` -> float32 ``(N, draft_vocab_size)``;
    ``compute_target_logits(h)`` -> float32 ``(N, vocab_size)``, ``-inf`` off the draft vocabulary.
    """

    def __init__(self, cfg: Eagle3Config, *, layer_index: int = 0, own_embeddings: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg, layer_index)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if own_embeddings else None
        self._shared_embedding: tuple[nn.Embedding, ...] = ()  # the target's, kept out of the state dict
        # the target layers to capture (CausalLM.set_aux_hidden_layers); the loader fills in the default
        self.aux_layer_ids: tuple[int, ...] | None = cfg.aux_layer_ids

    # -- wiring --------------------------------------------------------------------------
    def share_embedding(self, embedding: nn.Embedding) -> None:
        """Use the target's ``embed_tokens`` (checkpoints without their own); not saved with the head."""
        self._shared_embedding = (embedding,)

    def set_vocab_map(self, draft_to_target: torch.Tensor) -> None:
        """``draft_to_target (draft_vocab_size,)``: the target id of each draft id, strictly within
        the target vocabulary and distinct; fills ``d2t`` (offsets) and ``t2d`` (mask)."""
        ids = draft_to_target.to(device=self.d2t.device, dtype=torch.int64)
        assert ids.shape == self.d2t.shape and int(ids.unique().numel()) == ids.numel()
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def layer_index(self) -> int:
        return self.midlayer.self_attn.attn.layer_index

    def kv_layout(self, dtype: torch.dtype) -> KVLayout:
        """The head's own cache: one layer of ``num_kv_heads x head_dim`` K and V rows."""
        c = self.cfg
        return KVLayout(num_layers=self.layer_index + 1, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                        dtype=dtype)

    def attention_shape(self, mla_mode: str | None = None) -> AttentionShape:
        """The head layer's attention shape (``mla_mode`` is ignored: a grouped-query layer)."""
        c = self.cfg
        return AttentionShape(c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim)

    # -- computation ----------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(ids)
        if not self._shared_embedding:
            raise ValueError("this EAGLE-3 head has no embed_tokens: share the target's with "
                             "share_embedding()")
        return self._shared_embedding[0](ids)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's three hidden states ``(T, 3 * target_hidden)`` -> the head's input ``(T, hidden)``."""
        return self.fc(aux)

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        out, residual = self.midlayer(self.embed(next_ids), hidden, positions, meta)
        return residual + out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return float32_logits(self.norm(hidden), self.lm_head.weight)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (``id + d2t[id]``)."""
        return draft_ids + self.d2t[draft_ids]

    def compute_target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits scattered into the target vocabulary; ids outside the draft vocabulary get -inf."""
        draft = self.compute_logits(hidden)
        out = draft.new_full((draft.shape[0], self.cfg.vocab_size), float("-inf"))
        index = self.draft_to_target(torch.arange(self.cfg.draft_vocab_size, device=draft.device))
        out[:, index] = draft
        return out
