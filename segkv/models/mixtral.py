"""Mixtral (``MixtralForCausalLM``): Mistral attention with a routed mixture of experts in every layer."""

from __future__ import annotations

import re
from typing import Any

from segkv.models.decoder import DecoderConfig
from segkv.models.moe_decoder import SparseMoeDecoderForCausalLM, SparseMoeSettings, softmax_router

# checkpoint names -> segkv's: block_sparse_moe.{gate, experts.{i}.w1/w3/w2} are the
# router and each expert's gate, up and down projections
_BLOCK = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.")
_EXPERT = re.compile(r"(\.experts\.\d+\.)(w1|w2|w3)\.")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_W = {v: k for k, v in _PROJ.items()}
_MLP = re.compile(r"^(model\.layers\.\d+\.)mlp\.")
_PARAM_EXPERT = re.compile(r"(\.experts\.\d+\.)(gate_proj|up_proj|down_proj)\.")


class MixtralForCausalLM(SparseMoeDecoderForCausalLM):
    """Mixtral: every layer's MLP is ``num_local_experts`` experts of ``intermediate_size``; each
    token takes the top ``num_experts_per_tok`` by softmax of the router logits, weighted by those
    k probabilities renormalised to sum 1 (the softmax of the k logits).

    A ``sliding_window`` is attended as Mistral's is (``models/mistral.py``): every layer sees
    the window, planned by the runner. ``router_jitter_noise``, ``router_aux_loss_coef`` and
    ``output_router_logits`` only matter in training.
    """

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> MixtralForCausalLM:
        decoder = DecoderConfig.from_hf(cfg)
        num_experts = int(cfg.get("num_local_experts", cfg.get("num_experts", 8)) or 0)
        if num_experts < 1:
            raise ValueError(f"MixtralForCausalLM: num_local_experts = {num_experts}; a Mixtral layer needs experts")
        router = softmax_router(cfg, num_experts=num_experts, default_top_k=2, norm_topk_prob=True)
        moe = SparseMoeSettings(router=router, expert_size=decoder.intermediate_size,
                                moe_layers=(True,) * decoder.num_layers)
        model = cls(decoder, moe)
        window = cfg.get("sliding_window")
        model.sliding_window = int(window) if window else None
        return model

    def param_name(self, checkpoint_name: str) -> str:
        """The parameter a checkpoint tensor loads into: ``block_sparse_moe.*`` is ``mlp.*`` and an
        expert's ``w1``/``w3``/``w2`` its ``gate_proj``/``up_proj``/``down_proj``."""
        name, found = _BLOCK.subn(r"\1mlp.", checkpoint_name)
        if not found:
            return checkpoint_name
        return _EXPERT.sub(lambda m: f"{m.group(1)}{_PROJ[m.group(2)]}.", name)

    def checkpoint_name(self, param_name: str) -> str:
        """Inverse of :meth:`param_name`."""
        name, found = _MLP.subn(r"\1block_sparse_moe.", param_name)
        if not found:
            return param_name
        return _PARAM_EXPERT.sub(lambda m: f"{m.group(1)}{_W[m.group(2)]}.", name)
