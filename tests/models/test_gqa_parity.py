"""Llama, Llama 3.1, Mistral, Qwen2 and Qwen3 against Hugging Face transformers (fp32)."""

from __future__ import annotations

import pytest
import torch

from model_helpers import build_model_dir, gqa_families
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig
from segkv.models.loader import load_model
from segkv.runner.model_runner import ModelRunner, StepInput


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("family", list(gqa_families()))
def test_prompt_logits_and_greedy_tokens_match_transformers(family, tmp_path, gen):
    hf = build_model_dir(tmp_path, family)
    model = load_model(tmp_path)
    cache = PagedKVCache(model.kv_layout(torch.float32), CacheConfig(page_size=16, num_pages=64))
    runner = ModelRunner(model, cache, prefill_chunk=11)  # history attended as pieces
    prompt = torch.randint(0, hf.config.vocab_size, (40,), generator=gen)
    chain = cache.new_chain()
    logits = runner.prompt_logits(chain, prompt.tolist())
    with torch.no_grad():
        reference = hf(prompt[None]).logits[0]
    assert logits.shape == reference.shape
    assert rel_err(logits, reference) < 1e-4

    # no end-of-sequence id: transformers' greedy argmax over all ids, 32 tokens (min_new_tokens would
    # mask the EOS id instead, and a prompt whose greedy run reaches it would then differ)
    hf.generation_config.eos_token_id = None
    expected = hf.generate(prompt[None], max_new_tokens=32, do_sample=False)[0, 40:]
    assert len(expected) == 32
    step_logits = [logits[-1]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(31):
        step_logits.append(runner.forward([StepInput(chain, [tokens[-1]])])[0])
        tokens.append(int(step_logits[-1].argmax()))
    expected = expected.tolist()
    if tokens != expected:  # only a float32 near-tie may flip greedy: then both paths agree up to it
        i = next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)
        gap = (step_logits[i][tokens[i]] - step_logits[i][expected[i]]).abs().item()
        assert gap < 1e-4 * step_logits[i].abs().max().item(), f"step {i}: {tokens[i]} vs {expected[i]}, gap {gap}"
    chain.release()
    assert cache.pool.pages_in_use == 0
