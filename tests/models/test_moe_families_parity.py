"""Qwen3-MoE and Mixtral against Hugging Face transformers (float32): prompt logits, greedy
decode through ``LLM``, and the packed (device-dispatch) experts against the expert loop."""

from __future__ import annotations

import pytest
import torch

from model_helpers import build_moe_dir, assert_greedy_agrees
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig
from segkv.engine import LLM
from segkv.layers.activation import GatedMLP
from segkv.layers.moe import MixtureOfExperts
from segkv.models.loader import load_model
from segkv.runner.model_runner import ModelRunner, StepInput
from segkv.sampling_params import SamplingParams

PROMPT = 40
NEW_TOKENS = 32
TOLERANCE = 1e-4

# case -> (family, config overrides, extra unused vocabulary ids, which layers are experts)
CASES = {
    "qwen3_moe": ("qwen3_moe", {}, 0, [True, True, True]),
    # MQA, an odd vocabulary, unnormalised top-3 weights, a dense layer in the middle
    "qwen3_moe_mqa_dense_layer": ("qwen3_moe", dict(
        num_key_value_heads=1, norm_topk_prob=False, num_experts=6, num_experts_per_tok=3,
        mlp_only_layers=[1], tie_word_embeddings=True), 6, [True, False, True]),
    # every second layer sparse (transformers: (i + 1) % decoder_sparse_step == 0)
    "qwen3_moe_sparse_step": ("qwen3_moe", dict(decoder_sparse_step=2, num_hidden_layers=4), 0,
                              [False, True, False, True]),
    # every layer windowed (transformers' Qwen3-MoE has no per-layer types), the window shorter than the prompt
    "qwen3_moe_window": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=12), 0, [True, True, True]),
    "mixtral": ("mixtral", {}, 0, [True, True, True]),
    # MQA, an odd vocabulary, head_dim != hidden / heads, a window shorter than the model length
    "mixtral_mqa_window": ("mixtral", dict(num_key_value_heads=1, head_dim=24, num_local_experts=5,
                                           sliding_window=256), 6, [True, True, True]),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _build(case: str, directory):
    family, overrides, extra_vocab, _ = CASES[case]
    hf = build_moe_dir(directory, family, extra_vocab=extra_vocab, **overrides)
    if extra_vocab:
        assert hf.config.vocab_size % 2 == 1
    return hf


def _prompt_logits(model, prompt: torch.Tensor) -> torch.Tensor:
    """``prompt (T,)`` -> float32 ``(T, vocab)``, prefilled in chunks of 11 (history attended as pieces)."""
    cache = PagedKVCache(model.kv_layout(torch.float32), CacheConfig(page_size=16, num_pages=64))
    runner = ModelRunner(model, cache, prefill_chunk=11)
    chain = cache.new_chain()
    logits = runner.prompt_logits(chain, prompt.tolist())
    chain.release()
    return logits


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_tokens_match_transformers(case, tmp_path, gen):
    hf = _build(case, tmp_path)
    model = load_model(tmp_path)
    assert [isinstance(layer.mlp, MixtureOfExperts) for layer in model.model.layers] == CASES[case][3]
    assert all(isinstance(layer.mlp, (MixtureOfExperts, GatedMLP)) for layer in model.model.layers)
    prompt = torch.randint(0, hf.config.vocab_size, (PROMPT,), generator=gen)
    logits = _prompt_logits(model, prompt)
    with torch.no_grad():
        reference = hf(prompt[None]).logits[0]
    assert logits.shape == reference.shape
    assert torch.isfinite(logits).all()
    assert rel_err(logits, reference) < TOLERANCE

    # greedy through the engine; no end-of-sequence id on either side (see test_gqa_parity)
    hf.generation_config.eos_token_id = None
    expected = hf.generate(prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT:].tolist()
    llm = LLM(tmp_path, dtype="float32", device="cpu", page_size=16, num_pages=64)
    assert llm.model.max_model_len == hf.config.max_position_embeddings  # a window does not cap it
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens = llm.generate([prompt.tolist()], params)[0].outputs[0].token_ids
    assert len(expected) == NEW_TOKENS
    assert_greedy_agrees(hf, prompt.tolist(), tokens, expected, TOLERANCE)


