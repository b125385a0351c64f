"""The grouped-query decoder shared by the Llama, Mistral and Qwen families."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from segkv.attention.metadata import AttentionMetadata
from segkv.attention.plan import AttentionShape
from segkv.config import KVLayout
from segkv.kernels.fused.fused_ops import rope_and_write_kv, rope_fusable
from segkv.layers.activation import GatedMLP, stack_linears
from segkv.layers.fp8 import Fp8Linear, set_stacked, stack_fp8
from segkv.layers.attention import PagedAttention
from segkv.layers.linear import RowProduct
from segkv.layers.parallel import RowParallelLinear
from segkv.layers.norm import PendingCombine, RMSNorm
from segkv.layers.rotary import RotaryEmbedding
from segkv.models.base import CausalLM, PreNormBlock
from segkv.models.hf_config import require, rope_settings


@dataclass(slots=True, frozen=True)
class DecoderConfig:
    """The fields of a Llama-style ``config.json`` that shape the model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    hidden_act: str

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], *, qkv_bias: bool | None = None, qk_norm: bool = False) -> DecoderConfig:
        require(cfg, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        heads = int(cfg["num_attention_heads"])
        theta, scaling = rope_settings(cfg)
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=qk_norm,
            hidden_act=str(cfg.get("hidden_act", "silu")),
        )


