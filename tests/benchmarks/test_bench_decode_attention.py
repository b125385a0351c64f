"""CPU checks of the decode attention benchmark (benchmarks/decode_attention.py): the timing
graphs' call count, the command line's harness flags and the report's tables. The timed runs
themselves need a CUDA device."""

from __future__ import annotations

import pytest

from benchmarks import decode_attention as bench


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


def test_cascade_speedup_bound_is_the_unshared_time_over_the_distinct_bytes_at_the_copy_rate():
    # 167.8 MB at 3.01 TB/s take 55.75 us; an unshared batch of 0.378 ms allows at most 6.78x
    unique = 2 * (32768 + 16 * 512) * 8 * 128 * 2
    assert bench.cascade_speedup_bound(0.378, unique, 3.01e12) == pytest.approx(0.378e-3 * 3.01e12 / unique)
    assert 6.7 < bench.cascade_speedup_bound(0.378, unique, 3.01e12) < 6.8
    assert 9.3 < bench.cascade_speedup_bound(0.375, unique, 4.24e12) < 9.5
    for bad in ((0.378, 0, 3.0e12), (0.378, unique, 0.0)):
        with pytest.raises(ValueError, match="must be positive"):
            bench.cascade_speedup_bound(*bad)


def _cascade(with_bound: bool) -> dict:
    timing = {"min_ms": 0.0, "max_ms": 0.0}
    variants = {"cascade": dict(timing, median_ms=0.0735, fraction_of_bandwidth=0.76),
                "no_sharing": dict(timing, median_ms=0.378, fraction_of_bandwidth=0.15),
                "own_copies": dict(timing, median_ms=0.694, fraction_of_bandwidth=1.04)}
    cascade = {"shape": "llama3-8b", "forks": 16, "prefix": 32768, "suffix": 512, "page_size": 16,
               "plans": {"cascade": {"max_partitions": 33}}, "variants": variants,
               "speedup": 0.378 / 0.0735, "speedup_vs_own_copies": 0.694 / 0.0735}
    if with_bound:
        cascade |= {"unique_bytes": 167_772_160, "speedup_bound": 6.78}
    return cascade


@pytest.mark.parametrize("with_bound", [True, False])
def test_cascade_line_gives_the_bound_where_the_report_has_it(with_bound):
    report = {"device": "H100", "bandwidth_bytes_per_s": 3.01e12, "dtype": "bfloat16", "trials": 5,
              "rows": [_row(0.05, 0.05)], "cascade": _cascade(with_bound)}
    text = bench.markdown_tables(report)
    assert "no sharing 0.3780 ms, **5.1×**" in text and "own copy of the history 0.6940 ms, 9.4×." in text
    bound = "Reading its 167.8 MB of distinct K/V once at the copy rate bounds the cascade to 6.8× the unshared batch"
    assert (bound in text) == with_bound
    assert ("it runs at 76% of the copy rate." in text) == with_bound
