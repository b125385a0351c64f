"""Speculative decoding through the engine samples exactly the target's distribution.

``tests/spec/test_rejection.py`` proves the rejection rule on synthetic distributions; here the
whole path runs (the scheduler, prefix reuse, proposers, verify windows, the sampler's
distributions, trimming): a 24-token vocabulary model's first three generated tokens, drawn tens
of thousands of times with and without speculation (n-gram lookup; a second random model as the
draft), are compared by chi-square tests with each other and with the exact distribution
computed from the model's logits, at temperature 1 and at top-p 0.9. A deliberately wrong
acceptance rule patched in must fail the same comparison (the tests' power). Then windows under
a small KV cache: preempted and recomputed requests, and an abort between steps.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import segkv.engine.generation as generation
from engine_helpers import run_all
from segkv.engine.core import EngineCore
from segkv.engine.llm import LLM
from segkv.sampling_params import SamplingParams
from segkv.scheduler import SchedulerConfig
from spec_sampling_helpers import (SETTINGS, VIEWS, big_batches, build_word_model, draw, exact_joint_of,
                                   goodness_of_fit_p, p_values, params_of, spec_counts, view_probs)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
NUM_SAMPLES = 10_000
NUM_POWER_SAMPLES = 5_000
ALPHA = 1e-5  # a correct engine fails one of this file's 40 comparisons with probability < 1e-3


@pytest.fixture(scope="module")
def word_models(tmp_path_factory):
    """(target directory, draft directory, the target's HF model): two different random models."""
    root = tmp_path_factory.mktemp("word-models")
    target = build_word_model(root / "target", seed=0)
    build_word_model(root / "draft", seed=1)
    return root / "target", root / "draft", target


@pytest.fixture(scope="module")
def engines(word_models):
    target, draft, _ = word_models
    kw = {"page_size": 16, "num_pages": 4096}  # 1024 running sequences and the shared prompt fit
    return {
        "plain": big_batches(LLM(target, **kw)),
        "ngram": big_batches(LLM(target, speculative_config=NGRAM, **kw)),
        "draft_model": big_batches(LLM(target, **kw, speculative_config={
            "method": "draft_model", "num_speculative_tokens": 2, "model": str(draft)})),
    }


# The draft model proposer looks for a draft chain to fork among those of every live target
# chain, and ``generate`` keeps its requests' chains alive until it returns: a call of 10,000
# requests costs quadratic time there, so its samples are drawn 500 requests per call
CHUNKS = {"ngram": None, "draft_model": 500}


_plain_samples: dict[str, list[tuple[int, int, int]]] = {}


def plain_samples(engines, setting: str) -> list[tuple[int, int, int]]:
    if setting not in _plain_samples:
        _plain_samples[setting] = draw(engines["plain"], setting, NUM_SAMPLES, seed=100)
    return _plain_samples[setting]


# -- the exact distribution ---------------------------------------------------------
_exact: dict[str, torch.Tensor] = {}


def exact_joint(word_models, engines, setting: str) -> torch.Tensor:
    """``(V, V, V)`` float64: the exact distribution of the first three tokens (computed once)."""
    if setting not in _exact:
        _exact[setting] = exact_joint_of(word_models[2], engines["plain"].generator.sampler, params_of(setting))
    return _exact[setting]



# -- exactness ----------------------------------------------------------------------
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_plain_sampling_matches_the_exact_distribution(word_models, engines, setting):
    """The reference itself: plain samples fit the distribution computed from the logits (and
    that distribution is spread: neither one-hot nor uniform at any position)."""
    joint = exact_joint(word_models, engines, setting)
    assert math.isclose(float(joint.sum()), 1.0, abs_tol=1e-6)
    for view in ("token 1", "token 2", "token 3"):
        probs = torch.tensor(list(view_probs(joint, view).values()))
        assert 0.1 < float(probs.max()) < 0.6 and int((probs > 0.01).sum()) >= 5
    samples = plain_samples(engines, setting)
    for view, key in VIEWS.items():
        p = goodness_of_fit_p(Counter(map(key, samples)), view_probs(joint, view))
        print("plain", setting, view, p)  # shown with -s
        assert p > ALPHA, (view, p)


# the n-gram proposer at both settings; the draft model (slower on the CPU) at temperature 1
@pytest.mark.parametrize("method,setting", [("ngram", "temperature-1"), ("ngram", "top-p-0.9"),
                                            ("draft_model", "temperature-1")])
def test_speculative_sampling_has_the_target_distribution(word_models, engines, method, setting):
    llm = engines[method]
    before = spec_counts(llm)
    samples = draw(llm, setting, NUM_SAMPLES, seed=200, chunk=CHUNKS[method])
    drafts, accepted, rejected = (b - a for a, b in zip(before, spec_counts(llm)))
    assert drafts > 0 and accepted > 0 and rejected > 0, (drafts, accepted, rejected)
    assert drafts >= NUM_SAMPLES // 2  # the proposers draft at (nearly) every first window
    result = p_values(samples, plain_samples(engines, setting), exact_joint(word_models, engines, setting))
    print(method, setting, (drafts, accepted, rejected), result)  # shown with -s
    failed = {name: p for name, p in result.items() if p <= ALPHA}
    assert not failed, (failed, result)


def accept_every_draft(target_probs, draft_ids, draft_probs, generators):
    """A wrong acceptance rule (``verify_windows``' signature): every draft is kept, then the bonus
    token is drawn from each window's last row (the second token becomes the n-gram lookup's guess
    whenever there is one)."""
    out, start = [], 0
    for drafts, generator in zip(draft_ids, generators):
        last = target_probs[start + len(drafts)]
        out.append(list(drafts) + [int(torch.multinomial(last, 1, generator=generator))])
        start += len(drafts) + 1
    return out


def test_a_wrong_acceptance_rule_fails_the_same_comparison(word_models, engines, monkeypatch):
    """The tests' power: with a wrong rule patched into the generator, the second token's
    distribution and the joint of the first two are told apart from plain sampling and from
    the exact distribution."""
    monkeypatch.setattr(generation, "verify_windows", accept_every_draft)
    llm = engines["ngram"]
    before = spec_counts(llm)
    samples = draw(llm, "temperature-1", NUM_POWER_SAMPLES, seed=300)
    assert spec_counts(llm)[0] > before[0]
    result = p_values(samples, plain_samples(engines, "temperature-1"),
                      exact_joint(word_models, engines, "temperature-1"))
    print("wrong rule", result)  # shown with -s
    for name in ("token 2 vs plain", "token 2 vs exact", "tokens 1-2 vs plain", "tokens 1-2 vs exact"):
        assert result[name] < 1e-12, (name, result)


# -- windows under a small KV cache -------------------------------------------------
def looping_prompts(count: int) -> list[list[int]]:
    """Short prompts with repeats (and random greedy continuations loop): n-gram drafts are found."""
    return [[3 + (i + j) % 7 for j in range(4 + i % 3)] * 2 + [3 + i % 7] for i in range(count)]


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def greedy_alone(word_models):
    big = LLM(word_models[0], page_size=4, num_pages=800)
    return [big.generate([p], GREEDY)[0].outputs[0].token_ids for p in looping_prompts(12)]


def small_core(word_models) -> tuple[LLM, EngineCore]:
    small = LLM(word_models[0], page_size=4, num_pages=40, speculative_config=NGRAM)
    config = SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=64)
    return small, EngineCore(small.cache, small.generator, config)


