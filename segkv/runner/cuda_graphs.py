"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket.

A decode step (one new token per sequence) is captured once per bucket over static inputs:
token ids, positions and cache slots ``(B,)`` int64, and the attention plan's index arrays in
a :class:`~segkv.attention.triton_backend.TritonBackend` with a fixed
:class:`~segkv.attention.triton_backend.PlanCapacity`. A later step with ``n <= B`` sequences
writes its inputs and its plan into those buffers and replays; padding rows (ids 0,
position 0) write their K/V into a reserved scratch page and attend nothing. Mixture-of-experts
layers are packed (stacked expert weights, device-side dispatch at every batch). A step that does
not fit (its plan exceeds the capacity) returns None and the runner runs it eagerly.

Verify windows (speculative decoding: up to ``W`` query rows per sequence) have buckets of their
own, by sequence count and window size ``W``: ``size * W`` static rows, work items of up to ``W``
rows (``wide`` ones: up to every row, for prefixes several sequences share). A step whose windows
are shorter than ``W`` (an n-gram found fewer drafts, or none) pads the rest of the rows like a
decode step does.

Every replay also leaves the model's hidden states in a static buffer, and its auxiliary hidden
states in another while the model returns them (``CausalLM.set_aux_hidden_layers``); the runner
hands the ones a drafter needs to its ``hidden_listener`` (:meth:`DecodeGraphs.last_states`: an
EAGLE-3 head reads the auxiliary states, an MTP drafter the hidden states), so graphs and
drafting go together. A bucket captured before the auxiliary layers changed is captured again.

``emulate=True`` replays by calling the captured step again over the same static buffers,
so the buffer logic can be checked on machines without CUDA graphs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch import nn

from segkv.attention.device import DeviceSpec
from segkv.attention.metadata import AttentionMetadata
from segkv.attention.plan import AttentionPlan, SequenceQuery
from segkv.attention.planner import plan_attention
from segkv.attention.triton_backend import PlanCapacity, TritonBackend, merges_in_stage1, stage1_merge_bound
from segkv.cache.kv_cache import PagedKVCache
from segkv.layers.transfer import to_device
from segkv.runner.layer_windows import layer_windows

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# the most static rows of a verify-window graph (sequences x window): logits and activations of
# every row live in the graph's pool
MAX_WINDOW_ROWS = 256


def expert_layers(model: nn.Module) -> list:
    from segkv.layers.moe import MixtureOfExperts

    return [m for m in model.modules() if isinstance(m, MixtureOfExperts)]


@dataclass
class _Bucket:
    size: int
    backend: TritonBackend
    inputs: torch.Tensor  # (3, rows) int64 on the device: ids, positions, slots
    staging: torch.Tensor  # (3, rows) int64 on the host (pinned on CUDA)
    window: int = 1  # query rows per sequence (1: decode)
    logits: torch.Tensor | None = None  # (rows, vocab) float32, written by every replay
    hidden: torch.Tensor | None = None  # (rows, hidden) the model's output, written by every replay
    aux: torch.Tensor | None = None  # (rows, width) auxiliary hidden states (EAGLE-3), when the model returns them
    aux_layers: tuple[int, ...] | None = None  # the model's aux_hidden_layers when captured
    hidden_in: torch.Tensor | None = None  # (rows, hidden) static input of MTP graphs (MtpGraphs)
    graph: torch.cuda.CUDAGraph | None = None
    step: object = None  # the captured callable (emulation replays it)
    copied: object = None  # torch.cuda.Event after the last host-to-device copy of the staging rows
    staged: AttentionPlan | None = None  # the plan whose indices were copied ahead (stage_ahead)
    # per-layer sliding windows (layer_windows): each window's plan in buffers of its own
    windowed: dict[int, TritonBackend] = field(default_factory=dict)


