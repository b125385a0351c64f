"""The drafting side of speculative decoding for the generator: its proposers and their counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from segkv.runner.model_runner import ModelRunner
from segkv.runner.mtp import MtpRunner
from segkv.spec.config import SpeculativeConfig
from segkv.spec.draft_model import DraftModelProposer
from segkv.spec.eagle3 import Eagle3Proposer, resolve_head_dir
from segkv.spec.mtp import MtpProposer
from segkv.spec.ngram import NgramIndex, NgramProposer
from segkv.spec.tree import DraftTree
from segkv.tokenizer.tokenizer import Tokenizer


class Sequence(Protocol):
    """What a proposer reads of a sequence (``generation.Sequence`` is one)."""

    history: list[int]
    output_ids: list[int]
    draft_state: object | None

    def all_token_ids(self) -> list[int]: ...


@dataclass(slots=True)
class SpecStats:
    """Counters of verify windows (vLLM's spec-decode metrics): windows verified (``drafts``),
    draft tokens proposed, draft tokens accepted, and accepted drafts per position
    (``accepted_per_position[j]``: windows whose first ``j + 1`` drafts were kept; for a tree
    window, whose kept path reached depth ``j + 1``). A tree's proposed tokens are its nodes."""

    max_drafts: int
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.max_drafts

    def record(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify window: the accepted drafts plus the one drawn after them."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 0.0


class Proposer(Protocol):
    """The drafting side of speculative decoding.

    ``propose(seqs, rooms)``: for each decoding sequence (its tokens so far are
    ``seq.all_token_ids()``, the last of them pending: it has no row in ``seq.chain`` yet), at most
    ``rooms[i]`` draft token ids (an empty list: no drafts this step), or a
    :class:`~segkv.spec.tree.DraftTree` of depth at most ``rooms[i]``. Called once per step with
    every sequence that may speculate. A proposer that keeps state per sequence (a draft model's
    own cache) must not trust it blindly: between two calls a sequence may have been trimmed,
    preempted and recomputed, or forked; compare the tokens it holds with ``all_token_ids()``.

    A proposer that keeps states per target row may also define ``keep_tree_rows(chain, window,
    keep)``: called after a tree window's kept rows (offsets ``keep`` of the chain's last
    ``window`` rows) were moved into place (``KVChain.keep_last_rows``), to move its states alike.
    """

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int] | DraftTree]: ...


class NgramDrafts:
    """:class:`Proposer` of prompt lookup (``segkv.spec.ngram``) over each sequence's own tokens.

    Each sequence keeps an incremental n-gram index (``draft_state``) that takes only the tokens
    generated since the last step, so a step costs the same at any context length. A sequence's
    tokens only grow (trims and preemption drop rows, not tokens), so the index never rolls back."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.lookup = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                                    config.num_speculative_tokens)

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        out = []
        for s, room in zip(seqs, rooms):
            index = s.draft_state
            if not isinstance(index, NgramIndex):
                index = s.draft_state = self.lookup.new_index(s.history)
            index.extend(s.output_ids[len(index) - len(s.history):])
            out.append(index.propose(room))
        return out


def make_proposer(config: SpeculativeConfig | None, runner: ModelRunner, tokenizer: Tokenizer, *,
                  target_dir: str | Path | None = None) -> Proposer | None:
    """The drafting side of ``config`` (None when speculation is off); a draft model runs on the
    target's device in its dtype and must share its tokenizer. ``target_dir``: the target's
    directory, where an EAGLE-3 head ``"default"`` is looked up (``resolve_head_dir``)."""
    if config is None:
        return None
    if config.method == "ngram":
        return NgramDrafts(config)
    if config.method == "draft_model":
        return DraftModelProposer.for_target(config.model, runner, tokenizer)
    if config.method == "eagle3":
        return Eagle3Proposer(resolve_head_dir(config.model, target_dir), runner, topk=config.topk,
                              num_draft_tokens=config.num_draft_tokens)
    if config.method == "mtp":
        return MtpProposer(MtpRunner(runner))
    raise ValueError(f"unknown speculative method {config.method!r}")
