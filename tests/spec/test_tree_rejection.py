"""Verification of tree windows (``verify_trees``): exact in distribution against the analytic
joint (chi-square, with a wrong residual shown to fail), greedy, equal to chain windows on chains,
reproducible, and clear errors for malformed trees."""

from __future__ import annotations

import pytest
import torch

import segkv.spec.rejection as rejection
from segkv.spec.rejection import tree_children, verify_trees, verify_windows
from tests.spec.test_rejection import _chi2_pvalue, _fit_pvalue

VOCAB = 8
NUM = 40_000
ALPHA = 1e-5


def _table(gen: torch.Generator, temperature: float = 1.0) -> torch.Tensor:
    """(VOCAB, VOCAB) float32: a Markov target, row t = the next-token distribution after token t."""
    return (torch.randn(VOCAB, VOCAB, generator=gen) * 1.5 / temperature).softmax(-1)


def _tree_of(table: torch.Tensor, root_token: int) -> tuple[list[int], list[int]]:
    """A fixed tree over the target's own top tokens (as a draft head's top-k branches): the root's
    three most likely tokens, under the first of them its two most likely, under the second one."""
    def top(token: int, k: int) -> list[int]:
        return table[token].topk(k).indices.tolist()

    a, b, c = top(root_token, 3)
    a1, a2 = top(a, 2)
    (b1,) = top(b, 1)
    return [-1, -1, -1, 0, 0, 1], [a, b, c, a1, a2, b1]


def _rows(table: torch.Tensor, root_token: int, parents: list[int], drafts: list[int]) -> torch.Tensor:
    """(N + 1, VOCAB): the target's row after the root, then after each node's token."""
    return torch.stack([table[root_token]] + [table[t] for t in drafts])


def _first_two(table: torch.Tensor, root: int, num: int, seed: int) -> torch.Tensor:
    """(num, 2): the first two tokens after ``root``, from one tree window and, when it emitted one
    token only, one plain draw after it."""
    parents, drafts = _tree_of(table, root)
    rows = _rows(table, root, parents, drafts)
    torch.manual_seed(seed)
    verdicts = verify_trees(rows.repeat(num, 1), [parents] * num, [drafts] * num)
    out = []
    for v in verdicts:
        tokens = list(v.tokens[:2])
        if len(tokens) == 1:
            tokens.append(int(torch.multinomial(table[tokens[0]], 1)))
        out.append(tokens)
    return torch.tensor(out)


def _joint_pvalue(tokens: torch.Tensor, table: torch.Tensor, root: int) -> float:
    exact = table[root].double()[:, None] * table.double()
    counts = torch.bincount(tokens[:, 0] * VOCAB + tokens[:, 1], minlength=VOCAB * VOCAB).reshape(VOCAB, VOCAB)
    return _fit_pvalue(counts, exact)


def test_tree_windows_emit_the_target_distribution(gen):
    table = _table(gen)
    tokens = _first_two(table, root=0, num=NUM, seed=int(torch.randint(0, 2**31, (1,), generator=gen)))
    first = _fit_pvalue(torch.bincount(tokens[:, 0], minlength=VOCAB), table[0])
    joint = _joint_pvalue(tokens, table, 0)
    assert min(first, joint) > ALPHA, (first, joint)


def test_a_residual_that_keeps_the_children_fails_the_same_test(gen, monkeypatch):
    """The test's power: drawing a rejected node's token from p (children not zeroed) skews it."""
    monkeypatch.setattr(rejection, "_tree_residuals", lambda p, index, present: p)
    table = _table(gen)
    tokens = _first_two(table, root=0, num=NUM, seed=int(torch.randint(0, 2**31, (1,), generator=gen)))
    first = _fit_pvalue(torch.bincount(tokens[:, 0], minlength=VOCAB), table[0])
    assert first < 1e-12, first