def test_a_small_cache_preempts_and_recomputes_windows_with_plain_greedy_tokens(word_models, greedy_alone):
    small, core = small_core(word_models)
    start = small.cache.pool.pages_in_use
    requests = [core.add_request(p, GREEDY) for p in looping_prompts(12)]
    run_all(core)
    assert core.num_preemptions > 0
    drafts, accepted, rejected = spec_counts(small)
    assert drafts > 0 and accepted > 0 and rejected > 0
    assert [r.output().outputs[0].token_ids for r in requests] == greedy_alone
    core.prefix.clear()
    assert small.cache.pool.pages_in_use == start


def test_an_abort_between_windows_frees_its_pages(word_models, greedy_alone):
    small, core = small_core(word_models)
    start = small.cache.pool.pages_in_use
    prompts = looping_prompts(12)
    requests = [core.add_request(p, GREEDY) for p in prompts]
    owner = {id(r.seqs[0]): i for i, r in enumerate(requests)}
    running = []
    while not running:  # a request that has verified windows and holds rows now
        core.step()
        running = [owner[id(s)] for s in core.running if len(s.output_ids) >= 4 and s.chain.num_rows]
    assert small.generator.spec_stats.drafts > 0
    victim = running[0]
    in_use = small.cache.pool.pages_in_use
    assert core.abort(requests[victim].request_id) and requests[victim].aborted
    assert small.cache.pool.pages_in_use < in_use  # its pages went back at once
    run_all(core)
    assert core.num_preemptions > 0
    assert requests[victim].output().outputs[0].finish_reason == "abort"
    assert [r.output().outputs[0].token_ids for i, r in enumerate(requests) if i != victim] == \
        [t for i, t in enumerate(greedy_alone) if i != victim]
    core.prefix.clear()
    assert small.cache.pool.pages_in_use == start
