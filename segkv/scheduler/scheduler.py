"""Continuous-batching policy: which sequences run this step and how many tokens each gets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """Limits of one engine step (vLLM's names).

    ``max_num_seqs``: sequences running at once. ``max_num_batched_tokens``: tokens one
    forward may process (decodes first, then prefill chunks). ``max_waiting``: queued
    requests before new ones are refused.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class Schedulable(Protocol):
    """What the policy reads of a sequence."""

    @property
    def num_pending(self) -> int: ...  # tokens that still need KV rows (1 when decoding)


S = TypeVar("S", bound=Schedulable)


@dataclass(slots=True)
class StepDecision:
    """The step's work: ``(sequence, tokens)`` pairs, and which waiting sequences were admitted."""

    work: list
    admitted: list


class Scheduler:
    """Decode-first continuous batching with chunked prefill under a token budget."""

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()

    def decide(self, running: Sequence[S], waiting: Sequence[S]) -> StepDecision:
        """Running decodes first (one token each), then running prefills, then admissions.

        Every scheduled sequence gets at least one token while budget remains; prefills are
        cut to the remaining budget (chunked prefill). Waiting sequences are admitted in
        arrival order while ``max_num_seqs`` allows.
        """
        budget = self.config.max_num_batched_tokens
        work = []
        decodes = [s for s in running if s.num_pending == 1]
        prefills = [s for s in running if s.num_pending > 1]
        for seq in decodes + prefills:
            if budget <= 0:
                break
            take = min(seq.num_pending, budget)
            work.append((seq, take))
            budget -= take
        admitted = []
        slots = self.config.max_num_seqs - len(running)
        for seq in waiting:
            if budget <= 0 or slots <= 0:
                break
            take = min(seq.num_pending, budget)
            work.append((seq, take))
            admitted.append(seq)
            budget -= take
            slots -= 1
        return StepDecision(work, admitted)
