"""Drafting with the model's own MTP layers (``method: "mtp"``): exact, rows trimmed, and the MTP
rows kept in the chain's slots."""

from __future__ import annotations

import pytest

from segkv.engine.llm import LLM
from segkv.runner.mtp import MtpRunner
from segkv.sampling_params import SamplingParams

PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(",
    "import os\nimport sys\n\n\ndef main():\n    ",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
]


def mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def plain():
    return LLM("default-mla", dtype="float32")


def tokens(llm, prompts, params):
    return [[o.token_ids for o in r.outputs] for r in llm.generate(prompts, params)]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_tokens_equal_plain_decoding(plain, k):
    """k above the model's one MTP layer reuses it; drafts are accepted at every position."""
    spec = LLM("default-mla", dtype="float32", speculative_config=mtp(k))
    assert spec.cache.layout.num_layers == plain.cache.layout.num_layers + 1  # the MTP layer's rows
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert tokens(spec, PROMPTS, params) == tokens(plain, PROMPTS, params)
    stats = spec.generator.spec_stats
    assert stats.drafts > 0 and stats.draft_tokens <= k * stats.drafts
    assert all(n > 0 for n in stats.accepted_per_position)  # the MTP layer predicts token t + 2
    assert stats.accepted_tokens / stats.draft_tokens > 0.2
    assert spec.cache.stats()["pages_in_use"] == 0


def test_turns_forks_stops_logprobs_and_seeds(plain, tmp_path):
    spec = LLM("default-mla", dtype="float32", speculative_config=mtp(2))
    params = SamplingParams(temperature=0, max_tokens=30, stop=("\n\n",), logprobs=2)
    want, got = plain.generate(PROMPTS, params), spec.generate(PROMPTS, params)
    for w, g in zip(want, got):
        a, b = w.outputs[0], g.outputs[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert [x.token_id for x in b.logprobs] == [x.token_id for x in a.logprobs]
    replies = []
    for llm in (plain, spec):
        p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        conv = llm.conversation()
        out = [conv.say(PROMPTS[0], p).text]
        fork = conv.fork()
        out += [conv.say(PROMPTS[1], p).text, fork.say(PROMPTS[2], p).text]
        conv.save(tmp_path / "c.safetensors")
        out.append(llm.load_conversation(tmp_path / "c.safetensors").say(PROMPTS[2], p).text)
        replies.append(out)
    assert replies[0] == replies[1]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=30, ignore_eos=True)
    assert tokens(spec, PROMPTS, seeded) == tokens(spec, PROMPTS, seeded)


def test_a_model_without_mtp_layers_and_a_cache_without_their_rows_are_refused(plain):
    with pytest.raises(ValueError, match="multi-token-prediction layers"):
        LLM("default", dtype="float32", speculative_config=mtp(1))
    with pytest.raises(ValueError, match="MTP drafting needs"):
        MtpRunner(plain.runner)  # its cache holds the main layers only


def test_drafts_leave_no_rows_and_the_mtp_rows_follow_the_chain(monkeypatch):
    """Step by step with sampling: the chain always holds the prompt and output but the pending
    token, every draft row is trimmed, and no row is copied."""
    spec = LLM("default-mla", dtype="float32", speculative_config=mtp(3))
    copied = []
    monkeypatch.setattr(spec.cache.storage, "copy_rows", lambda src, dst: copied.append(len(src)))
    gen, pool = spec.generator, spec.cache.pool
    ids = spec.tokenizer.encode(PROMPTS[0])
    seq = gen.new_sequence(0, spec.cache.new_chain(), ids, ids,
                           SamplingParams(temperature=0.8, seed=5, max_tokens=50, ignore_eos=True))
    while seq.finish_reason is None:
        gen.step([(seq, len(seq.pending))])
        tail = seq.chain.tail
        assert len(tail.page_ids) == pool.pages_for_rows(tail.num_rows)
        assert seq.chain.token_ids() == (ids + seq.output_ids)[:-1]
    assert gen.spec_stats.drafts > 0 and copied == []
    seq.chain.release()
    assert pool.pages_in_use == 0
