"""Builders of small random Hugging Face checkpoints (with a tiny tokenizer) for tests."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenizer_helpers import build_tiny_tokenizer, tiny_vocab_size

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)


def gqa_families() -> dict[str, tuple[type, type, dict]]:
    """family name -> (HF config class, HF model class, extra config)."""
    import transformers as tf

    llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "llama3.1": (tf.LlamaConfig, tf.LlamaForCausalLM, {"rope_scaling": llama31, "rope_theta": 500000.0}),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": None}),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 32}),
    }


def build_model_dir(directory: Path, family: str = "qwen3", *, seed: int = 0, **overrides):
    """Write a random ``family`` checkpoint and a tiny ChatML tokenizer; return the HF model."""
    directory.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(directory, style="chatml")
    config_cls, model_cls, extra = gqa_families()[family]
    config = config_cls(vocab_size=tiny_vocab_size(directory), **{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # larger weights than the default init: sharper, less tie-prone logits
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(directory)
    return model


def build_deepseek_dir(path, **overrides) -> None:
    """A tiny random DeepSeek-V3-style checkpoint (MLA; experts from layer ``first_k_dense_replace``)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    build_tiny_tokenizer(path, style="chatml")
    settings = dict(
        vocab_size=tiny_vocab_size(path), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, n_shared_experts=1, moe_intermediate_size=32, max_position_embeddings=256, n_group=1,
        topk_group=1)
    config = DeepseekV3Config(**{**settings, **overrides})
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    hf.save_pretrained(path)


def moe_families() -> dict[str, tuple[type, type, dict]]:
    """Sparse-MoE family name -> (HF config class, HF model class, base config: 3 layers, 8 experts, top-2)."""
    import transformers as tf

    return {
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(
            hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, max_position_embeddings=512)),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, dict(
            hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
            sliding_window=None)),
    }


def build_moe_dir(directory: Path, family: str, *, seed: int = 0, extra_vocab: int = 0, **overrides):
    """Write a random sparse-MoE checkpoint (``moe_families``) and a tiny ChatML tokenizer; return the
    HF model. The vocabulary is the tokenizer's plus ``extra_vocab`` unused ids. Weights are scaled
    so that attention is far from uniform and the router's choices are decisive (HF's init leaves
    both near flat, where routing or scale errors would hardly show)."""
    import math

    directory.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(directory, style="chatml")
    config_cls, model_cls, base = moe_families()[family]
    config = config_cls(vocab_size=tiny_vocab_size(directory) + extra_vocab, **{**base, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0, 1)
            elif p.dim() >= 2:  # linears (out, in) and stacked experts (E, out, in)
                p.copy_(torch.randn_like(p) * 1.5 / math.sqrt(p.shape[-1]))
    model.save_pretrained(directory)
    return model


def assert_greedy_agrees(hf, prompt: list[int], tokens: list[int], expected: list[int], tolerance: float) -> None:
    """segkv's greedy ``tokens`` against transformers' ``expected`` after ``prompt``: equal, or they
    part at a float32 near-tie (the two candidates' logits at that step, by transformers, within
    ``tolerance`` of the step's largest logit), which only then may flip greedy."""
    import torch

    assert len(tokens) == len(expected)
    if tokens == expected:
        return
    i = next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)
    with torch.no_grad():
        step = hf(torch.tensor([prompt + expected[:i]])).logits[0, -1]
    gap = (step[tokens[i]] - step[expected[i]]).abs().item()
    assert gap < tolerance * step.abs().max().item(), f"step {i}: {tokens[i]} vs {expected[i]}, gap {gap}"


GEMMA3 = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, max_position_embeddings=256,
              sliding_window=128, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                               "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                  "rope_theta": 100_000.0}})


def build_gemma3_dir(directory: Path, *, seed: int = 0, odd_vocab: bool = False, **overrides):
    """Write a random Gemma 3 text checkpoint (``GEMMA3``: local, global and local layers, each type
    with its own RoPE, attention scaled by ``query_pre_attn_scalar`` 24, not the head size) and a
    tiny ChatML tokenizer; return the HF model. ``odd_vocab``: one id past the tokenizer's where its
    vocabulary is even. Projections and embeddings are ~N(0, 0.08) and the norm weights ~N(0, 0.3)
    (HF's init leaves them at 0, where ``w`` and ``1 + w`` scaling would look alike)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    directory.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(directory, style="chatml")
    vocab = tiny_vocab_size(directory)
    vocab += int(odd_vocab and vocab % 2 == 0)
    config = Gemma3TextConfig(vocab_size=vocab, pad_token_id=0, bos_token_id=None, eos_token_id=None,
                              **{**GEMMA3, **overrides})
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.3 if "norm" in name else 0.08)
    model.save_pretrained(directory)
    return model


GPT_OSS = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=24, num_local_experts=8, num_experts_per_tok=2,
               max_position_embeddings=256, sliding_window=12,
               layer_types=["sliding_attention", "full_attention", "sliding_attention"],
               rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 64,
                                "rope_theta": 150_000.0})


def build_gpt_oss_dir(directory: Path, *, seed: int = 0, odd_vocab: bool = False, **overrides):
    """Write a random gpt-oss checkpoint (``GPT_OSS``: sliding, full and sliding layers with a window
    of 12, head size 24 (not hidden / heads), YaRN RoPE, 8 experts of which 2 per token) and a tiny
    ChatML tokenizer; return the HF model. ``odd_vocab``: one id past the tokenizer's where its
    vocabulary is even. Weights are scaled so that attention is far from uniform, the router's
    choices decisive and the sinks take a real share of each row (HF's init leaves sinks, biases
    and routers near 0, where their errors would hardly show)."""
    import math

    from transformers import GptOssConfig, GptOssForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(directory, style="chatml")
    vocab = tiny_vocab_size(directory)
    vocab += int(odd_vocab and vocab % 2 == 0)
    config = GptOssConfig(vocab_size=vocab, pad_token_id=0, bos_token_id=None, eos_token_id=None,
                          **{**GPT_OSS, **overrides})
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("sinks"):
                p.copy_(1.5 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0, 1)
            elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                p.copy_(torch.randn_like(p) * 1.5 / math.sqrt(p.shape[-2]))  # (E, in, out): x @ W
            elif p.dim() >= 2:  # linears (out, in)
                p.copy_(torch.randn_like(p) * 1.5 / math.sqrt(p.shape[-1]))
            else:  # biases
                p.normal_(0, 0.3)
    model.save_pretrained(directory)
    return model


def mxfp4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A reference MXFP4 quantizer: ``weight (E, in, out)`` (``x @ W``) -> ``blocks`` uint8
    ``(E, out, in / 32, 16)`` and ``scales`` uint8 ``(E, out, in / 32)`` as gpt-oss checkpoints
    store them. Each block of 32 values gets the E8M0 exponent ``floor(log2(max |v|)) - 2`` (the
    largest FP4 magnitude is 6 = 1.5 * 2^2), then each value the nearest FP4 (E2M1) code, the low
    nibble first."""
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    w = weight.float().transpose(-1, -2)  # (E, out, in)
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    peak = blocks.abs().amax(dim=-1).clamp(min=2.0 ** -100)
    exponent = torch.floor(torch.log2(peak)) - 2
    scaled = blocks / torch.ldexp(torch.ones_like(exponent), exponent.int()).unsqueeze(-1)
    code = (scaled.abs().unsqueeze(-1) - values).abs().argmin(dim=-1)  # nearest magnitude
    code = code | ((scaled < 0).long() << 3)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent + 127).to(torch.uint8)
