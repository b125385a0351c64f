"""An account of every ``config.json`` field of each supported family: handled, inert or refused.

The fields come from the transformers config class of the family (``FieldTable.config_class``):
its dataclass fields, ``__init__`` parameters, ``attribute_map`` aliases and the keys of a default
instance's ``to_dict()``, plus fields real checkpoints carry outside that class (DeepSeek's
remote-code keys, legacy ``rope_theta``/``rope_scaling``, ``torch_dtype``). Each field is

- **handled**: segkv reads it and computes what the reference computes (``hidden_size``, the
  biases it builds, ``rope_parameters``; Mistral's ``sliding_window``, planned as a window);
- **inert**: it does not change inference (token ids, initialisation, dropout, training losses,
  bookkeeping, values transformers itself recomputes);
- **refused** unless at a value that changes nothing: :class:`Refused` says what segkv does
  instead. A refusal whose ``is_inert`` is None is checked elsewhere, named by ``checked_by``
  (``config_checks.common_settings``, the family's ``unimplemented_settings``, the layer that
  reads the field); the others are checked here by :func:`field_problems`.

``tests/models/test_config_fields.py`` walks each transformers class and fails on a field in no
category, so a transformers upgrade that adds a field is noticed; it also loads every refusal's
``example`` and checks the error names the field.

A field in no table (a newer transformers version's metadata, a fine-tune's extra key) is logged
and the model loads: refusing it would break checkpoints over bookkeeping, and the walker test is
what keeps the tables complete for the supported transformers version.

A registered architecture needs a table in :data:`FIELD_TABLES` or an entry, with its reason, in
:data:`NO_TABLE`; the walker test fails on one with neither.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Refused:
    """A field refused unless its value changes nothing.

    ``why``: what segkv does instead (it ends the error). ``example``: config changes that must be
    refused, naming this field (the walker test loads them). ``is_inert(value, cfg)``: whether
    the value changes nothing; None when ``checked_by`` names where the check lives.
    """

    why: str
    example: Mapping[str, Any]
    is_inert: Callable[[Any, Mapping[str, Any]], bool] | None = None
    checked_by: str = ""


@dataclass(frozen=True)
class FieldTable:
    """One family's account of its ``config.json`` fields (see the module docstring)."""

    config_class: str  # the transformers class, e.g. "LlamaConfig"
    handled: frozenset[str]
    inert: frozenset[str]
    refused: Mapping[str, Refused] = field(default_factory=dict)

    def known(self) -> frozenset[str]:
        return self.handled | self.inert | frozenset(self.refused)


def _false(value: Any, cfg: Mapping[str, Any]) -> bool:
    """Inert when false or absent."""
    return not value


def _no_kv_groups(value: Any, cfg: Mapping[str, Any]) -> bool:
    """transformers' MLA groups heads only where ``num_attention_heads // num_key_value_heads > 1``
    (its default config has 128 KV heads whatever the head count: no grouping)."""
    return value is None or int(cfg.get("num_attention_heads") or 0) // max(int(value), 1) <= 1


# Fields of transformers' PreTrainedConfig (every family) and keys checkpoints carry beside them.
_BASE_INERT = frozenset({
    "_name_or_path", "model_type", "transformers_version", "auto_map",
    "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder",
    "output_attentions", "output_hidden_states", "return_dict", "use_cache",
    "_attn_implementation_autoset",
    # initialisation and training only: no effect on a forward pass in eval mode
    # (transformers no longer reads pretraining_tp: its sliced products were the same product)
    "initializer_range", "attention_dropout", "pretraining_tp",
    # token ids: pad only sets the embedding's padding_idx (gradients); bos/eos select
    # nothing in the forward pass (stop tokens are read by segkv/tokenizer)
    "bos_token_id", "eos_token_id", "pad_token_id",
})
_BASE_HANDLED = frozenset({
    "architectures",  # picks the family (registry.py)
    "torch_dtype", "dtype",  # the precision of dtype="auto" on CUDA (config.resolve_dtype)
    "rope_parameters", "rope_theta", "rope_scaling",  # hf_config.rope_settings; unknown types refused
    "quantization_config",  # FP8 formats load (fp8_checkpoint.py); others refused in common_settings
})
_COMMON_REFUSED = {
    "partial_rotary_factor": Refused(
        "RoPE over part of each head is not implemented", {"partial_rotary_factor": 0.5},
        checked_by="config_checks.common_settings"),
    "hidden_act": Refused(
        "only SiLU gated MLPs are implemented", {"hidden_act": "gelu"},
        checked_by="layers/activation.GatedMLP"),
}
_DECODER_HANDLED = _BASE_HANDLED | {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
}


