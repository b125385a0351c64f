"""CPU smoke test of the speculative decoding benchmark (benchmarks/spec_decode.py) on tiny
settings: the end-to-end cases (default model, n-gram drafts, both workloads) and the verify-step
cost on tiny shapes, through ``main`` and its JSON report, then the markdown tables. No timing
is asserted, only that times are finite and positive."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from benchmarks import spec_decode as sd


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("spec") / "report.json"
    argv = ["--device", "cpu", "--cases", "default:ngram,default-mla:mtp", "--ks", "1,2", "--batches", "1",
            "--prompts", "1", "--prompt-tokens", "48", "--max-tokens", "8", "--trials", "2",
            "--preset", "tiny", "--verify-models", "llama-3.1-8b,deepseek-v2-lite", "--verify-batches", "2",
            "--contexts", "40", "--verify-steps", "2", "--verify-trials", "1", "--verify-warmup", "1",
            "--json", str(path)]
    assert sd.main(argv) == 0  # 1: speculative greedy tokens differed from the plain ones
    return json.loads(path.read_text())


def _positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def test_end_to_end_cases(report):
    cases = report["e2e"]["cases"]
    assert {(c["model"], c["method"], c["k"], c["workload"], c["batch"], c["temperature"]) for c in cases} == {
        (model, method, k, w, 1, 0.0) for model, method in (("default", "ngram"), ("default-mla", "mtp"))
        for k in (1, 2) for w in ("heldout", "repeat")}
    assert report["greedy_tokens_equal"] is True
    for c in cases:
        assert "skipped" not in c
        assert c["tokens_equal"] is True
        assert c["prompts"] == 1 and c["max_tokens"] == 8
        for side in ("plain", "speculative"):
            assert len(c[side]["trials"]) == 2
            assert all(_positive(r) for r in c[side]["trials"])
            assert c[side]["min"] <= c[side]["tokens_per_s"] <= c[side]["max"]
        assert c["speedup"] == pytest.approx(c["speculative"]["tokens_per_s"] / c["plain"]["tokens_per_s"])
        st = c["stats"]
        assert c["generated_tokens"] == 2 * 1 * 8  # trials x prompts x max_tokens (EOS ignored)
        assert c["tokens_per_forward"] == pytest.approx(16 / (16 - st["accepted_tokens"]))
        assert 1 <= c["tokens_per_forward"] <= 1 + c["k"]
        assert len(st["accepted_per_position"]) == c["k"]
        assert 0 <= st["accepted_tokens"] <= st["draft_tokens"] <= c["k"] * st["drafts"]
        if st["drafts"]:
            assert all(0 <= a <= 1 for a in st["acceptance_per_position"])
            assert 0 <= st["acceptance_rate"] <= 1
            assert 1 <= st["mean_accepted_length"] <= 1 + c["k"]
        else:
            assert st["acceptance_per_position"] is None and st["mean_accepted_length"] is None
    heldout = next(c for c in cases if c["workload"] == "heldout")
    assert heldout["prompt_tokens"] == [48]
    assert heldout["prompt_sources"][0].split("[")[0] in sd.heldout_files()[0][0]
    # the multi-token-prediction layer drafts at every step after the first token
    assert all(c["stats"]["drafts"] > 0 for c in cases if c["method"] == "mtp")


def test_verify_step_cost(report):
    part = report["verify"]
    assert set(part["models"]) == {"llama-3.1-8b", "deepseek-v2-lite"}
    assert {(c["model"], c["batch"], c["context"]) for c in part["cases"]} == {
        ("llama-3.1-8b", 2, 40), ("deepseek-v2-lite", 2, 40)}
    for c in part["cases"]:
        assert c["status"] == "done", c
        assert set(c["windows"]) == {"1", "2"}
        for side in [c["plain"], *c["windows"].values()]:
            for key in ("step", "host"):
                assert all(_positive(t) for t in side[key]["trials"])
                assert side[key]["min"] <= side[key]["median"] <= side[key]["max"]
        for w in c["windows"].values():
            assert _positive(w["ratio"]) and _positive(w["host_ratio"])
    assert report["graphs"] == "eager steps on both sides"  # no CUDA graphs on the CPU


def test_markdown(report, tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    assert sd.main(["--markdown", str(path)]) == 0
    text = capsys.readouterr().out
    assert "| default | ngram | 2 | repeat | 1 | 0 |" in text
    assert "| llama-3.1-8b | 2 | 40 | 1 |" in text and "| deepseek-v2-lite | 2 | 40 | 2 |" in text
    assert text.count("Device: cpu") == 2


def test_stats_delta():
    before = {"drafts": 2, "draft_tokens": 6, "accepted_tokens": 3, "accepted_per_position": [2, 1, 0]}
    after = {"drafts": 6, "draft_tokens": 18, "accepted_tokens": 9, "accepted_per_position": [5, 3, 1]}
    d = sd.stats_delta(before, after)
    assert d["drafts"] == 4 and d["draft_tokens"] == 12 and d["accepted_tokens"] == 6
    assert d["accepted_per_position"] == [3, 2, 1]
    assert d["acceptance_per_position"] == [0.75, 0.5, 0.25]
    assert d["mean_accepted_length"] == 2.5 and d["acceptance_rate"] == 0.5
    assert sd.stats_delta(after, after)["mean_accepted_length"] is None


def test_repeat_prompt_asks_for_the_file_back():
    class Words:  # a whitespace tokenizer: only the prompt's text is checked
        def encode(self, text):
            return text.split()

    text = "import os\n\n\ndef load(path):\n    return open(path).read()\n\nX = 1\n"
    prompt = sd.repeat_prompt(text, Words(), tokens=100)
    assert prompt.startswith("Here is a file:\n" + text)
    assert "Rewrite the file with the function load renamed to load_v2:\nimport os\n\n\n" in prompt
    short = sd.repeat_prompt(text, Words(), tokens=2)  # the lines that fit
    assert short.startswith("Here is a file:\nimport os\n\n\n\nRewrite the file with the function renamed:")


def test_prompt_lookup_sizes_reach_the_ngram_config():
    assert sd.spec_config("ngram", 4, draft_model="default", prompt_lookup=sd.size_pair("1,3")) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    assert sd.spec_config("mtp", 2, draft_model="default", prompt_lookup=[1, 3]) == {
        "method": "mtp", "num_speculative_tokens": 2}
    with pytest.raises(argparse.ArgumentTypeError, match="MIN,MAX"):
        sd.size_pair("3")
