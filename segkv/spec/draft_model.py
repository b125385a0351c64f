"""DraftModelProposer: a smaller model with the target's tokenizer drafts each sequence's greedy continuation.

Each sequence has a *draft chain* in the proposer's own paged cache: rows of the draft model
for the sequence's tokens. A call of :meth:`DraftModelProposer.propose`

1. compares the tokens a draft chain holds with the sequence's ``all_token_ids()`` and trims the
   chain back to their common prefix (rejected drafts, a trimmed, preempted or recomputed
   sequence, a restored conversation), leaving at least the pending (last) token to process;
2. catches up: one batched forward of every sequence's missing tokens, the pending one last
   (prefill chunks); the logits of that last row give the first draft ``d1``;
3. drafts greedily, batched over the sequences: step ``j`` feeds ``d_{j-1}`` and its logits give
   ``d_j``, until each sequence has its ``rooms[i]`` drafts.

The drafted rows stay in the draft chain after the call (``d1 .. d_{k-1}``; ``d_k`` has none):
the next call's prefix comparison trims the rejected ones, and the accepted ones need no
recomputation, which trimming them now and catching them up next call would cost (one forward
row per accepted draft). Drafts are the draft model's greedy tokens, so verification with a
one-hot draft distribution (``draft_probs=None``) is exact at every temperature.

The state is keyed by the sequence's target chain object (``seq.chain``) through a weak
reference, so a draft chain is released when its target chain goes away (the request ended,
was preempted — its chain replaced —, or the conversation holding it was dropped). A chain
also lives across a conversation's turns, so the draft rows of the history are kept for the
next turn. A new chain starts by forking (sharing pages, no copy) the live draft chain with
the longest common prefix (``n > 1`` siblings, a conversation fork). When the draft cache is
out of pages, the least recently used draft chains of other sequences are released; a
sequence that still does not fit gets no drafts this step: the step never fails.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from segkv.cache.chain import KVChain
from segkv.cache.kv_cache import PagedKVCache
from segkv.cache.page_pool import OutOfPagesError
from segkv.config import CacheConfig, default_page_size
from segkv.layers.transfer import to_device
from segkv.models.default_models import check_model_dir, resolve_model_dir
from segkv.models.loader import load_model
from segkv.runner.model_runner import ModelRunner, StepInput
from segkv.spec.chain_states import ChainStates, common_prefix
from segkv.tokenizer.tokenizer import Tokenizer

DEFAULT_DRAFT_CACHE_BYTES = 256 << 20
# text whose token ids both tokenizers must agree on (code, prose, digits, non-ASCII)
_PROBE = "def f(x):\n    return {'a': [1, 2.5]}  # héllo, wörld — 日本語 🙂\n\nThe quick brown fox. 12345"


class DraftSequence(Protocol):
    """What the proposer reads of a sequence: its tokens (the last one pending) and its target
    chain (any weakly referenceable object that stays the same while the sequence's rows do)."""

    chain: Any

    def all_token_ids(self) -> list[int]: ...


@dataclass(slots=True, eq=False)
class _DraftState:
    """One sequence's draft chain and the token of each of its rows."""

    chain: KVChain
    token_ids: list[int]
    key: weakref.ref
    last_used: int = 0

    def trim_to(self, num_rows: int) -> None:
        if num_rows < len(self.token_ids):
            self.chain.trim(len(self.token_ids) - num_rows)
            del self.token_ids[num_rows:]


class DraftModelProposer:
    """Greedy drafts of a draft model (see the module docstring); the :class:`Proposer` protocol.

    ``model_dir``: the draft model (a directory, ``"default"`` or ``"default-mla"``).
    ``target_tokenizer`` and ``target_vocab_size``: the target's, which the draft must share (a
    ValueError naming both models otherwise). ``dtype``/``device``: the target's. The draft cache
    holds ``num_pages`` pages of ``page_size`` rows (default: as many as ``kv_cache_bytes``).
    ``backend``, ``cuda_graphs`` and ``graph_windows``: the draft runner's (``ModelRunner``).
    """

    def __init__(self, model_dir: str | Path, *, target_tokenizer: Tokenizer, target_vocab_size: int,
                 dtype: torch.dtype, device: str | torch.device, target_name: str = "the target model",
                 kv_cache_bytes: int = DEFAULT_DRAFT_CACHE_BYTES, num_pages: int | None = None,
                 page_size: int | None = None, prefill_chunk: int = 512, cuda_graphs: bool | str = False,
                 graph_windows: tuple[int, ...] = (), backend: str = "auto") -> None:
        self.model_dir = check_model_dir(resolve_model_dir(model_dir))
        self.device = torch.device(device)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        _check_same_tokenizer(self.tokenizer, target_tokenizer, draft_name=str(model_dir), target_name=target_name)
        self.model = load_model(self.model_dir, dtype=dtype, device=self.device)
        # ids the draft may propose: the target's logits have no column past its vocabulary
        self.vocab_limit = min(self.model.cfg.vocab_size, target_vocab_size)
        self.max_model_len = self.model.max_model_len
        page_size = default_page_size(self.device.type) if page_size is None else page_size
        layout = self.model.kv_layout(dtype)
        if num_pages is None:
            num_pages = max(1, kv_cache_bytes // (page_size * layout.row_bytes))
        self.cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=num_pages),
                                  device=str(self.device))
        # draft steps are decode steps, and catching up after a window is a window: graphs for both
        self.runner = ModelRunner(self.model, self.cache, device=self.device, backend=backend, cuda_graphs=cuda_graphs,
                                  graph_windows=graph_windows, decode_rows_threshold=max(graph_windows, default=1),
                                  max_model_len=self.max_model_len, prefill_chunk=prefill_chunk)
        # one draft state per live target chain; its lock is held while a call changes the draft cache
        self._states: ChainStates[_DraftState] = ChainStates()

    @classmethod
    def for_target(cls, model_dir: str | Path, runner: ModelRunner, tokenizer: Tokenizer,
                   **kwargs: Any) -> DraftModelProposer:
        """The proposer for the target that ``runner`` runs (its dtype, device and vocabulary, and its
        CUDA graphs: decode steps and the same verify-window sizes, emulated where the target's are)."""
        model = runner.model
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        graphs = runner.graphs
        if graphs is not None:
            kwargs.setdefault("cuda_graphs", "emulate" if graphs.emulate else True)
            kwargs.setdefault("graph_windows", graphs.windows)
            kwargs.setdefault("backend", "triton")  # the backend graphs run
        return cls(model_dir, target_tokenizer=tokenizer, target_vocab_size=model.cfg.vocab_size, dtype=dtype,
                   device=runner.device, target_name=kwargs.pop("target_name", type(model).__name__), **kwargs)

    @property
    def num_sequences(self) -> int:
        """Draft chains held (one per live sequence that was drafted for)."""
        return len(self._states)

    @property
    def evictions(self) -> int:
        """Draft chains released to make room."""
        return self._states.evictions

    def release_all(self) -> None:
        """Release every draft chain (the cache's pages all go back)."""
        self._states.release_all()

    # -- the Proposer protocol ----------------------------------------------------------
    def propose(self, seqs: list[DraftSequence], rooms: list[int]) -> list[list[int]]:
        """Up to ``rooms[i]`` greedy draft tokens for each of ``seqs`` (see the module docstring)."""
        with self._states.lock:
            self._states.begin_call()
            tokens = [s.all_token_ids() for s in seqs]
            # every draft row has a position of the draft model: d_k has no row, so len + k - 1 rows
            rooms = [max(0, min(room, self.max_model_len + 1 - len(ids))) for room, ids in zip(rooms, tokens)]
            states = [self._state_of(s, ids) if room > 0 else None for s, ids, room in zip(seqs, tokens, rooms)]
            active = [i for i, st in enumerate(states) if st is not None]
            for i in active:  # keep the common prefix, and the pending token to process
                states[i].trim_to(min(common_prefix(states[i].token_ids, tokens[i]), len(tokens[i]) - 1))
            active = self._make_room(active, states, tokens, rooms)
            drafts: list[list[int]] = [[] for _ in seqs]
            try:
                self._draft(active, states, tokens, rooms, drafts)
            except OutOfPagesError:  # the forward that failed left its chains as they were
                pass
            return drafts

    # -- internals ----------------------------------------------------------------------
    def _draft(self, active: list[int], states: list[_DraftState | None], tokens: list[list[int]],
               rooms: list[int], drafts: list[list[int]]) -> None:
        """Catch up and draft for ``active`` into ``drafts`` (a failure keeps the drafts made
        before it). Draft steps run from the device's picks (``decode_from_device``): the host
        reads every draft with one copy at the end instead of waiting for each step."""
        if not active:
            return
        inputs = [tokens[i][len(states[i].token_ids):] for i in active]
        logits = self.runner.forward([StepInput(states[i].chain, ids) for i, ids in zip(active, inputs)])
        for i, ids in zip(active, inputs):
            states[i].token_ids.extend(ids)
        picks = logits[:, : self.vocab_limit].argmax(dim=-1)
        columns = [(active, picks)]  # each draft step's sequences and their picks (device)
        step = 1
        try:
            while True:
                prev, prev_picks = columns[-1]
                nxt = [i for i in prev if rooms[i] > step]
                if not nxt:
                    break
                where = {i: n for n, i in enumerate(prev)}
                feed = prev_picks if len(nxt) == len(prev) else prev_picks[
                    to_device([where[i] for i in nxt], torch.long, prev_picks.device)]
                logits = self.runner.decode_from_device([states[i].chain for i in nxt], feed)
                columns.append((nxt, logits[:, : self.vocab_limit].argmax(dim=-1)))
                step += 1
        finally:  # the drafts made, read at once; the draft rows appended get their token ids
            values = torch.cat([c for _, c in columns]).tolist()
            at = 0
            for seqs, c in columns:
                for i in seqs:
                    drafts[i].append(values[at])
                    at += 1
            for i in active:
                fed = drafts[i][:-1]  # every draft but the last was appended as a row
                if fed:
                    states[i].chain.set_last_token_ids(fed)
                    states[i].token_ids.extend(fed)

    def _state_of(self, seq: DraftSequence, ids: list[int]) -> _DraftState:
        """``seq``'s draft state: its own, else a new one forking the live draft chain that shares
        the longest prefix with ``ids`` (no copy), else an empty one."""
        state = self._states.get(seq.chain)
        if state is not None:
            return state
        best, ref, clock = self._states.fork_source(ids), self._states.key_ref(seq.chain), self._states.clock
        if best is None:
            state = _DraftState(self.cache.new_chain(), [], ref, clock)
        else:
            state = _DraftState(best.chain.fork(), list(best.token_ids), ref, clock)
        return self._states.put(seq.chain, state)

    def _make_room(self, active: list[int], states: list[_DraftState | None], tokens: list[list[int]],
                   rooms: list[int]) -> list[int]:
        """The sequences of ``active`` the draft cache has pages for: least recently used draft
        chains of other sequences are released first; those that still do not fit are left out."""
        pool = self.cache.pool
        # rows each adds (its missing tokens, then k - 1 drafts), one more page for a new tail
        need = {i: pool.pages_for_rows(len(tokens[i]) - len(states[i].token_ids) + rooms[i] - 1) + 1
                for i in active}
        total = sum(need.values())
        self._states.evict_idle({id(states[i]) for i in active}, lambda: total <= pool.num_free_pages)
        while active and total > pool.num_free_pages:
            total -= need[active.pop()]
        return active


