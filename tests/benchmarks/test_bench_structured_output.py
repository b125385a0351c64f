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
