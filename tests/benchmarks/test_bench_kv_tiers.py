"""benchmarks/kv_tiers.py on the CPU (tiny shapes): every case runs, the report is complete, and
the disk tier's files are gone at the end."""

from __future__ import annotations

import json

from benchmarks import kv_tiers


def test_the_tiers_benchmark_runs_every_case(tmp_path):
    out = tmp_path / "tiers.json"
    assert kv_tiers.main(["--preset", "tiny", "--device", "cpu", "--history", "400", "--follow-up", "4",
                          "--runs", "1", "--page-size", "16", "--disk-dir", str(tmp_path / "disk"),
                          "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["cases"]) == {"resident", "host", "disk", "recompute"}
    assert all(case["median_ms"] > 0 for case in report["cases"].values())
    assert report["history_bytes"] > 0
    assert report["bring_back_GBps"] > 0 and report["recompute_over_host"] > 0
    assert not list((tmp_path / "disk").iterdir())  # the disk tier's files went with their segment
