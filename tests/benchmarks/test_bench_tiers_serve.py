"""benchmarks/tiers_serve.py on the CPU with a tiny model: conversations whose histories overflow
the KV pool are served from the tiers when they are on (every turn finds the whole prompt of the
turn before, tier hits, no recompute of what was offloaded) and recomputed when they are off;
every request completes."""

from __future__ import annotations

import json

import torch

from benchmarks import tiers_serve
from model_helpers import build_model_dir
from segkv.models.loader import load_model

PAGE, PAGES = 16, 48


def test_multi_turn_serving_with_tiers_on_and_off(tmp_path):
    build_model_dir(tmp_path / "model", "qwen3")
    row_bytes = load_model(tmp_path / "model").kv_layout(torch.float32).row_bytes
    out = tmp_path / "report.json"
    code = tiers_serve.main([
        "--model", str(tmp_path / "model"), "--kv-cache-memory", repr(PAGES * PAGE * row_bytes / 2**30),
        "--host-gib", "0.05", "--conversations", "8", "--turns", "3", "--input-len", "20", "--output-len", "4",
        "--server-flag", f"--device cpu --dtype float32 --page-size {PAGE} --max-model-len 512",
        "--start-timeout", "120", "--request-timeout", "120", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    off, on = report["modes"]["off"], report["modes"]["on"]
    assert off["kv_tiers"] is None and on["kv_tiers"]["stored"] > 0 and on["kv_tiers"]["host_hits"] > 0
    assert on["kv_tiers"]["recomputed_rows"] == 0
    # eight histories of three turns do not fit the pool: with tiers off, later turns lose their cache
    total_prompt = sum(t["input_tokens"] for t in on["per_turn"][1:])
    assert total_prompt > report["modes"]["on"]["kv_capacity_tokens"]
    cached_off = sum(t["cached_tokens"] for t in off["per_turn"][1:])
    cached_on = sum(t["cached_tokens"] for t in on["per_turn"][1:])
    assert cached_on > cached_off, (cached_on, cached_off)
    # with the tiers every turn finds at least the whole prompt of the turn before, in pages or back
    for before, turn in zip(on["per_turn"], on["per_turn"][1:]):
        assert turn["cached_tokens"] >= before["input_tokens"], (before, turn)
    for mode in (off, on):
        assert [t["turn"] for t in mode["per_turn"]] == [1, 2, 3]
        assert all(t["completed"] == 8 and t["failed"] == 0 and t["median_ttft_ms"] > 0 for t in mode["per_turn"])
    assert "| turn |" in tiers_serve.table(report)
