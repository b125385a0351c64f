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
4. or, with ``topk`` > 1, a tree (EAGLE-2's dynamic tree, as SGLang drafts it; a
   :class:`~segkv.spec.tree.DraftTree` per sequence). Depth 1: the ``topk`` best tokens of the
   draft vocabulary's log-softmax at the last target row, each scored by its log-probability.
   Each further depth ``d`` expands the frontier (the ``topk`` best nodes of depth ``d - 1`` by
   score; all of depth 1): one head forward for the whole batch appends a head row per frontier
   node at position ``last + d - 1``, reading its parent's head output and its own token and
   attending the head's history and its ancestors' rows only (a tree query whose rows are the
   tree's newest nodes, ``SequenceQuery.tree_parents``); each row's ``topk`` best tokens are
   candidates scored ``parent's score + log-probability``, and the best ``topk`` of the
   ``topk ** 2`` become the next frontier. The tree is the ``num_draft_tokens - 1`` best nodes of
   all those created (the unexpanded candidates too), ties going to the earlier-created node, in
   depth then creation order: a child's score never exceeds its parent's (log-probabilities are
   clamped to <= 0) and a parent is created first, so the pick keeps every node's ancestors.
   Scores and tokens stay on the device, selections are torch ops batched over the sequences,
   and the tree comes over in one copy at the end; the attention plan is built on the host, so
   each depth also copies which frontier node each new row's parent is (``(B, topk)`` ints).

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


class Eagle3Proposer:
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

    def _tree_nodes(self, room: int) -> int:
        """The nodes of a tree drafted with ``room`` levels at most (before the levels' own limit)."""
        if self.num_draft_tokens is not None:
            return self.num_draft_tokens - 1
        return min(self.topk * room, MAX_TREE_NODES)

    def _draft_trees(self, work: list[_Work], hidden: torch.Tensor, drafts: list[list[int] | DraftTree]) -> None:
        """Draft a top-k tree per item from ``hidden (len(work), hidden)`` (each item's head output at
        its last target row) into ``drafts`` (see the module docstring). A level's head rows are
        appended to the item's chain and every one is trimmed at the end; a failure (no pages for a
        level's rows) keeps the levels drafted so far."""
        k, device = self.topk, hidden.device
        width = hidden.shape[-1]
        # levels[d - 1]: (items (positions in work), scores (n, c) float32, target ids (n, c) int64,
        # parents (n, c) int64: each node's parent's creation index, -1 at depth 1); c = k at depth 1,
        # k * k deeper. A node's creation index is its column in the levels concatenated.
        scores, ids = self._top(hidden, k)
        levels = [(list(range(len(work))), scores, ids, torch.full_like(ids, -1))]
        # the frontier (the nodes the next level expands), per item in ``items``: scores (n, k), ids
        # (n, k), creation indices (n, k), the head output each node's row reads (n, k, width), and
        # (host) each node's parent's draft row (-1: the last history row)
        items = levels[0][0]
        front = (scores, ids, torch.arange(k, device=device).expand(len(work), k),
                 hidden[:, None].expand(len(work), k, width))
        front_rows = [[-1] * k for _ in work]
        rows: list[list[int]] = [[] for _ in work]  # each item's draft rows' parents (draft row indices)
        try:
            for depth in range(2, max(w.room for w in work) + 1):
                keep = [r for r, m in enumerate(items) if work[m].room >= depth]
                if len(keep) != len(items):
                    index = to_device(keep, torch.long, device)
                    front = tuple(t[index] for t in front)
                    front_rows = [front_rows[r] for r in keep]
                    items = [items[r] for r in keep]
                f_scores, f_ids, f_created, f_hidden = front
                n = len(items)
                parents = [tuple(rows[m] + f) for m, f in zip(items, front_rows)]
                out = self._head_step([work[m].state.chain for m in items], f_hidden.reshape(n * k, width), None,
                                      [work[m].state.covered - 2 + depth for m in items for _ in range(k)],
                                      [k] * n, device_ids=f_ids.reshape(n * k), tree_parents=parents)
                for m, p in zip(items, parents):
                    rows[m] = list(p)
                logp, child_ids = self._top(out, k)  # (n * k, k): each frontier node's children
                cum = (f_scores[:, :, None] + logp.view(n, k, k)).view(n, k * k)
                child_ids = child_ids.view(n, k * k)
                levels.append((items, cum, child_ids, f_created.repeat_interleave(k, dim=1)))
                if not any(work[m].room > depth for m in items):
                    break
                # the next frontier: the k best candidates (ties: the earlier-created)
                local = torch.sort(cum, dim=1, descending=True, stable=True).indices[:, :k]
                slot = local // k  # the frontier node each one is a child of
                offset = k + (depth - 2) * k * k  # the creation index of this level's first candidate
                front = (cum.gather(1, local), child_ids.gather(1, local), local + offset,
                         out.view(n, k, width)[torch.arange(n, device=device)[:, None], slot])
                # the plan is built on the host: each new row's parent row is this level's row of its slot
                base = (depth - 2) * k
                front_rows = [[base + j for j in js] for js in slot.tolist()]
        except OutOfPagesError:  # no room for a level's rows: the levels so far stand
            pass
        finally:
            for w, r in zip(work, rows):
                if r:
                    w.state.chain.trim(len(r))
            self._collect_trees(work, levels, drafts)

    def _collect_trees(self, work: list[_Work], levels: list, drafts: list[list[int] | DraftTree]) -> None:
        """Pick each item's best nodes of ``levels`` (see :meth:`_draft_trees`) into a DraftTree: one
        device-to-host copy."""
        device, size = levels[0][1].device, len(work)
        counts = [0] * size  # nodes created per item
        scores, ids, parents = [], [], []
        for items, s, t, p in levels:
            index = to_device(items, torch.long, device)
            for full, part, fill in ((scores, s, float("-inf")), (ids, t, 0), (parents, p, -1)):
                full.append(part.new_full((size, part.shape[1]), fill).index_copy_(0, index, part))
            for m in items:
                counts[m] += s.shape[1]
        scores, ids, parents = torch.cat(scores, 1), torch.cat(ids, 1), torch.cat(parents, 1)
        wanted = [min(self._tree_nodes(w.room), c) for w, c in zip(work, counts)]
        # best first, ties to the earlier-created; a row's padding (-inf, after its own columns) is never
        # among its first ``wanted`` picks
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :max(wanted)]
        picked = torch.stack([order, ids.gather(1, order), parents.gather(1, order)]).tolist()
        for m, (w, n) in enumerate(zip(work, wanted)):
            nodes = sorted(zip(picked[0][m][:n], picked[1][m][:n], picked[2][m][:n]))  # depth, then creation
            new = {created: i for i, (created, _, _) in enumerate(nodes)}
            drafts[w.index] = DraftTree(tuple(t for _, t, _ in nodes),
                                        tuple(-1 if p < 0 else new[p] for _, _, p in nodes))

    def _top(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` best tokens of head outputs ``hidden (N, hidden)``: their log-probabilities over
        the draft vocabulary ``(N, k)`` float32 (clamped to <= 0, so a child never outscores its
        parent), best first, and their target ids ``(N, k)`` int64."""
        logp = torch.log_softmax(self.head.compute_logits(hidden).float(), dim=-1)
        values, draft_ids = logp.topk(k, dim=-1)
        return values.clamp_(max=0.0), self.head.draft_to_target(draft_ids)

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
