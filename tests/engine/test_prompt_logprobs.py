"""prompt_logprobs: each prompt token's log-probability equals log_softmax of the full prompt's
logits computed directly, with or without a cached prefix; max_tokens 0 scores without generating."""

from __future__ import annotations

import pytest
import torch

from segkv.engine.llm import LLM
from segkv.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM("default", dtype="float32", device="cpu", prefill_chunk=16)


def random_prompt(llm, n):
    return torch.randint(3, llm.model.cfg.vocab_size, (n,)).tolist()


def reference(llm, ids):
    chain = llm.cache.new_chain()
    logits = llm.runner.prompt_logits(chain, ids).float()
    chain.release()
    return torch.log_softmax(logits, dim=-1)


def check(scores, ids, want, top, atol):
    assert scores[0] is None and len(scores) == len(ids)
    got = torch.tensor([s.logprob for s in scores[1:]])
    expected = want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.isfinite(got).all() and torch.allclose(got, expected, atol=atol, rtol=0)
    for pos, s in enumerate(scores[1:]):
        assert s.token_id == ids[pos + 1] and len(s.top) == top
        if top:
            values, where = want[pos].topk(top)
            assert [t for t, _ in s.top] == where.tolist()
            assert torch.allclose(torch.tensor([v for _, v in s.top]), values, atol=atol, rtol=0)


@pytest.mark.parametrize("top", [0, 3])
def test_prompt_scoring_with_max_tokens_0(llm, top):
    ids = random_prompt(llm, 41)  # three prefill chunks
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=top))[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    check(out.prompt_logprobs, ids, reference(llm, ids), top, 1e-5)
    assert llm.cache.stats()["pages_in_use"] == 0


def test_scores_with_generation_and_a_cached_prefix_recomputed(llm):
    ids = random_prompt(llm, 37)
    want = reference(llm, ids)
    core = llm.core
    first = core.add_request(ids, SamplingParams(max_tokens=2))  # leaves the prompt in the prefix index
    while not first.finished:
        core.step()
    assert first.output().prompt_logprobs is None
    again = core.add_request(ids, SamplingParams(max_tokens=3, n=2, temperature=0, prompt_logprobs=1))
    while not again.finished:
        core.step()
    out = again.output()
    assert out.num_cached_tokens == 0  # the cached prefix was recomputed to score it
    assert [len(o.token_ids) for o in out.outputs] == [3, 3]
    check(out.prompt_logprobs, ids, want, 1, 5e-5)  # other chunk boundaries: summation order differs


def test_max_tokens_0_needs_prompt_logprobs():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
