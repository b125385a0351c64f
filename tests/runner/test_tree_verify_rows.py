"""ModelRunner.forward over tree verify windows (``StepInput.tree_parents``), and
``KVChain.keep_last_rows`` moving an accepted path into place."""

from __future__ import annotations

import pytest
import torch

from segkv.engine.llm import LLM
from segkv.runner.model_runner import StepInput, tree_positions

PARENTS = (-1, -1, 0, 0, 1, 2, 4, -1)  # three roots, branches of depth up to 3


@pytest.fixture(scope="module", params=["default", "default-mla"])
def llm(request):
    return LLM(request.param, dtype="float32", device="cpu")


def _path(parents, node):
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def test_tree_positions_count_depth():
    assert tree_positions(10, PARENTS) == [10, 10, 11, 11, 11, 12, 12, 10]


def test_each_tree_node_gets_the_logits_of_its_path_alone(llm, gen):
    """Every node's logits equal those of a plain window of the tokens on its path (a fork of the
    same history); a plain decode in the same forward is unaffected."""
    runner, vocab = llm.runner, llm.model.cfg.vocab_size
    prompt = torch.randint(0, vocab, (37,), generator=gen).tolist()
    tokens = torch.randint(0, vocab, (len(PARENTS),), generator=gen).tolist()
    other = torch.randint(0, vocab, (11,), generator=gen).tolist()
    a, b = llm.cache.new_chain(), llm.cache.new_chain()
    try:
        runner.forward([StepInput(a, prompt), StepInput(b, other)])
        want_b = runner.forward([StepInput(b.fork(), [7])])
        forks = [a.fork() for _ in PARENTS]
        wants = [runner.prompt_logits(f, [tokens[n] for n in _path(PARENTS, node)])[-1]
                 for node, f in enumerate(forks)]
        got = runner.forward([StepInput(a, tokens, PARENTS), StepInput(b, [7])],
                             logit_rows=[len(PARENTS), 1])
        assert got.shape == (len(PARENTS) + 1, vocab) and torch.isfinite(got).all()
        for node, want in enumerate(wants):
            torch.testing.assert_close(got[node], want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[-1:], want_b, rtol=1e-4, atol=1e-4)
        # power: a sibling-blind window (the same tokens as a causal window) differs at node 1
        causal = runner.forward([StepInput(forks[0].fork(), tokens)], logit_rows=[len(PARENTS)])
        assert (causal[1] - got[1]).abs().max() > 1e-3
        for f in forks:
            f.release()
    finally:
        a.release()
        b.release()


def test_an_accepted_path_moved_into_place_continues_like_a_plain_chain(llm, gen):
    """After a tree window, keeping the path 1 -> 4 -> 6 (moved to the window's first rows) leaves a
    chain whose next step gives the logits of a chain that decoded that path plainly."""
    runner, vocab, cache = llm.runner, llm.model.cfg.vocab_size, llm.cache
    prompt = torch.randint(0, vocab, (29,), generator=gen).tolist()
    tokens = torch.randint(0, vocab, (len(PARENTS),), generator=gen).tolist()
    chain = cache.new_chain()
    try:
        runner.forward([StepInput(chain, prompt)])
        plain = chain.fork()
        path = _path(PARENTS, 6)
        runner.forward([StepInput(plain, [tokens[n] for n in path])])
        runner.forward([StepInput(chain, tokens, PARENTS)], logit_rows=[len(PARENTS)])
        copied = cache.stats()["bytes_copied"]
        moved = chain.keep_last_rows(len(PARENTS), path)
        assert moved == 3  # nodes 1, 4, 6 go to offsets 0, 1, 2
        assert cache.stats()["bytes_copied"] == copied + 3 * cache.layout.row_bytes
        assert chain.num_rows == plain.num_rows and chain.token_ids() == plain.token_ids()
        got = runner.forward([StepInput(chain, [5])])
        want = runner.forward([StepInput(plain, [5])])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        plain.release()
    finally:
        chain.release()


def test_bad_trees_are_refused_and_leave_the_chain(llm):
    chain = llm.cache.new_chain()
    try:
        with pytest.raises(ValueError, match="one parent per token"):
            llm.runner.forward([StepInput(chain, [1, 2, 3], (-1, 0))])
        with pytest.raises(ValueError, match="tree_parents"):
            llm.runner.forward([StepInput(chain, [1, 2, 3], (-1, 2, 0))])
        assert chain.num_rows == 0
        with pytest.raises(ValueError, match="strictly ascending"):
            chain.keep_last_rows(0, [0])
    finally:
        chain.release()
