"""Smoke test of the serving benchmark (segkv/bench/serve.py) against a live tiny server."""

from __future__ import annotations

import asyncio
import json

import pytest

from model_helpers import build_model_dir
from server_helpers import live_server
from segkv.bench.serve import BenchConfig, main, run_benchmark
from segkv.engine import LLM, AsyncEngine
from segkv.server.app import create_app

TINY = dict(num_prompts=4, max_concurrency=2, input_len=8, output_len=4, num_warmups=1)


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bench-serve-model")
    build_model_dir(directory, "qwen3")
    engine = AsyncEngine(LLM(directory, page_size=8, num_pages=600))
    with live_server(create_app(engine, model_name="m")) as base:
        yield base
    engine.shutdown()


def run(base_url: str, **kw) -> dict:
    return asyncio.run(run_benchmark(BenchConfig(base_url=base_url, **{**TINY, **kw})))


def check_section(section: dict, count: int, output_len: int = 4) -> None:
    """Every request succeeded and the latencies are positive and consistent."""
    assert section["completed"] == count and section["failed"] == 0
    assert section["total_output_tokens"] == count * output_len
    assert section["total_input_tokens"] > 0
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < section[f"min_{name}_ms"] <= section[f"median_{name}_ms"] <= section[f"max_{name}_ms"]
        assert section[f"min_{name}_ms"] <= section[f"mean_{name}_ms"] <= section[f"max_{name}_ms"]
        assert section[f"median_{name}_ms"] <= section[f"p99_{name}_ms"] <= section[f"max_{name}_ms"]
    assert section["max_ttft_ms"] <= section["max_e2el_ms"]


def check_requests(result: dict, count: int) -> None:
    assert result["num_requests"] == count and not any(result["errors"])
    assert result["output_lens"] == [4] * count and result["usage_missing"] == 0
    for ttft, e2el, itl in zip(result["ttfts"], result["e2els"], result["itls"]):
        assert 0 < ttft <= e2el and len(itl) <= 3 and all(g >= 0 for g in itl)
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    assert result["total_token_throughput"] > result["output_throughput"]
    assert result["duration"] * 1000 >= result["max_e2el_ms"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_single(base_url, endpoint):
    result = run(base_url, workload="single", endpoint=endpoint, request_rate=50.0, seed=1)
    assert result["model_id"] == "m" and result["request_rate"] == 50.0
    check_section(result, 4)
    check_requests(result, 4)


def test_multi_turn_reuses_the_cached_history(base_url):
    result = run(base_url, workload="multi-turn", turns=2)
    check_section(result, 8)
    check_requests(result, 8)
    first, second = result["per_turn"]
    check_section(first, 4)
    check_section(second, 4)
    assert second["total_input_tokens"] > first["total_input_tokens"]  # the history is resent
    assert second["total_cached_tokens"] > 0
    cached = [c for c, t in zip(result["cached_lens"], result["turn_indices"]) if t == 2]
    assert all(c > 0 for c in cached)


def test_fork_reports_fork_ttfts(base_url):
    result = run(base_url, workload="fork", forks=2, input_len=24)
    check_section(result, 4 * 3)
    check_requests(result, 4 * 3)
    check_section(result["first_turn"], 4)
    fork = result["fork"]
    check_section(fork, 8)
    assert fork["total_cached_tokens"] > 0  # forks reuse the parent's pages
    assert 0 < fork["min_fork_create_ms"] <= fork["max_fork_create_ms"]
    assert result["groups"].count("fork") == 8


def test_main_writes_result_json(base_url, tmp_path, capsys):
    path = tmp_path / "result.json"
    code = main(["--base-url", base_url, "--workload", "single", "--num-prompts", "3",
                 "--max-concurrency", "2", "--input-len", "8", "--output-len", "4",
                 "--result-json", str(path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Mean TTFT (ms):" in out
    result = json.loads(path.read_text())
    for key in ("completed", "failed", "duration", "request_throughput", "output_throughput",
                "total_token_throughput", "total_input_tokens", "total_output_tokens", "total_cached_tokens",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms",
                "mean_e2el_ms", "ttfts", "itls", "errors"):
        assert key in result
    assert result["completed"] == 3 and result["request_rate"] == "inf" and result["model_id"] == "m"


def test_main_fails_cleanly_without_a_server():
    assert main(["--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--timeout", "5"]) == 1