@pytest.mark.parametrize("case", ["qwen3_moe_mqa_dense_layer", "mixtral"])
def test_packed_experts_match_transformers(case, tmp_path, gen):
    """The device-side dispatch (what CUDA graphs capture): a grouped GEMM per expert for the
    prompt (over 64 token-expert pairs), a GEMV per pair for one-token decode steps; on the GPU
    where there is one (the Triton kernels run CPU tensors only in the interpreter)."""
    from gpu_helpers import DEVICE

    hf = _build(case, tmp_path)
    model = load_model(tmp_path, device=DEVICE)
    moes = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MixtureOfExperts)]
    for moe in moes:
        moe.pack_experts()
    assert moes and all(moe.packed for moe in moes)
    prompt = torch.randint(0, hf.config.vocab_size, (PROMPT,), generator=gen)
    cache = PagedKVCache(model.kv_layout(torch.float32), CacheConfig(page_size=16, num_pages=64), device=DEVICE)
    runner = ModelRunner(model, cache, device=DEVICE, prefill_chunk=PROMPT, fused_ops=False)
    chain = cache.new_chain()
    logits = runner.prompt_logits(chain, prompt.tolist())
    ids = prompt.tolist()
    steps = [logits[-1]]
    for _ in range(3):
        ids.append(int(steps[-1].argmax()))
        steps.append(runner.forward([StepInput(chain, [ids[-1]])])[0])
    chain.release()
    with torch.no_grad():
        reference = hf(torch.tensor([ids])).logits[0]
    logits, steps = logits.cpu(), [s.cpu() for s in steps]
    assert torch.isfinite(logits).all() and all(torch.isfinite(s).all() for s in steps)
    assert rel_err(logits, reference[:PROMPT]) < TOLERANCE
    assert rel_err(torch.stack(steps[1:]), reference[PROMPT:]) < TOLERANCE


def test_mixtral_checkpoint_names_map_both_ways(tmp_path):
    build_moe_dir(tmp_path, "mixtral", num_hidden_layers=1, num_local_experts=2)
    model = load_model(tmp_path)
    assert model.param_name("model.layers.0.block_sparse_moe.experts.1.w3.weight") == \
        "model.layers.0.mlp.experts.1.up_proj.weight"
    assert model.param_name("model.layers.0.block_sparse_moe.gate.weight") == "model.layers.0.mlp.gate.weight"
    for name, _ in model.named_parameters():
        assert model.param_name(model.checkpoint_name(name)) == name
    assert model.checkpoint_name("model.layers.0.mlp.experts.0.down_proj.weight") == \
        "model.layers.0.block_sparse_moe.experts.0.w2.weight"
    # the router stays float32 whatever the model dtype (loader.keep_fp32)
    half = load_model(tmp_path, dtype="bfloat16")
    assert half.model.layers[0].mlp.gate.weight.dtype == torch.float32
    assert half.model.layers[0].mlp.experts[0].gate_proj.weight.dtype == torch.bfloat16


@pytest.mark.gpu  # runs in emulation on the CPU too, but Triton's interpreter takes minutes
@pytest.mark.parametrize("case", ["qwen3_moe_mqa_dense_layer", "mixtral"])
def test_graph_decode_gives_the_eager_tokens(case, tmp_path):
    """Fused ops and packed experts inside CUDA graphs: the eager tokens, with batches of 3 (GEMV
    per pair) and of 17 sequences (over 64 pairs: the grouped GEMM)."""
    from gpu_helpers import DEVICE, GRAPHS

    _build(case, tmp_path)

    def llm(**kw):
        return LLM(tmp_path, device=DEVICE, dtype="float32", backend="triton", page_size=16, num_pages=128,
                   prefill_chunk=32, **kw)

    prompts = [[5, 9, 13, 40, 77] * 2, [3, 1, 4, 1, 5, 9, 2, 6], [8, 8, 1]]
    wide = [[(7 * i + j) % 90 + 3 for j in range(3)] for i in range(17)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    eager = llm()
    graphed = llm(cuda_graphs=GRAPHS)
    for batch in (prompts, wide):
        expected = [o.outputs[0].token_ids for o in eager.generate(batch, params)]
        assert [o.outputs[0].token_ids for o in graphed.generate(batch, params)] == expected
    assert graphed.runner.graphs.replays >= 4
