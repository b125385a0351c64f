"""CPU smoke test of the structured output benchmark (benchmarks/structured_output.py) on tiny
settings, through ``main`` and its JSON report. No timing is asserted, only that times are finite
and positive and that both sides generated exactly the same number of tokens."""

from __future__ import annotations

import json
import math

from benchmarks import structured_output as so


def test_report(tmp_path, capsys):
    path = tmp_path / "report.json"
    assert so.main(["--device", "cpu", "--batches", "1,3", "--max-tokens", "4", "--trials", "2",
                    "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert [c["batch"] for c in report["cases"]] == [1, 3] and report["device"].startswith("cpu")
    for case in report["cases"]:
        for side in ("free", "json_schema"):
            s = case[side]
            assert s["lengths"] == [4] and s["finish_reasons"] == ["length"]
            assert all(math.isfinite(t) and t > 0 for t in s["trials_ms"]) and len(s["trials_ms"]) == 2
            assert s["min_ms"] <= s["tpot_ms"] <= s["max_ms"]
        assert math.isfinite(case["overhead"])
    assert report["cases"][0]["compile_s"] > 0 and report["cases"][1]["compile_s"] == 0  # compiled once
    assert "| 3 |" in capsys.readouterr().out


def test_a_random_model_of_a_benchmark_shape(tmp_path, capsys):
    """``--shape``: a model directory of that shape with random weights and the default model's
    tokenizer and vocabulary, written once, then measured."""
    path = tmp_path / "report.json"
    args = ["--device", "cpu", "--shape", "llama-3.1-8b", "--preset", "tiny", "--work-dir", str(tmp_path / "m"),
            "--batches", "2", "--max-tokens", "3", "--trials", "1", "--json", str(path)]
    assert so.main(args) == 0
    made = tmp_path / "m" / "llama-3.1-8b-tiny"
    config = json.loads((made / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 8192
    assert (made / "tokenizer.json").is_file()
    stamp = (made / "model.safetensors").stat().st_mtime_ns
    report = json.loads(path.read_text())
    assert report["cases"][0]["json_schema"]["lengths"] == [3]
    assert "(llama-3.1-8b shape, random weights)" in capsys.readouterr().out
    assert so.main(args) == 0 and (made / "model.safetensors").stat().st_mtime_ns == stamp  # written once
