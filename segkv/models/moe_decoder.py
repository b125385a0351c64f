"""The grouped-query decoder with sparse mixture-of-experts MLPs (Qwen3-MoE, Mixtral).

Attention is the shared decoder's (``models/decoder.py``); a layer's MLP is either a routed
mixture of experts without shared experts (``layers/moe.py``) or the dense gated MLP.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from segkv.layers.activation import GatedMLP
from segkv.layers.moe import MixtureOfExperts, RouterSpec
from segkv.layers.norm import RMSNorm
from segkv.layers.rotary import RotaryEmbedding
from segkv.models.base import CausalLM, PreNormBlock
from segkv.models.decoder import DecoderAttention, DecoderConfig, DecoderForCausalLM


@dataclass(slots=True, frozen=True)
class SparseMoeSettings:
    """Which layers route their tokens to experts, and how.

    ``router``: top-k of the softmax over all experts (``norm_topk_prob``: the k weights
    renormalised to sum 1); None when the config has no experts. ``expert_size``: each expert's
    intermediate size. ``moe_layers[i]``: layer ``i`` is a mixture of experts (else the dense
    MLP of ``DecoderConfig.intermediate_size``).
    """

    router: RouterSpec | None
    expert_size: int
    moe_layers: tuple[bool, ...]


class SparseMoeDecoderLayer(PreNormBlock):
    """Decoder attention, then the layer's mixture of experts or its dense MLP (``mlp.*``)."""

    def __init__(self, cfg: DecoderConfig, moe: SparseMoeSettings, index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DecoderAttention(cfg, index, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if moe.moe_layers[index]:
            assert moe.router is not None
            self.mlp: nn.Module = MixtureOfExperts(cfg.hidden_size, moe.expert_size, moe.router,
                                                   activation=cfg.hidden_act)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, activation=cfg.hidden_act)


class SparseMoeDecoderBody(nn.Module):
    """``model.*`` of the checkpoint: embeddings, layers, final norm."""

    def __init__(self, cfg: DecoderConfig, moe: SparseMoeSettings) -> None:
        super().__init__()
        rotary = RotaryEmbedding(cfg.head_dim, base=cfg.rope_theta, max_position=cfg.max_position_embeddings,
                                 scaling=cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(SparseMoeDecoderLayer(cfg, moe, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class SparseMoeDecoderForCausalLM(DecoderForCausalLM):
    """A grouped-query causal LM whose MLPs are (some or all) routed experts.

    ``forward(input_ids (T,), positions (T,), meta)`` returns hidden states ``(T, hidden)``;
    ``compute_logits(hidden (N, hidden))`` returns float32 ``(N, vocab)``. ``moe``: the
    :class:`SparseMoeSettings`. Families build both from the config in ``from_hf_config``.
    """

    def __init__(self, cfg: DecoderConfig, moe: SparseMoeSettings) -> None:
        CausalLM.__init__(self, cfg, SparseMoeDecoderBody(cfg, moe))
        self.moe = moe


def softmax_router(cfg: dict, *, num_experts: int, default_top_k: int, norm_topk_prob: bool) -> RouterSpec | None:
    """Top-k of the softmax over ``num_experts`` router logits (None without experts)."""
    if num_experts <= 0:
        return None
    top_k = int(cfg.get("num_experts_per_tok") or default_top_k)
    return RouterSpec(num_experts=num_experts, top_k=top_k, scoring="softmax", topk_method="greedy",
                      norm_topk_prob=norm_topk_prob)
