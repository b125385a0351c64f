"""The follow-up-turn benchmark end to end on the CPU: tiny Qwen3, segkv and transformers, forks, tables."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from benchmarks import turns

pytest.importorskip("transformers")

PAGE = 8
NEW, GEN, FOLLOW_UPS, FORKS, RUNS = 24, 6, 2, 2, 2
FIRSTS = (96, 160)
ARGS = ["--preset", "tiny", "--device", "cpu", "--first-turns", ",".join(map(str, FIRSTS)),
        "--follow-ups", str(FOLLOW_UPS), "--new-tokens", str(NEW), "--gen-tokens", str(GEN),
        "--runs", str(RUNS), "--forks", str(FORKS), "--page-size", str(PAGE)]
SMALL = ["--preset", "tiny", "--device", "cpu", "--first-turns", "40", "--follow-ups", "1", "--new-tokens", "8",
         "--gen-tokens", "3", "--runs", "1", "--page-size", str(PAGE)]


def test_benchmark_end_to_end_on_the_cpu(tmp_path, capsys, gen):
    """One whole run (once: the checks share it, whichever xdist worker runs this)."""
    path = tmp_path / "report.json"
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    assert turns.main([*ARGS, "--seed", str(seed), "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    run = path, report, report["config"]["row_bytes"]
    check_every_turn_of_both_systems_is_measured(run)
    check_both_systems_generate_the_same_greedy_tokens(run)
    check_forks_add_only_their_own_pages(run)
    check_report_round_trips_into_the_markdown_tables(run, capsys)


def check_every_turn_of_both_systems_is_measured(run):
    _, report, row_bytes = run
    assert report["status"] == "complete"
    assert report["config"]["cuda_graphs_requested"] is None  # CPU: graphs are never asked for
    assert row_bytes == 2 * 2 * 2 * 32 * 4  # layers x (K, V) x KV heads x head_dim x fp32
    records = report["turns"]
    bytes_per_page = report["config"]["pool_bytes"] // report["config"]["num_pages"]
    assert len(records) == 2 * len(FIRSTS) * RUNS * (1 + FOLLOW_UPS)
    seen = {(t["system"], t["first_turn"], t["run"], t["turn"]) for t in records}
    assert seen == {(s, f, r, k) for s in ("segkv", "hf") for f in FIRSTS for r in range(RUNS)
                    for k in range(1 + FOLLOW_UPS)}
    for t in records:
        for key in ("ttft_s", "decode_s", "decode_tok_s"):
            assert math.isfinite(t[key]) and t[key] > 0, (key, t)
        assert t["generated"] == GEN and t["peak_above_start"] is None  # no peak on the CPU
        first = t["turn"] == 0
        assert t["new_tokens"] == (t["first_turn"] if first else NEW + 1)  # + the last reply token
        assert t["rows_added"] == t["new_tokens"] + GEN - 1  # the last sampled token has no row yet
        assert t["new_turn_kv_bytes"] == t["rows_added"] * row_bytes
        if t["system"] == "hf":  # the DynamicCache keeps exactly the new rows
            assert t["kv_bytes_added"] == t["new_turn_kv_bytes"]
        else:  # each turn's rows start a fresh tail: whole pages of its own (a compaction may follow)
            assert t["pages_added_before_seal"] == -(-t["rows_added"] // PAGE)
            assert t["kv_bytes_added"] == t["pages_added"] * bytes_per_page
    histories = {}
    for t in records:
        histories.setdefault((t["first_turn"], t["run"], t["turn"]), set()).add(t["history_rows"])
    assert all(len(h) == 1 for h in histories.values())  # both systems hold the same rows each turn


def check_both_systems_generate_the_same_greedy_tokens(run):
    _, report, _ = run
    agreement = report["summary"]["token_agreement"]
    assert agreement["turns"] == len(FIRSTS) * RUNS * (1 + FOLLOW_UPS) + FORKS
    assert agreement["equal_fraction"] >= 0.9, agreement  # same weights, fp32: a tie at most may differ


def check_forks_add_only_their_own_pages(run):
    _, report, row_bytes = run
    forks = {(f["system"], f["fork"]): f for f in report["forks"]}
    assert set(forks) == {(s, i) for s in ("segkv", "hf") for i in range(FORKS)}
    history = max(FIRSTS) + GEN - 1
    for i in range(FORKS):
        mine, base = forks["segkv", i], forks["hf", i]
        assert mine["history_rows"] == base["history_rows"] == history
        assert mine["rows_added"] == base["rows_added"] == NEW + GEN
        assert mine["fork_pages"] == 0 and mine["fork_bytes"] == 0 and mine["bytes_copied"] == 0
        assert mine["pages_added"] == mine["expected_pages"] == -(-(NEW + GEN) // PAGE)
        assert base["fork_bytes"] == history * row_bytes  # the baseline copies the whole history
        assert math.isfinite(mine["ttft_s"]) and mine["ttft_s"] > 0
    assert report["summary"]["forks"]["segkv"]["only_own_pages"] is True
    assert report["fork_history"]["segkv"]["rows_added"] == history


def check_report_round_trips_into_the_markdown_tables(run, capsys):
    path, report, _ = run
    capsys.readouterr()
    assert turns.main(["--markdown", str(path), str(path)]) == 0  # reports merge: each row twice
    text = capsys.readouterr().out
    assert report["command"] in text and "| system | first turn | turn |" in text
    for first in FIRSTS:
        for system in ("segkv", "hf"):
            for k in range(1 + FOLLOW_UPS):
                start = f"| {system} | {first:,} | {k} |"
                row = next(line for line in text.splitlines() if line.startswith(start))
                cells = [c.strip() for c in row.strip("|").split("|")]
                ttft = [t["ttft_s"] * 1e3 for t in report["turns"]
                        if (t["system"], t["first_turn"], t["turn"]) == (system, first, k)]
                assert float(cells[5].split()[0]) == pytest.approx(statistics.median(ttft), abs=0.06)
                assert int(cells[4].replace(",", "")) == (first if k == 0 else NEW + 1)
    fork_rows = [line for line in text.splitlines() if line.startswith(("| segkv | 0 | ", "| hf | 0 | "))]
    assert len(fork_rows) == 4
    assert "only their own pages: True" in text and "greedy tokens segkv vs transformers" in text


def test_summary_tells_a_flat_workspace_from_one_that_grows_with_history():
    kv = 100 * turns.MIB
    records = []
    for first in (20000, 50000):
        for run in range(2):
            for k in range(1, 5):
                records.append({"system": "segkv", "first_turn": first, "run": run, "turn": k, "ttft_s": 0.1,
                                "decode_tok_s": 100.0 + k, "new_turn_kv_bytes": kv,
                                "peak_above_start": kv + 30 * turns.MIB, "tokens": [1, 2]})
                records.append({"system": "hf", "first_turn": first, "run": run, "turn": k, "ttft_s": 0.2,
                                "decode_tok_s": 50.0 * (1 + 0.1 * k), "new_turn_kv_bytes": kv,
                                "peak_above_start": kv + first * 10_000 + k * turns.MIB, "tokens": [1, 3]})
    summary = turns.summarize(records, [])
    segkv, hf = summary["systems"]["segkv"], summary["systems"]["hf"]
    assert segkv["workspace_growth_bytes"] == 0 and segkv["workspace_independent_of_history"] is True
    assert segkv["fixed_workspace_bytes"] == pytest.approx(30 * turns.MIB - 0.1 * kv)
    assert segkv["by_first_turn"]["20000"]["tok_s_spread"] == pytest.approx(3 / 102.5)
    assert segkv["tok_s_spread_within_10pct"] is True
    assert hf["workspace_growth_bytes"] == 30000 * 10_000 and hf["workspace_independent_of_history"] is False
    assert hf["tok_s_spread_within_10pct"] is False  # 55 .. 70 tok/s
    assert summary["token_agreement"] == {"turns": 16, "identical_turns": 0, "equal_fraction": 0.5}
    assert any("growth with history" in line for line in turns.summary_lines(summary))


def test_stop_after_leaves_a_report_of_what_finished(tmp_path):
    path = tmp_path / "stopped.json"
    assert turns.main([*SMALL, "--skip-hf", "--stop-after-s", "0", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["status"] == turns.STOPPED and report["turns"] == [] and report["forks"] == []
    assert "segkv" in report["warmup_s"] and report["config"]["hf_attn"] is None


def test_a_failing_system_is_reported_and_the_other_still_measured(tmp_path, monkeypatch):
    def fail(self, *args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(turns.HfSystem, "turn", fail)
    path = tmp_path / "errors.json"
    assert turns.main([*SMALL, "--forks", "1", "--json", str(path)]) == 1
    report = json.loads(path.read_text())
    assert report["status"] == "complete with errors"
    assert report["errors"] == [{"system": "hf", "part": "warmup",
                                 "error": "RuntimeError: CUDA out of memory (simulated)"}]
    assert {t["system"] for t in report["turns"]} == {"segkv"} and len(report["turns"]) == 2
    assert [f["system"] for f in report["forks"]] == ["segkv"]


def test_the_runner_is_asked_for_cuda_graphs_in_its_own_spelling(monkeypatch):
    class ModeRunner:  # cuda_graphs names a mode
        def __init__(self, model, cache, *, device, prefill_chunk=512, cuda_graphs="off"):
            if cuda_graphs not in ("off", "auto"):
                raise ValueError(f"cuda_graphs must be 'off' or 'auto', got {cuda_graphs!r}")
            self.graphs = object() if cuda_graphs == "auto" else None

    class OptionalModeRunner(ModeRunner):  # a mode again, but the default gives no hint
        def __init__(self, model, cache, *, device, prefill_chunk=512, cuda_graphs=None):
            super().__init__(model, cache, device=device, prefill_chunk=prefill_chunk,
                             cuda_graphs=cuda_graphs or "off")

    class FlagRunner:
        def __init__(self, model, cache, *, device, prefill_chunk=512, cuda_graphs=False):
            self.graphs = object() if cuda_graphs is True else None

    class PlainRunner:
        def __init__(self, model, cache, *, device, prefill_chunk=512):
            self.graphs = None

    cuda = torch.device("cuda")
    cases = [(ModeRunner, "auto"), (OptionalModeRunner, "auto"), (FlagRunner, True), (PlainRunner, None)]
    for cls, value in cases:
        monkeypatch.setattr(turns, "ModelRunner", cls)
        runner, passed = turns.make_runner(None, None, cuda, 512, graphs=True)
        assert passed == value and (runner.graphs is not None) == (value is not None), cls.__name__
        assert "asked for" in turns.graph_words(passed, runner) or value is None
        runner, passed = turns.make_runner(None, None, cuda, 512, graphs=False)
        assert passed is None and runner.graphs is None and turns.graph_words(passed, runner) == "off"