def _ignored_by_reference(name: str, family: str, what: str) -> Refused:
    """A bias flag the transformers class does not read (it hard-codes ``what``) but segkv's
    decoder does: true would make segkv expect tensors the checkpoint lacks."""
    return Refused(f"{family} has {what} whatever this flag says (transformers ignores it)", {name: True},
                   is_inert=_false)


# Qwen2/Qwen3 windows (use_sliding_window, sliding_window, max_window_layers) are attended per
# layer (config_checks.qwen_layer_windows); layer_types is handled but for what has no window
_QWEN_WINDOW_HANDLED = {"use_sliding_window", "sliding_window", "max_window_layers"}
_QWEN_LAYER_TYPES = Refused(
    "layer_types entries other than full and sliding attention, of another length than the layers, or "
    "sliding without use_sliding_window, are not implemented",
    {"layer_types": ["full_attention", "sliding_attention"]},
    checked_by="config_checks.qwen_sliding_window (the family's unimplemented_settings)")


_LLAMA = FieldTable(
    "LlamaConfig",
    handled=_DECODER_HANDLED | {"attention_bias", "mlp_bias"},  # q/k/v/o and MLP biases, as transformers
    inert=_BASE_INERT,
    refused=dict(_COMMON_REFUSED),
)
_MISTRAL = FieldTable(
    "MistralConfig",
    # sliding_window: every layer attends the window (the runner plans with model.sliding_window)
    handled=_DECODER_HANDLED | {"sliding_window"},
    inert=_BASE_INERT,
    refused={**_COMMON_REFUSED,
             "attention_bias": _ignored_by_reference("attention_bias", "Mistral", "no attention biases"),
             "mlp_bias": _ignored_by_reference("mlp_bias", "Mistral", "no MLP biases")},
)
_QWEN2 = FieldTable(
    "Qwen2Config",
    handled=_DECODER_HANDLED | _QWEN_WINDOW_HANDLED,
    inert=_BASE_INERT,
    refused={**_COMMON_REFUSED, "layer_types": _QWEN_LAYER_TYPES,
             "attention_bias": _ignored_by_reference(
                 "attention_bias", "Qwen2", "Q/K/V biases and none on o_proj"),
             "mlp_bias": _ignored_by_reference("mlp_bias", "Qwen2", "no MLP biases")},
)
_QWEN3 = FieldTable(
    "Qwen3Config",
    handled=_DECODER_HANDLED | {"attention_bias"} | _QWEN_WINDOW_HANDLED,  # Q/K/V and o_proj biases
    inert=_BASE_INERT,
    refused={**_COMMON_REFUSED, "layer_types": _QWEN_LAYER_TYPES,
             "mlp_bias": _ignored_by_reference("mlp_bias", "Qwen3", "no MLP biases")},
)

_DEEPSEEK_HANDLED = _BASE_HANDLED | {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "attention_bias",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
    "first_k_dense_replace", "n_group", "topk_group", "topk_method", "norm_topk_prob",
    "routed_scaling_factor",
    # DeepSeek's own config.json keys (remote code), read by deepseek.py
    "scoring_func", "moe_layer_freq", "num_nextn_predict_layers",
}
_DEEPSEEK_INERT = _BASE_INERT | {
    "output_router_logits",
    # transformers recomputes both from the MLA dimensions, whatever the file says
    "head_dim", "qk_head_dim",
    # DeepSeek's own keys: training losses and expert-parallel layout
    "aux_loss_alpha", "seq_aux", "ep_size",
}
_DEEPSEEK_REFUSED = {
    **_COMMON_REFUSED,
    "num_key_value_heads": Refused(
        "grouping MLA heads onto shared keys is not implemented (segkv gives every head its own "
        "keys, as transformers does where num_attention_heads // num_key_value_heads <= 1)",
        {"num_key_value_heads": 2}, is_inert=_no_kv_groups),
}


