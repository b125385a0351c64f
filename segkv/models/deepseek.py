"""DeepSeek V2 and V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``): MLA and routed MoE."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from segkv.attention.metadata import AttentionMetadata
from segkv.attention.plan import AttentionShape
from segkv.config import KVLayout
from segkv.layers.activation import GatedMLP
from segkv.layers.linear import float32_logits
from segkv.layers.mla import MLADims, MultiHeadLatentAttention
from segkv.layers.moe import MixtureOfExperts, RouterSpec
from segkv.layers.norm import RMSNorm
from segkv.layers.rotary import RotaryEmbedding, yarn_mscale
from segkv.models.base import CausalLM, PreNormBlock
from segkv.models.hf_config import require, rope_settings

_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(slots=True, frozen=True)
class DeepseekConfig:
    """The fields of a DeepSeek V2/V3 ``config.json`` that shape the model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    mla: MLADims
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    rope_interleave: bool
    max_position_embeddings: int
    tie_word_embeddings: bool
    mlp_bias: bool
    hidden_act: str
    router: RouterSpec | None  # None: every layer is dense
    moe_intermediate_size: int
    num_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    num_nextn_predict_layers: int

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], *, scoring: str, topk_method: str, rope_interleave: bool | None
                ) -> DeepseekConfig:
        """Read ``cfg``; ``scoring``/``topk_method`` are the family's defaults when the file omits them,
        ``rope_interleave`` None reads the file's flag (default True)."""
        require(cfg, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        theta, scaling = rope_settings(cfg)
        q_lora = cfg.get("q_lora_rank")
        mla = MLADims(
            hidden_size=int(cfg["hidden_size"]), num_heads=int(cfg["num_attention_heads"]),
            q_lora_rank=int(q_lora) if q_lora is not None else None, kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]), attention_bias=bool(cfg.get("attention_bias", False)),
        )
        router = None
        if cfg.get("n_routed_experts"):
            router = RouterSpec(
                num_experts=int(cfg["n_routed_experts"]), top_k=int(cfg.get("num_experts_per_tok") or 1),
                scoring=str(cfg.get("scoring_func") or scoring),
                topk_method=str(cfg.get("topk_method") or topk_method),
                num_groups=int(cfg.get("n_group") or 1), topk_groups=int(cfg.get("topk_group") or 1),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
            )
        nextn = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers"))
        interleave = bool(cfg.get("rope_interleave", True)) if rope_interleave is None else rope_interleave
        return cls(
            vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
            mla=mla,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            rope_interleave=interleave, max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)), hidden_act=str(cfg.get("hidden_act", "silu")),
            router=router, moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
            num_shared_experts=int(cfg.get("n_shared_experts") or 0),
            first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(cfg.get("moe_layer_freq") or 1), num_nextn_predict_layers=int(nextn or 0),
        )

    def is_moe_layer(self, index: int) -> bool:
        if self.router is None or index < self.first_k_dense_replace:
            return False
        return index % self.moe_layer_freq == 0

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN (as DeepSeek)."""
        scale = self.mla.qk_head_dim**-0.5
        s = self.rope_scaling
        if s and s.get("mscale_all_dim"):
            factor = s.get("factor")
            if factor is None:
                factor = self.max_position_embeddings / float(s["original_max_position_embeddings"])
            scale *= yarn_mscale(float(factor), float(s["mscale_all_dim"])) ** 2
        return scale


class DeepseekLayer(PreNormBlock):
    """One decoder layer: MLA, then a dense MLP (first layers) or the mixture of experts."""

    def __init__(self, cfg: DeepseekConfig, index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MultiHeadLatentAttention(cfg.mla, index, rotary, scale=cfg.softmax_scale)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe_layer(index):
            assert cfg.router is not None
            self.mlp: nn.Module = MixtureOfExperts(
                cfg.hidden_size, cfg.moe_intermediate_size, cfg.router, num_shared=cfg.num_shared_experts,
                shared_bias=cfg.mlp_bias, activation=cfg.hidden_act)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias,
                                activation=cfg.hidden_act)



class DeepseekBody(nn.Module):
    """``model.*`` of the checkpoint: embeddings, layers, final norm (one RoPE table for all layers)."""

    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__()
        rotary = _rotary(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class SharedHead(nn.Module):
    """``shared_head.*`` of an MTP layer: its final norm (the head itself is the main ``lm_head``)."""

    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekMTPLayer(DeepseekLayer):
    """One multi-token-prediction module (DeepSeek-V3), ``model.layers.{L + i}.*`` in checkpoints.

    From a hidden state ``h_t (T, hidden)`` (the main model's output, or the previous MTP
    layer's) and the embedding of the following token ``e_{t+1} (T, hidden)``, it computes
    ``eh_proj([enorm(e_{t+1}), hnorm(h_t)])`` and runs one decoder layer over it; its logits
    (``lm_head(shared_head.norm(.))``) predict the token after that one. Embeddings and the
    output head are the main model's, as DeepSeek-V3 shares them; the copies checkpoints carry
    (``embed_tokens``, ``shared_head.head``) are not loaded.
    """

    def __init__(self, cfg: DeepseekConfig, index: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, index, rotary)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(next_embeds), self.hnorm(hidden)), dim=-1))
        return super().forward(x, positions, meta)


def _rotary(cfg: DeepseekConfig) -> RotaryEmbedding:
    return RotaryEmbedding(cfg.mla.qk_rope_head_dim, base=cfg.rope_theta,
                           max_position=cfg.max_position_embeddings, scaling=cfg.rope_scaling,
                           interleaved=cfg.rope_interleave)


class DeepseekForCausalLM(CausalLM):
    """A DeepSeek causal LM over the MLA latent cache.

    ``forward(input_ids (T,), positions (T,), meta)`` returns hidden states ``(T, hidden)``;
    ``compute_logits(hidden (N, hidden))`` returns float32 ``(N, vocab)``. ``meta.mla_mode``
    picks absorbed (latent) or naive (decompressed) attention; both read the same cache.

    ``mtp`` holds the checkpoint's multi-token-prediction layers (``num_nextn_predict_layers``;
    checkpoint names ``model.layers.{L + i}.*``, parameter names ``mtp.{i}.*``), for drafting
    in speculative decoding; layers whose weights the checkpoint lacks are dropped at load.
    """

    config_class = DeepseekConfig
    # Family defaults for config files that omit them (the HF classes hard-code these).
    default_scoring = "softmax"
    default_topk_method = "greedy"
    rope_interleave: bool | None = True

    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__(cfg, DeepseekBody(cfg))
        rotary = _rotary(cfg)
        self.mtp = nn.ModuleList(DeepseekMTPLayer(cfg, cfg.num_layers + i, rotary)
                                 for i in range(cfg.num_nextn_predict_layers))

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> DeepseekForCausalLM:
        return cls(DeepseekConfig.from_hf(cfg, scoring=cls.default_scoring,
                                          topk_method=cls.default_topk_method,
                                          rope_interleave=cls.rope_interleave))

    def kv_layout(self, dtype: torch.dtype, *, mtp: bool = False) -> KVLayout:
        """The latent cache's layout; ``mtp``: with the MTP layers' rows after the main layers'
        (drafting with them, ``runner/mtp.py``)."""
        layers = self.cfg.num_layers + (len(self.mtp) if mtp else 0)
        return KVLayout(kind="mla", num_layers=layers, kv_lora_rank=self.cfg.mla.kv_lora_rank,
                        rope_dim=self.cfg.mla.qk_rope_head_dim, dtype=dtype)

    def attention_shape(self, mla_mode: str = "absorbed") -> AttentionShape:
        return self.cfg.mla.attention_shape(mla_mode)

    # -- multi-token prediction -------------------------------------------------------
    def mtp_forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                    meta: AttentionMetadata, *, depth: int = 0) -> torch.Tensor:
        """MTP layer ``depth``: ``hidden (T, hidden)`` at ``positions (T,)`` and the ids of the tokens
        one further ``next_ids (T,)`` -> ``(T, hidden)``, whose logits predict two tokens further."""
        return self.mtp[depth](hidden, self.model.embed_tokens(next_ids), positions, meta)

    def compute_mtp_logits(self, mtp_hidden: torch.Tensor, *, depth: int = 0) -> torch.Tensor:
        """``(N, hidden)`` output of MTP layer ``depth`` -> float32 ``(N, vocab)``."""
        return float32_logits(self.mtp[depth].shared_head.norm(mtp_hidden), self.lm_head.weight)

    # -- checkpoint names --------------------------------------------------------------
    def _mtp_index(self, name: str) -> tuple[int, str] | None:
        """``model.layers.{L + i}.rest`` -> ``(i, rest)`` for an MTP layer of the config; else None."""
        match = _LAYER_NAME.match(name)
        if match is None:
            return None
        i = int(match.group(1)) - self.cfg.num_layers
        if not 0 <= i < self.cfg.num_nextn_predict_layers:
            return None
        return i, name[match.end():]

    def param_name(self, checkpoint_name: str) -> str:
        """The parameter a checkpoint tensor loads into (MTP layers live in ``mtp``)."""
        found = self._mtp_index(checkpoint_name)
        return checkpoint_name if found is None else f"mtp.{found[0]}.{found[1]}"

    def checkpoint_name(self, param_name: str) -> str:
        """Inverse of :meth:`param_name`: ``mtp.{i}.rest`` -> ``model.layers.{L + i}.rest``."""
        if not param_name.startswith("mtp."):
            return param_name
        index, rest = param_name[len("mtp."):].split(".", 1)
        return f"model.layers.{self.cfg.num_layers + int(index)}.{rest}"

    def ignores_weight(self, name: str) -> bool:
        """An MTP layer's copies of the shared embeddings and output head (the main model's are used)."""
        found = self._mtp_index(name)
        return found is not None and found[1] in _MTP_SHARED

    def drop_unloaded(self, loaded: set[str]) -> list[str]:
        """Keep the MTP layers before the first one whose parameters are not all in ``loaded``.

        Many converted checkpoints strip the MTP weights although the config still counts them;
        the main model does not need them. Returns the dropped parameter names.
        """
        keep = 0
        for layer in self.mtp:
            names = {f"mtp.{keep}.{n}" for n, _ in layer.named_parameters()}
            if not names <= loaded:
                if names & loaded:
                    warnings.warn(f"the checkpoint has only some of MTP layer {keep}'s weights; "
                                  "multi-token prediction is disabled", stacklevel=2)
                break
            keep += 1
        dropped = [f"mtp.{n}" for n, _ in self.mtp.named_parameters() if int(n.split(".")[0]) >= keep]
        self.mtp = self.mtp[:keep]
        return dropped


_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


class DeepseekV2ForCausalLM(DeepseekForCausalLM):
    """DeepSeek V2 / V2-Lite / Coder-V2: softmax routing (greedy or group-limited), interleaved RoPE."""


class DeepseekV3ForCausalLM(DeepseekForCausalLM):
    """DeepSeek V3 / R1: sigmoid routing with bias-corrected group-limited top-k (``noaux_tc``).

    RoPE pairs are interleaved unless the config sets ``rope_interleave: false``.
    """

    default_scoring = "sigmoid"
    default_topk_method = "noaux_tc"
    rope_interleave = None
