"""What every causal LM family shares: the pre-norm block, the embed-layers-norm body, the LM head."""

from __future__ import annotations

import torch
from torch import nn

from segkv.attention.metadata import AttentionMetadata
from segkv.distributed.parallel import TensorParallel
from segkv.layers.linear import float32_logits
from segkv.layers.parallel import vocab_parallel_logits
from segkv.layers.norm import PendingCombine
from segkv.models.config_checks import common_settings


class PreNormBlock(nn.Module):
    """``x + self_attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``.

    Subclasses create the four submodules (names follow the checkpoints).
    """

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out, residual = self.forward_with_residual(x, None, positions, meta)
        return residual + out

    def forward_with_residual(self, x: torch.Tensor | PendingCombine, residual: torch.Tensor | None,
                              positions: torch.Tensor, meta: AttentionMetadata, *, defer_combine: bool = False
                              ) -> tuple[torch.Tensor | PendingCombine, torch.Tensor]:
        """The block with its last residual add left to the next norm (fused there with the norm).

        ``x`` ``(T, hidden)``: the previous block's MLP output (or its :class:`PendingCombine`),
        or the embeddings when ``residual`` is None. Returns ``(mlp output, residual)``; the
        block's output is their sum, rounded once, as ``forward`` returns it. ``defer_combine``:
        a mixture-of-experts MLP may return its output unformed, for the next norm to form."""
        attn_after_norm = getattr(self.self_attn, "forward_after_norm", None)  # the norm fused into q/k/v
        if attn_after_norm is not None:
            attn, residual = attn_after_norm(x, residual, self.input_layernorm, positions, meta)
        else:
            if residual is None:
                h, residual = self.input_layernorm(x), x
            else:
                h, residual = self.input_layernorm.add_and_norm(x, residual)
            attn = self.self_attn(h, positions, meta)
        after_norm = getattr(self.mlp, "forward_after_norm", None)  # a MoE fuses the norm into its router
        if after_norm is not None:
            return after_norm(attn, residual, self.post_attention_layernorm, defer_combine=defer_combine)
        h, residual = self.post_attention_layernorm.add_and_norm(attn, residual)
        return self.mlp(h), residual


def _residual_stream(x: torch.Tensor | PendingCombine, residual: torch.Tensor | None) -> torch.Tensor:
    """The hidden state between two blocks, ``x + residual`` (``x`` alone before the first block)."""
    if isinstance(x, PendingCombine):
        x = x.materialize()
    return x if residual is None else residual + x


