"""Compaction policy: which trailing segments of a chain to merge after a turn is sealed."""

from __future__ import annotations

from collections.abc import Sequence

from segkv.config import CompactionPolicy


def segments_to_merge(ref_rows: Sequence[int], policy: CompactionPolicy) -> int:
    """How many trailing references to merge into one (0 or 1 means none).

    ``ref_rows`` are the row counts of a chain's sealed references, oldest first. Merging
    proceeds like a binary counter: the newest run absorbs its predecessor while the
    predecessor holds fewer than ``policy.ratio`` times the run's rows. Sizes therefore
    grow geometrically towards the past and at most ``log_ratio(total / smallest) + 1``
    copyable segments remain. A reference with more than ``policy.max_copy_rows`` rows
    is never absorbed, so the big history segment is never copied and one merge copies
    at most ``max_copy_rows`` rows.
    """
    if not policy.enabled or len(ref_rows) < 2:
        return 0
    run_rows = ref_rows[-1]
    if run_rows > policy.max_copy_rows:
        return 0
    count = 1
    for rows in reversed(ref_rows[:-1]):
        if rows > policy.max_copy_rows or rows >= policy.ratio * run_rows:
            break
        if run_rows + rows > policy.max_copy_rows:
            break
        run_rows += rows
        count += 1
    return count if count >= 2 else 0