def max_graph_work_items(device: DeviceSpec, size: int, *, kv_heads: int, latent: bool, wide: bool = False) -> int:
    """Work items a graph bucket of ``size`` decode rows holds room for. Stage 1 launches a program
    per possible work item and KV head, and idle ones still start: sized for the latent layout
    (one program per item), an 8-KV-head model's batch-1 bucket launched 4224 programs for 88,
    measurably slower per layer.

    Narrow buckets (every work item one sequence's row, no shared pieces): two waves of stage-1
    programs (a split fills at most one; batches that fill the device make up to two), at most
    ``max_partitions`` per sequence, never fewer than 4 per row. Wide buckets (cascade plans over
    shared prefixes) keep two waves of single-program items: their pieces follow the shared
    history's segments (8 forks of a 100-segment history: 108 items), not the KV heads."""
    if wide:
        return max(2 * device.wave_size, 4 * size)
    programs_per_item = 1 if latent else kv_heads
    return max(min(2 * -(-device.wave_size // programs_per_item), size * device.max_partitions), 4 * size)


class DecodeGraphs:
    """CUDA-graph decode for one model and cache (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        cache: PagedKVCache,
        device_spec: DeviceSpec,
        *,
        device: torch.device,
        max_model_len: int,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        windows: tuple[int, ...] = (),
        emulate: bool = False,
    ) -> None:
        """``windows``: verify-window sizes (query rows per sequence, >= 2) that get graphs too."""
        if any(w < 2 for w in windows):
            raise ValueError(f"verify-window sizes must be >= 2, got {windows}")
        for layer in expert_layers(model):
            layer.pack_experts()  # device-side expert dispatch at every batch: no host synchronisation
        if not emulate and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device (emulate=True replays eagerly)")
        self.model = model
        self.cache = cache
        self.device = device
        self.device_spec = device_spec
        self.max_model_len = max_model_len
        self.buckets = tuple(sorted(buckets))
        self.windows = tuple(sorted(set(windows)))
        self.emulate = emulate
        # (batch size, wide, few): "narrow" graphs serve plans whose work items hold one query row
        # each (attention tiles as small as eager's: same rounding, no padded rows); "wide" ones
        # hold up to the bucket's rows per work item (prefixes shared by several sequences); "few"
        # narrow ones merge no row from more partials than the GQA stage-1 kernel merges itself,
        # so their graph has no merge launch
        self._buckets: dict[tuple[int, bool, bool], _Bucket] = {}
        self._window_buckets: dict[tuple[int, int, bool], _Bucket] = {}  # (sequences, window, wide)
        self._last: _Bucket | None = None  # the bucket replayed last (its hidden states)
        self._merge_in_stage1 = cache.storage.layout.kind == "mha"  # the latent kernels keep their merge
        # a page of the pool reserved for the K/V rows of padding query rows
        self._scratch = cache.new_chain()
        self._scratch_slot = self._scratch.append(1)[0]
        # a window graph's capture plan needs a query of its window's rows: a second scratch chain
        self._scratch_rows = cache.new_chain()
        if self.windows:
            self._scratch_rows.append(self.windows[-1])
        self.replays = 0
        self.window_replays = 0  # of them, verify-window steps
        self.fallbacks = 0
        self.staged_plans_used = 0  # replays whose plan indices were copied ahead (stage_ahead)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @property
    def captured(self) -> Mapping[tuple[int, bool, bool], _Bucket]:
        """The captured buckets by ``(size, wide, few)`` key, read-only (profilers time a bucket's
        ``graph.replay`` alone)."""
        return MappingProxyType(self._buckets)

    def bucket_for(self, num_rows: int) -> int | None:
        """The bucket size a decode step of ``num_rows`` rows replays (None: larger than every bucket)."""
        return next((b for b in self.buckets if b >= num_rows), None)

    def variants(self, size: int) -> list[tuple[int, bool, bool]]:
        """Every ``(size, wide, few)`` key a step may replay in bucket ``size``: narrow with the merge
        in stage 1 (GQA, few partials per row) or after it, and wide (prefixes shared by several
        sequences, so at least 2 rows)."""
        keys = [(size, False, True)] if self._merge_in_stage1 and stage1_merge_bound() > 0 else []
        keys.append((size, False, False))
        if size >= 2:
            keys.append((size, True, False))
        return keys

    def warm(self, size: int, mla_mode: str) -> list[tuple[int, bool, bool]]:
        """Capture every variant of bucket ``size`` not captured yet (``LLM.warm_up``: a capture
        compiles the step's kernels and blocks the step loop, so none should wait for a request).
        Returns the keys captured now."""
        if mla_mode == "naive":  # never replayed (see run)
            return []
        made = [key for key in self.variants(size) if key not in self._buckets]
        for key in made:
            bucket = self._capture(*key, mla_mode)
            if bucket.graph is not None:  # a graph's first launch also uploads it: not at a request's step
                bucket.graph.replay()  # over the capture's inputs: every row attends the scratch row
        return made

    def forget_staged(self) -> None:
        """Drop the index arrays staged for a next step (after a warm-up: that step never comes)."""
        for bucket in self._buckets.values():
            bucket.staged = None

    def window_sizes(self, window: int) -> tuple[int, ...]:
        """The sequence-count buckets of verify windows of ``window`` rows (at most
        :data:`MAX_WINDOW_ROWS` static rows each)."""
        return tuple(b for b in self.buckets if b * window <= MAX_WINDOW_ROWS)

    def window_bucket_for(self, widths: list[int]) -> tuple[int, int] | None:
        """``(sequences, window)`` of the bucket a step of windows of ``widths`` rows replays
        (None: no window graph holds it)."""
        widest = max(widths)
        window = next((w for w in self.windows if w >= widest), None)
        if window is None:
            return None
        size = next((b for b in self.window_sizes(window) if b >= len(widths)), None)
        return None if size is None else (size, window)

    @property
    def window_captured(self) -> Mapping[tuple[int, int, bool], _Bucket]:
        """The captured verify-window buckets by ``(sequences, window, wide)``, read-only."""
        return MappingProxyType(self._window_buckets)

    def warm_windows(self, size: int, mla_mode_of) -> list[tuple[int, int, bool]]:
        """Capture the verify-window buckets of ``size`` sequences not captured yet, narrow and
        (``size >= 2``) wide, for every window size; ``mla_mode_of(window)`` is the MLA mode of
        such a step. Returns the keys captured now."""
        made = []
        for window in self.windows:
            mode = mla_mode_of(window)
            if size not in self.window_sizes(window) or mode == "naive":
                continue
            for wide in (False, True) if size >= 2 else (False,):
                if (size, window, wide) in self._window_buckets:
                    continue
                bucket = self._capture(size, wide, False, mode, window=window)
                if bucket.graph is not None:
                    bucket.graph.replay()
                made.append((size, window, wide))
        return made

    def release(self) -> None:
        """Give the scratch pages back (the graphs stay unusable afterwards)."""
        self._scratch.release()
        self._scratch_rows.release()
        self._buckets.clear()
        self._window_buckets.clear()
        self._last = None

    def last_states(self, rows: int) -> torch.Tensor:
        """A copy of the first ``rows`` states a drafter reads of the last replay (its static
        buffers are overwritten by the next one): the auxiliary hidden states ``(rows, width)``
        where the model returned them, else the hidden states ``(rows, hidden)``."""
        last = self._last
        return (last.hidden if last.aux is None else last.aux)[:rows].clone()

    def run(self, ids: list[int], positions: list[int], slots: list[int], plan: AttentionPlan,
            mla_mode: str, *, arrays: dict | None = None, device_ids: torch.Tensor | None = None,
            hidden_in: torch.Tensor | None = None, windowed: Mapping[int, AttentionPlan] | None = None
            ) -> torch.Tensor | None:
        """``(n, vocab)`` float32 logits of a decode step, or None when it does not fit a graph.
        ``arrays``: the plan already flattened (``flatten_plan``), if it was. ``device_ids``: the
        token ids as an ``(n,)`` device tensor (copied on the device; ``ids`` are then ignored).
        ``hidden_in``: ``(n, hidden)``, the input hidden states of :class:`MtpGraphs`.
        ``windowed``: the step's plan bounded by each per-layer window (:func:`layer_windows`)."""
        n = len(ids)
        size, wide, few = self._bucket_key(n, plan)
        if size is None or mla_mode == "naive":  # naive MLA decompresses pieces through the reference
            self.fallbacks += 1
            return None
        bucket = self._current(self._buckets.get((size, wide, few))) or self._capture(size, wide, few, mla_mode)
        staged, bucket.staged = bucket.staged, None
        if staged is plan:
            self.staged_plans_used += 1
        elif not self._prepare(bucket, plan, arrays):
            return None
        if not self._prepare_windowed(bucket, windowed):
            return None
        self._replay(bucket, ids, positions, slots, device_ids, hidden_in)
        return bucket.logits[:n].clone()

    def run_window(self, widths: list[int], ids: list[int], positions: list[int], slots: list[int],
                   plan: AttentionPlan, mla_mode: str, rows: list[int], *,
                   hidden_in: torch.Tensor | None = None, device_ids: torch.Tensor | None = None,
                   windowed: Mapping[int, AttentionPlan] | None = None) -> torch.Tensor | None:
        """Logits ``(len(rows), vocab)`` float32 of the flat query ``rows`` of a step of verify
        windows (``widths[i]`` rows of sequence ``i``, ``ids``/``positions``/``slots`` flat), or
        None when no window graph holds it. ``device_ids``: the flat token ids as a device tensor."""
        key = self.window_bucket_for(widths)
        if key is None or mla_mode == "naive":
            self.fallbacks += 1
            return None
        size, window = key
        wide = plan.max_work_rows > window
        bucket = (self._current(self._window_buckets.get((size, window, wide)))
                  or self._capture(size, wide, False, mla_mode, window=window))
        bucket.staged = None
        if not self._prepare(bucket, plan, None) or not self._prepare_windowed(bucket, windowed):
            return None
        self._replay(bucket, ids, positions, slots, device_ids, hidden_in)
        self.window_replays += 1
        return bucket.logits[to_device(rows, torch.long, self.device)]

    def _current(self, bucket: _Bucket | None) -> _Bucket | None:
        """``bucket`` unless it was captured with other auxiliary hidden layers than the model's now
        (a drafter that reads them was set up after the capture): then None, to capture it again."""
        if bucket is None or bucket.aux_layers != getattr(self.model, "aux_hidden_layers", None):
            return None
        return bucket

    def _prepare(self, bucket: _Bucket, plan: AttentionPlan, arrays: dict | None) -> bool:
        try:
            bucket.backend.prepare(plan, arrays=arrays)
        except ValueError:  # the plan exceeds the bucket's fixed capacity
            self.fallbacks += 1
            return False
        return True

    def _prepare_windowed(self, bucket: _Bucket, windowed: Mapping[int, AttentionPlan] | None) -> bool:
        """Each per-layer window's plan into the bucket's buffers for it (False: one does not fit,
        or a window has no buffers: the step runs eagerly)."""
        plans = windowed or {}
        if set(plans) != set(bucket.windowed):
            self.fallbacks += 1
            return False
        for window, plan in plans.items():
            try:
                bucket.windowed[window].prepare(plan)
            except ValueError:  # over the capacity
                self.fallbacks += 1
                return False
        return True

    def _replay(self, bucket: _Bucket, ids: list[int], positions: list[int], slots: list[int],
                device_ids: torch.Tensor | None, hidden_in: torch.Tensor | None = None) -> None:
        """Write the step's rows (the rest: padding on the scratch slot) and replay ``bucket``."""
        n = len(positions)
        if bucket.copied is not None:  # the last step's transfer must have read the staging rows
            bucket.copied.synchronize()
        rows = bucket.staging.numpy()  # numpy writes: building a tensor from lists costs more
        rows[0, :n], rows[1, :n], rows[2, :n] = ids, positions, slots
        if n < rows.shape[1]:
            rows[0, n:], rows[1, n:], rows[2, n:] = 0, 0, self._scratch_slot
        bucket.inputs.copy_(bucket.staging, non_blocking=True)
        if device_ids is not None:  # the previous step's samples, never seen by the host
            bucket.inputs[0, :n].copy_(device_ids)
        if hidden_in is not None:
            bucket.hidden_in[:n].copy_(hidden_in)
        if self.device.type == "cuda":
            bucket.copied = torch.cuda.Event()
            bucket.copied.record()
        if self.emulate:
            bucket.step()
        else:
            bucket.graph.replay()
        self.replays += 1
        self._last = bucket

    def stage_ahead(self, plan: AttentionPlan, num_rows: int, arrays: dict) -> None:
        """Copy the index arrays of a likely next step (``plan`` over ``num_rows`` decode rows,
        ``flatten_plan`` arrays) into the graph bucket it would replay, right after this step's
        replay was launched: the copies run on the stream behind that replay, and the next
        :meth:`run` handed the same plan object skips them. The host work of preparing a step
        then overlaps the GPU instead of delaying the next replay. Any other plan run in the
        bucket first replaces them (``run`` prepares whatever it is handed otherwise)."""
        bucket = self._buckets.get(self._bucket_key(num_rows, plan))
        if bucket is None:
            return
        try:
            bucket.backend.prepare(plan, arrays=arrays)
        except ValueError:  # over the bucket's capacity: the step will fall back to eager anyway
            bucket.staged = None
            return
        bucket.staged = plan

    def _bucket_key(self, num_rows: int, plan: AttentionPlan) -> tuple[int | None, bool, bool]:
        """The bucket a step of ``num_rows`` decode rows replays (None: larger than every bucket),
        whether its plan needs a wide one (work items of several query rows), and whether stage 1
        merges its rows (``merges_in_stage1``)."""
        size = self.bucket_for(num_rows)
        few = self._merge_in_stage1 and merges_in_stage1(plan.max_work_rows, plan.max_row_partials)
        return size, plan.max_work_rows > 1, few

    def _new_bucket(self, bucket: _Bucket) -> None:
        """Static buffers a bucket's forward reads besides ids, positions and slots (none here)."""

    def _forward(self, bucket: _Bucket, meta: AttentionMetadata) -> None:
        """The captured forward: the model over the bucket's rows, its hidden states (and auxiliary
        ones, where the model returns them) and logits."""
        out = self.model(bucket.inputs[0], bucket.inputs[1], meta)
        bucket.hidden, bucket.aux = out if isinstance(out, tuple) else (out, None)
        bucket.logits = self.model.compute_logits(bucket.hidden)

    def _capacity(self, size: int, wide: bool, few: bool, window: int = 1, *, key_lows: bool = False) -> PlanCapacity:
        page = self.cache.page_size
        pages_per_seq = math.ceil(self.max_model_len / page) + 64  # + pages left part-full by segment ends
        work = max_graph_work_items(self.device_spec, size, kv_heads=self.cache.layout.num_kv_heads,
                                    latent=self.cache.layout.kind == "mla", wide=wide)
        rows = size * window
        return PlanCapacity(max_pages=size * pages_per_seq, max_work=work, max_partials=(work + 64 * size) * window,
                            max_rows=rows, max_work_rows=rows if wide else window,
                            max_row_partials=stage1_merge_bound() if few else None,
                            # decode steps never carry tree windows: their kernels compile without masks
                            max_key_mask_words=0 if window == 1 else None,
                            # a windowed model's plans carry each partial's window start
                            key_lows=key_lows or bool(getattr(self.model, "sliding_window", None)))

    def _capture(self, size: int, wide: bool, few: bool, mla_mode: str, *, window: int = 1) -> _Bucket:
        """Capture the bucket of ``size`` sequences of ``window`` rows each (1: decode)."""
        rows = size * window
        backend = TritonBackend(page_size=self.cache.page_size, device=self.device,
                                capacity=self._capacity(size, wide, few, window))
        pinned = self.device.type == "cuda"
        staging = torch.zeros(3, rows, dtype=torch.long, pin_memory=pinned)
        staging[2] = self._scratch_slot
        inputs = staging.to(self.device)
        bucket = _Bucket(size, backend, inputs, staging, window=window,
                         aux_layers=getattr(self.model, "aux_hidden_layers", None))
        # a plan with every row attending the scratch rows: valid for the warm-up and capture
        chain = self._scratch if window == 1 else self._scratch_rows
        scratch = SequenceQuery(tuple(chain.spans()), window)
        shape = self.model.attention_shape(mla_mode)
        prepared = backend.prepare(plan_attention([scratch] * size, shape, self.device_spec,
                                                  page_size=self.cache.page_size, route="single",
                                                  window=getattr(self.model, "sliding_window", None)))
        windowed = {}
        for window in layer_windows(self.model):  # each per-layer window's plan in buffers of its own
            bucket.windowed[window] = TritonBackend(page_size=self.cache.page_size, device=self.device,
                                                    capacity=self._capacity(size, wide, few, window,
                                                                            key_lows=True))
            windowed[window] = bucket.windowed[window].prepare(plan_attention(
                [scratch] * size, shape, self.device_spec, page_size=self.cache.page_size, route="single",
                window=window))
        meta = AttentionMetadata(backend=backend, prepared=prepared, storage=self.cache.storage,
                                 slots=inputs[2], mla_mode=mla_mode, trusted_slots=True, windowed=windowed)
        self._new_bucket(bucket)
        step = bucket.step = lambda: self._forward(bucket, meta)
        if self.emulate:
            step()
        else:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                step()  # compiles kernels, sizes cuBLAS workspaces: nothing may allocate lazily in the graph
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread-local: the server's other threads may touch CUDA while the engine thread captures
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                step()
            bucket.graph = graph
        if window == 1:
            self._buckets[size, wide, few] = bucket
        else:
            self._window_buckets[size, window, wide] = bucket
        return bucket


class MtpGraphs(DecodeGraphs):
    """The forwards of MTP layer ``depth`` (``model.mtp_forward``, ``runner/mtp.py``) replayed from
    CUDA graphs: one-row draft steps in decode buckets, catch-up windows in window buckets. Each
    bucket also holds a static ``(rows, hidden)`` input for the hidden states the layer reads, and
    what a replay returns is the layer's output hidden states, not logits."""

    def __init__(self, model: nn.Module, cache: PagedKVCache, device_spec: DeviceSpec, *, depth: int,
                 **kwargs) -> None:
        super().__init__(model, cache, device_spec, **kwargs)
        self.depth = depth

    def _new_bucket(self, bucket: _Bucket) -> None:
        embed = self.model.model.embed_tokens.weight
        bucket.hidden_in = torch.zeros(bucket.inputs.shape[1], embed.shape[1], dtype=embed.dtype,
                                       device=self.device)

    def _forward(self, bucket: _Bucket, meta: AttentionMetadata) -> None:
        bucket.hidden = self.model.mtp_forward(bucket.hidden_in, bucket.inputs[0], bucket.inputs[1], meta,
                                               depth=self.depth)
        bucket.logits = bucket.hidden  # what run and run_window return rows of


class Eagle3Graphs(DecodeGraphs):
    """An EAGLE-3 head's forwards (``Eagle3Head.forward``, ``spec/eagle3.py``) over its own cache,
    replayed from CUDA graphs: one-row chain draft steps in decode buckets, catch-ups and tree
    levels (``topk`` rows a sequence, key masks in the plan) in window buckets. Each bucket holds
    a static ``(rows, hidden)`` input for the hidden states the head reads; a replay returns the
    head's output hidden states, not logits."""

    def _new_bucket(self, bucket: _Bucket) -> None:
        weight = self.model.fc.weight
        bucket.hidden_in = torch.zeros(bucket.inputs.shape[1], weight.shape[0], dtype=weight.dtype,
                                       device=self.device)

    def _forward(self, bucket: _Bucket, meta: AttentionMetadata) -> None:
        bucket.hidden = self.model(bucket.hidden_in, bucket.inputs[0], bucket.inputs[1], meta)
        bucket.logits = bucket.hidden  # what run and run_window return rows of