class CausalLM(nn.Module):
    """``model`` (embed_tokens, layers, norm) plus ``lm_head``, tied to the embeddings if asked.

    ``forward(input_ids (T,), positions (T,), meta)`` returns hidden states ``(T, hidden)``;
    ``compute_logits(hidden (N, hidden))`` returns float32 ``(N, vocab)``.
    """

    def __init__(self, cfg, body: nn.Module) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = body
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def use_fused_ops(self) -> None:
        """The decode step with fewer, larger kernels (GPU): q/k/v and gate/up projections stacked
        into one GEMM each (the parameters become views, no second copy), and RMSNorm with the
        residual add, SiLU-and-mul and RoPE with the cache write as single Triton kernels. The
        routed experts of a mixture-of-experts layer keep their own packing. Irreversible.

        Modules with FP8 projections (:class:`~segkv.layers.fp8.Fp8Linear`) fuse where they say
        so (``stacks_fp8``: attention and gated MLPs stack their FP8 projections into one FP8
        layer, which runs its own product, ``kernels.quant.fp8_gemm``); the others stay unfused,
        as the one-row GEMVs read plain weights in the activation dtype. The norms and routers
        still fuse. Routed
        experts without FP8 weights are packed (``MixtureOfExperts.pack_experts``): a prefill's
        pairs then run as grouped products on the device, not one GEMM per expert from the host.
        A tensor-parallel shard (``models/tensor_parallel.py``) fuses the same way: the row-parallel
        products' fused kernels hand their partial sums to the all-reduce
        (``RowParallelLinear.reduce``); its experts stay unpacked (their MoE layer reduces once)."""
        from segkv.layers.fp8 import Fp8Linear
        from segkv.layers.moe import MixtureOfExperts

        experts = {id(m) for moe in self.modules() if isinstance(moe, MixtureOfExperts)
                   for m in moe.experts.modules()}
        for module in self.modules():
            fp8 = any(isinstance(child, Fp8Linear) for child in module.children())
            if id(module) not in experts and hasattr(module, "use_fused") and (
                    not fp8 or getattr(module, "stacks_fp8", False)):
                module.use_fused()
            if (isinstance(module, MixtureOfExperts) and module.tp is None
                    and not any(isinstance(m, Fp8Linear) for m in module.modules())):
                module.pack_experts()

    @property
    def max_model_len(self) -> int:
        return self.cfg.max_position_embeddings

    @classmethod
    def check_config(cls, cfg: dict) -> None:
        """Raise a ValueError naming every ``config.json`` setting that changes the computation and
        that this family does not implement (``models/config_checks.py``)."""
        problems = cls.unimplemented_settings(cfg)
        if problems:
            raise ValueError(f"{cls.__name__}: config.json asks for what segkv does not implement: "
                             + "; ".join(problems))

    @classmethod
    def unimplemented_settings(cls, cfg: dict) -> list[str]:
        """One line per refused setting; families add their own."""
        return common_settings(cfg)

    # Layers whose input hidden states the forward also returns (EAGLE-3 draft heads); None: off.
    aux_hidden_layers: tuple[int, ...] | None = None

    def set_aux_hidden_layers(self, layer_ids: tuple[int, ...] | list[int] | None) -> None:
        """Opt in (or out, with None) to the auxiliary hidden states of ``layer_ids``.

        Layer id ``i`` means the input of decoder layer ``i`` (the residual stream after layers
        ``0..i-1``; 0 is the embeddings), as vLLM numbers EAGLE-3's
        ``eagle_aux_hidden_state_layer_ids``. While set, :meth:`forward` returns
        ``(hidden, aux)`` with ``aux (T, len(layer_ids) * hidden)`` the states concatenated in
        the order given; no extra pass runs."""
        if layer_ids is None:
            self.aux_hidden_layers = None
            return
        ids = tuple(int(i) for i in layer_ids)
        num_layers = len(self.model.layers)
        bad = [i for i in ids if not 0 <= i < num_layers]
        if not ids or bad:
            raise ValueError(f"aux hidden layer ids {list(ids)} must be non-empty and within "
                             f"[0, {num_layers}) (the target has {num_layers} layers)")
        self.aux_hidden_layers = ids

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states ``(T, hidden)``; with :attr:`aux_hidden_layers` set, ``(hidden, aux)``
        (see :meth:`set_aux_hidden_layers`)."""
        x, residual = self.model.embed_tokens(input_ids), None
        wanted = self.aux_hidden_layers
        captured: dict[int, torch.Tensor] | None = None if wanted is None else {}
        for i, layer in enumerate(self.model.layers):
            if captured is not None and i in wanted:
                captured[i] = _residual_stream(x, residual)
            x, residual = layer.forward_with_residual(x, residual, positions, meta, defer_combine=True)
        if residual is None:  # no layers
            hidden = self.model.norm(x)
        else:
            hidden = self.model.norm.add_and_norm(x, residual)[0]
        if captured is None:
            return hidden
        return hidden, torch.cat([captured[i] for i in wanted], dim=-1)

    # the tensor-parallel group of a sharded model (models/tensor_parallel.py); None: whole
    tp: TensorParallel | None = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp is not None and self.tp.size > 1:  # this rank's vocabulary rows, gathered
            return vocab_parallel_logits(hidden, self.lm_head.weight, self.cfg.vocab_size, self.tp)
        return float32_logits(hidden, self.lm_head.weight)
