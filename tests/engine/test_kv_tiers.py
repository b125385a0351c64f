"""The engine over a KV pool far smaller than its histories, with the KV tiers attached: when pages
run short the scheduler moves idle cached segments to host memory (and disk) instead of dropping
them, and a request whose history is there brings it back instead of recomputing it. The tokens
are those of an engine whose pool holds everything."""

from __future__ import annotations

import random

import pytest

from model_helpers import build_model_dir
from segkv.cache.tiers import SegmentTiers
from segkv.engine import LLM
from segkv.sampling_params import SamplingParams

PAGE = 16
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3")
    build_model_dir(directory, "qwen3")
    return directory


def complete(llm: LLM, prompt: list[int]) -> list[int]:
    """One request through the engine core, its rows kept in the prefix index afterwards (as the
    server's are): the generated token ids."""
    core = llm.core
    with core.lock:
        request = core.add_request(prompt, PARAMS, cache_rows=True)
        while not request.finished:
            core.step()
    return list(request.output().outputs[0].token_ids)


def run_sessions(llm: LLM, sessions: int, turns: int, seed: int) -> dict[int, list[int]]:
    """``sessions`` token-id conversations taking ``turns`` turns each in a random order (every
    turn: the history, the last reply and 20 new tokens), a fork of session 0 at the end of the
    first round; returns each session's (and the fork's, key -1) whole token history."""
    rng = random.Random(seed)
    history = {s: [rng.randrange(3, 200) for _ in range(40)] for s in range(sessions)}
    order = [s for _ in range(turns) for s in range(sessions)]
    rng.shuffle(order)
    for step, s in enumerate(order):
        prompt = history[s]
        history[s] = prompt + complete(llm, prompt) + [rng.randrange(3, 200) for _ in range(20)]
        if step == sessions:  # a fork: another continuation of session 0's history so far
            history[-1] = history[0][:-20] + [rng.randrange(3, 200) for _ in range(20)]
    history[-1] += complete(llm, history[-1])
    return history


def test_histories_larger_than_the_pool_come_back_from_the_tiers(model_dir, tmp_path):
    """50 sessions (and a fork) over a pool of 12 pages, which carries more than 8 times that many
    pages of history: the tokens are the large pool's, and the prefix matches cover as many tokens
    as there (nothing the tiers held is recomputed); without tiers the same load recomputes evicted
    histories (the test's power)."""
    sessions, turns, pages = 50, 2, 12
    big = LLM(model_dir, dtype="float32", page_size=PAGE, num_pages=512)
    want = run_sessions(big, sessions, turns, seed=7)
    assert sum(len(h) for h in want.values()) > 8 * pages * PAGE  # 8N pages of history over N
    hits = big.core.prefix.stats()["num_hit_tokens"]

    llm = LLM(model_dir, dtype="float32", page_size=PAGE, num_pages=pages)
    row_bytes = llm.cache.layout.row_bytes
    tiers = SegmentTiers(host_bytes=6 * pages * PAGE * row_bytes, disk_dir=tmp_path,
                         disk_bytes=64 * pages * PAGE * row_bytes)
    llm.cache.attach_tiers(tiers)
    assert run_sessions(llm, sessions, turns, seed=7) == want
    stats = tiers.stats()
    assert stats["stored"] > 0 and stats["host_hits"] > 0 and stats["disk_hits"] > 0, stats
    assert stats["spilled_to_disk"] > 0 and stats["corrupt"] == stats["misses"] == 0, stats
    assert llm.core.scheduler.num_tier_recomputed_rows == 0
    assert llm.core.prefix.stats()["num_hit_tokens"] == hits  # every cached history came back
    llm.core.prefix.clear()
    assert llm.cache.pool.pages_in_use == 0  # nothing leaked, on the pool or in the tiers
    assert tiers.stats()["host_segments"] == tiers.stats()["disk_segments"] == 0

    plain = LLM(model_dir, dtype="float32", page_size=PAGE, num_pages=pages)
    assert run_sessions(plain, sessions, turns, seed=7) == want
    assert plain.core.prefix.stats()["num_hit_tokens"] < hits - sessions * PAGE


