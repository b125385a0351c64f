"""The explicit registry: a checkpoint's ``architectures`` name -> segkv model class."""

from __future__ import annotations

import importlib
from typing import Any

# name -> (module, class); modules are imported only when their architecture is used.
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("segkv.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("segkv.models.mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("segkv.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("segkv.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("segkv.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("segkv.models.mixtral", "MixtralForCausalLM"),
    "DeepseekV2ForCausalLM": ("segkv.models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("segkv.models.deepseek", "DeepseekV3ForCausalLM"),
    "Phi3ForCausalLM": ("segkv.models.phi3", "Phi3ForCausalLM"),
    "Gemma3ForCausalLM": ("segkv.models.gemma3", "Gemma3ForCausalLM"),
    "GptOssForCausalLM": ("segkv.models.gpt_oss", "GptOssForCausalLM"),
}


def model_class(config: dict[str, Any]) -> type:
    """The model class for a ``config.json`` dict; ValueError for unsupported architectures."""
    names = config.get("architectures") or []
    if not names:
        raise ValueError("config.json has no 'architectures' entry; cannot tell which model this is")
    for name in names:
        if name in ARCHITECTURES:
            module, cls = ARCHITECTURES[name]
            return getattr(importlib.import_module(module), cls)
    supported = ", ".join(sorted(ARCHITECTURES))
    raise ValueError(f"unsupported architecture {', '.join(names)}; segkv supports {supported}")