def _alias(name: str, target: str) -> Refused:
    """An ``attribute_map`` alias: transformers reads it as ``target``, segkv only reads ``target``."""
    return Refused(f"segkv reads this setting as {target!r}; rename the key", {name: 6, target: 4},
                   is_inert=lambda value, cfg: value is None or value == cfg.get(target))


_DEEPSEEK_V2 = FieldTable(
    "DeepseekV2Config",
    handled=_DEEPSEEK_HANDLED | {"mlp_bias"},  # dense and shared-expert MLP biases, as transformers
    inert=_DEEPSEEK_INERT,
    refused={**_DEEPSEEK_REFUSED, "num_experts": _alias("num_experts", "n_routed_experts")},
)
_DEEPSEEK_V3 = FieldTable(
    "DeepseekV3Config",
    handled=_DEEPSEEK_HANDLED | {"rope_interleave", "num_mtp_layers"},
    inert=_DEEPSEEK_INERT,
    refused={**_DEEPSEEK_REFUSED, "num_local_experts": _alias("num_local_experts", "n_routed_experts"),
             "mlp_bias": _ignored_by_reference("mlp_bias", "DeepSeek-V3", "no MLP biases")},
)


_QWEN3_MOE = FieldTable(
    "Qwen3MoeConfig",
    handled=_DECODER_HANDLED | {
        "attention_bias", "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
        # every layer attends the window when use_sliding_window is set, as transformers masks it
        "use_sliding_window", "sliding_window"},  # qwen3_moe.py
    # not transformers fields here (checkpoints carry them from Qwen3's config): its Qwen3-MoE
    # windows every layer whatever they say
    inert=_BASE_INERT | {"router_aux_loss_coef", "output_router_logits", "max_window_layers", "layer_types"},
    refused={**_COMMON_REFUSED,
             "mlp_bias": _ignored_by_reference("mlp_bias", "Qwen3-MoE", "no MLP biases")},
)
_MIXTRAL = FieldTable(
    "MixtralConfig",
    # sliding_window: every layer attends the window, as for Mistral
    handled=_DECODER_HANDLED | {"sliding_window", "num_local_experts", "num_experts", "num_experts_per_tok"},
    # router_jitter_noise is applied in training only
    inert=_BASE_INERT | {"router_aux_loss_coef", "router_jitter_noise", "output_router_logits"},
    refused={**_COMMON_REFUSED,
             "attention_bias": _ignored_by_reference("attention_bias", "Mixtral", "no attention biases"),
             "mlp_bias": _ignored_by_reference("mlp_bias", "Mixtral", "no MLP biases")},
)

_PHI3 = FieldTable(
    "Phi3Config",
    # sliding_window: every layer attends the window, as for Mistral; original_max_position_embeddings
    # picks longrope's short or long factors (layers/rotary.py)
    handled=_DECODER_HANDLED | {"sliding_window", "original_max_position_embeddings"},
    # dropouts act in training only
    inert=_BASE_INERT | {"resid_pdrop", "embd_pdrop"},
    refused=dict(_COMMON_REFUSED),
)


def _none(value: Any, cfg: Mapping[str, Any]) -> bool:
    """Inert when unset (None or absent)."""
    return value is None


