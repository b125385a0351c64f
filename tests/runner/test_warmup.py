"""LLM.warm_up: the step shapes run (and graphs captured) up front, leaving cache and results as they were."""

from __future__ import annotations

import pytest
import torch

from gpu_helpers import DEVICE, GPU, GRAPHS
from model_helpers import build_model_dir
from segkv.engine import LLM
from segkv.runner.warmup import warm_up, warm_up_shapes
from segkv.sampling_params import SamplingParams

PROMPTS = [[5, 9, 13, 40, 77] * 3, [3, 1, 4, 1, 5, 9, 2, 6], [8, 8, 1]]


def _llm(path, **kw):
    return LLM(path, dtype="float32", page_size=16, num_pages=128, prefill_chunk=32, **kw)


def _state(llm: LLM) -> tuple:
    pool = llm.cache.pool
    return (llm.stats(), list(pool._free), pool.rows_copied, llm.runner.plans_ahead_used)


def _tokens(llm: LLM, params: SamplingParams, seed: int | None = None) -> list[list[int]]:
    if seed is not None:
        torch.manual_seed(seed)  # unseeded sampling draws from the default generator
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=5, ignore_eos=True)


def test_warm_up_leaves_cache_counters_and_results_as_they_were(tmp_path):
    build_model_dir(tmp_path, "qwen3")
    llm, fresh = _llm(tmp_path), _llm(tmp_path)
    llm.generate([[1, 2, 3]], GREEDY)  # counters that are not zero: restored, not reset
    fresh.generate([[1, 2, 3]], GREEDY)
    before = _state(llm)
    assert before[0]["pages_allocated_total"] > 0 and before[0]["routes"]
    torch.manual_seed(7)
    report = llm.warm_up(max_batch=3)
    # CPU: one-token prompts and a decode step for each batch size up to the bucket of 3 rows
    assert report["buckets"] == [1, 2, 4] and report["forwards"] == 6
    assert report["bytes"] == 0 and report["graphs"] == [] and report["skipped"] == []
    assert 0 < report["seconds"] < 60
    assert _state(llm) == before  # pages, free-list order, pool counters, route counts
    assert llm.runner.last_plan is not None and llm.cache.pool.pages_in_use == 0
    assert _tokens(llm, GREEDY) == _tokens(fresh, GREEDY)
    torch.manual_seed(7)  # the warm-up's draws were given back: the same samples follow
    assert _tokens(llm, SAMPLED) == _tokens(fresh, SAMPLED, seed=7)


def test_thorough_warm_up_on_the_cpu(tmp_path):
    """The CUDA warm-up's shapes (every prefill length, the largest forward, device-id decode steps,
    a mixed step, forks, every sampler setting), run on the CPU's torch backend."""
    build_model_dir(tmp_path, "qwen3")
    llm, fresh = _llm(tmp_path), _llm(tmp_path)
    shapes = warm_up_shapes(llm.runner, max_batch=3, max_num_batched_tokens=80, max_model_len=llm.max_model_len,
                            thorough=True)
    assert shapes.decode_sizes == (1, 2, 4) and shapes.graph_sizes == ()
    assert shapes.prefill_lengths == (1, 2, 3, 5, 9, 17, 32, 39)  # powers of two + 1, a chunk, two chunks
    assert shapes.batched == (32, 32, 16) and shapes.shared_prefix == 35
    before = _state(llm)
    torch.manual_seed(3)
    report = warm_up(llm.runner, llm.generator.sampler, shapes, vocab_size=llm.model.cfg.vocab_size)
    # 8 prefills, 1 batched forward, 3 decode sizes x 3 steps + 1 mixed step, 3 forwards of forks
    assert report["forwards"] == 8 + 1 + 9 + 1 + 3 and report["skipped"] == []
    assert _state(llm) == before
    assert _tokens(llm, GREEDY) == _tokens(fresh, GREEDY)
    torch.manual_seed(3)
    assert _tokens(llm, SAMPLED) == _tokens(fresh, SAMPLED, seed=3)


def test_shapes_the_cache_cannot_hold_are_skipped(tmp_path):
    build_model_dir(tmp_path, "qwen3")
    llm = LLM(tmp_path, dtype="float32", page_size=16, num_pages=6, prefill_chunk=32)
    shapes = warm_up_shapes(llm.runner, max_batch=8, max_num_batched_tokens=128, max_model_len=llm.max_model_len,
                            thorough=True)
    before = _state(llm)
    report = warm_up(llm.runner, llm.generator.sampler, shapes, vocab_size=llm.model.cfg.vocab_size)
    assert "forward of 128 tokens" in report["skipped"] and "decode of 8 sequences" in report["skipped"]
    assert "prefill of 39 tokens" not in report["skipped"]
    assert _state(llm) == before


def test_warm_up_captures_every_graph_variant(tmp_path):
    """Every variant of the buckets up to the batch is captured (emulated without a GPU, in the
    Triton interpreter), and later steps replay them, giving the eager tokens."""
    build_model_dir(tmp_path, "qwen3")
    llm = _llm(tmp_path, backend="triton", cuda_graphs=GRAPHS, device=DEVICE)
    graphs = llm.runner.graphs
    report = llm.warm_up(max_batch=2)
    narrow_few, narrow, wide = (1, False, True), (1, False, False), (2, True, False)
    expected = [narrow_few, narrow, (2, False, True), (2, False, False), wide]
    assert report["graphs"] == [list(k) for k in expected] and report["buckets"] == [1, 2]
    assert sorted(graphs._buckets) == sorted(expected)
    assert graphs.replays == 0 and llm.runner.route_counts == {} and llm.cache.pool.pages_in_use == 1  # scratch
    assert llm.warm_up(max_batch=2)["graphs"] == []  # captured once
    if GPU:
        assert report["bytes"] > 0  # the graphs' memory pools
    eager = _tokens(_llm(tmp_path, backend="triton", device=DEVICE), GREEDY)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], GREEDY)]
    assert got == eager[:2]
    assert graphs.replays >= 4 and sorted(graphs._buckets) == sorted(expected)  # nothing captured late


def test_bad_warm_up_sizes_are_refused(tmp_path):
    build_model_dir(tmp_path, "qwen3")
    llm = _llm(tmp_path)
    with pytest.raises(ValueError, match="max_batch and max_num_batched_tokens must be >= 1"):
        llm.warm_up(max_batch=0, max_num_batched_tokens=-1)
