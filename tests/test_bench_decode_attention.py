"""CPU checks of the decode attention benchmark (segkv/bench/decode_attention.py): the timing
graphs' call count, the command line's harness flags and the report's tables. The timed runs
themselves need a CUDA device."""

from __future__ import annotations

import pytest

from segkv.bench import decode_attention as bench


def _row(auto_ms: float, sdpa_ms: float) -> dict:
    timing = {"median_ms": 0.0, "min_ms": 0.0, "max_ms": 0.0, "fraction_of_bandwidth": 0.5}
    variants = {name: dict(timing, median_ms=auto_ms) for name in
                ("auto", "single", "segments2", "segments8", "segments30", "auto_segments8")}
    variants["sdpa_flash"] = dict(timing, median_ms=sdpa_ms)
    return {"shape": "llama3-8b", "batch": 1, "context": 32768, "page_size": 32, "plans": {"auto": {"route": "split", "max_partitions": 32}},
            "variants": variants}


@pytest.mark.parametrize("calls,pdl,words", [(16, False, "at least 16 calls per timing graph, attention PDL off"),
                                             (0, True, "one pass over the data copies per timing graph, "
                                                       "attention PDL on")])
def test_tables_name_the_timing_harness(calls, pdl, words):
    report = {"device": "H200", "bandwidth_bytes_per_s": 4.2e12, "dtype": "bfloat16", "trials": 5,
              "calls_per_graph": calls, "attention_pdl": pdl, "rows": [_row(0.0380, 0.0475)]}
    text = bench.markdown_tables(report)
    assert words in text
    assert "| 1.25 |" in text  # best SDPA / segkv of the one row


def test_reports_from_before_the_harness_flags_still_render():
    report = {"device": "H200", "bandwidth_bytes_per_s": 4.2e12, "dtype": "bfloat16", "trials": 5,
              "rows": [_row(0.05, 0.05)]}
    assert "one pass over the data copies per timing graph, attention PDL on" in bench.markdown_tables(report)


def test_harness_flags_are_checked_before_any_device_work(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--calls-per-graph", "-1"])
    assert exc.value.code == 2 and "--calls-per-graph must be 0 or more" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        bench.main(["--pdl", "2"])
    assert exc.value.code == 2
    assert bench.CALLS_PER_GRAPH == 0  # the default: one pass over the data copies
