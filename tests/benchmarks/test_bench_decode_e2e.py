"""CPU checks of the model decode benchmark (benchmarks/decode_e2e.py): the published shapes,
the bandwidth limit against hand computations, the whole pipeline on tiny shapes (segkv alone,
the CUDA-graph code path emulated, a Hugging Face eager comparison on shared weights), memory
skips, the deadline and resuming, and the markdown table. Only the CUDA timing (events, graph
capture, torch.compile) is left to the GPU run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import decode_e2e as e2e
from benchmarks.hf_baseline import hf_tensor
from segkv.models.registry import model_class
from settings_helpers import setenv

CPU = torch.device("cpu")


def _run(tmp_path, name: str, *args: str) -> dict:
    path = tmp_path / f"{name}.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--steps", "5", "--trials", "3", "--json", str(path)]
    assert e2e.main([*argv, *args]) == 0
    return json.loads(path.read_text())


def _cases(report: dict) -> dict:
    return {(c["model"], c["batch"], c["context"]): c for c in report["cases"]}


def test_models_have_the_published_parameter_counts():
    published = {"llama-3.1-8b": 8_030_261_248, "qwen3-8b": 8_190_735_360, "qwen3-32b": 32_762_123_264,
                 "deepseek-v2-lite": 15_706_484_224}
    for name, count in published.items():
        cfg = e2e.model_config(name)
        with torch.device("meta"):
            model = model_class(cfg).from_hf_config(cfg)
        assert sum(p.numel() for p in model.parameters()) == count, name
    assert e2e.model_config("deepseek-v2-lite")["rope_scaling"]["factor"] == 40
    with pytest.raises(ValueError):
        e2e.model_config("gpt2")


def test_expected_distinct_experts():
    assert e2e.expected_distinct_experts(64, 6, 1) == pytest.approx(6)
    assert e2e.expected_distinct_experts(64, 6, 32) == pytest.approx(64 * (1 - (58 / 64) ** 32))
    assert e2e.expected_distinct_experts(8, 8, 3) == pytest.approx(8)


def test_limit_equals_hand_computation():
    bw = 1e9
    llama, _ = e2e.build_segkv(e2e.model_config("llama-3.1-8b", "tiny"), device=CPU, dtype=torch.bfloat16)
    # per layer q 64x64, k and v 64x32, o 64x64, gate/up/down 3x64x128, two norms; final norm;
    # lm_head 320x64; the embedding table is not read. bf16.
    weights = (2 * (4096 + 2048 + 2048 + 4096 + 3 * 64 * 128 + 128) + 64 + 320 * 64) * 2
    kv = 2 * 100 * (2 * 2 * 2 * 16 * 2)  # batch 2 x context 100 x (layers x K,V x heads x dim x bf16)
    limit = e2e.case_limit(llama, batch=2, context=100, dtype=torch.bfloat16, bandwidth=bw)
    assert limit["weight_bytes"] == weights == 189056 and limit["kv_bytes"] == kv
    assert limit["tokens_per_s"] == pytest.approx(2 * bw / (weights + kv))

    ds, _ = e2e.build_segkv(e2e.model_config("deepseek-v2-lite", "tiny"), device=CPU, dtype=torch.bfloat16)
    attention = 64 * 4 * 24 + 64 * 40 + 32 + 32 * 4 * 32 + 64 * 64  # q, kv_a, kv_a norm, kv_b, o
    dense = (attention + 128 + 3 * 64 * 96) * 2  # layer 0: attention, norms, dense MLP (bf16)
    moe_fixed = dense + 8 * 64 * 4  # the same plus the float32 router; shared experts 2 x 48 = 96 wide
    expert = 3 * 64 * 48 * 2
    head = (64 + 320 * 64) * 2
    for batch, distinct in ((1, 2), (3, 8 * (1 - (6 / 8) ** 3))):
        limit = e2e.case_limit(ds, batch=batch, context=50, dtype=torch.bfloat16, bandwidth=bw)
        assert limit["weight_bytes"] == pytest.approx(dense + 2 * (moe_fixed + distinct * expert) + head)
        assert limit["kv_bytes"] == batch * 50 * 3 * (32 + 8) * 2
        assert limit["expected_distinct_experts"] == pytest.approx(distinct)


def test_fused_expert_views():
    gate_up = torch.randn(3, 10, 6)  # (E, 2I, H) with I = 5, H = 6
    down = torch.randn(3, 6, 5)
    state, used = {"m.experts.gate_up_proj": gate_up, "m.experts.down_proj": down}, set()
    assert torch.equal(hf_tensor("m.experts.1.up_proj.weight", (5, 6), state, used), gate_up[1, 5:])
    assert torch.equal(hf_tensor("m.experts.2.down_proj.weight", (6, 5), state, used), down[2])
    transposed = {"m.experts.gate_up_proj": gate_up.transpose(1, 2).contiguous(),  # (E, H, 2I)
                  "m.experts.down_proj": down.transpose(1, 2).contiguous()}
    gate = hf_tensor("m.experts.0.gate_proj.weight", (5, 6), transposed, used)
    assert torch.equal(gate, gate_up[0, :5])
    assert torch.equal(hf_tensor("m.experts.0.down_proj.weight", (6, 5), transposed, used), down[0])
    assert used == {"m.experts.gate_up_proj", "m.experts.down_proj"}
    with pytest.raises(ValueError, match="no Hugging Face tensor"):
        hf_tensor("m.other.weight", (2, 2), state, used)


def test_pipeline_segkv_alone(tmp_path, monkeypatch):
    setenv(monkeypatch, "SEGKV_LOOKAHEAD", "1")  # as on a GPU: the engine's loop both ways, steps ahead first
    report = _run(tmp_path, "segkv", "--skip-hf", "--batches", "1,2", "--contexts", "40,100")
    cases = _cases(report)
    assert len(cases) == 16 and not report["not_run"] and not report["stopped_early"]
    for key, case in cases.items():
        s = case["segkv"]
        assert math.isfinite(s["tokens_per_s"]) and s["tokens_per_s"] > 0, key
        assert s["min"] <= s["tokens_per_s"] <= s["max"] and len(s["trials"]) == 3
        assert s["tokens_equal_eager"] and not s["cuda_graphs"]
        # every step but the first of each trial came from a step launched ahead (GQA and MLA/MoE)
        assert s["lookahead"] and s["steps_ahead_used"] == 3 * (report["steps"] - 1), key
        assert len(s["step_by_step"]["trials"]) == 3
        # the whole runs' rates (set-up and first steps included) beside the rate past the first steps
        for part in (s, s["step_by_step"]):
            whole = part["whole_run"]
            assert len(whole["trials"]) == 3 and all(math.isfinite(r) and r > 0 for r in whole["trials"]), key
        assert case["ratio"] == pytest.approx(s["tokens_per_s"] / case["limit"]["tokens_per_s"])
        assert case["hf"] == {} and case["speedup"] == {}
    bw = report["bandwidth_bytes_per_s"]
    assert bw > 0
    limit = cases[("llama-3.1-8b", 2, 100)]["limit"]
    assert limit["tokens_per_s"] == pytest.approx(2 * bw / (189056 + 2 * 100 * 256))
    # one token per layer routes to exactly top-k = 2 distinct experts
    assert cases[("deepseek-v2-lite", 1, 40)]["segkv"]["distinct_experts_measured"] == 2
    assert 2 <= cases[("deepseek-v2-lite", 2, 40)]["segkv"]["distinct_experts_measured"] <= 4
    assert report["models"]["qwen3-32b"]["params"] > 0


def test_fp8_weights_and_fp8_kv_cache(tmp_path):
    """``--quantization fp8 --kv-cache-dtype fp8``: the projections FP8 (their bytes in the limit),
    the KV rows one byte an element, decode equal to the eager reference; no Hugging Face side."""
    plain = _run(tmp_path, "plain", "--skip-hf", "--models", "llama-3.1-8b,deepseek-v2-lite", "--batches", "2",
                 "--contexts", "40")
    fp8 = _run(tmp_path, "fp8", "--models", "llama-3.1-8b,deepseek-v2-lite", "--batches", "2", "--contexts", "40",
               "--quantization", "fp8", "--kv-cache-dtype", "fp8")
    assert fp8["args"]["skip_hf"] and fp8["args"]["kv_cache_dtype"] == "fp8"
    for name in ("llama-3.1-8b", "deepseek-v2-lite"):
        info, before = fp8["models"][name], plain["models"][name]
        assert info["fp8_layers"] >= 7 and info["weight_bytes_all"] < before["weight_bytes_all"]
        assert 2 * info["kv_row_bytes"] == before["kv_row_bytes"]  # bfloat16 rows (the default) against e4m3
        a, b = _cases(fp8)[(name, 2, 40)], _cases(plain)[(name, 2, 40)]
        assert a["segkv"]["tokens_equal_eager"] and a["segkv"]["tokens_per_s"] > 0
        assert a["limit"]["weight_bytes"] < b["limit"]["weight_bytes"]
        assert 2 * a["limit"]["kv_bytes"] == b["limit"]["kv_bytes"] > 0


def test_pipeline_with_hugging_face(tmp_path, capsys):
    report = _run(tmp_path, "hf", "--models", "qwen3-8b,deepseek-v2-lite", "--batches", "1,2",
                  "--contexts", "32", "--dtype", "float32", "--init-std", "0.2",
                  "--hf-variants", "eager,compiled", "--hf-max-prompt-tokens", "40")
    cases = _cases(report)
    for name in ("qwen3-8b", "deepseek-v2-lite"):
        parity = report["models"][name]["parity"]
        assert parity["rel_err"] < 1e-4 and parity["argmax_agree"] == 1.0  # the same weights, shared
        assert report["models"][name]["copied_bytes"] == 0  # float32: even the routers are HF's tensors
        one = cases[(name, 1, 32)]
        eager = one["hf"]["eager"]
        assert math.isfinite(eager["tokens_per_s"]) and eager["tokens_per_s"] > 0
        assert len(eager["trials"]) == 3 and len(eager["skipped_forwards_s"]) == 3
        assert one["speedup"]["eager"] == pytest.approx(one["segkv"]["tokens_per_s"] / eager["tokens_per_s"])
        assert "CUDA only" in one["hf"]["compiled"]["skipped"]
        assert "prompt of 2 x 32 tokens" in cases[(name, 2, 32)]["hf"]["eager"]["skipped"]
    out = capsys.readouterr().out
    assert "qwen3-8b B=1 ctx=32 graphs=off segkv" in out and "| hf eager" in out


def test_memory_skip_deadline_resume_and_markdown(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(e2e, "free_memory_bytes", lambda device: 1 << 20)
    args = ["--skip-hf", "--models", "llama-3.1-8b", "--batches", "1", "--contexts", "40,5000", "--dtype",
            "float32", "--reserve-gib", "0", "--trials", "1", "--warmup", "1"]
    report = _run(tmp_path, "skip", *args, "--stop-after-s", "0")
    assert report["stopped_early"] and report["cases"] == []
    assert report["not_run"] == [["llama-3.1-8b", 1, 40], ["llama-3.1-8b", 1, 5000]]

    report = _run(tmp_path, "skip", *args, "--resume", "--cuda-graphs", "emulate")
    cases = _cases(report)
    assert not report["not_run"] and not report["stopped_early"]
    ran = cases[("llama-3.1-8b", 1, 40)]["segkv"]
    assert ran["cuda_graphs"] and ran["graph_replays"] == 5 and ran["graph_fallbacks"] == 0
    assert ran["tokens_equal_eager"] and ran["tokens_per_s"] > 0
    skipped = cases[("llama-3.1-8b", 1, 5000)]["segkv"]["skipped"]
    assert skipped.startswith("KV cache + reserve") and "> free 0.0 GiB" in skipped  # 2.5 MB > 1 MiB
    assert cases[("llama-3.1-8b", 1, 5000)]["limit"]["tokens_per_s"] > 0

    capsys.readouterr()
    assert e2e.main(["--markdown", str(tmp_path / "skip.json")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("Device: cpu") and table[2].startswith("| model | batch | context | graphs |")
    rows = [line for line in table if line.startswith("| llama-3.1-8b")]
    assert len(rows) == 2
    assert rows[0].startswith("| llama-3.1-8b | 1 | 40 | on | ") and "%" in rows[0]
    assert "skipped: KV cache" in rows[1]


def test_markdown_merges_reports(tmp_path, capsys):
    limit = {"tokens_per_s": 200.0}
    ours = {"cases": [{"model": "qwen3-8b", "batch": 1, "context": 1024, "limit": limit, "status": "done",
                       "segkv": {"tokens_per_s": 180.0, "min": 170.0, "max": 185.0, "cuda_graphs": True},
                       "hf": {"eager": {"tokens_per_s": 30.0, "min": 29.0, "max": 31.0}}}],
            "device": "NVIDIA H200", "bandwidth_bytes_per_s": 4.4e12, "dtype": "bfloat16", "steps": 32,
            "trials": 3}
    compiled = {**ours, "cases": [{**ours["cases"][0], "segkv": {"skipped": "--skip-segkv"},
                                   "hf": {"compiled": {"tokens_per_s": 120.0, "min": 110.0, "max": 125.0}}}]}
    paths = []
    for name, report in (("a", ours), ("b", compiled)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(report))
    assert e2e.main(["--markdown", *map(str, paths)]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| qwen3-8b")]
    assert row == ["| qwen3-8b | 1 | 1K | on | 180 [170-185] | 200 | 90.0% | 30.0 | - | 120 | 6.00× | 1.50× |"]


def test_failed_hugging_face_build_still_measures_segkv(tmp_path, monkeypatch):
    def broken(cfg, **kwargs):
        raise RuntimeError("no such model class")

    monkeypatch.setattr(e2e, "build_hf", broken)
    report = _run(tmp_path, "nohf", "--models", "llama-3.1-8b", "--batches", "1", "--contexts", "40",
                  "--hf-variants", "eager", "--trials", "1")
    assert "no such model class" in report["models"]["llama-3.1-8b"]["hf_error"]
    case = report["cases"][0]
    assert case["segkv"]["tokens_per_s"] > 0
    assert case["hf"]["eager"]["error"].startswith("model build: RuntimeError")


def test_step_marks_time_the_steps_after_the_first(monkeypatch):
    """``StepMarks`` marks every decode step the runner launches while it is on (both entry points),
    times the span from a mark to the last, and leaves the runner's own methods after."""
    from benchmarks.decode_e2e import StepMarks

    class Runner:
        def forward(self, inputs):
            return ("forward", inputs)

        def decode_from_device(self, chains, ids):
            return ("ahead", chains, ids)

    clock = iter([10.0, 10.5, 11.0, 12.0])
    monkeypatch.setattr("benchmarks.decode_e2e.time.perf_counter", lambda: next(clock))
    runner = Runner()
    with StepMarks(runner, torch.device("cpu")) as marks:
        assert runner.forward([1]) == ("forward", [1])
        assert runner.decode_from_device(["c"], 7) == ("ahead", ["c"], 7)
        runner.decode_from_device(["c"], 8)
        runner.forward([2])
    assert marks.marks == [10.0, 10.5, 11.0, 12.0]
    assert marks.seconds(1) == pytest.approx(1.5) and marks.seconds(0) == pytest.approx(2.0)
    assert "forward" not in vars(runner) and runner.forward([3]) == ("forward", [3])
