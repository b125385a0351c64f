"""Mistral, Mixtral and Phi-3 with a ``sliding_window`` shorter than the sequences, against
transformers (float32): prompt logits and greedy tokens past the window; for Mistral, every
route, the Triton kernels (the interpreter on the CPU), prompt chunks smaller than the window,
a follow-up turn, a fork and emulated CUDA-graph decode give the reference backend's tokens. The
window does not cap the model length."""

from __future__ import annotations

import pytest
import torch

from gpu_helpers import DEVICE, GPU
from engine_helpers import conversation_tokens
from model_helpers import assert_greedy_agrees, build_model_dir, build_moe_dir
from segkv.attention import Route
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig
from segkv.engine import LLM
from segkv.models.loader import load_model
from segkv.runner.model_runner import ModelRunner
from segkv.sampling_params import SamplingParams
from test_phi3_parity import _build as build_phi3

PROMPT = 44
NEW_TOKENS = 32
TOLERANCE = 1e-4
WINDOWS = {"mistral": 16, "mixtral": 12, "phi3": 9}


def _build(family: str, directory, gen):
    window = WINDOWS[family]
    if family == "mistral":
        return build_model_dir(directory, "mistral", sliding_window=window)
    if family == "mixtral":
        return build_moe_dir(directory, "mixtral", sliding_window=window)
    return build_phi3(directory, "phi3", gen, sliding_window=window)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("family", list(WINDOWS))
def test_windowed_logits_and_greedy_tokens_match_transformers(family, tmp_path, gen):
    hf = _build(family, tmp_path, gen)
    window = WINDOWS[family]
    assert hf.config.sliding_window == window < PROMPT
    model = load_model(tmp_path)
    assert model.sliding_window == window
    assert model.max_model_len == hf.config.max_position_embeddings  # not capped at the window

    # the prompt's logits, prefilled in chunks of 11 (windows starting inside earlier chunks)
    prompt = torch.randint(0, hf.config.vocab_size, (PROMPT,), generator=gen)
    cache = PagedKVCache(model.kv_layout(torch.float32), CacheConfig(page_size=16, num_pages=64))
    chain = cache.new_chain()
    logits = ModelRunner(model, cache, prefill_chunk=11).prompt_logits(chain, prompt.tolist())
    chain.release()
    with torch.no_grad():
        reference = hf(prompt[None]).logits[0]
        hf.config.sliding_window = None  # the same weights with full attention: the window matters
        full = hf(prompt[None]).logits[0]
        hf.config.sliding_window = window
    assert rel_err(logits, reference) < TOLERANCE
    assert rel_err(full, reference) > 100 * TOLERANCE

    # greedy past the window through the engine; no end-of-sequence id on either side
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = hf.generate(prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT:].tolist()
    llm = LLM(tmp_path, dtype="float32", device="cpu", backend="torch", page_size=16, num_pages=64)
    assert llm.max_model_len == hf.config.max_position_embeddings
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens = llm.generate([prompt.tolist()], params)[0].outputs[0].token_ids
    assert len(expected) == NEW_TOKENS
    assert_greedy_agrees(hf, prompt.tolist(), tokens, expected, TOLERANCE)


# Mistral through the engine: every route and backend against the reference backend
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 9, 13, 40, 77, 21] * 7, [3, 1, 4, 1, 5, 9, 2, 6] * 3]


def _tokens(directory, *, backend: str, chunk: int = 64, route: str | None = None, **kw):
    llm = LLM(directory, device=DEVICE, dtype="float32", backend=backend, page_size=16, num_pages=128,
              prefill_chunk=chunk, route=route, **kw)
    turns = ("hello there, a first turn of the conversation", "and a follow-up", "a fork's own turn")
    return conversation_tokens(llm, PROMPTS, PARAMS, turns), llm


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mistral_window")
    build_model_dir(directory, "mistral", sliding_window=10)
    return directory


