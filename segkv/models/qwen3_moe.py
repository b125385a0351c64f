"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention with routed experts and no shared expert."""

from __future__ import annotations

from typing import Any

from segkv.models.decoder import DecoderConfig, apply_layer_windows
from segkv.models.moe_decoder import SparseMoeDecoderForCausalLM, SparseMoeSettings, softmax_router


class Qwen3MoeForCausalLM(SparseMoeDecoderForCausalLM):
    """Qwen3-MoE: per-head q/k RMSNorm before RoPE; the MLP of layer ``i`` is a mixture of
    ``num_experts`` experts of ``moe_intermediate_size`` (softmax router, top
    ``num_experts_per_tok``, renormalised when ``norm_topk_prob``) when ``i`` is not in
    ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``, as transformers builds it;
    otherwise the dense MLP of ``intermediate_size``.

    ``router_aux_loss_coef`` and ``output_router_logits`` only matter in training. With
    ``use_sliding_window`` every layer attends its last ``sliding_window`` positions, as
    transformers' Qwen3-MoE masks them (it has no per-layer types): the model's
    ``sliding_window``, one plan bound for every layer.
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
        model = cls(decoder, moe)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        apply_layer_windows(model, [int(window)] * decoder.num_layers if window else None)
        return model
