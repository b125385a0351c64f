"""Eagle3Proposer: greedy chains or top-k trees drafted by an EAGLE-3 head over the target's auxiliary
hidden states.

The head (``segkv/models/eagle3.py``) reads, for target row ``t``, the target's three auxiliary
hidden states (``CausalLM.set_aux_hidden_layers``) fused into one and the embedding of token
``t + 1``. The target's forwards report those states for every row they compute (the runner's
``hidden_listener``; no extra pass), and the proposer keeps them, per target chain, until the
row's next token is known. A call of :meth:`Eagle3Proposer.propose`

1. compares the tokens a head state holds with the sequence's ``all_token_ids()`` and trims the
   head's rows back to their common prefix (rejected drafts, a trimmed or recomputed sequence);
2. catches up: the head rows of the target rows it lacks, batched over the sequences (chunks of
   at most :data:`CATCH_UP_CHUNK` rows each). Row ``t``'s input is ``fuse(aux_t)`` and the
   embedding of token ``t + 1``, at position ``t``; the output at the last target row (whose next
   token is the pending one) gives the first draft;
3. drafts, with ``topk`` 1, one greedy chain: step ``j`` appends one head row at position
   ``last + j`` whose inputs are the head's previous output and the previous draft's embedding,
   as training-time test trained it. Drafts are the argmax of the head's logits mapped to target
   ids (``compute_target_logits``'s argmax: ids off the draft vocabulary are ``-inf`` there), kept
   on the device until the last is drawn: one device-to-host copy per call; a list per sequence;
4. or, with ``topk`` > 1, a top-k tree (EAGLE-2's dynamic tree, a
   :class:`~segkv.spec.tree.DraftTree` per sequence; ``segkv/spec/eagle3_tree.py``).

Drafts are deterministic, so verification with one-hot draft probabilities (a tree's: the
siblings' masses) is exact at every temperature.

The draft rows (steps ``j >= 1``, every tree row) are trimmed after each call, on failure too:
their input is the head's own output, not the target's states, so they are not the rows a
catch-up writes for an accepted token, and keeping them (as the draft model does) would give
later drafts a worse history.

Head states are keyed weakly by the sequence's target chain, like ``DraftModelProposer``'s: a
state is released with its target chain, a new chain forks the live head state with the longest
common prefix (``n > 1`` siblings), and the least recently used states of other sequences are
released when the head's cache is out of pages. A sequence whose last target row has no recorded
auxiliary state (a fork, rows written before drafting began, a history taken from the prefix
cache) proposes nothing that step; older rows without one are skipped (the head's history has a
hole there, which costs acceptance, never correctness).
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from segkv.attention.device import DeviceSpec
from segkv.attention.metadata import AttentionMetadata
from segkv.attention.plan import SequenceQuery
from segkv.attention.planner import plan_attention
from segkv.attention.reference import TorchReferenceBackend
from segkv.cache.chain import KVChain
from segkv.cache.kv_cache import PagedKVCache
from segkv.cache.page_pool import OutOfPagesError
from segkv.config import CacheConfig, default_page_size
from segkv.layers.transfer import to_device
from segkv.models.default_models import GQA_NAME, MLA_NAME, PACKAGE_ROOT, packaged_dir
from segkv.models.eagle3 import Eagle3Head
from segkv.models.eagle3_loading import load_eagle3_head
from segkv.runner.model_runner import PENDING_TOKEN, ModelRunner
from segkv.runner.row_states import RowStates, record_rows
from segkv.spec.chain_states import ChainStates, common_prefix
from segkv.spec.config import MAX_TOPK, MAX_TREE_NODES
from segkv.spec.draft_model import DraftSequence
from segkv.spec.eagle3_tree import TreeDrafting
from segkv.spec.tree import DraftTree

DEFAULT_HEAD_CACHE_BYTES = 64 << 20
# the most head rows one sequence catches up per forward (a long prompt: attention scores of
# this many query rows at once)
CATCH_UP_CHUNK = 512
BUILT_IN_HEADS = {GQA_NAME: "eagle3-default", MLA_NAME: "eagle3-default-mla"}
DEFAULT_HEAD = "default"


def resolve_head_dir(model: str | Path, target_dir: str | Path | None) -> Path:
    """The head directory of ``model``: a path, or ``"default"``: the built-in head of the built-in
    target in ``target_dir``. ValueError when the target has no built-in head, or a directory
    lacks ``config.json``."""
    if str(model) == DEFAULT_HEAD:
        target = None if target_dir is None else Path(target_dir).resolve()
        name = next((n for n in BUILT_IN_HEADS if target == packaged_dir(n).resolve()), None)
        if name is None:
            raise ValueError(f"speculative method 'eagle3': model 'default' picks the built-in head of a built-in "
                             f"target ({', '.join(BUILT_IN_HEADS)}); {target_dir} has none: give the head's "
                             f"directory")
        return PACKAGE_ROOT / BUILT_IN_HEADS[name]
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"speculative method 'eagle3': the head directory '{model}' "
                         f"{'has no config.json' if path.is_dir() else 'does not exist'}")
    return path


@dataclass(slots=True, eq=False)
class _HeadState:
    """One sequence's head rows: their chain, the target row of each, and the tokens they read.

    ``covered``: target rows ``0 .. covered - 1`` are done (a head row each, or skipped: no
    recorded state); ``token_ids``: the sequence's first ``covered + 1`` tokens (empty while
    ``covered == 0``), which those rows were computed from."""

    chain: KVChain
    key: weakref.ref
    positions: list[int] = field(default_factory=list)
    covered: int = 0
    token_ids: list[int] = field(default_factory=list)
    last_used: int = 0

    def trim_to(self, covered: int) -> None:
        if covered < self.covered:
            keep = bisect.bisect_left(self.positions, covered)
            self.chain.trim(len(self.positions) - keep)
            del self.positions[keep:]
            self.covered = covered
            del self.token_ids[covered + 1 if covered else 0:]


@dataclass(slots=True)
class _Work:
    """A sequence being drafted for: its index in the call, state, first target row to catch up
    (``start``), the states of rows ``start .. last`` and their next tokens, and its room."""

    index: int
    state: _HeadState
    record: RowStates
    tokens: list[int]
    start: int
    aux: torch.Tensor
    next_ids: list[int]
    room: int

    def mark_done(self, covered: int) -> None:
        """Target rows before ``covered`` are done: the state reads tokens through ``covered``."""
        state = self.state
        state.covered = covered
        state.token_ids.extend(self.tokens[len(state.token_ids): covered + 1])


class Eagle3Proposer(TreeDrafting):
    """Greedy chains or top-k trees drafted by an EAGLE-3 head (see the module docstring); the
    :class:`Proposer` protocol. ``runner``: the target's; the proposer sets the target's auxiliary
    hidden layers and becomes the runner's ``hidden_listener``. ``head_dir``: the head's directory
    (checked against the target: ValueErrors name the field). The head's cache holds
    ``num_pages`` pages (default: as many as ``kv_cache_bytes``) of the target cache's page size.
    Where the target replays CUDA graphs, the head's forwards replay graphs of their own
    (:class:`~segkv.runner.cuda_graphs.Eagle3Graphs`); steps no graph holds run eagerly.

    ``topk`` (``SpeculativeConfig.topk``, 1..16): 1 drafts chains (lists), more drafts trees
    (:class:`DraftTree`) of ``num_draft_tokens - 1`` nodes (``SpeculativeConfig.num_draft_tokens``,
    the verify window with the pending token; default ``1 + topk * depth``), at most 64, and fewer
    when the call's room (a tree's depth) cannot create that many."""

    def __init__(self, head_dir: str | Path, runner: ModelRunner, *, kv_cache_bytes: int = DEFAULT_HEAD_CACHE_BYTES,
                 num_pages: int | None = None, page_size: int | None = None, topk: int = 1,
                 num_draft_tokens: int | None = None) -> None:
        if not 1 <= topk <= MAX_TOPK:
            raise ValueError(f"speculative method 'eagle3': topk must be between 1 and {MAX_TOPK}, got {topk}")
        if num_draft_tokens is not None and not 2 <= num_draft_tokens <= MAX_TREE_NODES + 1:
            raise ValueError(f"speculative method 'eagle3': num_draft_tokens must be between 2 and "
                             f"{MAX_TREE_NODES + 1}, got {num_draft_tokens}")
        self.topk = topk
        self.num_draft_tokens = num_draft_tokens
        target = runner.model
        if not hasattr(target, "set_aux_hidden_layers"):
            raise ValueError(f"speculative method 'eagle3' needs a target that returns auxiliary hidden states; "
                             f"{type(target).__name__} does not")
        dtype = next(p.dtype for p in target.parameters() if p.is_floating_point())
        self.device = runner.device
        try:
            self.head: Eagle3Head = load_eagle3_head(head_dir, target, dtype=dtype, device=self.device)
        except FileNotFoundError as exc:  # a head directory without its weights: bad input too
            raise ValueError(f"speculative method 'eagle3': {exc}") from None
        page_size = page_size or runner.cache.page_size or default_page_size(self.device.type)
        layout = self.head.kv_layout(dtype)
        if num_pages is None:
            num_pages = max(1, kv_cache_bytes // (page_size * layout.row_bytes))
        self.cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=num_pages),
                                  device=str(self.device))
        self.backend = self._make_backend(runner)
        self.device_spec = DeviceSpec.detect(self.device)
        self.shape = self.head.attention_shape()
        self.graphs = self._make_graphs(runner)
        target.set_aux_hidden_layers(self.head.aux_layer_ids)
        self._aux: weakref.WeakKeyDictionary[Any, RowStates] = weakref.WeakKeyDictionary()
        runner.hidden_listener = self._record
        # one head state per live target chain; its lock is held while a call changes the head cache
        self._states: ChainStates[_HeadState] = ChainStates()

    def _make_graphs(self, runner: ModelRunner):
        """Where the target replays CUDA graphs, the head's forwards replay their own
        (:class:`~segkv.runner.cuda_graphs.Eagle3Graphs`): one-row chain steps in decode buckets;
        catch-ups of up to a verify window's rows and tree levels (``topk`` rows) in window buckets."""
        main = runner.graphs
        if main is None:
            return None
        from segkv.runner.cuda_graphs import Eagle3Graphs

        windows = {w for w in (*main.windows, self.topk) if w >= 2}
        return Eagle3Graphs(self.head, self.cache, self.device_spec, device=self.device,
                            max_model_len=main.max_model_len, buckets=main.buckets, windows=tuple(windows),
                            emulate=main.emulate)

    def _make_backend(self, runner: ModelRunner):
        """The Triton backend where the target runs it on CUDA; the torch reference elsewhere (eager
        head steps; graph replays, emulated ones too, run their buckets' Triton backends)."""
        if runner.backend.name == "triton" and self.device.type == "cuda":
            from segkv.attention.triton_backend import TritonBackend

            return TritonBackend(page_size=self.cache.page_size, device=self.device)
        return TorchReferenceBackend(page_size=self.cache.page_size, device=self.device)

    @property
    def num_sequences(self) -> int:
        """Head states held (one per live sequence that was drafted for)."""
        return len(self._states)

    @property
    def evictions(self) -> int:
        """Head states released to make room."""
        return self._states.evictions

    def release_all(self) -> None:
        """Release every head state (the head cache's pages all go back)."""
        self._states.release_all()

    # -- the target's states ------------------------------------------------------------
    def _record(self, chains: list[KVChain], chunks: list[list[int]], aux: torch.Tensor) -> None:
        """Keep each chunk's auxiliary states (``aux (T, width)``, chunks in order)."""
        record_rows(self._aux, chains, chunks, aux)

    def keep_tree_rows(self, chain: KVChain, window: int, keep: list[int]) -> None:
        """A tree verify window's kept rows moved into place (``chain.keep_last_rows(window, keep)``,
        already done): their recorded auxiliary states move the same way, so that the head catches
        up the accepted path's states, not those of the nodes the window held at those rows."""
        record = self._aux.get(chain)
        if record is None:
            return
        base = chain.num_rows - len(keep)  # the window's first row
        if record.start > base or record.end != base + window:  # not the window's states: drop them
            record.truncate(base)  # (the head then drafts nothing until new rows are recorded)
            return
        kept = record.rows_from(base)[to_device(keep, torch.long, record.parts[0].device)]
        record.truncate(base)
        record.parts.append(kept)
        record.rows += len(keep)

    # -- the Proposer protocol ----------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[DraftSequence], rooms: list[int]) -> list[list[int] | DraftTree]:
        """For each of ``seqs``: with ``topk`` 1, up to ``rooms[i]`` greedy draft tokens; else a
        :class:`DraftTree` of depth at most ``rooms[i]`` (see the module docstring). ``[]``: no drafts."""
        with self._states.lock:
            self._states.begin_call()
            drafts: list[list[int] | DraftTree] = [[] for _ in seqs]
            work = []
            for i, (seq, room) in enumerate(zip(seqs, rooms)):
                item = self._work_of(i, seq, room) if room > 0 else None
                if item is not None:
                    work.append(item)
            work = self._make_room(work)
            if work:
                try:
                    hidden = self._catch_up(work)
                except OutOfPagesError:  # the chunk that failed left its chains as they were
                    return drafts
                if self.topk == 1:
                    self._draft(work, hidden, drafts)
                else:
                    self._draft_trees(work, hidden, drafts)
            return drafts

    def _work_of(self, index: int, seq: DraftSequence, room: int) -> _Work | None:
        """What ``seq`` needs caught up (None: its last row's state is unknown, so no drafts)."""
        tokens = seq.all_token_ids()
        rows = seq.chain.num_rows  # the target's rows: every token but the pending one
        record = self._aux.get(seq.chain)
        if record is not None and record.end > rows:
            record.truncate(rows)
        if record is None or record.end != rows or rows == 0 or len(tokens) != rows + 1:
            return None
        state = self._state_of(seq, tokens)
        state.trim_to(min(state.covered, max(common_prefix(state.token_ids, tokens) - 1, 0), rows))
        start = max(state.covered, record.start)  # rows before the record's have no state: skipped
        if start >= rows:  # the head is up to date, yet the last row must be its input: recompute it
            state.trim_to(rows - 1)
            start = rows - 1
            if start < record.start:
                return None
        item = _Work(index, state, record, tokens, start, record.rows_from(start), tokens[start + 1: rows + 1], room)
        item.mark_done(start)
        return item

    def _catch_up(self, work: list[_Work]) -> torch.Tensor:
        """Write the head rows of every ``work`` item's missing target rows; returns the head's
        output at each one's last row, ``(len(work), hidden)``."""
        done = [0] * len(work)
        last: list[torch.Tensor | None] = [None] * len(work)
        while any(d < len(w.next_ids) for d, w in zip(done, work)):
            active = [n for n, w in enumerate(work) if done[n] < len(w.next_ids)]
            spans = [(done[n], min(done[n] + CATCH_UP_CHUNK, len(work[n].next_ids))) for n in active]
            fused = self.head.fuse(torch.cat([work[n].aux[a:b] for n, (a, b) in zip(active, spans)]))
            ids = [t for n, (a, b) in zip(active, spans) for t in work[n].next_ids[a:b]]
            positions = [work[n].start + r for n, (a, b) in zip(active, spans) for r in range(a, b)]
            out = self._head_step([work[n].state.chain for n in active], fused, ids, positions,
                                  [b - a for a, b in spans])
            end = 0
            for n, (a, b) in zip(active, spans):
                end += b - a
                work[n].state.positions += range(work[n].start + a, work[n].start + b)
                work[n].mark_done(work[n].start + b)
                done[n] = b
                if b == len(work[n].next_ids):
                    last[n] = out[end - 1]
        for w in work:  # the head holds these rows now; the last one's state stays, to recompute
            w.record.drop_before(w.state.covered - 1)  # its output if a step comes without new rows
        return torch.stack(last)

    def _draft(self, work: list[_Work], hidden: torch.Tensor, drafts: list[list[int]]) -> None:
        """Draft greedily from ``hidden`` (each item's output at its last row) into ``drafts``; draft
        rows are appended for steps ``1..`` and trimmed at the end (a failure keeps the drafts so far)."""
        picks = self._pick(hidden)
        columns = [(list(range(len(work))), picks)]  # each step's items (positions in work) and picks
        appended = [0] * len(work)
        step = 1
        try:
            while True:
                prev, prev_picks = columns[-1]
                nxt = [n for n in prev if work[n].room > step]
                if not nxt:
                    break
                if len(nxt) != len(prev):
                    index = to_device([prev.index(n) for n in nxt], torch.long, hidden.device)
                    hidden, prev_picks = hidden[index], prev_picks[index]
                positions = [work[n].state.covered - 1 + step for n in nxt]
                hidden = self._head_step([work[n].state.chain for n in nxt], hidden, None, positions,
                                         [1] * len(nxt), device_ids=prev_picks)
                for n in nxt:
                    appended[n] += 1
                columns.append((nxt, self._pick(hidden)))
                step += 1
        except OutOfPagesError:  # no room for a draft row: the drafts so far stand
            pass
        finally:
            for w, n in zip(work, appended):
                if n:
                    w.state.chain.trim(n)
            values = torch.cat([c for _, c in columns]).tolist()
            at = 0
            for items, _ in columns:
                for n in items:
                    drafts[work[n].index].append(values[at])
                    at += 1

    def _pick(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy target ids ``(N,)`` int64 of head outputs ``hidden (N, hidden)``: the argmax of the
        draft logits mapped to the target vocabulary (the argmax of ``compute_target_logits``)."""
        return self.head.draft_to_target(self.head.compute_logits(hidden).argmax(dim=-1))

    def _head_step(self, chains: list[KVChain], hidden: torch.Tensor, ids: list[int] | None,
                   positions: list[int], widths: list[int], *, device_ids: torch.Tensor | None = None,
                   tree_parents: list[tuple[int, ...]] | None = None) -> torch.Tensor:
        """One head forward: ``widths[i]`` rows appended to ``chains[i]`` at ``positions`` (flat),
        reading ``hidden (T, hidden)`` and the next tokens ``ids`` (or ``device_ids (T,)`` int64 on
        the device); returns ``(T, hidden)``. ``tree_parents[i]`` (a tree's level): the parents of
        chain ``i``'s draft rows this call (its last ``widths[i]`` the new ones), as
        ``SequenceQuery.tree_parents`` takes them; default causal. On failure every chain is left
        as it was."""
        slots, queries, appended = [], [], []
        try:
            at = 0
            for chain, width in zip(chains, widths):
                tokens = [PENDING_TOKEN] * width if ids is None else ids[at: at + width]
                slots += chain.append(width, token_ids=tokens)
                appended.append((chain, width))
                tree = None if tree_parents is None else tree_parents[len(queries)]
                queries.append(SequenceQuery.from_chain(chain, width, tree_parents=tree))
                at += width
            plan = plan_attention(queries, self.shape, self.device_spec, page_size=self.cache.page_size)
            out = self._replay(plan, widths, ids, positions, slots, hidden, device_ids)
            if out is not None:
                return out
            meta = AttentionMetadata(backend=self.backend, prepared=self.backend.prepare(plan),
                                     storage=self.cache.storage, slots=to_device(slots, torch.long, self.device))
            next_ids = device_ids if device_ids is not None else to_device(ids, torch.long, self.device)
            return self.head(hidden, next_ids, to_device(positions, torch.long, self.device), meta)
        except BaseException:
            for chain, width in appended:
                chain.trim(width)
            raise

    def _replay(self, plan, widths: list[int], ids: list[int] | None, positions: list[int], slots: list[int],
                hidden: torch.Tensor, device_ids: torch.Tensor | None) -> torch.Tensor | None:
        """The head step's output from a CUDA-graph replay, or None when no graph holds it (no
        graphs, a catch-up wider than every window, a plan over a bucket's capacity)."""
        graphs = self.graphs
        if graphs is None:
            return None
        flat = [PENDING_TOKEN] * len(positions) if ids is None else ids
        # a grouped-query head: the mode only has to be one the graphs replay (naive MLA is not)
        if max(widths) == 1:
            return graphs.run(flat, positions, slots, plan, "absorbed", hidden_in=hidden, device_ids=device_ids)
        if max(widths) <= max(graphs.windows, default=0):
            return graphs.run_window(widths, flat, positions, slots, plan, "absorbed", list(range(len(positions))),
                                     hidden_in=hidden, device_ids=device_ids)
        return None

    # -- head states ----------------------------------------------------------------------
    def _state_of(self, seq: DraftSequence, ids: list[int]) -> _HeadState:
        """``seq``'s head state: its own, else a new one forking the live state that shares the
        longest prefix with ``ids`` (no copy), else an empty one."""
        state = self._states.get(seq.chain)
        if state is not None:
            return state
        best, ref, clock = self._states.fork_source(ids), self._states.key_ref(seq.chain), self._states.clock
        if best is None:
            state = _HeadState(self.cache.new_chain(), ref, last_used=clock)
        else:
            state = _HeadState(best.chain.fork(), ref, list(best.positions), best.covered, list(best.token_ids),
                               clock)
        return self._states.put(seq.chain, state)

    def _make_room(self, work: list[_Work]) -> list[_Work]:
        """The items of ``work`` the head cache has pages for: least recently used head states of
        other sequences are released first; those that still do not fit are left out."""
        pool = self.cache.pool
        need = {id(w): pool.pages_for_rows(len(w.next_ids) + self.topk * (w.room - 1)) + 1 for w in work}
        total = sum(need.values())
        self._states.evict_idle({id(w.state) for w in work}, lambda: total <= pool.num_free_pages)
        while work and total > pool.num_free_pages:
            total -= need[id(work.pop())]
        return work