@pytest.fixture(scope="module")
def reference(mistral_dir):
    tokens, llm = _tokens(mistral_dir, backend="torch")
    assert llm.model.sliding_window == 10 and llm.max_model_len == 512
    return tokens


def test_the_reference_tokens_are_transformers(mistral_dir, reference):
    """The plain prompts' greedy tokens (windows of 10 over 24 and 42 prompt tokens)."""
    from transformers import MistralForCausalLM

    hf = MistralForCausalLM.from_pretrained(mistral_dir, torch_dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for prompt, got in zip(PROMPTS, reference):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=PARAMS.max_tokens, do_sample=False)
        assert got == want[0, len(prompt):].tolist()


@pytest.mark.parametrize("route", [r.value for r in Route])
def test_every_route_gives_the_reference_tokens(route, mistral_dir, reference):
    assert _tokens(mistral_dir, backend="torch", route=route)[0] == reference


@pytest.mark.parametrize("route,chunk", [("single", 5), ("cascade", 64)])
def test_triton_kernels_give_the_reference_tokens(route, chunk, mistral_dir, reference):
    """Prompt chunks of 5 rows (smaller than the window) and a cascade over the fork's history."""
    assert _tokens(mistral_dir, backend="triton", chunk=chunk, route=route)[0] == reference


def test_graph_decode_of_a_windowed_model(mistral_dir, reference):
    """Decode graphs hold windowed plans (buffers with key lows) and replay the reference tokens,
    also for a step whose windows all start on a page boundary (no key lows) after steps with
    lows: the 24-token prompt alone reaches position 25 (window 16..25, page 1 whole)."""
    tokens, llm = _tokens(mistral_dir, backend="triton", cuda_graphs=True if GPU else "emulate")
    graphs = llm.runner.graphs
    assert tokens == reference
    assert llm.generate(PROMPTS[1:], PARAMS)[0].outputs[0].token_ids == reference[1]
    assert graphs.replays > 0 and all(b.backend.capacity.key_lows for b in graphs._buckets.values())


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("how", ["max_window_layers", "layer_types"])
def test_qwen_windows_over_every_layer_match_transformers(family, how, tmp_path, gen):
    """Qwen2/Qwen3 with every layer windowed (``max_window_layers`` 0, or ``layer_types`` all
    sliding) and a window shorter than the prompt: prompt logits and greedy tokens are
    transformers'; windows over some layers only stay refused."""
    window = 10
    extra = ({"max_window_layers": 0} if how == "max_window_layers"
             else {"layer_types": ["sliding_attention", "sliding_attention"], "max_window_layers": 0})
    hf = build_model_dir(tmp_path, family, use_sliding_window=True, sliding_window=window, **extra)
    assert all(t == "sliding_attention" for t in hf.config.layer_types)
    model = load_model(tmp_path)
    assert model.sliding_window == window and model.max_model_len == hf.config.max_position_embeddings
    prompt = torch.randint(0, hf.config.vocab_size, (PROMPT,), generator=gen)
    runs = []
    for sliding_window in (window, None):  # None: the same weights with full attention
        model.sliding_window = sliding_window
        cache = PagedKVCache(model.kv_layout(torch.float32), CacheConfig(page_size=16, num_pages=64))
        chain = cache.new_chain()
        runs.append(ModelRunner(model, cache, prefill_chunk=7).prompt_logits(chain, prompt.tolist()))
        chain.release()
    with torch.no_grad():
        reference = hf(prompt[None]).logits[0]
    assert rel_err(runs[0], reference) < TOLERANCE
    assert rel_err(runs[1], reference) > 100 * TOLERANCE  # the window matters
    llm = LLM(tmp_path, device="cpu", dtype="float32", page_size=16, num_pages=64)
    ours = llm.generate([prompt.tolist()], SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                          ignore_eos=True))[0].outputs[0].token_ids
    theirs = hf.generate(prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT:].tolist()
    assert ours == theirs


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_windows_over_some_layers_match_transformers(family, tmp_path, gen):
    """Qwen2/Qwen3 windowing the layers from ``max_window_layers`` on (layers 1 and 2 of 3) with a
    window shorter than the prompt: one plan per window a step, each layer attending its own.
    Prompt logits (chunks of 7) and greedy tokens are transformers'; without the windows the
    logits are not (the windows matter)."""
    window = 10
    hf = build_model_dir(tmp_path, family, use_sliding_window=True, sliding_window=window, max_window_layers=1,
                         num_hidden_layers=3)
    assert hf.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    model = load_model(tmp_path)
    assert model.layer_windows == (None, window, window) and model.sliding_window is None
    prompt = torch.randint(0, hf.config.vocab_size, (PROMPT,), generator=gen)

    def logits():
        cache = PagedKVCache(model.kv_layout(torch.float32), CacheConfig(page_size=16, num_pages=64))
        chain = cache.new_chain()
        out = ModelRunner(model, cache, prefill_chunk=7).prompt_logits(chain, prompt.tolist())
        chain.release()
        return out
    windowed = logits()
    with torch.no_grad():
        reference = hf(prompt[None]).logits[0]
    attns = [layer.self_attn.attn for layer in model.model.layers]
    for attn in attns:  # the same weights with full attention everywhere
        attn.window = None
    model.layer_windows = None
    full = logits()
    assert rel_err(windowed, reference) < TOLERANCE
    assert rel_err(full, reference) > 100 * TOLERANCE

    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = hf.generate(prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT:].tolist()
    llm = LLM(tmp_path, device="cpu", dtype="float32", backend="torch", page_size=16, num_pages=64)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert_greedy_agrees(hf, prompt.tolist(), llm.generate([prompt.tolist()], params)[0].outputs[0].token_ids,
                         expected, TOLERANCE)


