"""Speculative decoding in verify windows (n-gram drafts): the same tokens as plain decoding,
rejected rows trimmed, and every sampling setting respected."""

from __future__ import annotations

import math

import pytest
import torch

from model_helpers import build_deepseek_dir, build_model_dir
from segkv.engine.llm import LLM
from segkv.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Prompts whose continuations repeat what came before, so the n-gram proposer finds drafts
PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor i in",
    "import os\nimport sys\nimport os\nimport sys\nimport",
]


def pair(model_dir, **kw):
    """The same model without and with n-gram speculation."""
    kw = {"dtype": "float32", "device": "cpu", **kw}
    return LLM(model_dir, **kw), LLM(model_dir, speculative_config=NGRAM, **kw)


def tokens(llm, prompts, params):
    return [[o.token_ids for o in r.outputs] for r in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def default_pair():
    return pair("default")


def test_greedy_tokens_equal_plain_decoding_and_drafts_are_accepted(default_pair):
    plain, spec = default_pair
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    assert tokens(spec, PROMPTS, params) == tokens(plain, PROMPTS, params)
    stats = spec.generator.spec_stats
    assert stats.drafts > 0 and 0 < stats.accepted_tokens <= stats.draft_tokens
    assert stats.mean_accepted_length > 1.0
    assert spec.cache.stats()["pages_in_use"] == 0  # every window's rows went back with the chains


def test_batches_of_one_and_many_give_the_same_tokens(default_pair):
    _, spec = default_pair
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    together = tokens(spec, PROMPTS, params)
    alone = [tokens(spec, [p], params)[0] for p in PROMPTS]
    assert together == alone


@pytest.mark.parametrize("limit", [
    {"max_tokens": 7},
    {"max_tokens": 40, "stop": ("\n\n",)},
    {"max_tokens": 40, "stop_token_ids": (13, 198)},
    {"max_tokens": 40, "logprobs": 3},
    {"max_tokens": 30, "n": 2, "temperature": 0},
    {"max_tokens": 40, "repetition_penalty": 1.3, "frequency_penalty": 0.5},
])
def test_stops_lengths_logprobs_and_penalties_as_in_plain_decoding(default_pair, limit):
    plain, spec = default_pair
    params = SamplingParams(**{"temperature": 0, **limit})
    want, got = plain.generate(PROMPTS, params), spec.generate(PROMPTS, params)
    for w, g in zip(want, got):
        for a, b in zip(w.outputs, g.outputs):
            assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == \
                (a.token_ids, a.text, a.finish_reason, a.stop_reason)
            assert len(b.token_ids) <= params.max_tokens
            if params.logprobs is not None:
                assert [x.token_id for x in b.logprobs] == [x.token_id for x in a.logprobs]
                for x, y in zip(a.logprobs, b.logprobs):
                    assert math.isclose(x.logprob, y.logprob, rel_tol=1e-4, abs_tol=1e-4)
                    assert [t for t, _ in x.top] == [t for t, _ in y.top] and len(y.top) == 3


def test_seeded_sampling_is_reproducible_and_opting_out_decodes_plainly(default_pair):
    plain, spec = default_pair
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=40, ignore_eos=True)
    first, second = tokens(spec, PROMPTS, params), tokens(spec, PROMPTS, params)
    assert first == second
    before = spec.generator.spec_stats.drafts
    out = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=40, ignore_eos=True, speculative=False)
    assert tokens(spec, PROMPTS, out) == tokens(plain, PROMPTS, out)  # the plain sampler's draws
    assert spec.generator.spec_stats.drafts == before


def test_conversation_turns_forks_and_save_load_match_plain(default_pair, tmp_path):
    """Turns, a fork and a restored snapshot file decode the same tokens with speculation; every
    chain holds exactly the pages its rows need."""
    results = []
    for llm in default_pair:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        conv = llm.conversation(system="You write Python.")
        replies = [conv.say(PROMPTS[0], params).text, conv.say(PROMPTS[1], params).text]
        fork = conv.fork()
        replies.append(fork.say(PROMPTS[2], params).text)
        path = tmp_path / f"c{len(results)}.safetensors"
        conv.save(path)
        loaded = llm.load_conversation(path)
        replies.append(loaded.say(PROMPTS[2], params).text)
        for c in (conv, fork, loaded):
            chain = c.chain
            pages = sum(len(span.page_ids) for span in chain.spans())
            assert pages >= math.ceil(chain.num_rows / llm.cache.page_size)
        results.append(replies)
    assert results[0] == results[1]


@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek"])
def test_every_family_decodes_the_same_greedy_tokens(family, tmp_path):
    """Random checkpoints of each family (their greedy outputs loop, so n-grams match)."""
    if family == "deepseek":
        build_deepseek_dir(tmp_path)
    else:
        build_model_dir(tmp_path, family)
    plain, spec = pair(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10]]
    assert tokens(spec, prompts, params) == tokens(plain, prompts, params)
    assert spec.generator.spec_stats.drafts > 0


def test_rejected_rows_are_trimmed_without_a_copy_and_pages_stay_exact(default_pair, monkeypatch):
    """Step by step: after every verify window the tail holds exactly the pages its rows need, the
    chain's rows are the pending token's history (prompt and output but the last token), and no
    row is ever copied."""
    _, spec = default_pair
    copied = []
    monkeypatch.setattr(spec.cache.storage, "copy_rows", lambda src, dst: copied.append(len(src)))
    gen, pool = spec.generator, spec.cache.pool
    in_use = pool.pages_in_use
    ids = spec.tokenizer.encode(PROMPTS[0])
    seq = gen.new_sequence(0, spec.cache.new_chain(), ids, ids, SamplingParams(
        temperature=0.7, seed=3, max_tokens=60, ignore_eos=True))
    windows = gen.spec_stats.drafts
    while seq.finish_reason is None:
        gen.step([(seq, len(seq.pending))])
        tail = seq.chain.tail
        assert len(tail.page_ids) == pool.pages_for_rows(tail.num_rows)
        assert pool.pages_in_use == in_use + len(tail.page_ids)
        expected = len(ids) + len(seq.output_ids) - 1  # the last token has no row yet
        assert seq.chain.num_rows == expected
        assert seq.chain.token_ids() == (ids + seq.output_ids)[:expected]
    assert gen.spec_stats.drafts > windows and copied == []
    seq.chain.release()
    assert pool.pages_in_use == in_use
