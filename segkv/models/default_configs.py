"""The built-in models' names and architectures: the ``config.json`` of each family, its
special tokens' ids. Below ``default_models`` (the packaged directories) and ``placeholder``
(the untrained stand-ins), which both build on it."""

from __future__ import annotations

from typing import Any

from segkv.models.stdlib_corpus import SPECIAL_TOKENS

GQA_NAME = "default"
MLA_NAME = "default-mla"
EOS_TOKEN_IDS = [SPECIAL_TOKENS.index("<|endoftext|>"), SPECIAL_TOKENS.index("<|im_end|>")]


def gqa_config(vocab_size: int, *, hidden_size: int = 256, num_layers: int = 6, num_heads: int = 8,
               num_kv_heads: int = 2, head_dim: int = 32, intermediate_size: int = 768,
               max_position_embeddings: int = 2048) -> dict[str, Any]:
    """A Qwen3 ``config.json`` (grouped-query attention, q/k norms, tied embeddings)."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "attention_bias": False, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "bos_token_id": None, "eos_token_id": EOS_TOKEN_IDS[1], "pad_token_id": 0,
    }


def mla_config(vocab_size: int, *, hidden_size: int = 256, num_layers: int = 6, num_heads: int = 8,
               q_lora_rank: int | None = 128, kv_lora_rank: int = 64, qk_rope_head_dim: int = 16,
               qk_nope_head_dim: int = 32, v_head_dim: int = 32, intermediate_size: int = 768,
               moe_intermediate_size: int = 128, num_experts: int = 4, experts_per_token: int = 2,
               num_shared_experts: int = 1, num_mtp_layers: int = 1,
               max_position_embeddings: int = 2048) -> dict[str, Any]:
    """A DeepSeek-V3 ``config.json``: MLA, a dense first layer, then routed experts with sigmoid
    scores and bias-corrected top-k (``noaux_tc``), plus ``num_mtp_layers`` MTP layers."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_heads, "q_lora_rank": q_lora_rank,
        "kv_lora_rank": kv_lora_rank, "qk_rope_head_dim": qk_rope_head_dim,
        "qk_nope_head_dim": qk_nope_head_dim, "v_head_dim": v_head_dim,
        "head_dim": qk_rope_head_dim, "rope_interleave": True,  # transformers' rotary width
        "n_routed_experts": num_experts, "num_experts_per_tok": experts_per_token,
        "n_shared_experts": num_shared_experts, "moe_intermediate_size": moe_intermediate_size,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 1.0, "num_nextn_predict_layers": num_mtp_layers, "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "attention_bias": False, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "bos_token_id": None, "eos_token_id": EOS_TOKEN_IDS[1], "pad_token_id": 0,
    }
