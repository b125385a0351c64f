"""DraftTree: draft tokens that form a tree (top-k branches at each depth), verified in one window.

A proposer returns, per sequence, either a list of draft token ids (a chain) or a
:class:`DraftTree`. The verify window is the pending token (the root, window row 0) followed by
the tree's nodes in node order (window row ``i + 1`` is node ``i``); a node attends the history
and its ancestors only, at the position of its depth.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DraftTree:
    """``tokens[i]``: node ``i``'s draft token id; ``parents[i]``: its parent, ``-1`` (a child of
    the pending token) or an earlier node. Siblings hold distinct tokens. ValueError otherwise."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "parents", tuple(int(p) for p in self.parents))
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a draft tree has {len(self.tokens)} tokens and {len(self.parents)} parents")
        seen: set[tuple[int, int]] = set()
        for node, (parent, token) in enumerate(zip(self.parents, self.tokens)):
            if not -1 <= parent < node:
                raise ValueError(f"draft tree node {node}'s parent must be -1 or an earlier node, got {parent}")
            if (parent, token) in seen:
                raise ValueError(f"draft tree node {node} repeats its sibling's token {token}")
            seen.add((parent, token))

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        """A chain of drafts as a tree (each node the child of the one before)."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        """Each node's depth: 1 for a child of the pending token (the number of drafts on its path)."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent < 0 else out[parent] + 1)
        return out

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def window_parents(self) -> tuple[int, ...]:
        """The verify window's ``tree_parents``: the root (-1), then each node's window row's parent."""
        return (-1,) + tuple(p + 1 for p in self.parents)

    def path(self, node: int) -> list[int]:
        """The nodes from a child of the root down to ``node``."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def truncated(self, max_depth: int) -> DraftTree:
        """The nodes of depth at most ``max_depth`` (parents come first, so the result is a tree)."""
        keep = [i for i, d in enumerate(self.depths) if d <= max_depth]
        index = {old: new for new, old in enumerate(keep)}
        return DraftTree(tuple(self.tokens[i] for i in keep),
                         tuple(-1 if self.parents[i] < 0 else index[self.parents[i]] for i in keep))

    def first_branch(self) -> list[int]:
        """The tokens of the path that takes each node's first child: the drafts of a window that
        cannot branch (a constrained sequence's grammar walks one path)."""
        out, node = [], -1
        while True:
            child = next((i for i in range(node + 1, len(self.parents)) if self.parents[i] == node), None)
            if child is None:
                return out
            out.append(self.tokens[child])
            node = child
