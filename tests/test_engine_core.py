"""Continuous batching: many requests at once, prefix reuse, preemption under a small budget, abort."""

from __future__ import annotations

import pytest

from model_helpers import build_model_dir
from segkv.engine import LLM
from segkv.engine.core import EngineCore, QueueFullError
from segkv.sampling_params import SamplingParams
from segkv.scheduler import SchedulerConfig

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("core-model")
    build_model_dir(directory, "qwen3")
    return directory


def run_all(core: EngineCore, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not core.has_unfinished():
            return
        core.step()
    raise AssertionError("requests did not finish")


def prompts(llm, count: int) -> list[list[int]]:
    words = ["pages", "segments", "forks", "chains", "merge", "split", "plans", "turns"]
    return [llm.tokenizer.encode(" ".join(words[(i + j) % 8] for j in range(3 + i % 5))) for i in range(count)]


def test_32_concurrent_requests_match_one_at_a_time(model_dir):
    llm = LLM(model_dir, page_size=8, num_pages=600)
    batch = prompts(llm, 32)
    alone = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in batch]
    core = EngineCore(llm, SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=64))
    requests = [core.add_request(p, GREEDY) for p in batch]
    run_all(core)
    assert [r.output().outputs[0].token_ids for r in requests] == alone
    assert all(r.output().outputs[0].finish_reason == "length" for r in requests)
    assert core.stats()["running"] == 0


def test_repeated_history_is_served_from_the_prefix_index(model_dir):
    llm = LLM(model_dir, page_size=8, num_pages=600)
    core = EngineCore(llm)
    history = prompts(llm, 1)[0] * 6
    first = core.add_request(history, GREEDY)
    run_all(core)
    follow_up = history + first.output().outputs[0].token_ids + llm.tokenizer.encode(" more")
    second = core.add_request(follow_up, GREEDY)
    run_all(core)
    assert second.cached_tokens >= len(history)
    fresh = llm.generate([follow_up], GREEDY)[0].outputs[0].token_ids
    assert second.output().outputs[0].token_ids == fresh


def test_small_kv_budget_preempts_recomputes_and_completes(model_dir):
    big = LLM(model_dir, page_size=4, num_pages=800)
    batch = prompts(big, 12)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [big.generate([p], params)[0].outputs[0].token_ids for p in batch]
    small = LLM(model_dir, page_size=4, num_pages=40)
    core = EngineCore(small, SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=64))
    requests = [core.add_request(p, params) for p in batch]
    run_all(core)
    assert core.num_preemptions > 0
    assert [r.output().outputs[0].token_ids for r in requests] == alone


def test_abort_frees_pages_and_queue_limits(model_dir):
    llm = LLM(model_dir, page_size=8, num_pages=600)
    core = EngineCore(llm, SchedulerConfig(max_waiting=2))
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    a = core.add_request(prompts(llm, 1)[0], long)
    core.add_request(prompts(llm, 2)[1], long)
    with pytest.raises(QueueFullError):
        core.add_request(prompts(llm, 3)[2], long)
    core.step()
    core.step()
    assert core.abort(a.request_id) and not core.abort(a.request_id)
    run_all(core)
    core.prefix.clear()
    assert llm.cache.pool.pages_in_use == 0
    with pytest.raises(ValueError):
        core.add_request([], GREEDY)


def test_n_samples_run_as_forked_siblings(model_dir):
    llm = LLM(model_dir, page_size=8, num_pages=600)
    core = EngineCore(llm)
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=5, ignore_eos=True)
    request = core.add_request(prompts(llm, 1)[0], params)
    run_all(core)
    outs = request.output().outputs
    assert [o.index for o in outs] == [0, 1, 2] and all(len(o.token_ids) == 6 for o in outs)
    expected = llm.generate([prompts(llm, 1)[0]], params)[0].outputs
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