class DecoderAttention(nn.Module):
    """Q/K/V projections (optional per-head q/k RMSNorm), RoPE, paged attention, output."""

    def __init__(self, cfg: DecoderConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rotary = rotary
        self.attn = PagedAttention(layer_index, scale=cfg.head_dim**-0.5)
        self.fused = False  # RoPE and the cache write in one Triton kernel (kernels/fused/fused_ops.py)
        self._rope_fusable = rope_fusable(cfg.head_dim, interleaved=rotary.interleaved)
        self._qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # see use_fused (not saved)
        self._qkv_fp8: Fp8Linear | None = None  # the same for FP8 projections (not saved)
        self._row_product = RowProduct()  # batch-1 decode (layers.linear)

    stacks_fp8 = True  # use_fused also stacks FP8 projections (CausalLM.use_fused_ops)

    def use_fused(self) -> None:
        """Stack the q, k and v projections into one weight (one GEMM instead of three; their
        parameters become views of it) and fuse RoPE with the cache write where it can. FP8
        projections stack into one FP8 layer (``layers.fp8.stack_fp8``) where their scales allow."""
        pieces = (self.q_proj, self.k_proj, self.v_proj)
        fp8 = [isinstance(p, Fp8Linear) for p in pieces]
        if all(fp8):
            if self._qkv_fp8 is None:
                set_stacked(self, "_qkv_fp8", stack_fp8(*pieces))
        elif self._qkv is None and not any(fp8):
            self._qkv = stack_linears(*pieces)
        self.fused = self._rope_fusable

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._qkv_fp8 is not None:
            return self._split_heads(*self._qkv_fp8(x).split(self._qkv_sizes(), dim=-1))
        if self._qkv is None:
            return self._split_heads(self.q_proj(x), self.k_proj(x), self.v_proj(x))
        return self._split_heads(*F.linear(x, *self._qkv).split(self._qkv_sizes(), dim=-1))

    def _qkv_sizes(self) -> list[int]:
        d = self.head_dim
        return [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]

    def _split_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, d = q.shape[0], self.head_dim
        return q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d), v.view(t, self.num_kv_heads, d)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self._attend(*self._project(x), positions, meta)

    def forward_after_norm(self, x: torch.Tensor | PendingCombine, residual: torch.Tensor | None, norm: RMSNorm,
                           positions: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """A pre-norm block's first half: ``(self(norm(x + residual)), x + residual)`` (``x``
        itself without a residual; a MoE layer's :class:`PendingCombine` takes the separate path).
        At one row on CUDA with the projections stacked, the residual add and the norm run inside
        the q/k/v product's launch (``layers.linear.RowProduct``)."""
        if isinstance(x, PendingCombine) or not (self._qkv is not None and self._qkv[1] is None and norm.fused
                                                 and self._row_product.applies(x, self._qkv[0])):
            h, residual = (norm(x), x) if residual is None else norm.add_and_norm(x, residual)
            return self(h, positions, meta), residual
        qkv, residual = self._row_product.after_norm(x, residual, norm.weight, norm.eps, self._qkv[0])
        return self._attend(*self._split_heads(*qkv.split(self._qkv_sizes(), dim=-1)), positions, meta), residual

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """``q (T, H, D)``, ``k, v (T, KVH, D)`` of the new rows -> the output projection ``(T, hidden)``."""
        # an FP8 cache is written by storage.write, which quantizes; the fused RoPE-and-write kernel
        # stores rows unscaled in their own dtype
        fused = self.fused and not meta.storage.fp8
        # the fused kernel norms the heads itself where the norm weights are in q's dtype
        norms_in_rope = fused and self.qk_norm and self.q_norm.weight.dtype == self.k_norm.weight.dtype == q.dtype
        if self.qk_norm and not norms_in_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if fused:
            keys, values = meta.storage.rows_to_write(self.attn.layer_index, meta.slots, k, v,
                                                      trusted_slots=meta.trusted_slots)
            norms = {"q_norm": self.q_norm.weight, "k_norm": self.k_norm.weight, "q_eps": self.q_norm.eps,
                     "k_eps": self.k_norm.eps} if norms_in_rope else {}
            q = rope_and_write_kv(q, k, v, positions, self.rotary.cos_sin_table(q.dtype), meta.slots, keys, values,
                                  **norms)
            out = self.attn.attend(q, meta)
        else:
            q, k = self.rotary(q, positions), self.rotary(k, positions)
            out = self.attn(q, k, v, meta)
        return self._output(out)

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's ``(T, H, D)`` -> the output projection ``(T, hidden)``."""
        out = out.reshape(out.shape[0], self.num_heads * self.head_dim)
        if self._qkv is None:  # not fused: torch's product
            return self.o_proj(out)
        if isinstance(self.o_proj, RowParallelLinear):  # a shard: the ranks' products summed, then the bias
            return self.o_proj.reduce(self._row_product(out, self.o_proj.weight, None))
        return self._row_product(out, self.o_proj.weight, self.o_proj.bias)


class DecoderLayer(PreNormBlock):
    def __init__(self, cfg: DecoderConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DecoderAttention(cfg, layer_index, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, activation=cfg.hidden_act)


class DecoderBody(nn.Module):
    """``model.*`` of the checkpoint: embeddings, layers (``layer_class``, one per layer), final norm."""

    layer_class: type[nn.Module] = None  # DecoderLayer, set below; a family with its own layer overrides it

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        rotary = RotaryEmbedding(cfg.head_dim, base=cfg.rope_theta, max_position=cfg.max_position_embeddings,
                                 scaling=cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


DecoderBody.layer_class = DecoderLayer


def apply_layer_windows(model: nn.Module, windows: Sequence[int | None] | None) -> None:
    """Bound each decoder layer's attention by its sliding window (``windows``: one per layer,
    None for full attention; None: no window). One window over every layer becomes the model's
    ``sliding_window``: one plan bounds every layer. Windows that differ go on each layer's
    ``PagedAttention.window``, listed in the model's ``layer_windows``: the runner plans the step
    once per distinct window and each layer attends its own (``AttentionMetadata.windowed``)."""
    model.sliding_window, model.layer_windows = None, None
    if not windows or all(w is None for w in windows):
        return
    layers = model.model.layers
    if len(windows) != len(layers):
        raise ValueError(f"{len(windows)} layer windows for {len(layers)} layers")
    if len(set(windows)) == 1:
        model.sliding_window = windows[0]
        return
    model.layer_windows = tuple(windows)
    for layer, window in zip(layers, windows):
        layer.self_attn.attn.window = window


class DecoderForCausalLM(CausalLM):
    """A Llama-style causal LM over the paged cache.

    ``forward(input_ids (T,), positions (T,), meta)`` returns hidden states ``(T, hidden)``;
    ``compute_logits(hidden (N, hidden))`` returns float32 ``(N, vocab)``.
    """

    config_class = DecoderConfig
    config_overrides: dict[str, Any] = {}

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__(cfg, DecoderBody(cfg))

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> DecoderForCausalLM:
        return cls(DecoderConfig.from_hf(cfg, **cls.config_overrides))

    def kv_layout(self, dtype: torch.dtype) -> KVLayout:
        return KVLayout(num_layers=self.cfg.num_layers, num_kv_heads=self.cfg.num_kv_heads,
                        head_dim=self.cfg.head_dim, dtype=dtype)

    def attention_shape(self, mla_mode: str = "absorbed") -> AttentionShape:
        c = self.cfg
        return AttentionShape(c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim)
