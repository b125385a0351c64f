"""logit_bias: -100 bans a token and +100 forces it, greedy and sampled, also in verify windows;
an id outside the vocabulary is refused when the request is added."""

from __future__ import annotations

import pytest

from segkv.engine.llm import LLM
from segkv.sampling_params import SamplingParams

PROMPT = "import os\nimport sys\nimport os\nimport sys\nimport"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def llms():
    kw = {"dtype": "float32", "device": "cpu"}
    return LLM("default", **kw), LLM("default", speculative_config=NGRAM, **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("which", [0, 1])
def test_minus_100_bans_and_plus_100_forces(llms, temperature, which):
    llm = llms[which]
    free = llm.generate([PROMPT], SamplingParams(temperature=temperature, max_tokens=16, ignore_eos=True, seed=3))
    seen = free[0].outputs[0].token_ids
    banned = max(set(seen), key=seen.count)  # the token the model writes most here
    out = llm.generate([PROMPT], SamplingParams(temperature=temperature, max_tokens=16, ignore_eos=True, seed=3,
                                                n=2, logit_bias={banned: -100}))
    for o in out[0].outputs:
        assert banned not in o.token_ids and len(o.token_ids) == 16
    forced = 1234
    out = llm.generate([PROMPT], SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True,
                                                logit_bias={forced: 100, banned: -5}))
    assert out[0].outputs[0].token_ids == [forced] * 8


def test_bias_changes_the_greedy_choice_by_exactly_its_value(llms):
    """A small bias moves the argmax only where it closes the gap between the two best logits."""
    llm = llms[0]
    ids = llm.tokenizer.encode(PROMPT)
    chain = llm.cache.new_chain()
    last = llm.runner.prompt_logits(chain, ids)[-1].float()
    chain.release()
    top2 = last.topk(2)
    gap = (top2.values[0] - top2.values[1]).item()
    second = top2.indices[1].item()
    under = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logit_bias={second: gap * 0.9}))
    over = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logit_bias={second: gap + 1e-3}))
    assert under[0].outputs[0].token_ids == [top2.indices[0].item()]
    assert over[0].outputs[0].token_ids == [second]


def test_unknown_token_id_is_refused(llms):
    llm = llms[0]
    vocab = llm.model.cfg.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias token id {vocab} is out of the vocabulary"):
        llm.generate(["hi"], SamplingParams(logit_bias={vocab: 1}))
    assert llm.cache.stats()["pages_in_use"] == 0
