"""segkv/engine/tree_windows.py: a tree window's rows, the greedy walk, and the rows an outcome
keeps (checked against explicit trees and against the rejection rule's greedy limit)."""

from __future__ import annotations

import torch

from segkv.engine.tree_windows import emitted_rows, greedy_walk, kept_rows, row_prefixes, window_size
from segkv.spec.rejection import TreeVerdict, verify_trees
from segkv.spec.tree import DraftTree

# node:             0   1   2   3   4   5
TREE = DraftTree((10, 11, 12, 13, 14, 15), (-1, -1, 0, 0, 2, 1))  # 0 -> {2 -> 4, 3}, 1 -> 5
VOCAB = 32


def random_tree(gen: torch.Generator, size: int, vocab: int = 5) -> DraftTree:
    tokens, parents = [], []
    for node in range(size):
        parent = int(torch.randint(-1, node, (1,), generator=gen)) if node else -1
        free = [t for t in range(vocab) if (t, parent) not in set(zip(tokens, parents))]
        if not free:
            parent, free = node - 1, list(range(vocab))  # a new child of the last node
        tokens.append(free[int(torch.randint(0, len(free), (1,), generator=gen))])
        parents.append(parent)
    return DraftTree(tuple(tokens), tuple(parents))


def walk_by_paths(tree: DraftTree, best: list[int]) -> TreeVerdict:
    """The greedy verdict the slow way: the longest node path whose every token is its parent
    row's argmax, then that path's last row's argmax."""
    nodes = []
    while True:
        row = nodes[-1] + 1 if nodes else 0
        under = [i for i in range(len(tree)) if tree.parents[i] == (nodes[-1] if nodes else -1)]
        match = [i for i in under if tree.tokens[i] == best[row]]
        assert len(match) <= 1
        if not match:
            return TreeVerdict([tree.tokens[n] for n in nodes] + [best[row]], nodes)
        nodes.append(match[0])


def test_window_size_and_row_prefixes_of_chains_and_trees():
    assert window_size([]) == 1 and window_size([4, 5, 6]) == 4 and window_size(TREE) == 7
    assert row_prefixes([4, 5, 6]) == [[], [4], [4, 5], [4, 5, 6]]
    assert row_prefixes([]) == [[]]
    assert row_prefixes(TREE) == [[], [10], [11], [10, 12], [10, 13], [10, 12, 14], [11, 15]]
    assert row_prefixes(DraftTree.chain([4, 5, 6])) == row_prefixes([4, 5, 6])


def test_greedy_walk_follows_the_argmax_child_then_emits_the_argmax():
    #       row:  0   1   2   3   4   5   6
    best = [11, 12, 15, 99, 98, 97, 96]
    assert greedy_walk(TREE, best) == TreeVerdict([11, 15, 96], [1, 5])
    best = [10, 12, 15, 14, 98, 97, 96]  # 10 -> 12 -> 14 -> leaf (node 4, row 5): its argmax 97
    assert greedy_walk(TREE, best) == TreeVerdict([10, 12, 14, 97], [0, 2, 4])
    best = [10, 13, 15, 14, 98, 97, 96]  # node 0's argmax is its second child, a leaf (row 4)
    assert greedy_walk(TREE, best) == TreeVerdict([10, 13, 98], [0, 3])
    best = [10, 14, 15, 14, 98, 97, 96]  # 14 is a grandchild of node 0, not a child
    assert greedy_walk(TREE, best) == TreeVerdict([10, 14], [0])
    best = [31, 12, 15, 99, 14, 97, 96]  # no child is the root's argmax
    assert greedy_walk(TREE, best) == TreeVerdict([31], [])
    assert greedy_walk(DraftTree((), ()), [7]) == TreeVerdict([7], [])


def test_emitted_and_kept_rows_of_a_verdict():
    verdict = TreeVerdict([10, 12, 14, 97], [0, 2, 4])
    assert emitted_rows(verdict) == [0, 1, 3, 5]  # 10 from the root, 12 from node 0's row, ...
    assert kept_rows(verdict, 4) == [0, 1, 3, 5]  # the chain keeps root, 10, 12, 14; 97 is pending
    assert kept_rows(verdict, 3) == [0, 1, 3]  # a stop at 14: its row is not needed
    assert kept_rows(verdict, 1) == [0]
    second = TreeVerdict([11, 15, 96], [1, 5])
    assert emitted_rows(second) == [0, 2, 6] and kept_rows(second, 3) == [0, 2, 6]
    assert emitted_rows(TreeVerdict([31], [])) == [0] and kept_rows(TreeVerdict([31], []), 1) == [0]


def test_random_trees_walk_like_the_slow_walk_and_the_rejection_rule_at_one_hot_rows(gen):
    walks_through = 0
    for _ in range(300):
        tree = random_tree(gen, int(torch.randint(0, 10, (1,), generator=gen)))
        # argmax rows over a small vocabulary (the trees' tokens' range) so that walks go deep
        best = [int(torch.randint(0, 6, (1,), generator=gen)) for _ in range(len(tree) + 1)]
        verdict = greedy_walk(tree, best)
        assert verdict == walk_by_paths(tree, best)
        assert len(verdict.tokens) == len(verdict.nodes) + 1
        rows = emitted_rows(verdict)
        assert [best[r] for r in rows] == verdict.tokens  # each token is its row's argmax
        assert kept_rows(verdict, len(verdict.tokens)) == rows
        # each kept node is a child of the one before (the root first), its row the next emitting one
        assert [tree.parents[n] for n in verdict.nodes] == ([-1] + verdict.nodes)[: len(verdict.nodes)]
        assert rows[1:] == [n + 1 for n in verdict.nodes]
        walks_through += len(verdict.nodes) > 1
        # greedy rows are one-hot distributions: the rejection rule gives the same verdict
        probs = torch.nn.functional.one_hot(torch.tensor(best), VOCAB).float()
        assert verify_trees(probs, [tree.parents], [tree.tokens])[0] == verdict
    assert walks_through >= 2  # walks past one kept node happen (about 13 in 300; 2 or more but for ~5e-5)