def test_the_engine_and_the_command_line_take_the_tiers(model_dir, tmp_path):
    from segkv.cli import build_parser

    llm = LLM(model_dir, dtype="float32", num_pages=32, kv_offload_host_gib=0.5, kv_offload_dir=tmp_path / "kv",
              kv_offload_disk_gib=2)
    tiers = llm.cache.tiers
    assert tiers.host_capacity == 1 << 29 and tiers.disk_capacity == 2 << 30 and (tmp_path / "kv").is_dir()
    assert LLM(model_dir, dtype="float32", num_pages=32).cache.tiers is None  # off by default
    for kwargs, message in (({"kv_offload_dir": tmp_path}, "needs kv_offload_disk_gib"),
                            ({"kv_offload_disk_gib": 1}, "needs kv_offload_dir"),
                            ({"kv_offload_host_gib": -1}, ">= 0")):
        with pytest.raises(ValueError, match=message):
            LLM(model_dir, dtype="float32", num_pages=32, **kwargs)
    args = build_parser().parse_args(["serve", "--kv-offload-host-gib", "4", "--kv-offload-dir", str(tmp_path),
                                      "--kv-offload-disk-gib", "100"])
    assert (args.kv_offload_host_gib, args.kv_offload_dir, args.kv_offload_disk_gib) == (4.0, str(tmp_path), 100.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-offload-host-gib", "-1"])


def test_the_server_shows_the_tiers_in_health_and_metrics(model_dir, tmp_path):
    """Completions over a pool smaller than their histories, through the server: the replies are
    those of a large pool, and /health and /metrics count the segments that went to the tiers
    and came back."""
    import httpx

    from server_helpers import live_server
    from segkv.engine import AsyncEngine
    from segkv.server.app import create_app

    big = LLM(model_dir, dtype="float32", page_size=PAGE, num_pages=512)
    llm = LLM(model_dir, dtype="float32", page_size=PAGE, num_pages=24, kv_offload_host_gib=0.01)
    engine = AsyncEngine(llm)
    rng = random.Random(3)
    words = "the of and to in is was for on that with as by at from his her an were are which".split()
    texts = {s: " ".join(rng.choice(words) for _ in range(30)) for s in range(6)}
    try:
        with live_server(create_app(engine, model_name="tiny")) as base:
            for _ in range(3):
                for s in range(6):
                    body = {"model": "tiny", "prompt": texts[s], "max_tokens": 4, "temperature": 0,
                            "ignore_eos": True}
                    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
                    assert "choices" in reply, reply
                    want = big.generate([texts[s]], PARAMS)[0].outputs[0].text
                    assert reply["choices"][0]["text"] == want
                    texts[s] += reply["choices"][0]["text"] + " " + " ".join(rng.choice(words) for _ in range(8))
            tiers = httpx.get(f"{base}/health").json()["kv_tiers"]
            assert tiers["stored"] > 0 and tiers["host_hits"] > 0 and tiers["recomputed_rows"] == 0, tiers
            metrics = httpx.get(f"{base}/metrics").text
            hits = [line for line in metrics.splitlines() if line.startswith("segkv:kv_tier_hits_total{")
                    and 'tier="host"' in line]
            assert hits and float(hits[0].rsplit(" ", 1)[1]) == tiers["host_hits"]
            assert "segkv:kv_tier_bytes{" in metrics
            took = [line for line in metrics.splitlines() if line.startswith("segkv:kv_tier_transfer_seconds_total{")
                    and 'direction="from_host"' in line]
            assert took and float(took[0].rsplit(" ", 1)[1]) > 0 and tiers["from_host_bytes_per_s"] > 0
    finally:
        engine.shutdown()
    assert httpx.get is not None


def test_a_conversation_brings_its_history_back_or_recomputes_it(model_dir):
    """The offline conversation API: a history moved to the tiers comes back for the next turn; a
    lost copy is recomputed; the tokens are those of a conversation that kept its pages."""
    from segkv.cache.tiers import offload

    turn = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = LLM(model_dir, dtype="float32", page_size=PAGE, num_pages=64).conversation()
    want = [plain.say(text, turn).output.token_ids for text in ("hello there", "and more", "once more")]
    llm = LLM(model_dir, dtype="float32", page_size=PAGE, num_pages=64, kv_offload_host_gib=0.01)
    conv = llm.conversation()
    got = [conv.say("hello there", turn).output.token_ids]
    assert all(offload(llm.cache, ref.segment) for ref in conv.chain.refs)
    got.append(conv.say("and more", turn).output.token_ids)
    assert conv.last_stats.cached_tokens > 0 and llm.cache.tiers.stats()["host_hits"] > 0
    for ref in conv.chain.refs:
        offload(llm.cache, ref.segment)
        llm.cache.tiers.discard(ref.segment.segment_id)  # the copy is lost: these rows are recomputed
    got.append(conv.say("once more", turn).output.token_ids)
    assert conv.last_stats.cached_tokens == 0  # recomputed from the first lost segment on
    assert got == want


@pytest.mark.parametrize("shared,num_pages", [(20, 16), (40, 18), (40, 24)])
def test_requests_sharing_the_first_rows_of_a_cached_history_under_pressure(shared, num_pages, model_dir):
    """Requests that all start with the first rows of a cached history, admitted together into a
    nearly full pool: the history may leave its pages only if the copies of those first rows
    (one per request) fit the free pages and free more than they take; the step never asks
    for pages that are not there, and the replies are those of a large pool."""
    rng = random.Random(11)
    history = [rng.randrange(3, 200) for _ in range(110)]
    prompts = [history[:shared] + [rng.randrange(3, 200) for _ in range(50)] for _ in range(6)]
    big = LLM(model_dir, dtype="float32", page_size=PAGE, num_pages=512)
    small = LLM(model_dir, dtype="float32", page_size=PAGE, num_pages=num_pages, kv_offload_host_gib=0.01,
                max_model_len=160)
    complete(small, history)
    core = small.core
    with core.lock:
        requests = [core.add_request(p, PARAMS, cache_rows=True) for p in prompts]
        while not all(r.finished for r in requests):
            core.step()
    got = [list(r.output().outputs[0].token_ids) for r in requests]
    assert got == [complete(big, p) for p in prompts]
    assert core.scheduler.num_tier_recomputed_rows == 0


class SlowCopy:
    """Stands in for a GPU copy's CUDA events: complete after ``queries`` polls; ``waited``: a
    wait for it came before it was complete."""

    def __init__(self, queries: int) -> None:
        self.left, self.waited = queries, False

    def query(self) -> bool:
        self.left -= 1
        return self.left < 0

    def synchronize(self) -> None:
        self.waited |= self.left >= 0
        self.left = -1

    def elapsed_time(self, end) -> float:
        return 1.0


@pytest.fixture
def slow_copies(monkeypatch) -> list[SlowCopy]:
    """Every copy back the scheduler starts runs on, as a GPU's would, until polled 3 times: the
    list of their stand-in events."""
    import segkv.scheduler.scheduler as scheduler_module

    start, copies = scheduler_module.start_bring_back, []

    def slow_start(cache, segment):
        arrival = start(cache, segment)
        if arrival is not None:
            arrival.ready = arrival.started = SlowCopy(queries=3)
            copies.append(arrival.ready)
        return arrival

    monkeypatch.setattr(scheduler_module, "start_bring_back", slow_start)
    return copies


@pytest.mark.parametrize("alone", [False, True])
def test_a_request_waits_for_its_rows_while_other_requests_step(alone, model_dir, slow_copies):
    """Rows coming back from the tiers on a side stream: their request joins the steps once the
    copy is complete, while other requests go on stepping without waiting for it; alone, the step
    waits for the copy. Either way, the tokens are those of a pool that held everything."""
    from segkv.cache.tiers import offload

    copies = slow_copies
    rng = random.Random(5)
    history = [rng.randrange(3, 200) for _ in range(60)]
    prompts = [history + [rng.randrange(3, 200) for _ in range(10)], [rng.randrange(3, 200) for _ in range(30)]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    big = LLM(model_dir, dtype="float32", page_size=PAGE, num_pages=256)
    llm = LLM(model_dir, dtype="float32", page_size=PAGE, num_pages=64, kv_offload_host_gib=0.01)
    complete(llm, history)
    core = llm.core
    cached = core.scheduler.prefix.segments_by_last_use()
    assert cached and all(offload(llm.cache, segment) for segment in cached)
    with core.lock:
        requests = [core.add_request(p, params, cache_rows=True) for p in prompts[:1 if alone else 2]]
        tokens_per_step = []
        while not all(r.finished for r in requests):
            core.step()
            tokens_per_step.append([len(r.output().outputs[0].token_ids) for r in requests])
    assert copies and all(copy.left < 0 or copy.waited for copy in copies)
    if alone:  # nothing else to run: the first step waited for the copy
        assert copies[0].waited and tokens_per_step[0] == [1]
    else:  # the other request stepped while the rows came back, nobody waited
        assert not any(copy.waited for copy in copies)
        assert tokens_per_step[0][0] == 0 and tokens_per_step[0][1] >= 1
        assert tokens_per_step[2][1] == 3 and tokens_per_step[-1][0] == 8
    assert requests[0].cached_tokens >= 48 and core.scheduler.num_tier_recomputed_rows == 0
    assert llm.cache.tiers.stats()["corrupt"] == 0 and not core.scheduler.arrivals
    want = [list(o.outputs[0].token_ids) for o in big.generate(prompts[:len(requests)], params)]
    assert [list(r.output().outputs[0].token_ids) for r in requests] == want


def test_a_request_aborted_while_its_rows_come_back_leaks_nothing(model_dir, slow_copies):
    """Aborted while its history is on its way back: the copy still lands (the prefix index holds
    the segment) or gives its pages back, the other request finishes with a large pool's tokens,
    and every page in use afterwards is one the prefix index holds."""
    from segkv.cache.tiers import offload

    rng = random.Random(9)
    history = [rng.randrange(3, 200) for _ in range(60)]
    prompts = [history + [rng.randrange(3, 200) for _ in range(10)], [rng.randrange(3, 200) for _ in range(30)]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(model_dir, dtype="float32", page_size=PAGE, num_pages=64, kv_offload_host_gib=0.01)
    complete(llm, history)
    core = llm.core
    assert all(offload(llm.cache, segment) for segment in core.scheduler.prefix.segments_by_last_use())
    with core.lock:
        waiting, other = (core.add_request(p, params, cache_rows=True) for p in prompts)
        core.step()
        assert core.scheduler.arrivals and not waiting.output().outputs[0].token_ids
        assert core.abort(waiting.request_id)
        while not other.finished:
            core.step()
    big = LLM(model_dir, dtype="float32", page_size=PAGE, num_pages=256)
    assert list(other.output().outputs[0].token_ids) == big.generate([prompts[1]], params)[0].outputs[0].token_ids
    assert not core.scheduler.arrivals and core.pages_of_requests() == 0
    assert llm.cache.pool.pages_in_use == core.scheduler.prefix.num_pages_held_only()
    assert llm.cache.tiers.stats()["corrupt"] == 0
