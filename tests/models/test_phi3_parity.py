"""Phi-3 (fused qkv / gate_up, LongRoPE) and Llama with dynamic NTK RoPE against transformers (fp32)."""

from __future__ import annotations

import math

import pytest
import torch

from segkv.cache import PagedKVCache
from segkv.config import CacheConfig
from segkv.engine.llm import LLM
from segkv.models.loader import load_model
from segkv.runner.model_runner import ModelRunner
from segkv.sampling_params import SamplingParams
from tokenizer_helpers import build_tiny_tokenizer, tiny_vocab_size

ORIGINAL = 32  # LongRoPE's original length: prompts and generations cross it


def _longrope(half: int, gen: torch.Generator) -> dict:
    """Distinct random short and long factors (1 to 4 per rotary dimension pair)."""
    factors = 1 + 3 * torch.rand(2, half, generator=gen, dtype=torch.float64)
    return {"rope_type": "longrope", "short_factor": factors[0].tolist(), "long_factor": factors[1].tolist()}


def _build(directory, family: str, gen: torch.Generator, odd_vocab: bool = False, **settings):
    """A random ``family`` checkpoint (weights ~N(0, 0.08)) with a tiny tokenizer; returns the HF model.
    ``odd_vocab``: one id past the tokenizer's where its vocabulary is even."""
    import transformers as tf

    build_tiny_tokenizer(directory, style="chatml")
    config_cls, model_cls = {"phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
                             "llama": (tf.LlamaConfig, tf.LlamaForCausalLM)}[family]
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    if family == "phi3":  # Phi3Config's default special ids (32000) lie outside a tiny vocabulary
        base.update(pad_token_id=None, eos_token_id=None, bos_token_id=None)
    vocab = tiny_vocab_size(directory)
    vocab += int(odd_vocab and vocab % 2 == 0)
    config = config_cls(vocab_size=vocab, **{**base, **settings})
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(directory)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    err = ((a.double() - b.double()).norm() / b.double().norm()).item()
    return err if math.isfinite(err) else math.inf  # NaN never passes


def _check_logits(hf, model, prompt: torch.Tensor, prefill_chunk: int) -> float:
    cache = PagedKVCache(model.kv_layout(torch.float32), CacheConfig(page_size=16, num_pages=64))
    runner = ModelRunner(model, cache, prefill_chunk=prefill_chunk)
    chain = cache.new_chain()
    logits = runner.prompt_logits(chain, prompt.tolist())
    chain.release()
    with torch.no_grad():
        reference = hf(prompt[None]).logits[0]
    assert logits.shape == reference.shape
    err = rel_err(logits, reference)
    assert err < 1e-4, err
    return err


def _check_greedy(hf, llm: LLM, prompt: torch.Tensor, tokens: int = 32) -> None:
    """``tokens`` greedy tokens through the engine equal transformers' generate."""
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = hf.generate(prompt[None], max_new_tokens=tokens, do_sample=False)[0, len(prompt):].tolist()
    out = llm.generate([prompt.tolist()], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected


def test_phi3_matches_transformers(tmp_path, gen):
    """GQA, untied, plain RoPE: fused checkpoint tensors, logits (prefill in pieces) and 32 greedy tokens."""
    hf = _build(tmp_path, "phi3", gen)
    model = load_model(tmp_path)
    assert not hasattr(model.model.layers[0].self_attn, "q_proj")  # qkv_proj loaded as stored
    _check_logits(hf, model, torch.randint(0, hf.config.vocab_size, (40,), generator=gen), prefill_chunk=11)
    _check_greedy(hf, LLM(tmp_path, dtype="float32", device="cpu"),
                  torch.randint(0, hf.config.vocab_size, (12,), generator=gen))


def test_phi3_unusual_config_with_longrope(tmp_path, gen):
    """One KV head (MQA), an odd vocabulary, tied embeddings, a window longer than the prompts, LongRoPE with original
    length 32 and factor 8 (attention factor ~1.26): prompts below, at and above 32 tokens (short,
    then long factors), and a greedy run past it. (A sequence crossing 32 after its first step is
    not compared: transformers recomputes its cache at the long factors, see
    ``RotaryEmbedding.table_positions``.)"""
    head_dim = 64 // 4
    hf = _build(tmp_path, "phi3", gen, odd_vocab=True, num_key_value_heads=1, tie_word_embeddings=True,
                sliding_window=200, original_max_position_embeddings=ORIGINAL,
                rope_scaling=_longrope(head_dim // 2, gen))
    assert hf.config.vocab_size % 2 == 1
    model = load_model(tmp_path)
    assert model.max_model_len == 256 and model.sliding_window == 200  # the window does not cap it
    assert model.lm_head.weight is model.model.embed_tokens.weight
    rotary = model.model.layers[0].self_attn.rotary
    assert rotary.longrope and rotary.attention_factor == pytest.approx(math.sqrt(1 + math.log(8) / math.log(32)))
    vocab = hf.config.vocab_size
    for length in (20, ORIGINAL, ORIGINAL + 1, 48):  # short factors up to 32 tokens, long from 33
        _check_logits(hf, model, torch.randint(0, vocab, (length,), generator=gen), prefill_chunk=512)
    _check_greedy(hf, LLM(tmp_path, dtype="float32", device="cpu"),
                  torch.randint(0, vocab, (40,), generator=gen))  # long from the prompt on


def test_llama_dynamic_rope_matches_transformers(tmp_path, gen):
    """Dynamic NTK: within max_position_embeddings (segkv's model length) transformers' frequencies
    are the plain ones; logits and greedy tokens up to that length."""
    hf = _build(tmp_path, "llama", gen, max_position_embeddings=64,
                rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    model = load_model(tmp_path)
    assert model.max_model_len == 64
    _check_logits(hf, model, torch.randint(0, hf.config.vocab_size, (40,), generator=gen), prefill_chunk=11)
    _check_greedy(hf, LLM(tmp_path, dtype="float32", device="cpu"),
                  torch.randint(0, hf.config.vocab_size, (30,), generator=gen), tokens=32)