@pytest.fixture(scope="module")
def per_layer_dir(tmp_path_factory):
    """Qwen3 windowing layers 1 and 2 of 3 (window 10), and its single-route tokens."""
    directory = tmp_path_factory.mktemp("qwen_per_layer")
    build_model_dir(directory, "qwen3", use_sliding_window=True, sliding_window=10, max_window_layers=1,
                    num_hidden_layers=3)
    tokens, llm = _tokens(directory, backend="torch", route="single")
    assert llm.model.layer_windows == (None, 10, 10)
    return directory, tokens


def test_per_layer_windows_on_every_route(per_layer_dir):
    """Every route of the reference backend gives the single route's tokens over prompts, a
    follow-up turn and a fork (the parity with transformers is the test above)."""
    directory, base = per_layer_dir
    for route in ("split", "segments", "cascade"):
        assert _tokens(directory, backend="torch", route=route)[0] == base, route


@pytest.mark.gpu  # the interpreter takes minutes here; the kernels' windows are checked on the CPU above
def test_per_layer_windows_in_the_triton_kernels(per_layer_dir):
    directory, base = per_layer_dir
    assert _tokens(directory, backend="triton", chunk=5, route="split")[0] == base


def test_graph_decode_with_per_layer_windows(per_layer_dir):
    """Decode graphs hold each per-layer window's plan in buffers of its own (with key lows) and
    replay the reference backend's tokens."""
    directory, _ = per_layer_dir
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = PROMPTS[1]
    want = LLM(directory, device=DEVICE, dtype="float32", backend="torch", page_size=16,
               num_pages=64).generate([prompt], params)[0].outputs[0].token_ids
    graphed = LLM(directory, device=DEVICE, dtype="float32", backend="triton", page_size=16, num_pages=64,
                  prefill_chunk=64, cuda_graphs=True if GPU else "emulate")
    assert graphed.generate([prompt], params)[0].outputs[0].token_ids == want
    graphs = graphed.runner.graphs
    assert graphs.replays >= 3
    for bucket in graphs._buckets.values():
        assert set(bucket.windowed) == {10} and bucket.windowed[10].capacity.key_lows
        assert not bucket.backend.capacity.key_lows  # the full-attention layers' plan has no window
