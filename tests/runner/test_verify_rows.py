"""ModelRunner.forward's ``logit_rows``: the logits of each input's last rows (verify windows)."""

from __future__ import annotations

import pytest
import torch

from segkv.engine.llm import LLM
from segkv.runner.model_runner import StepInput


@pytest.fixture(scope="module")
def llm():
    return LLM("default", dtype="float32", device="cpu")


def test_window_rows_match_the_rows_of_a_plain_prefill(llm, gen):
    """A window of 5 tokens after a history gives the same logits, row for row, as the same tokens
    run on a fork of the history with every row's logits; a plain decode in the same forward
    gives its last row's."""
    runner, vocab = llm.runner, llm.model.cfg.vocab_size
    prompt = torch.randint(0, vocab, (40,), generator=gen).tolist()
    window = torch.randint(0, vocab, (5,), generator=gen).tolist()
    other = torch.randint(0, vocab, (23,), generator=gen).tolist()
    a, b = llm.cache.new_chain(), llm.cache.new_chain()
    try:
        runner.forward([StepInput(a, prompt), StepInput(b, other)])
        fork = a.fork()
        want = runner.prompt_logits(fork, window)
        want_b = runner.forward([StepInput(b.fork(), [7])])
        got = runner.forward([StepInput(a, window), StepInput(b, [7])], logit_rows=[5, 1])
        assert got.shape == (6, vocab) and torch.isfinite(got).all()
        torch.testing.assert_close(got[:5], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[5:], want_b, rtol=1e-5, atol=1e-5)
        assert a.num_rows == 45 and b.num_rows == 24
        fork.release()
    finally:
        a.release()
        b.release()


def test_bad_logit_rows_are_refused_and_leave_the_chains(llm):
    chain = llm.cache.new_chain()
    try:
        for rows in ([0], [4], [1, 1]):
            with pytest.raises(ValueError, match="logit_rows"):
                llm.runner.forward([StepInput(chain, [1, 2, 3])], logit_rows=rows)
        assert chain.num_rows == 0
    finally:
        chain.release()
