"""Continuous batching: many requests at once, prefix reuse, preemption under a small budget, abort."""

from __future__ import annotations

import pytest

from engine_helpers import run_all
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


def prompts(llm, count: int) -> list[list[int]]:
    words = ["pages", "segments", "forks", "chains", "merge", "split", "plans", "turns"]
    return [llm.tokenizer.encode(" ".join(words[(i + j) % 8] for j in range(3 + i % 5))) for i in range(count)]


def test_32_concurrent_requests_match_one_at_a_time(model_dir):
    llm = LLM(model_dir, page_size=8, num_pages=600)
    batch = prompts(llm, 32)
    alone = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in batch]
    core = EngineCore(llm.cache, llm.generator, SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=64))
    requests = [core.add_request(p, GREEDY) for p in batch]
    run_all(core)
    assert [r.output().outputs[0].token_ids for r in requests] == alone
    assert all(r.output().outputs[0].finish_reason == "length" for r in requests)
    assert core.stats()["running"] == 0


def test_repeated_history_is_served_from_the_prefix_index(model_dir):
    llm = LLM(model_dir, page_size=8, num_pages=600)
    core = EngineCore(llm.cache, llm.generator)
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
    core = EngineCore(small.cache, small.generator,
                      SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=64))
    requests = [core.add_request(p, params) for p in batch]
    run_all(core)
    assert core.num_preemptions > 0
    assert [r.output().outputs[0].token_ids for r in requests] == alone


def test_abort_frees_pages_and_queue_limits(model_dir):
    llm = LLM(model_dir, page_size=8, num_pages=600)
    core = EngineCore(llm.cache, llm.generator, SchedulerConfig(max_waiting=2))
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
    core = EngineCore(llm.cache, llm.generator)
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=5, ignore_eos=True)
    request = core.add_request(prompts(llm, 1)[0], params)
    run_all(core)
    outs = request.output().outputs
    assert [o.index for o in outs] == [0, 1, 2] and all(len(o.token_ids) == 6 for o in outs)
    expected = llm.generate([prompts(llm, 1)[0]], params)[0].outputs
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]


class _Seq:
    """What the scheduler needs of a sequence: a chain, the tokens still pending, all tokens."""

    def __init__(self, chain, tokens: list[int]) -> None:
        self.chain, self.pending, self.tokens = chain, list(tokens), list(tokens)

    @property
    def num_pending(self) -> int:
        return len(self.pending)

    def all_token_ids(self) -> list[int]:
        return list(self.tokens)

    def run(self, num_tokens: int) -> None:  # what the generator does with scheduled tokens
        self.chain.append(num_tokens, token_ids=self.pending[:num_tokens])
        del self.pending[:num_tokens]

    def sample(self, token: int) -> None:  # a sampled token waits for its row
        self.pending, self.tokens = [token], self.tokens + [token]


def test_scheduler_output_says_what_runs_this_step():
    """The scheduler's contract, without a model: which sequences run and how many tokens each
    (decodes first, prefill chunks under the token budget), who was admitted, the cached prefix
    each admission found."""
    from segkv.cache import PagedKVCache
    from segkv.config import CacheConfig, KVLayout
    from segkv.scheduler import Scheduler

    cache = PagedKVCache(KVLayout(num_layers=1, num_kv_heads=1, head_dim=4),
                         CacheConfig(page_size=4, num_pages=16))
    scheduler = Scheduler(cache, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=12))
    a, b, c = (_Seq(cache.new_chain(), list(range(k, k + 10))) for k in (0, 100, 200))
    for seq in (a, b, c):
        scheduler.add(seq)
    out = scheduler.schedule()
    assert out.scheduled == [(a, 10), (b, 2)] and out.admitted == [a, b] and not out.preempted
    assert out.matched == [(a, 0), (b, 0)] and not out.ahead_ok  # c still waits
    assert list(scheduler.waiting) == [c] and scheduler.running == [a, b]
    for seq, n in out.scheduled:
        seq.run(n)
    out = scheduler.schedule()
    assert out.scheduled == [(b, 8)]  # a has nothing pending: its sampled token is not appended here
    a.sample(10)
    b.run(8)
    b.sample(110)
    scheduler.free(a)  # a finishes: its rows are sealed into the prefix index
    twin = _Seq(cache.new_chain(), list(range(0, 11)))
    scheduler.add(twin)
    out = scheduler.schedule()  # c is admitted before the twin (max_num_seqs=2: b runs, one slot)
    assert out.scheduled == [(b, 1), (c, 10)] and out.admitted == [c] and out.matched == [(c, 0)]
    assert out.num_evicted_pages == 0 and not out.preempted
    scheduler.free(b)
    scheduler.free(c)
    out = scheduler.schedule()
    assert out.matched == [(twin, 10)] and out.scheduled == [(twin, 1)]  # ten rows came from a