def test_greedy_rows_follow_the_argmax_branch(gen):
    table = _table(gen)
    one_hot = torch.zeros_like(table).scatter_(1, table.argmax(-1, keepdim=True), 1.0)
    root = 3
    parents, drafts = _tree_of(table, root)
    (verdict,) = verify_trees(_rows(one_hot, root, parents, drafts), [parents], [drafts])
    best = table[root].argmax().item()
    assert verdict.nodes[0] == 0 and verdict.tokens[0] == best == drafts[0]  # the top branch is the argmax
    expected = [best]
    node = 0
    while True:  # follow the argmax through the tree, then the argmax after the last kept node
        nxt = table[expected[-1]].argmax().item()
        kids = [c for c in tree_children(parents)[node + 1] if drafts[c] == nxt]
        expected.append(nxt)
        if not kids:
            break
        node = kids[0]
    assert verdict.tokens == expected and len(verdict.nodes) == len(expected) - 1


def test_a_chain_shaped_tree_is_a_verify_window(gen):
    """Parents i - 1: the same tokens as ``verify_windows`` on greedy rows, and the same
    distribution on sampled ones (first token)."""
    table = _table(gen)
    one_hot = torch.zeros_like(table).scatter_(1, table.argmax(-1, keepdim=True), 1.0)
    for start in range(VOCAB):
        chain = [table[start].argmax().item()]
        chain += [table[chain[-1]].topk(2).indices[1].item()]  # a draft the argmax rejects
        rows = torch.stack([one_hot[start], one_hot[chain[0]], one_hot[chain[1]]])
        (tree,) = verify_trees(rows, [[-1, 0]], [chain])
        assert tree.tokens == verify_windows(rows, [chain])[0]
    drafts = [2, 5]
    rows = torch.stack([table[0], table[2], table[5]])
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    firsts = [v.tokens[0] for v in verify_trees(rows.repeat(NUM // 4, 1), [[-1, 0]] * (NUM // 4),
                                                [drafts] * (NUM // 4))]
    assert _fit_pvalue(torch.bincount(torch.tensor(firsts), minlength=VOCAB), table[0]) > ALPHA


def test_seeded_trees_repeat_whatever_the_batch(gen):
    table = _table(gen)
    parents, drafts = _tree_of(table, 1)
    rows = _rows(table, 1, parents, drafts)
    alone = verify_trees(rows, [parents], [drafts], [torch.Generator().manual_seed(7)])
    other_parents, other_drafts = [-1], [4]
    batch = verify_trees(torch.cat([_rows(table, 2, other_parents, other_drafts), rows]),
                         [other_parents, parents], [other_drafts, drafts],
                         [None, torch.Generator().manual_seed(7)])
    assert batch[1] == alone[0]


def test_malformed_trees_and_rows_are_clear_errors(gen):
    table = _table(gen)
    rows = torch.stack([table[0], table[1], table[2]])
    with pytest.raises(ValueError, match="parent must be -1"):
        verify_trees(rows, [[-1, 1]], [[1, 2]])
    with pytest.raises(ValueError, match="repeat a token"):
        verify_trees(rows, [[-1, -1]], [[1, 1]])
    with pytest.raises(ValueError, match="sum"):
        verify_trees(rows[:2], [[-1, -1]], [[1, 2]])
    with pytest.raises(ValueError, match="draft ids must be in"):
        verify_trees(rows, [[-1, -1]], [[1, VOCAB]])
    bad = rows.clone()
    bad[1, 0] = float("nan")
    with pytest.raises(ValueError, match="probabilities"):
        verify_trees(bad, [[-1, -1]], [[1, 2]])
    assert verify_trees(rows[:0], [], []) == []


def test_the_chi_square_helper_rejects_a_shifted_sample():
    """The helper used above tells a wrong distribution apart at this sample size."""
    probs = torch.full((VOCAB,), 1.0 / VOCAB)
    counts = torch.full((VOCAB,), NUM // VOCAB)
    counts[0] += 400
    counts[1] -= 400
    assert _fit_pvalue(counts, probs) < 1e-6 and _chi2_pvalue(0.0, 3) == pytest.approx(1.0)
