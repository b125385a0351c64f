"""Shared steps of the float32 parity tests against transformers: relative error (NaN never
passes), prompt logits through the runner, transformers' and the engine's greedy tokens."""

from __future__ import annotations

import math

import torch

from segkv.cache import PagedKVCache
from segkv.config import CacheConfig
from segkv.engine import LLM
from segkv.runner.model_runner import ModelRunner
from segkv.sampling_params import SamplingParams

NEW_TOKENS = 32


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    err = ((a.double() - b.double()).norm() / b.double().norm()).item()
    return err if math.isfinite(err) else math.inf  # NaN never passes


def prompt_logits(model, prompt: torch.Tensor, prefill_chunk: int) -> torch.Tensor:
    """``(n, vocab)`` float32 logits of every prompt row, prefilled in chunks of ``prefill_chunk``."""
    cache = PagedKVCache(model.kv_layout(torch.float32), CacheConfig(page_size=16, num_pages=64))
    chain = cache.new_chain()
    logits = ModelRunner(model, cache, prefill_chunk=prefill_chunk).prompt_logits(chain, prompt.tolist())
    chain.release()
    return logits


def hf_greedy(hf, prompt: list[int], tokens: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy tokens after ``prompt`` (no end-of-sequence id; every prompt token
    attended: without a mask, generate masks out a prompt token equal to the pad id)."""
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def cpu_llm(directory, **kw) -> LLM:
    return LLM(directory, dtype="float32", device="cpu", backend="torch", page_size=16, num_pages=64, **kw)


def greedy(llm: LLM, prompts: list[list[int]], tokens: int = NEW_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
