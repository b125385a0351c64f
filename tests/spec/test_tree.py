"""DraftTree (segkv/spec/tree.py): validation, depths, paths, the verify window's parents, cuts
to a depth, the first branch, and chains."""

from __future__ import annotations

import pytest
import torch

from segkv.runner.model_runner import tree_positions
from segkv.spec.tree import DraftTree

# node:     0   1   2   3   4   5   6
TOKENS = (10, 11, 12, 13, 14, 15, 10)
PARENTS = (-1, -1, 0, 0, 2, 1, 4)  # two roots; 0 -> {2, 3}, 2 -> 4 -> 6, 1 -> 5
TREE = DraftTree(TOKENS, PARENTS)


def random_tree(gen: torch.Generator, size: int, vocab: int = 6) -> DraftTree:
    """A random tree of ``size`` nodes (siblings distinct, tokens from a small vocabulary so that
    cousins repeat tokens)."""
    tokens, parents = [], []
    for node in range(size):
        while True:
            parent = int(torch.randint(-1, node, (1,), generator=gen)) if node else -1
            taken = {t for t, p in zip(tokens, parents) if p == parent}
            free = [t for t in range(vocab) if t not in taken]
            if free:
                break
        tokens.append(free[int(torch.randint(0, len(free), (1,), generator=gen))])
        parents.append(parent)
    return DraftTree(tuple(tokens), tuple(parents))


def paths_of(tree: DraftTree) -> set[tuple[int, ...]]:
    """Every node's path as a token sequence (siblings are distinct, so these identify the nodes)."""
    return {tuple(tree.tokens[n] for n in tree.path(i)) for i in range(len(tree))}


def test_values_are_normalised_to_tuples_of_ints():
    tree = DraftTree([torch.tensor(3), 4.0, 5], [-1, torch.tensor(0), 0])
    assert tree.tokens == (3, 4, 5) and tree.parents == (-1, 0, 0)
    assert all(type(t) is int for t in tree.tokens + tree.parents)
    assert len(tree) == 3 and len(DraftTree((), ())) == 0
    assert tree == DraftTree((3, 4, 5), (-1, 0, 0)) and hash(tree) == hash(DraftTree((3, 4, 5), (-1, 0, 0)))


@pytest.mark.parametrize("tokens,parents,message", [
    ((1, 2), (-1,), "2 tokens and 1 parents"),
    ((1,), (-1, 0), "1 tokens and 2 parents"),
    ((1, 2), (-1, 1), "node 1's parent must be -1 or an earlier node, got 1"),
    ((1, 2), (-1, 2), "node 1's parent must be -1 or an earlier node, got 2"),
    ((1,), (0,), "node 0's parent must be -1 or an earlier node, got 0"),
    ((1, 2), (-1, -2), "node 1's parent must be -1 or an earlier node, got -2"),
    ((1, 1), (-1, -1), "node 1 repeats its sibling's token 1"),
    ((1, 2, 3, 2), (-1, 0, 0, 0), "node 3 repeats its sibling's token 2"),
])
def test_malformed_trees_are_refused(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        DraftTree(tokens, parents)


def test_cousins_and_a_parent_and_child_may_hold_the_same_token():
    tree = DraftTree((7, 8, 7, 7, 7), (-1, -1, 0, 1, 2))
    assert tree.depths == [1, 1, 2, 2, 3]


def test_depths_paths_and_window_parents():
    assert TREE.depths == [1, 1, 2, 2, 3, 2, 4]
    assert TREE.depth == 4 and DraftTree((), ()).depth == 0
    assert [TREE.path(i) for i in range(len(TREE))] == [[0], [1], [0, 2], [0, 3], [0, 2, 4], [1, 5], [0, 2, 4, 6]]
    assert TREE.path(-1) == []
    # the root (row 0), then node i at row i + 1 under its parent's row
    assert TREE.window_parents() == (-1, 0, 0, 1, 1, 3, 2, 5)
    assert DraftTree((), ()).window_parents() == (-1,)
    # a node's position in the window is the root's plus its depth
    assert tree_positions(20, TREE.window_parents()) == [20] + [20 + d for d in TREE.depths]
    assert not TREE.is_chain


def test_chains():
    chain = DraftTree.chain([5, 5, 9])
    assert chain.tokens == (5, 5, 9) and chain.parents == (-1, 0, 1)
    assert chain.is_chain and chain.depths == [1, 2, 3] and chain.first_branch() == [5, 5, 9]
    assert chain.window_parents() == (-1, 0, 1, 2)
    assert DraftTree.chain([]) == DraftTree((), ()) and DraftTree.chain([]).is_chain
    assert DraftTree((4,), (-1,)).is_chain and not DraftTree((4, 5), (-1, -1)).is_chain
    # one branch, but its nodes not in path order: not a chain
    assert not DraftTree((4, 5, 6), (-1, 0, 0)).is_chain


def test_truncated_keeps_the_nodes_up_to_a_depth_and_renumbers_parents():
    assert TREE.truncated(1) == DraftTree((10, 11), (-1, -1))
    assert TREE.truncated(2) == DraftTree((10, 11, 12, 13, 15), (-1, -1, 0, 0, 1))
    assert TREE.truncated(3) == DraftTree((10, 11, 12, 13, 14, 15), (-1, -1, 0, 0, 2, 1))
    assert TREE.truncated(4) == TREE and TREE.truncated(9) == TREE
    assert TREE.truncated(0) == DraftTree((), ())
    deep_first = DraftTree((1, 2, 3, 4), (-1, 0, 1, -1))  # a later root after a deep branch
    assert deep_first.truncated(1) == DraftTree((1, 4), (-1, -1))
    assert deep_first.truncated(2) == DraftTree((1, 2, 4), (-1, 0, -1))


def test_first_branch_follows_each_first_child():
    assert TREE.first_branch() == [10, 12, 14, 10]
    assert DraftTree((), ()).first_branch() == []
    # the first child of the root has no children: the branch ends there, whatever the others hold
    assert DraftTree((1, 2, 3), (-1, -1, 1)).first_branch() == [1]
    # the first child is the earliest node under its parent, not the deepest
    assert DraftTree((1, 2, 3, 4), (-1, 0, 0, 2)).first_branch() == [1, 2]


def test_random_trees_cut_and_walk_consistently(gen):
    for _ in range(200):
        tree = random_tree(gen, int(torch.randint(0, 12, (1,), generator=gen)))
        depths = tree.depths
        assert depths == [len(tree.path(i)) for i in range(len(tree))]
        assert tree.depth == max(depths, default=0)
        for cut in range(tree.depth + 2):
            short = tree.truncated(cut)
            assert paths_of(short) == {p for p in paths_of(tree) if len(p) <= cut}
            assert short.depth == min(cut, tree.depth)
        branch = tree.first_branch()
        assert len(branch) <= tree.depth and (not tree.tokens or branch)
        if branch:
            assert tuple(branch) in paths_of(tree)
            node = next(i for i in range(len(tree)) if tree.parents[i] == -1)
            assert branch[0] == tree.tokens[node]
        if tree.is_chain:
            assert tree == DraftTree.chain(list(tree.tokens)) and tree.first_branch() == list(tree.tokens)