def test_scheduler_preempts_the_youngest_when_pages_run_out():
    """Two decodes that each need a new page and no page free: the younger is preempted (its
    rows sealed into the prefix index, then evicted to make room), the older runs."""
    from segkv.cache import PagedKVCache
    from segkv.config import CacheConfig, KVLayout
    from segkv.scheduler import Scheduler

    cache = PagedKVCache(KVLayout(num_layers=1, num_kv_heads=1, head_dim=4),
                         CacheConfig(page_size=4, num_pages=4))
    scheduler = Scheduler(cache, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    a, b = _Seq(cache.new_chain(), list(range(8))), _Seq(cache.new_chain(), list(range(100, 108)))
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    assert out.scheduled == [(a, 8), (b, 8)] and out.ahead_ok
    for seq, n in out.scheduled:
        seq.run(n)
    a.sample(8)
    b.sample(108)
    out = scheduler.schedule()
    assert out.preempted == [b] and out.scheduled == [(a, 1)] and out.num_evicted_pages == 2
    assert list(scheduler.waiting) == [b] and scheduler.running == [a] and scheduler.num_preemptions == 1
    assert b.pending == b.tokens and not b.chain.num_rows  # recomputed when admitted again


def test_llm_generate_runs_on_its_core_and_leaves_no_pages(model_dir):
    """``LLM.generate`` adds requests to the LLM's one core and steps it: every step reaches the
    core's listeners, more prompts than the queue holds are fed in as room frees, outputs come in
    input order and equal each prompt run alone, and no page stays behind."""
    llm = LLM(model_dir, page_size=8, num_pages=600)
    batch = prompts(llm, 5)
    alone = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in batch]
    llm.core.configure(SchedulerConfig(max_waiting=2))
    seen: set[str] = set()
    llm.core.step_listeners.append(lambda touched: seen.update(r.request_id for r in touched))
    outs = llm.generate(batch, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert seen == {o.request_id for o in outs} and len(seen) == 5
    assert llm.cache.pool.pages_in_use == 0 and len(llm.core.prefix) == 0 and not llm.core.requests
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([batch[0], [5] * llm.max_model_len], GREEDY)
    assert llm.cache.pool.pages_in_use == 0 and not llm.core.requests


def test_async_engine_drives_the_llms_core_beside_generate(model_dir):
    """An AsyncEngine wraps the LLM's own core (limits from its config); ``LLM.generate`` called
    while a served request runs shares the steps, and both get the tokens they get alone."""
    import asyncio
    import threading

    from segkv.engine import AsyncEngine

    llm = LLM(model_dir, page_size=8, num_pages=600)
    served, offline = prompts(llm, 2)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want_served = llm.generate([served], long)[0].outputs[0].token_ids
    want_offline = llm.generate([offline], GREEDY)[0].outputs[0].token_ids
    engine = AsyncEngine(llm, SchedulerConfig(max_num_seqs=8))
    try:
        assert engine.core is llm.core and llm.core.config.max_num_seqs == 8
        started = threading.Event()

        async def stream() -> list[int]:
            last = None
            async for update in engine.generate(served, long):
                started.set()
                last = update
            return last.output.outputs[0].token_ids

        result: list = []
        thread = threading.Thread(target=lambda: result.append(asyncio.run(stream())))
        thread.start()
        assert started.wait(60)
        got_offline = llm.generate([offline], GREEDY)[0].outputs[0].token_ids
        thread.join(60)
        assert result == [want_served] and got_offline == want_offline
    finally:
        engine.shutdown()
    assert engine._on_step not in llm.core.step_listeners


def test_the_serving_loop_lets_other_threads_take_the_lock_between_steps(model_dir):
    """While a long request runs, a thread asking for the core's lock (stats for /health, a new
    request) gets it within a few steps: the loop gives the interpreter up after each step, where
    taking the lock again at once kept waiters out for seconds."""
    import asyncio
    import threading
    import time

    from segkv.engine import AsyncEngine

    llm = LLM(model_dir, page_size=8, num_pages=600)
    (prompt,) = prompts(llm, 1)
    engine = AsyncEngine(llm)
    try:
        started, finished = threading.Event(), threading.Event()

        async def stream() -> None:
            async for _ in engine.generate(prompt, SamplingParams(max_tokens=400, n=16, ignore_eos=True)):
                started.set()
            finished.set()

        thread = threading.Thread(target=lambda: asyncio.run(stream()))
        thread.start()
        assert started.wait(60)
        waits = []
        while not finished.is_set() and len(waits) < 20:
            steps, begin = engine.steps, time.monotonic()
            engine.stats()  # under the core's lock
            waits.append((engine.steps - steps, time.monotonic() - begin))
        thread.join(120)
        assert len(waits) == 20, "the request ended before the lock was taken 20 times"
        assert max(steps for steps, _ in waits) <= 5, waits  # steps run while one acquisition waited
    finally:
        engine.shutdown()
