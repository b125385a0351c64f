"""Verify windows whose drafts form a tree (:class:`~segkv.spec.tree.DraftTree`): what their rows
hold, the greedy walk, and which rows an outcome keeps.

A tree window's rows are the pending token's (row 0, the root) and then one per draft node (row
``i + 1`` is node ``i``); a chain of ``k`` drafts is the window of rows ``0 .. k``. A verdict is
the emitted tokens and the kept nodes in path order: emitted token ``j`` was drawn from the
logits of the root (``j = 0``) or of kept node ``j - 1``, and the rows kept in the chain are the
root's and those of the kept nodes before the last token taken.
"""

from __future__ import annotations

from segkv.spec.rejection import TreeVerdict, tree_children
from segkv.spec.tree import DraftTree

Drafts = list[int] | DraftTree


def window_size(drafts: Drafts) -> int:
    """The window's rows: the pending token's and one per draft."""
    return len(drafts) + 1


def row_prefixes(drafts: Drafts) -> list[list[int]]:
    """Per window row, the drafts before it on its path (what penalties count as output)."""
    if isinstance(drafts, DraftTree):
        return [[]] + [[drafts.tokens[n] for n in drafts.path(i)] for i in range(len(drafts))]
    return [list(drafts[:j]) for j in range(len(drafts) + 1)]


def greedy_walk(tree: DraftTree, best: list[int]) -> TreeVerdict:
    """The greedy verdict of a tree window from each row's argmax ``best`` (``len(tree) + 1``
    token ids): from the root, follow the child holding the row's argmax while there is one,
    then emit the argmax."""
    children = tree_children(tree.parents)
    nodes, tokens, row = [], [], 0
    while True:
        token = best[row]
        tokens.append(token)
        child = next((c for c in children[row] if tree.tokens[c] == token), None)
        if child is None:
            return TreeVerdict(tokens, nodes)
        nodes.append(child)
        row = child + 1


def emitted_rows(verdict: TreeVerdict) -> list[int]:
    """The window row whose logits drew each emitted token."""
    return [0] + [n + 1 for n in verdict.nodes[: len(verdict.tokens) - 1]]


def kept_rows(verdict: TreeVerdict, taken: int) -> list[int]:
    """The window rows kept when the first ``taken`` emitted tokens are taken (a stop may cut the
    rest): the root's and the kept nodes' before the last token taken, ascending."""
    return [0] + [n + 1 for n in verdict.nodes[: taken - 1]]
