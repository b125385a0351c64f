"""A grammar matcher per sequence: the token mask before sampling, the sampled tokens after it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from segkv.sampling_params import StructuredOutput
from segkv.structured.grammar import GrammarCache


class GrammarState:
    """Where one sequence stands in its grammar (an ``xgrammar.GrammarMatcher``).

    :meth:`accept` follows each generated token; :attr:`terminated` is true once the grammar is
    complete and its end-of-sequence token was taken (the output ends there). Drafts of a verify
    window are walked with :meth:`draft_masks`, which leaves the state as it found it."""

    __slots__ = ("matcher",)

    def __init__(self, cache: GrammarCache, structured: StructuredOutput) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(cache.compile(structured))

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        """Advance over ``token_id``; False (and no change) if the grammar does not allow it."""
        return self.matcher.accept_token(token_id)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (``(B, ceil(V / 32))`` int32 on the CPU)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def draft_masks(self, drafts: Sequence[int], bitmask: torch.Tensor, start: int) -> int:
        """Fill ``bitmask[start + i]`` with the mask after drafts ``0..i-1`` for ``i`` in
        ``0..m``, where ``m`` is the number of leading drafts the grammar allows (a draft that
        would end the grammar is not taken either: its row would follow the end); return ``m``.
        The state is rolled back to where it was."""
        taken = 0
        for token in drafts:
            self.fill(bitmask, start + taken)
            if not self.accept(token):
                break
            taken += 1
            if self.terminated:
                self.matcher.rollback(1)
                taken -= 1
                break
        self.fill(bitmask, start + taken)
        if taken:
            self.matcher.rollback(taken)
        return taken


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """``(rows, ceil(vocab_size / 32))`` int32 on the CPU, every token allowed (all bits set)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def fill_bitmask(states: Sequence[GrammarState | None], vocab_size: int) -> torch.Tensor | None:
    """The token bitmask of a batch: row ``i`` from ``states[i]``, all allowed where it is None;
    None when no row is constrained."""
    if all(s is None for s in states):
        return None
    bitmask = new_bitmask(len(states), vocab_size)
    for row, state in enumerate(states):
        if state is not None:
            state.fill(bitmask, row)
    return bitmask
