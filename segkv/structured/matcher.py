"""A grammar matcher per sequence: the token mask before sampling, the sampled tokens after it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from segkv.sampling_params import StructuredOutput
from segkv.structured.grammar import GrammarCache
from segkv.structured.json_closing import json_closing

# tokens kept spare when JSON mode decides to close: one free token can open several containers
CLOSING_MARGIN = 8


class GrammarState:
    """Where one sequence stands in its grammar (an ``xgrammar.GrammarMatcher``).

    :meth:`accept` follows each generated token; :attr:`terminated` is true once the grammar is
    complete and its end-of-sequence token was taken (the output ends there). Drafts of a verify
    window are walked with :meth:`draft_masks`, which leaves the state as it found it."""

    __slots__ = ("matcher", "budget", "_tokens", "_texts", "_encode")

    def __init__(self, cache: GrammarCache, structured: StructuredOutput, *, budget: int | None = None) -> None:
        """``budget``: the most tokens the sequence may generate; a JSON-mode (``json_object``)
        state then closes its JSON in time: once the tokens left only just hold the shortest
        completion (:func:`json_closing`, plus the end-of-sequence token and a margin), the mask
        allows the completion's next token only, so the output parses whatever the model wants."""
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(cache.compile(structured))
        closes = budget is not None and structured.kind == "json_object" and not structured.prefix
        self.budget = budget if closes else None
        self._tokens: list[int] = []  # the tokens accepted (the text the closing is computed from)
        self._texts = cache.token_texts() if closes else None
        self._encode = cache.tokenizer.encode if closes else None

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        """Advance over ``token_id``; False (and no change) if the grammar does not allow it."""
        if not self.matcher.accept_token(token_id):
            return False
        self._tokens.append(token_id)
        return True

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` accepted tokens."""
        if count:
            self.matcher.rollback(count)
            del self._tokens[-count:]

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (``(B, ceil(V / 32))`` int32 on the CPU)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        forced = self._closing_token()
        if forced is not None and _allowed(bitmask, row, forced):
            bitmask[row] = 0
            word, bit = divmod(forced, 32)
            bitmask[row, word] = (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32: bit 31 is the sign

    def _closing_token(self) -> int | None:
        """The next token of the JSON's shortest completion when the budget calls for closing."""
        if self.budget is None:
            return None
        left = self.budget - len(self._tokens)
        if left > 64:  # far from the end: nothing to compute
            return None
        text = b"".join(self._texts[t] for t in self._tokens).decode("utf-8", errors="replace")
        try:
            closing = json_closing(text)
        except ValueError:
            return None
        ids = self._encode(closing, add_special_tokens=False) if closing else []
        if not ids or left > len(ids) + 1 + CLOSING_MARGIN:
            return None
        return ids[0]

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
                self.rollback(1)
                taken -= 1
                break
        self.fill(bitmask, start + taken)
        self.rollback(taken)
        return taken


def _allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    word, bit = divmod(token, 32)
    return word < bitmask.shape[1] and bool((int(bitmask[row, word]) >> bit) & 1)


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
