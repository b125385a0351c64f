"""Conversations: chat turns, forks, snapshots and restores on one KV chain, never re-prefilling."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from segkv.cache.chain import ChainSnapshot
from segkv.cache.tiers import bring_back_chain
from segkv.runner.layer_windows import history_window
from segkv.sessions.snapshot_file import load_snapshot, save_snapshot
from segkv.outputs import CompletionOutput, TurnStats
from segkv.sampling_params import SamplingParams


class ConversationEngine(Protocol):
    """What a conversation uses of its engine (``LLM`` is one): the KV cache, the tokenizer, the
    model runner and generator, the model's fingerprint and the prompt length check."""

    cache: Any
    tokenizer: Any
    runner: Any
    generator: Any
    fingerprint: str

    def check_prompt_length(self, num_tokens: int) -> None: ...


@dataclass(slots=True)
class ConversationSnapshot:
    """A conversation at one moment: its messages, a snapshot of its chain, and the cost of
    its last turn then (so a restore reports the turn that is last again)."""

    messages: tuple[dict, ...]
    chain: ChainSnapshot
    last_stats: TurnStats | None = None

    def release(self) -> None:
        self.chain.release()


@dataclass(slots=True)
class Turn:
    """The reply of one turn and what it cost."""

    text: str
    output: CompletionOutput
    stats: TurnStats


class Conversation:
    """A chat on a KV chain: each turn prefills only tokens the chain does not hold yet.

    The chat template renders the whole message list every turn; the chain's token ids
    are compared with it and only the differing suffix is recomputed (a mismatch, e.g. a
    reply that tokenizes differently when re-rendered, trims the chain back without
    copying). ``fork``, ``snapshot`` and ``restore`` share references and allocate nothing.
    """

    def __init__(self, llm: ConversationEngine, *, system: str | None = None, _chain=None, _messages=None,
                 _last_stats: TurnStats | None = None) -> None:
        self.llm = llm
        self.chain = _chain if _chain is not None else llm.cache.new_chain()
        self.messages: list[dict] = list(_messages or [])
        if system is not None and not self.messages:
            self.messages.append({"role": "system", "content": system})
        # the cost of the turn that ends the conversation now (None: no turn run here)
        self.last_stats: TurnStats | None = _last_stats

    @property
    def num_tokens(self) -> int:
        return self.chain.num_rows

    def say(self, text: str, sampling: SamplingParams | None = None) -> Turn:
        """Add a user message, generate the assistant's reply, and end the turn."""
        if not isinstance(text, str):
            raise ValueError(f"a message must be a string, got {type(text).__name__}")
        params = sampling or SamplingParams(max_tokens=128)
        messages = self.messages + [{"role": "user", "content": text}]
        ids = self.llm.tokenizer.encode_chat(messages, add_generation_prompt=True)
        self.llm.check_prompt_length(len(ids))
        pool, runner = self.llm.cache.pool, self.llm.runner
        before = (pool.pages_in_use, pool.bytes_in_use, pool.bytes_copied, dict(runner.route_counts))
        bring_back_chain(self.llm.cache, self.chain)  # rows moved to the KV tiers (or recomputed)
        cached = self._reuse_prefix(ids)
        seq = self.llm.generator.new_sequence(0, self.chain, ids, ids[cached:], params)
        self.llm.generator.run([seq])
        output = seq.result()
        self.chain.seal()
        self.messages = messages + [{"role": "assistant", "content": output.text}]
        routes = {k: v - before[3].get(k, 0) for k, v in runner.route_counts.items() if v != before[3].get(k, 0)}
        self.last_stats = TurnStats(
            prompt_tokens=len(ids), cached_tokens=cached, new_tokens=len(ids) - cached,
            generated_tokens=len(output.token_ids), pages_added=pool.pages_in_use - before[0],
            bytes_added=pool.bytes_in_use - before[1], bytes_copied=pool.bytes_copied - before[2],
            segments=self.chain.num_segments, routes=routes,
        )
        return Turn(output.text, output, self.last_stats)

    def _reuse_prefix(self, ids: list[int]) -> int:
        """Trim the chain to the longest prefix it shares with ``ids``; return that length.

        At least one token is left to compute, since the next token needs its logits.
        """
        held = self.chain.token_ids() or []
        common = 0
        for a, b in zip(held, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)
        window = history_window(self.llm.runner.model)
        if window is not None and not self.chain.holds_rows_from(common - window):
            common = 0  # a loaded chain whose rows behind its window were released: recompute
        if common < self.chain.num_rows:
            self.chain.trim(self.chain.num_rows - common)
        return common

    def fork(self) -> Conversation:
        """An independent continuation sharing this conversation's history (no copy)."""
        return Conversation(self.llm, _chain=self.chain.fork(), _messages=copy.deepcopy(self.messages),
                            _last_stats=self.last_stats)

    def snapshot(self) -> ConversationSnapshot:
        """The conversation now, to ``restore`` later (references only)."""
        return ConversationSnapshot(tuple(copy.deepcopy(self.messages)), self.chain.snapshot(),
                                    self.last_stats)

    def restore(self, snapshot: ConversationSnapshot) -> None:
        """Go back to ``snapshot`` (e.g. undo turns); allocates and copies nothing."""
        self.chain.restore(snapshot.chain)
        self.messages = [dict(m) for m in copy.deepcopy(snapshot.messages)]
        self.last_stats = snapshot.last_stats

    def save(self, path: str | Path) -> None:
        """Write the conversation (its KV rows, tokens and messages) to a snapshot file."""
        snap = self.snapshot()
        try:
            save_snapshot(path, snap.chain, self.llm.cache, fingerprint=self.llm.fingerprint,
                          metadata={"messages": list(snap.messages)})
        finally:
            snap.release()

    @classmethod
    def load(cls, llm: ConversationEngine, path: str | Path) -> Conversation:
        """A conversation from a snapshot file; errors (other model, damage) change nothing."""
        loaded = load_snapshot(path, llm.cache, fingerprint=llm.fingerprint)
        try:
            conv = cls(llm, _messages=loaded.metadata.get("messages", []))
            conv.chain.restore(loaded.snapshot)
        finally:
            loaded.snapshot.release()
        return conv

    def release(self) -> None:
        """Give the conversation's pages back (shared ones stay with their other holders)."""
        self.chain.release()