_GEMMA3 = FieldTable(
    "Gemma3TextConfig",
    # models/gemma3.py. sliding_window: the window of the layers layer_types (or the older
    # sliding_window_pattern, also saved as _sliding_window_pattern) marks sliding_attention;
    # rope_parameters per layer type, or the older rope_local_base_freq (local layers) beside
    # rope_theta and rope_scaling (global ones); RoPE and layer types segkv does not implement are
    # refused by the family's unimplemented_settings
    handled=_DECODER_HANDLED | {
        "attention_bias", "query_pre_attn_scalar", "sliding_window", "layer_types", "sliding_window_pattern",
        "_sliding_window_pattern", "rope_local_base_freq", "final_logit_softcapping"},
    # cache_implementation ("hybrid" in Google's files) picks transformers' generation cache
    inert=_BASE_INERT | {"cache_implementation"},
    refused={
        "attn_logit_softcapping": Refused(
            "soft-capping of attention scores is not implemented (the attention kernels do not cap "
            "scores)", {"attn_logit_softcapping": 50.0}, is_inert=_none),
        "use_bidirectional_attention": Refused(
            "only causal attention is implemented", {"use_bidirectional_attention": True}, is_inert=_false),
        "hidden_activation": Refused(
            "only the gelu_pytorch_tanh gated MLP is implemented", {"hidden_activation": "gelu"},
            is_inert=lambda value, cfg: value == "gelu_pytorch_tanh"),
        "partial_rotary_factor": Refused(
            "RoPE over part of each head is not implemented", {"partial_rotary_factor": 0.5},
            checked_by="config_checks.common_settings"),
    },
)

_GPT_OSS = FieldTable(
    "GptOssConfig",
    # models/gpt_oss.py: Q/K/V/O biases (attention_bias); sliding_window for the layers layer_types
    # marks sliding_attention (other types refused by the family's unimplemented_settings); every
    # MLP routes to num_local_experts (alias num_experts) experts with the clamped SwiGLU of
    # swiglu_alpha and swiglu_limit; quantization_config mxfp4 is dequantized at load (models/mxfp4.py)
    handled=_DECODER_HANDLED | {
        "attention_bias", "sliding_window", "layer_types", "num_local_experts", "num_experts",
        "num_experts_per_tok", "swiglu_alpha", "swiglu_limit"},
    # hidden_act: transformers' experts apply the clamped SwiGLU whatever it says; the router's
    # auxiliary loss acts in training only
    inert=_BASE_INERT | {"hidden_act", "router_aux_loss_coef", "output_router_logits"},
    refused={"partial_rotary_factor": _COMMON_REFUSED["partial_rotary_factor"]},
)

# architecture name (registry.ARCHITECTURES) -> its table
FIELD_TABLES: dict[str, FieldTable] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _MISTRAL,
    "Qwen2ForCausalLM": _QWEN2,
    "Qwen3ForCausalLM": _QWEN3,
    "Qwen3MoeForCausalLM": _QWEN3_MOE,
    "MixtralForCausalLM": _MIXTRAL,
    "Phi3ForCausalLM": _PHI3,
    "Gemma3ForCausalLM": _GEMMA3,
    "GptOssForCausalLM": _GPT_OSS,
    "DeepseekV2ForCausalLM": _DEEPSEEK_V2,
    "DeepseekV3ForCausalLM": _DEEPSEEK_V3,
}

# Registered architectures without a table yet, each with its reason. Their configs get only
# config_checks.common_settings and the family's own unimplemented_settings, no field account.
NO_TABLE: dict[str, str] = {}


def table_for(cfg: Mapping[str, Any]) -> FieldTable | None:
    """The table of the first of the config's ``architectures`` that has one (as the registry picks)."""
    for name in cfg.get("architectures") or []:
        if name in FIELD_TABLES:
            return FIELD_TABLES[name]
    return None


def field_problems(cfg: Mapping[str, Any]) -> list[str]:
    """One line per refused field at a value that changes the computation (those checked here;
    the rest are checked where ``Refused.checked_by`` says). Fields in no category are logged."""
    table = table_for(cfg)
    if table is None:
        return []
    problems = []
    for name, refused in table.refused.items():
        if refused.is_inert is not None and name in cfg and not refused.is_inert(cfg[name], cfg):
            problems.append(f"{name} = {cfg[name]!r}: {refused.why}")
    unknown = sorted(set(cfg) - table.known())
    if unknown:
        logger.warning("config.json fields segkv does not know for %s, ignored: %s (if one changes the "
                       "computation, the output will differ from the reference)",
                       table.config_class, ", ".join(unknown))
    return problems
