"""N-gram (prompt lookup) proposals: draft the tokens that followed the sequence's last n tokens before.

The rule (vLLM's ``ngram`` method, SGLang's and transformers' prompt lookup): for n from
``max_n`` down to ``min_n``, find the most recent earlier occurrence of the sequence's last n
tokens (an occurrence starting at i < len - n, so the suffix itself does not count, but an
occurrence may overlap it) and propose up to k of the tokens that followed it; the first n that
matches wins. No match at any n: no proposal (``[]``). A match near the end of the sequence
proposes fewer than k tokens (those that exist).

Example, ``min_n=1, max_n=3, k=3`` on ``[1, 2, 3, 4, 1, 2, 3]``: the last 3 tokens ``1 2 3``
occurred at 0, followed by ``4 1 2`` -> ``[4, 1, 2]``. On ``[5, 6, 5, 7, 5]``: no 3-gram or
2-gram matches; ``5`` occurred last at 2, followed by ``7 5`` -> ``[7, 5]``.

Two implementations of the same rule: :class:`NgramProposer` (stateless: any token list, numpy
per call, O(len) vectorised work) and :class:`NgramIndex` (one per sequence, updated with the
tokens appended and truncated when rejected drafts roll back; a proposal costs O(max_n + k)).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


def _check_sizes(min_n: int, max_n: int) -> None:
    for name, value in (("min_n", min_n), ("max_n", max_n)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if min_n > max_n:
        raise ValueError(f"min_n ({min_n}) must not exceed max_n ({max_n})")


def _check_k(k: int) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")


class NgramProposer:
    """Prompt lookup over any token list (the module docstring's rule); no state between calls.

    ``propose`` compares whole columns with numpy: the candidates are the positions holding the
    suffix's first token, narrowed by each following token, so a call costs O(len) vectorised
    plus O(candidates * n). For one growing sequence, :meth:`new_index` gives an
    :class:`NgramIndex` whose proposals cost O(max_n + k).
    """

    def __init__(self, min_n: int, max_n: int, k: int) -> None:
        _check_sizes(min_n, max_n)
        _check_k(k)
        self.min_n, self.max_n, self.k = min_n, max_n, k

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        """Up to ``k`` drafted tokens for the sequence ``token_ids``; ``[]`` when nothing matches."""
        length = len(token_ids)
        if length <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n:]
            # starts i < length - n: an occurrence other than the suffix, followed by a token
            starts = np.flatnonzero(tokens[: length - n] == suffix[0])
            for j in range(1, n):
                if not starts.size:
                    break
                starts = starts[tokens[starts + j] == suffix[j]]
            if starts.size:
                begin = int(starts[-1]) + n
                return tokens[begin: begin + self.k].tolist()
        return []

    def new_index(self, token_ids: Iterable[int] = ()) -> NgramIndex:
        """An incremental index of these n-gram sizes over ``token_ids`` (extend it as the sequence grows)."""
        return NgramIndex(self.min_n, self.max_n, token_ids)


class NgramIndex:
    """One sequence's n-grams (sizes ``min_n..max_n``) and where each occurred, kept up to date.

    ``extend`` appends tokens, ``truncate`` drops the last ones (rejected drafts), and
    ``propose(k)`` applies the module docstring's rule in O(max_n + k). An n-gram is indexed once
    a token follows it (starts i with i + n < len), so the sequence's own suffix is never its own
    match. Each n-gram keeps its start positions in increasing order; the last is the most recent,
    and truncation pops the positions it removes from the ends of those lists. Memory: one
    position per token per size.
    """

    def __init__(self, min_n: int, max_n: int, token_ids: Iterable[int] = ()) -> None:
        _check_sizes(min_n, max_n)
        self.min_n, self.max_n = min_n, max_n
        self._tokens: list[int] = []
        self._starts: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(min_n, max_n + 1)}
        self.extend(token_ids)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def token_ids(self) -> list[int]:
        """A copy of the indexed sequence."""
        return list(self._tokens)

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append ``token_ids`` to the sequence and index the n-grams they complete."""
        old = len(self._tokens)
        self._tokens.extend(int(t) for t in token_ids)
        tokens, new = self._tokens, len(self._tokens)
        for n, table in self._starts.items():
            # newly indexed starts: i + n < new, not indexed before: i + n >= old
            first, stop = max(0, old - n), new - n
            if first >= stop:
                continue
            keys = zip(*(tokens[first + j: stop + j] for j in range(n)))
            for start, key in enumerate(keys, first):
                table.setdefault(key, []).append(start)

    def append(self, token_id: int) -> None:
        """Append one token."""
        self.extend((token_id,))

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens (roll back rejected drafts); the index is as if
        only those had been appended."""
        if not 0 <= num_tokens <= len(self._tokens):
            raise ValueError(f"num_tokens must be between 0 and {len(self._tokens)}, got {num_tokens}")
        tokens, old = self._tokens, len(self._tokens)
        for n, table in self._starts.items():
            # starts indexed now but not at the new length: num_tokens - n <= i < old - n
            for start in range(old - n - 1, max(0, num_tokens - n) - 1, -1):
                key = tuple(tokens[start: start + n])
                starts = table[key]
                popped = starts.pop()
                assert popped == start, (popped, start)
                if not starts:
                    del table[key]
        del tokens[num_tokens:]

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` drafted tokens for the indexed sequence; ``[]`` when nothing matches."""
        _check_k(k)
        tokens, length = self._tokens, len(self._tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            starts = self._starts[n].get(tuple(tokens[length - n:]))
            if starts:
                begin = starts[-1] + n
                return tokens[begin: begin + k]
        return []
