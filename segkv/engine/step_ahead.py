"""A decode step launched before the host read the tokens it consumes (``Generator.lookahead``).

The step's rows are already in the sequences' chains (token ids still placeholders) and its
logits are being computed. The next engine step takes the rows its work still wants; every other
row is given back (trimmed), so a chain never keeps a row of a step nobody used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from segkv.cache.chain import KVChain
from segkv.layers.transfer import select_rows


class Sequence(Protocol):
    """What a step ahead reads of a sequence (``generation.Sequence`` is one): its chain and the
    tokens it has yet to feed."""

    chain: KVChain
    pending: list[int]


@dataclass(slots=True, eq=False)
class StepAhead:
    """The sequences of a decode step launched ahead, the chains they had, and the step's
    ``logits`` ``(B, vocab)`` float32 (row ``i``: ``seqs[i]``)."""

    seqs: list[Sequence]
    chains: list[KVChain | None]  # None once the sequence's row was given back
    logits: torch.Tensor
    rows: dict[int, int] = field(default_factory=dict)  # id(sequence) -> its row
    lengths: list[int] = field(default_factory=list)  # each chain's rows with the step's row

    def __post_init__(self) -> None:
        self.rows = {id(s): i for i, s in enumerate(self.seqs)}
        self.lengths = [c.num_rows for c in self.chains]

    @property
    def empty(self) -> bool:
        """Whether every row was given back."""
        return all(c is None for c in self.chains)

    def index(self, seq: Sequence) -> int | None:
        i = self.rows.get(id(seq))
        return i if i is not None and self.seqs[i] is seq else None

    def holds(self, i: int) -> bool:
        """Whether sequence ``i``'s chain is still as this step left it (same object, same rows):
        not given back, not released (abort), not replaced (preemption)."""
        chain = self.chains[i]
        return chain is not None and self.seqs[i].chain is chain and chain.num_rows == self.lengths[i]

    def live(self, seq: Sequence) -> bool:
        """Whether ``seq`` still holds its row of this step."""
        i = self.index(seq)
        return i is not None and self.holds(i)

    def give_back(self, seq: Sequence) -> None:
        """Trim ``seq``'s row of this step (it ended on the token that row would have held)."""
        i = self.index(seq)
        if i is not None and self.holds(i):
            seq.chain.trim(1)
            self.chains[i] = None

    def take(self, work: list[tuple[Sequence, int]]) -> tuple[list[int], torch.Tensor | None]:
        """The positions of ``work`` (``(sequence, tokens)`` pairs) whose decode row this step
        holds, and their logits in that order (None if there are none). Every row no work item
        takes (an aborted or preempted sequence, one left out) is given back."""
        served, rows = [], []
        for pos, (s, k) in enumerate(work):
            i = self.index(s)
            if i is not None and k == 1 and len(s.pending) == 1 and self.holds(i):
                served.append(pos)
                rows.append(i)
        taken = set(rows)
        for i, seq in enumerate(self.seqs):
            if i not in taken and self.holds(i):
                seq.chain.trim(1)
                self.chains[i] = None
        return served, (select_rows(self.logits, rows) if rows else None)
