"""The engine API on a small random Qwen3: conversations, routes, sampling, limits, snapshots."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from model_helpers import build_model_dir
from segkv.config import CompactionPolicy
from segkv.engine import LLM
from segkv.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
TURNS = ["hello there", "what is a segment?", "and a page?", "thanks, bye"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3")
    build_model_dir(directory, "qwen3")
    return directory


def make_llm(model_dir, **kw) -> LLM:
    kw.setdefault("page_size", 8)
    kw.setdefault("num_pages", 400)
    return LLM(model_dir, prefill_chunk=16, **kw)


def test_conversation_equals_rerunning_history_and_grows_by_new_pages_only(model_dir):
    llm = make_llm(model_dir, compaction=CompactionPolicy(enabled=False))
    pool = llm.cache.pool
    conv = llm.conversation(system="You are terse.")
    for text in TURNS:
        allocated = pool.pages_allocated_total
        turn = conv.say(text, GREEDY)
        stats = turn.stats
        rows_written = stats.new_tokens + stats.generated_tokens - 1  # the last token has no row yet
        assert pool.pages_allocated_total - allocated == math.ceil(rows_written / 8)
        assert stats.bytes_copied == 0
        # the same turn computed from scratch, history re-prefilled
        history = llm.tokenizer.encode_chat(conv.messages[:-1], add_generation_prompt=True)
        assert history[: stats.cached_tokens] == (conv.chain.token_ids() or [])[: stats.cached_tokens]
        fresh = llm.generate([history], GREEDY)[0].outputs[0]
        assert fresh.token_ids == turn.output.token_ids
    assert stats.cached_tokens > stats.prompt_tokens // 2  # later turns reuse the history

    allocated, in_use = pool.pages_allocated_total, pool.pages_in_use
    child = conv.fork()
    undo = conv.snapshot()
    conv.restore(undo)
    assert (pool.pages_allocated_total, pool.pages_in_use, pool.bytes_copied) == (allocated, in_use, 0)
    child.say("a branch", GREEDY)
    assert pool.pages_allocated_total > allocated  # writing is what allocates
    for c in (child, conv):
        c.release()
    undo.release()
    assert pool.pages_in_use == 0


@pytest.mark.parametrize("route", ["split", "segments"])
def test_routes_give_the_same_greedy_tokens(model_dir, route):
    outputs = {}
    for name in ("single", route):
        llm = make_llm(model_dir, route=name)
        conv = llm.conversation()
        outputs[name] = [conv.say(text, GREEDY).output.token_ids for text in TURNS[:3]]
        assert set(llm.runner.route_counts) == {name}
        if name == "split":  # the split route really split
            assert llm.runner.last_plan.num_partitions > 1
    assert outputs["single"] == outputs[route]


def test_saved_conversation_continues_identically_in_a_new_process(model_dir, tmp_path):
    llm = make_llm(model_dir)
    conv = llm.conversation(system="Be brief.")
    conv.say(TURNS[0], GREEDY)
    conv.say(TURNS[1], GREEDY)
    path = tmp_path / "conv.segkv"
    conv.save(path)
    expected = conv.say(TURNS[2], GREEDY).output.token_ids
    script = (
        "import json, sys\n"
        "from segkv.engine import LLM\n"
        "from segkv.sampling_params import SamplingParams\n"
        f"llm = LLM({str(model_dir)!r}, page_size=8, num_pages=400, prefill_chunk=16)\n"
        f"conv = llm.load_conversation({str(path)!r})\n"
        "turn = conv.say(sys.argv[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))\n"
        "print(json.dumps({'tokens': turn.output.token_ids, 'cached': turn.stats.cached_tokens}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, TURNS[2]], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"] == expected
    assert result["cached"] > 0  # the loaded history was reused, not recomputed


def test_loading_into_another_model_changes_nothing(model_dir, tmp_path):
    llm = make_llm(model_dir)
    conv = llm.conversation()
    conv.say(TURNS[0], GREEDY)
    conv.save(tmp_path / "c.segkv")
    other_dir = tmp_path / "other"
    build_model_dir(other_dir, "qwen3", seed=1)
    other = make_llm(other_dir)
    before = other.cache.stats()
    with pytest.raises(ValueError, match="different model"):
        other.load_conversation(tmp_path / "c.segkv")
    assert other.cache.stats() == before


def test_prompt_over_the_model_length_is_a_clear_error(model_dir):
    llm = make_llm(model_dir, max_model_len=64)
    with pytest.raises(ValueError, match=r"maximum context length is 64 tokens.*requested 80 tokens"):
        llm.generate([[5] * 80], GREEDY)
    assert llm.cache.pool.pages_in_use == 0
    out = llm.generate([[5] * 60], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4


def test_sampling_is_reproducible_and_n_samples_share_one_prefill(model_dir):
    llm = make_llm(model_dir)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6, seed=7, n=3, ignore_eos=True)
    prompt = "the segmented cache"
    first = llm.generate(prompt, params)[0]
    second = llm.generate(prompt, params)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1
    pool = llm.cache.pool
    base = pool.pages_allocated_total
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))
    one = pool.pages_allocated_total - base
    base = pool.pages_allocated_total
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, n=4))
    assert pool.pages_allocated_total - base == one  # forks of the prefilled prompt: no pages


def test_stops_logprobs_and_finish_reasons(model_dir):
    llm = make_llm(model_dir)
    greedy = llm.generate("abc", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3))[0]
    out = greedy.outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8
    assert len(out.logprobs) == 8 and all(len(lp.top) == 3 for lp in out.logprobs)
    assert all(lp.top[0][0] == lp.token_id for lp in out.logprobs)  # greedy takes the top token
    stop_id = out.token_ids[3]
    stopped = llm.generate("abc", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id],
                                                 ignore_eos=True))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    assert stopped.token_ids == out.token_ids[: out.token_ids.index(stop_id) + 1]
    if len(out.text.strip()) > 2:
        stop = out.text.strip()[1:3]
        by_text = llm.generate("abc", SamplingParams(temperature=0, max_tokens=8, stop=[stop],
                                                     ignore_eos=True))[0].outputs[0]
        assert by_text.finish_reason == "stop" and stop not in by_text.text
        assert out.text.startswith(by_text.text)


def test_bad_prompts_are_rejected(model_dir):
    llm = make_llm(model_dir)
    for bad in ([], [[]], [[1, "x"]], [[10**9]], 42):
        with pytest.raises(ValueError):
            llm.generate(bad, GREEDY)
    assert llm.cache.pool.pages_in_use == 0


def test_page_size_defaults_to_the_devices_measured_choice(model_dir):
    """32 rows per page on CUDA (measured faster there), 16 elsewhere; an explicit size wins."""
    from segkv.config import default_page_size

    assert (default_page_size("cuda"), default_page_size("cpu")) == (32, 16)
    assert LLM(model_dir, num_pages=8).cache.page_size == 16  # this test's device: the CPU
    assert LLM(model_dir, num_pages=8, page_size=8).cache.page_size == 8


def test_bad_devices_and_page_sizes_are_clear_errors(model_dir, monkeypatch):
    """An unknown device, a device this torch build or machine lacks, and a page size below 1
    are refused with what is wrong, before any weights load."""
    import torch

    from segkv.engine.llm import parse_device

    assert parse_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU
    for device, message in (("tpu", "unknown device 'tpu'"), ("mps", "not supported"),
                            ("cuda", "not available"), ("cuda:7", "not available")):
        with pytest.raises(ValueError, match=message):
            LLM(model_dir, device=device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert parse_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ValueError, match=r"'cuda:1' is not available: 1 GPU\(s\) visible"):
        parse_device("cuda:1")
    for size in (0, -16):
        with pytest.raises(ValueError, match=f"page_size must be >= 1, got {size}"):
            LLM(model_dir, page_size=size)
