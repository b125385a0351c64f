"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention with routed experts and no shared expert."""

from __future__ import annotations

from typing import Any

from segkv.models.config_checks import qwen_sliding_window
from segkv.models.decoder import DecoderConfig
from segkv.models.moe_decoder import SparseMoeDecoderForCausalLM, SparseMoeSettings, softmax_router


class Qwen3MoeForCausalLM(SparseMoeDecoderForCausalLM):
    """Qwen3-MoE: per-head q/k RMSNorm before RoPE; the MLP of layer ``i`` is a mixture of
    ``num_experts`` experts of ``moe_intermediate_size`` (softmax router, top
    ``num_experts_per_tok``, renormalised when ``norm_topk_prob``) when ``i`` is not in
    ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``, as transformers builds it;
    otherwise the dense MLP of ``intermediate_size``.

    ``router_aux_loss_coef`` and ``output_router_logits`` only matter in training. Sliding-window
    layers (``use_sliding_window``, ``layer_types``) are refused at load unless the window covers
    the whole model length (``config_checks.qwen_sliding_window``).
    """

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> Qwen3MoeForCausalLM:
        decoder = DecoderConfig.from_hf(cfg, qk_norm=True)
        # transformers' default is 128 experts; its config also takes the name num_local_experts
        num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 128)) or 0)
        step = int(cfg.get("decoder_sparse_step", 1))
        if step < 1:
            raise ValueError(f"Qwen3MoeForCausalLM: decoder_sparse_step = {step} must be at least 1")
        dense = {int(i) for i in cfg.get("mlp_only_layers") or []}
        router = softmax_router(cfg, num_experts=num_experts, default_top_k=8,
                                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
        layers = tuple(router is not None and i not in dense and (i + 1) % step == 0
                       for i in range(decoder.num_layers))
        moe = SparseMoeSettings(router=router, expert_size=int(cfg.get("moe_intermediate_size", 768)),
                                moe_layers=layers)
        return cls(decoder, moe)

    @classmethod
    def unimplemented_settings(cls, cfg: dict) -> list[str]:
        return super().unimplemented_settings(cfg) + qwen_sliding_window(cfg)
