"""benchmarks/tp_decode.py on the CPU (tiny 70B-family shape, gloo, emulated CUDA graphs): each
tensor-parallel size runs its ranks as processes, every case's decode steps replay graphs and are
timed against its limit, the all-reduces are timed where there are several ranks, and a rank holds
about 1/N of the weights."""

from __future__ import annotations

import json
import math

from benchmarks import tp_decode


def test_the_tensor_parallel_benchmark_runs_every_size_and_case(tmp_path):
    out = tmp_path / "tp.json"
    assert tp_decode.main(["--model", "llama-3.1-70b", "--preset", "tiny", "--device", "cpu", "--tp", "1,2",
                           "--batches", "1,2", "--contexts", "16", "--steps", "2", "--warmup", "1",
                           "--trials", "1", "--cuda-graphs", "emulate", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    sizes = {s["tp"]: s for s in report["sizes"]}
    assert set(sizes) == {1, 2}
    for size, s in sizes.items():
        assert [(c["batch"], c["context"]) for c in s["cases"]] == [(1, 16), (2, 16)]
        for case in s["cases"]:
            assert case["tokens_per_s"] > 0 and math.isfinite(case["ratio"]) and case["ratio"] > 0
            assert case["limit"]["weight_bytes"] > 0 and case["limit"]["kv_bytes"] > 0
            assert (case["all_reduce_ms_per_step"] > 0) == (size > 1)
            assert case["speedup_vs_smallest_tp"] > 0
            assert case["graph_replays"] >= 3  # every decode step (warm-up and timed) replayed its graph
    # each of 2 ranks: half the projections and vocabulary, the norms whole
    share = sizes[2]["rank_weight_bytes"] / sizes[1]["rank_weight_bytes"]
    assert 0.5 <= share < 0.55, share
    kv = [s["cases"][1]["limit"]["kv_bytes"] for s in (sizes[1], sizes[2])]
    assert kv[1] * 2 == kv[0] == 2 * 16 * 3 * 2 * 2 * 8 * 4  # batch 2 x 16 rows x 3 layers x K/V x 2 heads x 8 x fp32
