"""gpt-oss (``GptOssForCausalLM``, transformers' ``GptOssConfig``, ``gpt_oss``).

The grouped-query decoder with gpt-oss's differences, each as transformers computes it:

- Q/K/V/O biases (``attention_bias``, default on); ``head_dim`` from the config (default 64, not
  ``hidden_size / heads``); YaRN RoPE (``rope_parameters``, or the older ``rope_scaling`` /
  ``rope_theta``; without either, transformers' default: YaRN of factor 32 over 4096 positions,
  base 150000);
- attention sinks: a learned logit per query head (``self_attn.sinks (Hq,)``) in the units of the
  scaled scores, one more softmax-denominator term with a zero value
  (:class:`~segkv.layers.attention.PagedAttention`'s ``num_sinks``);
- sliding layers (``layer_types`` ``sliding_attention``: the last ``sliding_window`` positions,
  the token itself included) and full layers, alternating from a sliding one by default; each
  layer's window reaches the runner through ``decoder.apply_layer_windows``;
- every MLP a mixture of experts with a biased top-k router and clamped-SwiGLU experts
  (``layers/gpt_oss_moe.py``);
- RMSNorms that scale by the weight in float32 before the one rounding (transformers keeps the
  norm weights in float32 and scales before it rounds: ``GptOssRMSNorm``).

MXFP4 checkpoints (``quantization_config.quant_method`` ``"mxfp4"``) are dequantized to the model
dtype as they load (``models/mxfp4.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from segkv.layers.attention import PagedAttention
from segkv.layers.gpt_oss_moe import GptOssMoE
from segkv.layers.norm import RMSNorm
from segkv.layers.rotary import RotaryEmbedding
from segkv.models.base import CausalLM, PreNormBlock
from segkv.models.decoder import DecoderAttention, DecoderConfig, DecoderForCausalLM, apply_layer_windows
from segkv.models.hf_config import require, rope_settings
from segkv.models.mxfp4 import without_mxfp4

LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' GptOssConfig defaults, for config.json files that leave a field out
DEFAULT_THETA = 150_000.0
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
DEFAULTS = {"head_dim": 64, "num_key_value_heads": 8, "sliding_window": 128, "num_local_experts": 128,
            "num_experts_per_tok": 4, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-5,
            "swiglu_alpha": 1.702, "swiglu_limit": 7.0}

# the sinks live on the layer's PagedAttention (``self_attn.attn.sinks``); checkpoints keep them on
# the attention module (``self_attn.sinks``)
_CKPT_SINKS = re.compile(r"\.self_attn\.sinks$")
_PARAM_SINKS = re.compile(r"\.self_attn\.attn\.sinks$")


def _get(cfg: dict[str, Any], key: str) -> Any:
    """``cfg[key]`` as transformers reads it: its default where the file leaves the key out."""
    return cfg.get(key, DEFAULTS[key])


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """Each layer's type: ``layer_types``, else sliding and full layers alternating from a
    sliding one, as transformers derives them."""
    types = cfg.get("layer_types")
    if types is not None:
        return list(types)
    return ["sliding_attention" if (i + 1) % 2 else "full_attention"
            for i in range(int(cfg["num_hidden_layers"]))]


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The RoPE dict with ``rope_theta``, as ``GptOssConfig`` builds it: ``rope_parameters``, or the
    older ``rope_scaling``, else :data:`DEFAULT_ROPE`; the base from the dict, else ``rope_theta``,
    else :data:`DEFAULT_THETA`; YaRN's original length defaults to ``max_position_embeddings``."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or DEFAULT_ROPE)
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope.get("rope_theta") is None:
        theta = cfg.get("rope_theta")
        rope["rope_theta"] = DEFAULT_THETA if theta is None else theta
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        rope.setdefault("original_max_position_embeddings", _get(cfg, "max_position_embeddings"))
    return rope


@dataclass(slots=True, frozen=True)
class GptOssConfig(DecoderConfig):
    """The decoder's fields plus gpt-oss's. ``intermediate_size`` is each expert's; ``layer_windows``
    per layer: the sliding window, None for a full layer."""

    num_experts: int
    top_k: int
    swiglu_alpha: float
    swiglu_limit: float
    layer_windows: tuple[int | None, ...]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> GptOssConfig:
        require(cfg, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
        heads, max_len = int(cfg["num_attention_heads"]), int(_get(cfg, "max_position_embeddings"))
        head_dim, kv_heads = _get(cfg, "head_dim"), _get(cfg, "num_key_value_heads")
        theta, scaling = rope_settings({"rope_parameters": rope_parameters(cfg),
                                        "max_position_embeddings": max_len})
        window = _get(cfg, "sliding_window")
        # None or 0: no window; one covering the model length never binds (no plan of its own)
        window = int(window) if window and int(window) < max_len else None
        bias = bool(cfg.get("attention_bias", True))
        return cls(
            vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=heads if kv_heads is None else int(kv_heads),
            head_dim=int(cfg["hidden_size"]) // heads if head_dim is None else int(head_dim),
            rms_norm_eps=float(_get(cfg, "rms_norm_eps")), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=max_len, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False, hidden_act="silu",
            num_experts=int(cfg.get("num_local_experts",
                                    cfg.get("num_experts", DEFAULTS["num_local_experts"]))),
            top_k=int(_get(cfg, "num_experts_per_tok")),
            swiglu_alpha=float(_get(cfg, "swiglu_alpha")), swiglu_limit=float(_get(cfg, "swiglu_limit")),
            layer_windows=tuple(window if t == "sliding_attention" else None for t in layer_types(cfg)),
        )


class GptOssRMSNorm(RMSNorm):
    """``(weight * x / sqrt(mean(x^2) + eps))`` in float32, rounded once to ``x.dtype``; ``x (..., D)``.

    :class:`RMSNorm` rounds before it scales (as Llama's norm); transformers keeps gpt-oss's norm
    weights in float32 and scales before rounding. The fused kernels round first, so this norm stays on the
    torch ops (``use_fused`` leaves it)."""

    def use_fused(self) -> None:
        """No fused kernel scales before the rounding: stay on the torch ops."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class GptOssAttention(DecoderAttention):
    """The decoder's attention (biases, RoPE, scale ``head_dim ** -0.5``) with a sink per query head."""

    def __init__(self, cfg: GptOssConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer_index, rotary)
        self.attn = PagedAttention(layer_index, scale=cfg.head_dim ** -0.5, num_sinks=cfg.num_heads)


class GptOssDecoderLayer(PreNormBlock):
    """Pre-norm attention with sinks, then the layer's mixture of experts."""

    def __init__(self, cfg: GptOssConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GptOssAttention(cfg, layer_index, rotary)
        self.post_attention_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GptOssMoE(cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.top_k,
                             alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)


class GptOssBody(nn.Module):
    """``model.*`` of the checkpoint: embeddings, layers (one RoPE for all), final norm."""

    def __init__(self, cfg: GptOssConfig) -> None:
        super().__init__()
        rotary = RotaryEmbedding(cfg.head_dim, base=cfg.rope_theta, max_position=cfg.max_position_embeddings,
                                 scaling=cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GptOssDecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def unimplemented_gpt_oss_settings(cfg: dict[str, Any]) -> list[str]:
    """Layer settings segkv does not implement (the field table's refusals and the common checks
    come on top): layer types other than sliding and full, and a ``layer_types`` of the wrong length."""
    problems = []
    types = layer_types(cfg)
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        problems.append(f"layer_types with {', '.join(map(repr, unknown))}: gpt-oss layers are "
                        "'sliding_attention' or 'full_attention'")
    if len(types) != int(cfg.get("num_hidden_layers") or 0):
        problems.append(f"layer_types has {len(types)} entries for {cfg.get('num_hidden_layers')} layers")
    return problems


class GptOssForCausalLM(DecoderForCausalLM):
    """gpt-oss (20b, 120b): every layer a mixture of experts; sliding and full layers.

    Windows, as the runner plans them: sliding and full layers mixed (every real checkpoint) put
    each layer's window on its ``PagedAttention.window`` and list them in ``layer_windows``; one
    window over every layer is the model's ``sliding_window`` (one plan bounds every layer).
    """

    config_class = GptOssConfig
    # the experts' group sizes reach the host every layer (no expert kernel yet): decode runs eagerly
    cuda_graphs_unsupported = ("gpt-oss experts run as a host-synchronising loop over the chosen experts, "
                               "which a CUDA graph cannot capture")

    def __init__(self, cfg: GptOssConfig) -> None:
        CausalLM.__init__(self, cfg, GptOssBody(cfg))
        apply_layer_windows(self, cfg.layer_windows)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> GptOssForCausalLM:
        return cls(GptOssConfig.from_hf(cfg))

    @classmethod
    def unimplemented_settings(cls, cfg: dict) -> list[str]:
        """The common checks (an MXFP4 ``quantization_config`` is checked by ``models/mxfp4.py`` and
        left out of them) and :func:`unimplemented_gpt_oss_settings`."""
        cfg, problems = without_mxfp4(cfg)
        return problems + super().unimplemented_settings(cfg) + unimplemented_gpt_oss_settings(cfg)

    def param_name(self, checkpoint_name: str) -> str:
        """The parameter a checkpoint tensor loads into: ``self_attn.sinks`` is ``self_attn.attn.sinks``."""
        return _CKPT_SINKS.sub(".self_attn.attn.sinks", checkpoint_name)

    def checkpoint_name(self, param_name: str) -> str:
        """Inverse of :meth:`param_name`."""
        return _PARAM_SINKS.sub(".self_attn.sinks", param_name)