def _check_same_tokenizer(draft: Tokenizer, target: Tokenizer, *, draft_name: str, target_name: str) -> None:
    """ValueError naming both models unless ``draft`` maps text to ids and ids to text as ``target`` does."""
    checks = [
        ("vocabulary size", draft.vocab_size, target.vocab_size),
        ("special token ids", sorted(draft.special_token_ids), sorted(target.special_token_ids)),
        ("eos token ids", draft.eos_token_ids, target.eos_token_ids),
        ("bos token id", draft.bos_token_id, target.bos_token_id),
        ("pad token id", draft.pad_token_id, target.pad_token_id),
        ("ids of a probe text", draft.encode(_PROBE), target.encode(_PROBE)),
    ]
    for what, mine, theirs in checks:
        if mine != theirs:
            raise ValueError(f"speculative draft model {draft_name!r} does not share the tokenizer of {target_name} "
                             f"(different {what}: {_short(mine)} vs {_short(theirs)}); a draft model must use the "
                             "target's tokenizer")
    # the text of every id (id -> token), compared one id at a time where they differ
    ids = range(target.vocab_size)
    if draft.decode(ids, skip_special_tokens=False) != target.decode(ids, skip_special_tokens=False):
        first = next((i for i in ids if draft.decode([i], skip_special_tokens=False)
                      != target.decode([i], skip_special_tokens=False)), None)
        raise ValueError(f"speculative draft model {draft_name!r} does not share the tokenizer of {target_name} "
                         f"(token id {first} differs); a draft model must use the target's tokenizer")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
