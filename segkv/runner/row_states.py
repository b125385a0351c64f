"""States a drafter keeps for a chain's latest rows until it consumes them (MTP's hidden states,
an EAGLE-3 head's auxiliary states), recorded from the runner's ``hidden_listener``."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class RowStates:
    """The states ``(n, width)`` of a chain's rows ``start ..`` not consumed yet, in the parts
    the forwards gave them."""

    start: int
    parts: list[torch.Tensor] = field(default_factory=list)
    rows: int = 0

    @property
    def end(self) -> int:
        return self.start + self.rows

    def truncate(self, end: int) -> None:
        """Keep the rows before ``end`` (rows trimmed from the chain since)."""
        keep, parts, total = end - self.start, [], 0
        for part in self.parts:
            if total >= keep:
                break
            parts.append(part[: keep - total])
            total += len(parts[-1])
        self.parts, self.rows = parts, total

    def rows_from(self, start: int) -> torch.Tensor:
        """The states of rows ``start .. end`` (``start >= self.start``), ``(end - start, width)``."""
        whole = self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)
        return whole[start - self.start:]

    def drop_before(self, row: int) -> None:
        """Forget the rows before ``row`` (the drafter has what it needs of them)."""
        if row >= self.end:
            self.start, self.parts, self.rows = row, [], 0
        elif row > self.start:
            rest = self.rows_from(row).clone()  # a view would keep the whole forward's states alive
            self.start, self.parts, self.rows = row, [rest], len(rest)


def record_rows(records: weakref.WeakKeyDictionary[Any, RowStates], chains: list, chunks: list[list[int]],
                states: torch.Tensor) -> None:
    """Append each chunk's rows of ``states (T, width)`` (chunks in order, their rows already in
    their chains) to its chain's record: rows trimmed since the record's end are dropped first,
    and a chain whose rows do not follow its record (new, or rows not seen) starts a new one."""
    start = 0
    for chain, chunk in zip(chains, chunks):
        n = len(chunk)
        first = chain.num_rows - n
        rows = states[start : start + n]
        start += n
        record = records.get(chain)
        if record is not None and record.end > first >= record.start:
            record.truncate(first)  # rows trimmed since (rejected drafts)
        if record is None or record.end != first:
            record = records[chain] = RowStates(first)
        record.parts.append(rows)
        record.rows += n
