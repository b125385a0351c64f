"""ModelRunner: turns a batch of (chain, new tokens) into one forward pass over the paged cache."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from segkv.attention.backend import AttentionBackend
from segkv.attention.device import DeviceSpec
from segkv.attention.metadata import AttentionMetadata
from segkv.attention.plan import AttentionPlan, Route, SequenceQuery
from segkv.attention.planner import plan_attention
from segkv.attention.reference import TorchReferenceBackend
from segkv.attention.triton_backend import flatten_plan
from segkv.cache.chain import KVChain
from segkv.cache.kv_cache import PagedKVCache
from segkv.cache.page_pool import OutOfPagesError
from segkv.config import default_prefill_chunk
from segkv.runner.layer_windows import layer_windows
from segkv.runner.tp_steps import broadcast_step, broadcast_tensor
from segkv.layers.transfer import to_device

MLA_MODES = ("auto", "absorbed", "naive")
# token id recorded for a row whose token is still on the device (``decode_from_device``)
PENDING_TOKEN = -1
BACKENDS = ("auto", "torch", "triton")


@dataclass(slots=True)
class StepInput:
    """One sequence's share of a forward: its chain and the new token ids to process.

    ``tree_parents`` makes the tokens a tree verify window (``SequenceQuery.tree_parents``): one
    entry per token, the index of its parent among them, ``-1`` for a child of the chain's last
    row. Every token gets a KV row, in order; its position is the chain's length plus its depth
    (the root tokens' depth is 0), and it attends the history and its ancestors-or-self only.
    A tree must fit one forward (``prefill_chunk`` tokens)."""

    chain: KVChain
    token_ids: list[int]
    tree_parents: tuple[int, ...] | None = None




class ModelRunner:
    """Runs the model over chains: appends the new rows, plans attention, computes logits.

    Long inputs are processed in chunks of at most ``prefill_chunk`` tokens per sequence,
    so scores never exist for a whole prompt at once; history is attended as pieces (default:
    ``config.default_prefill_chunk`` of the device).
    ``fused_ops`` (default: on CUDA) stacks the q/k/v and gate/up projections and runs RMSNorm,
    SiLU-and-mul and RoPE with the cache write as single Triton kernels (``CausalLM.use_fused_ops``).
    ``cuda_graphs`` replays decode steps, and verify windows of the ``graph_windows`` sizes (rows
    per sequence), from CUDA graphs (``runner/cuda_graphs.py``). ``decode_rows_threshold``: the
    widest step per sequence that MLA runs absorbed (decode and verify windows), not naive.
    """

    def __init__(
        self,
        model: nn.Module,
        cache: PagedKVCache,
        *,
        device: str | torch.device = "cpu",
        route: Route | str | None = None,
        mla_mode: str = "auto",
        prefill_chunk: int | None = None,
        decode_rows_threshold: int = 1,
        backend: str = "auto",
        cuda_graphs: bool | str = False,
        graph_windows: tuple[int, ...] = (),
        max_model_len: int | None = None,
        fused_ops: bool | None = None,
    ) -> None:
        if mla_mode not in MLA_MODES:
            raise ValueError(f"mla_mode must be one of {MLA_MODES}, got {mla_mode!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if prefill_chunk is None:
            prefill_chunk = default_prefill_chunk(torch.device(device).type)
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model = model
        self.cache = cache
        self.device = torch.device(device)
        self.route = Route.parse(route) if route is not None else None
        self.mla_mode = mla_mode
        self.prefill_chunk = prefill_chunk
        self.decode_rows_threshold = decode_rows_threshold
        self.backend: AttentionBackend = self._make_backend(backend, cache)
        if cache.layout.kind not in self.backend.capabilities.kv_layouts:
            raise ValueError(f"the {self.backend.name} attention backend does not attend "
                             f"{cache.layout.kind!r} caches")
        # fused kernels and stacked projections: on by default on CUDA, where launches dominate
        self.fused_ops = self.device.type == "cuda" if fused_ops is None else bool(fused_ops)
        if self.fused_ops and hasattr(model, "use_fused_ops"):
            model.use_fused_ops()
        self.device_spec = DeviceSpec.detect(self.device)
        self.last_plan: AttentionPlan | None = None
        self.route_counts: Counter[str] = Counter()
        self.precision_counts: Counter[str] = Counter()  # forward steps per attention precision mode
        self.graphs_off_reason: str | None = None
        self._ahead: _PlanAhead | None = None  # see _plan_ahead
        self.plans_ahead_used = 0
        # called with (chains, chunks, states (T, width)) after every forward: the states a drafter
        # needs, the model's auxiliary hidden states while it returns them (an EAGLE-3 head,
        # spec/eagle3.py), else its final hidden states (MTP, runner/mtp.py)
        self.hidden_listener: Callable[[list[KVChain], list[list[int]], torch.Tensor], None] | None = None
        self.graphs = self._make_graphs(cuda_graphs, max_model_len or getattr(model, "max_model_len", 4096),
                                        graph_windows)

    @torch.inference_mode()
    def prompt_logits(self, chain: KVChain, token_ids: list[int]) -> torch.Tensor:
        """Process ``token_ids`` on ``chain`` and return ``(n, vocab)`` float32 logits of every row."""
        rows: list[torch.Tensor] = []
        self.forward([StepInput(chain, token_ids)], collect=rows)
        return torch.cat(rows)

    @torch.inference_mode()
    def forward(self, inputs: list[StepInput], *, collect: list[torch.Tensor] | None = None,
                logit_rows: list[int] | None = None) -> torch.Tensor:
        """Process every input's tokens; returns ``(B, vocab)`` float32 logits of each last token.

        ``logit_rows`` (one count per input, default all 1): the logits of each input's last
        ``logit_rows[i]`` rows instead, ``(sum(logit_rows), vocab)`` in input order (a verify
        window's rows); they must lie in the input's last chunk of ``prefill_chunk`` tokens.
        With ``collect`` (single input only) the logits of every processed row are appended
        to it chunk by chunk. On failure (e.g. :class:`OutOfPagesError`) every chain is left
        as it was.
        """
        if collect is not None and len(inputs) != 1:
            raise ValueError("collect works with exactly one input")
        if any(not item.token_ids for item in inputs):
            raise ValueError("every sequence of a forward needs at least one new token")
        for item in inputs:
            if item.tree_parents is not None and (len(item.tree_parents) != len(item.token_ids)
                                                  or len(item.token_ids) > self.prefill_chunk):
                raise ValueError(f"a tree of {len(item.token_ids)} tokens needs one parent per token "
                                 f"({len(item.tree_parents)} given) and at most {self.prefill_chunk} tokens")
            if item.tree_parents is not None:
                tree_positions(0, item.tree_parents)  # a ValueError for a malformed tree
        if logit_rows is not None:
            if collect is not None or len(logit_rows) != len(inputs):
                raise ValueError("logit_rows needs one count per input, and no collect")
            for n, item in zip(logit_rows, inputs):
                last_chunk = (len(item.token_ids) - 1) % self.prefill_chunk + 1
                if not 1 <= n <= last_chunk:
                    raise ValueError(f"logit_rows {n} is outside 1..{last_chunk}, the input's last chunk")
        done = [0] * len(inputs)
        logits: list[torch.Tensor | None] = [None] * len(inputs)
        try:
            while any(d < len(item.token_ids) for d, item in zip(done, inputs)):
                active = [i for i, item in enumerate(inputs) if done[i] < len(item.token_ids)]
                chunks = [inputs[i].token_ids[done[i] : done[i] + self.prefill_chunk] for i in active]
                rows = None if logit_rows is None else [
                    logit_rows[i] if done[i] + len(c) == len(inputs[i].token_ids) else 1 for i, c in zip(active, chunks)]
                trees = [inputs[i].tree_parents for i in active]
                out = self._step([inputs[i].chain for i in active], chunks, all_rows=collect is not None,
                                 logit_rows=rows, trees=trees if any(t is not None for t in trees) else None)
                if collect is not None:
                    collect.append(out)
                    out = out[-1:]
                starts = [0] * len(active)
                if rows is not None:
                    starts = [sum(rows[:r]) for r in range(len(active))]
                for row, i in enumerate(active):
                    done[i] += len(chunks[row])
                    if done[i] == len(inputs[i].token_ids):
                        logits[i] = out[row] if rows is None else out[starts[row] : starts[row] + rows[row]]
        except BaseException:
            for d, item in zip(done, inputs):
                if d:
                    item.chain.trim(d)
            raise
        return torch.stack(logits) if logit_rows is None else torch.cat(logits)

    @torch.inference_mode()
    def decode_from_device(self, chains: list[KVChain], token_ids: torch.Tensor) -> torch.Tensor:
        """A decode step whose input tokens are still on the device: ``token_ids (B,)`` int64, one
        per chain (the previous step's samples, not yet read by the host). Launches the step
        without waiting for them and returns ``(B, vocab)`` float32 logits (not yet computed).
        Each chain gets its row with the placeholder token id :data:`PENDING_TOKEN`; the caller
        sets the real id (``KVChain.set_last_token_id``) once it has it, or trims the row.
        On failure (e.g. :class:`OutOfPagesError`) every chain is left as it was."""
        if token_ids.shape != (len(chains),):
            raise ValueError(f"token_ids must have shape ({len(chains)},), got {tuple(token_ids.shape)}")
        return self._step(chains, [[PENDING_TOKEN]] * len(chains), device_ids=token_ids)

    def _step(self, chains: list[KVChain], chunks: list[list[int]], *, all_rows: bool = False,
              logit_rows: list[int] | None = None, device_ids: torch.Tensor | None = None,
              trees: list[tuple[int, ...] | None] | None = None) -> torch.Tensor:
        """One forward over ``chunks`` appended to ``chains``: logits of each chunk's last row, of
        every row (``all_rows``) or of each chunk's last ``logit_rows[i]`` rows. ``device_ids``:
        the chunks' token ids as a device tensor (decode steps; ``chunks`` then hold placeholders).
        ``trees``: per chunk, its tree parents (``StepInput.tree_parents``) or None."""
        slots: list[int] = []
        positions: list[int] = []
        appended: list[tuple[KVChain, int]] = []
        trees = trees or [None] * len(chunks)
        try:
            for chain, tokens, tree in zip(chains, chunks, trees):
                start = chain.num_rows
                slots += chain.append(len(tokens), token_ids=tokens)
                appended.append((chain, len(tokens)))
                positions += range(start, start + len(tokens)) if tree is None else tree_positions(start, tree)
            mla_mode = self.mla_mode_of(chunks)
            queries = [SequenceQuery.from_chain(c, len(t), tree_parents=tree)
                       for c, t, tree in zip(chains, chunks, trees)]
            ahead, self._ahead = self._ahead, None
            if (ahead is not None and ahead.mla_mode == mla_mode and ahead.device_spec is self.device_spec
                    and ahead.route == self.route and ahead.queries == queries):
                plan, arrays = ahead.plan, ahead.arrays  # planned while the GPU ran the last step
                self.plans_ahead_used += 1
            else:
                plan, arrays = self.plan(queries, mla_mode), None
            logits = None
            rows = None if all_rows else _last_rows(chunks, [1] * len(chunks) if logit_rows is None else logit_rows)
            # per-layer sliding windows: the step's plan bounded by each (AttentionMetadata.windowed)
            windowed = {w: self.plan(queries, mla_mode, window=w) for w in layer_windows(self.model)}
            if self.graphs is not None and not all_rows:
                widths = [len(t) for t in chunks]
                if max(widths) == 1:  # a decode step
                    if self.leads_tensor_parallel:  # the other ranks replay their own graphs of it
                        self._broadcast_graph_step(chunks, positions, slots, plan, mla_mode, windowed, device_ids)
                    logits = self.graphs.run([t[0] for t in chunks], positions, slots, plan, mla_mode,
                                             arrays=arrays, device_ids=device_ids, windowed=windowed)
                    if logits is not None:  # the replay runs on the GPU: plan the likely next step meanwhile
                        self._ahead = self._plan_ahead(chains, mla_mode)
                        if self._ahead is not None:  # and queue its index copies behind this replay
                            self.graphs.stage_ahead(self._ahead.plan, len(chains), self._ahead.arrays)
                elif (device_ids is None and max(widths) <= max(self.graphs.windows, default=0)
                      and not self.leads_tensor_parallel
                      and (not plan.has_key_masks or self.backend.capabilities.key_masks)):
                    logits = self.graphs.run_window(widths, [t for c in chunks for t in c], positions, slots,
                                                    plan, mla_mode, rows, windowed=windowed)
                if logits is not None and self.hidden_listener is not None:
                    self.hidden_listener(chains, chunks, self.graphs.last_states(len(positions)))
            if logits is None:  # eager: no graph, a prefill chunk, or a step no graph holds
                logits = self._eager_logits(chunks, positions, slots, plan, mla_mode, rows, device_ids, chains,
                                            windowed)
        except BaseException:
            for chain, n in appended:
                chain.trim(n)
            raise
        self.last_plan = plan
        self.route_counts[plan.route.value] += 1
        self.precision_counts[plan.precision.value] += 1
        return logits

    @property
    def decode_mla_mode(self) -> str:
        """The MLA mode of a decode step (one row per sequence): the one its CUDA graphs capture."""
        return self.mla_mode_of([[PENDING_TOKEN]])

    def forget_plan_ahead(self) -> None:
        """Drop the next step planned ahead (after a warm-up: that step never comes)."""
        self._ahead = None

    def plan(self, queries: list[SequenceQuery], mla_mode: str, *, window: int | None = None) -> AttentionPlan:
        """The attention plan of ``queries`` on this runner's device, cache and route, bounded by
        ``window``, else by the model's sliding window (one for every layer) where it has one."""
        return plan_attention(queries, self.model.attention_shape(mla_mode), self.device_spec,
                              page_size=self.cache.page_size, route=self.route,
                              window=window or getattr(self.model, "sliding_window", None))

    def _plan_ahead(self, chains: list[KVChain], mla_mode: str) -> _PlanAhead | None:
        """The plan (and flattened index arrays) of the next decode step of the same chains, one
        row longer each, made while the GPU runs this step. A tail whose last page is full gets
        the page the pool will hand out next (``PagePool.peek``, in the order the step appends).
        The next step uses the plan only if its queries come out equal, so a changed batch, an
        allocation in between, or a chain without a tail (a new segment) just plans anew."""
        page = self.cache.page_size
        spans_of = [chain.spans() for chain in chains]
        if not all(spans and not spans[-1].sealed for spans in spans_of):
            return None  # a chain without a tail: its next row starts a new segment
        new_pages = self.cache.pool.peek(sum(spans[-1].num_rows % page == 0 for spans in spans_of))
        if new_pages is None:
            return None
        queries, taken = [], 0
        for spans in spans_of:
            tail = spans[-1]
            pages = tail.page_ids
            if tail.num_rows % page == 0:  # the next row opens a new page
                pages, taken = pages + (new_pages[taken],), taken + 1
            spans[-1] = replace(tail, page_ids=pages, num_rows=tail.num_rows + 1)
            queries.append(SequenceQuery(tuple(spans), 1))
        plan = self.plan(queries, mla_mode)
        return _PlanAhead(queries, mla_mode, self.device_spec, self.route, plan, flatten_plan(plan))

    def _eager_logits(self, chunks: list[list[int]], positions: list[int], slots: list[int], plan: AttentionPlan,
                      mla_mode: str, rows: list[int] | None, device_ids: torch.Tensor | None = None,
                      chains: list[KVChain] | None = None,
                      windowed: dict[int, AttentionPlan] | None = None) -> torch.Tensor:
        """Logits of the step's ``rows`` (flat row indices; None: every row). ``windowed``: the
        step's plans bounded by each of the model's per-layer windows (:func:`layer_windows`)."""
        meta = AttentionMetadata(
            backend=self.backend,
            prepared=self.backend.prepare(plan),
            storage=self.cache.storage,
            slots=to_device(slots, torch.long, self.device),
            mla_mode=mla_mode,
            windowed={w: self.backend.prepare(p) for w, p in (windowed or {}).items()},
        )
        if device_ids is not None:
            ids = device_ids.to(device=self.device, dtype=torch.long)
        else:
            ids = to_device([t for chunk in chunks for t in chunk], torch.long, self.device)
        pos = to_device(positions, torch.long, self.device)
        if self.leads_tensor_parallel:  # the other ranks run this forward on their shards
            host_chunks = chunks if device_ids is None else _chunked(device_ids.tolist(), chunks)
            broadcast_step(self.model.tp, ("forward", (host_chunks, positions, slots, plan, mla_mode, rows, windowed)))
        hidden, aux = split_hidden(self.model(ids, pos, meta))
        if self.hidden_listener is not None and chains is not None:
            self.hidden_listener(chains, chunks, hidden if aux is None else aux)
        if rows is None:
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[to_device(rows, torch.long, self.device)])

    @property
    def leads_tensor_parallel(self) -> bool:
        """Whether this runner is rank 0 of a tensor-parallel model (it broadcasts every forward)."""
        tp = getattr(self.model, "tp", None)
        return tp is not None and tp.size > 1 and tp.rank == 0

    def run_followed_step(self, step: tuple) -> None:
        """Another rank: the forward rank 0 broadcast (``runner/tp_steps.py``), on this shard."""
        chunks, positions, slots, plan, mla_mode, rows, windowed = step
        self._eager_logits(chunks, positions, slots, plan, mla_mode, rows, windowed=windowed)

    def _broadcast_graph_step(self, chunks, positions, slots, plan, mla_mode, windowed, device_ids) -> None:
        """Rank 0: send a decode step that its graphs may replay. Token ids still on the device
        (a step launched ahead) go by a device broadcast, so the host does not wait for them."""
        tp = self.model.tp
        broadcast_step(tp, ("graph", ([t[0] for t in chunks], positions, slots, plan, mla_mode, windowed,
                                      device_ids is not None)))
        if device_ids is not None:
            broadcast_tensor(tp, device_ids.to(torch.long).contiguous())

    def run_followed_graph(self, step: tuple) -> None:
        """Another rank: the decode step rank 0 broadcast before replaying its graph, replayed from
        this rank's graphs (captured at the same steps as rank 0's, so their collectives meet).
        Where no graph holds it, rank 0 runs it eagerly and broadcasts that forward next."""
        ids, positions, slots, plan, mla_mode, windowed, on_device = step
        device_ids = None
        if on_device:
            device_ids = broadcast_tensor(self.model.tp, torch.empty(len(ids), dtype=torch.long, device=self.device))
        self.graphs.run(ids, positions, slots, plan, mla_mode, device_ids=device_ids, windowed=windowed)

    def warm_graphs(self, size: int) -> list[tuple[int, bool, bool]]:
        """Capture the decode graphs of bucket ``size`` not captured yet (``graphs.warm``); a
        tensor-parallel rank 0 has the other ranks capture theirs at the same time."""
        if self.leads_tensor_parallel:
            broadcast_step(self.model.tp, ("warm", (size, self.decode_mla_mode)))
        return self.graphs.warm(size, self.decode_mla_mode)

    def _make_graphs(self, mode: bool | str, max_model_len: int, windows: tuple[int, ...]):
        """CUDA-graph decode: ``True`` (error if unavailable), ``"auto"`` (on where available:
        CUDA and a backend whose ``capabilities.cuda_graphs`` holds), ``"emulate"``
        (replay by re-running the captured step: tests), ``False``. ``windows``: verify-window
        sizes that get graphs too."""
        from segkv.runner.cuda_graphs import DecodeGraphs

        if mode not in (True, False, "auto", "emulate"):
            raise ValueError(f"cuda_graphs must be True, False, 'auto' or 'emulate', got {mode!r}")
        if mode is False:
            return None
        emulate = mode == "emulate"
        # a model whose forward a graph cannot capture says why (gpt-oss's host-synchronising experts)
        reason = getattr(self.model, "cuda_graphs_unsupported", None)
        if reason is None and not self.backend.capabilities.cuda_graphs:
            reason = (f"the {self.backend.name} attention backend cannot run in CUDA graphs "
                      "(the Triton backend can)")
        elif reason is None and not emulate and self.device.type != "cuda":
            reason = "the device is not a CUDA device"
        if reason is not None:
            if mode is True or emulate:
                raise ValueError(f"CUDA graphs are not available: {reason}")
            self.graphs_off_reason = reason
            return None
        return DecodeGraphs(self.model, self.cache, self.device_spec, device=self.device,
                            max_model_len=max_model_len, windows=windows, emulate=emulate)

    def _make_backend(self, name: str, cache: PagedKVCache) -> AttentionBackend:
        """Triton kernels on CUDA ("auto"), for K/V and latent (MLA) caches alike; the torch
        reference otherwise. MLA's naive prefill path (``kv_transform``) decompresses each piece and
        runs the GQA kernels over it; absorbed decode runs the latent kernel."""
        use_triton = name == "triton" or (name == "auto" and self.device.type == "cuda")
        if use_triton:
            from segkv.attention.triton_backend import TritonBackend

            return TritonBackend(page_size=cache.page_size, device=self.device)
        return TorchReferenceBackend(page_size=cache.page_size, device=self.device)

    def mla_mode_of(self, chunks: list[list[int]]) -> str:
        """The MLA mode of a step over ``chunks``: absorbed (latent) attention for decode-sized
        windows, naive for prefill chunks (or the runner's forced mode)."""
        if self.mla_mode != "auto":
            return self.mla_mode
        return "absorbed" if max(len(c) for c in chunks) <= self.decode_rows_threshold else "naive"


@dataclass(slots=True)
class _PlanAhead:
    """A decode step planned one step early: what it was planned for, the plan, its index arrays."""

    queries: list[SequenceQuery]
    mla_mode: str
    device_spec: DeviceSpec
    route: Route | None
    plan: AttentionPlan
    arrays: dict


def split_hidden(out: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A model forward's ``(hidden (T, hidden), aux (T, width) or None)``: with auxiliary hidden
    layers set (``CausalLM.set_aux_hidden_layers``) the forward returns both, else hidden only."""
    return out if isinstance(out, tuple) else (out, None)


def tree_positions(start: int, parents: tuple[int, ...]) -> list[int]:
    """Each tree node's position: ``start`` plus its depth (a child of the last history row, -1,
    has depth 0)."""
    depths: list[int] = []
    for node, parent in enumerate(parents):
        if not -1 <= parent < node:
            raise ValueError(f"tree_parents[{node}] = {parent}: a parent is -1 (the last history row) "
                             f"or an earlier node (0 .. {node - 1})")
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return [start + d for d in depths]


def _chunked(ids: list[int], like: list[list[int]]) -> list[list[int]]:
    """``ids`` cut into chunks of ``like``'s lengths."""
    out, start = [], 0
    for chunk in like:
        out.append(ids[start : start + len(chunk)])
        start += len(chunk)
    return out


def _last_rows(chunks: list[list[int]], counts: list[int]) -> list[int]:
    """Flat indices of the last ``counts[i]`` rows of each chunk, in order."""
    out, total = [], 0
    for chunk, n in zip(chunks, counts):
        total += len(chunk)
        out += range(total - n, total)
    return out


__all__ = ["ModelRunner", "StepInput", "OutOfPagesError", "PENDING_TOKEN", "split_hidden"]
