"""The Triton backend: the same plans as the reference, run by the kernels in ``kernels/``.

``prepare`` flattens a plan into int32 index arrays, packed into one host buffer and copied
to the device in one transfer. With a :class:`PlanCapacity`, the arrays live at fixed
addresses with fixed maximum sizes and the kernels launch fixed grids (padding work items do
nothing), so a CUDA graph captured over ``run`` replays correctly for any later plan that
fits: the next ``prepare`` only rewrites the buffer's contents.

Tree verify windows: a plan's masked work items (each tree window's own small piece,
:class:`~segkv.attention.plan.WorkItem` ``key_masks``) run in the same kernels. ``flatten_plan``
packs each masked row's bitmask into int32 words (``work_key_masks``, ``key_mask_words``:
:func:`flatten_plan`), masks of at most :data:`MAX_KEY_MASK_BITS` piece rows; the kernels test one
bit per key of a masked item and read one flag per program of an unmasked one (a launch over a
plan without masks compiles the test away). Fixed buffers hold masks too (``PlanCapacity``'s
``max_key_mask_words``), so CUDA graphs replay plans with tree windows.

Attention sinks (``run``'s ``sinks``, gpt-oss): a per-call ``(Hq,)`` float32 tensor, not part of the
plan, so fixed buffers and the graphs captured over them are unchanged; the GQA kernels fold each
head's sink in float32 wherever a row is finished (``paged_attention``'s ``sinks``), and compile it
away without one. The latent kernel and ``kv_transform`` calls (MLA) refuse sinks.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from segkv.attention.backend import BackendCapabilities, KVScales, KVTransform, check_sinks
from segkv.attention.device import PARTIAL_WORKSPACE_BYTES, stage1_merge_bound
from segkv.attention.plan import AttentionPlan, Piece
from segkv.cache.storage import dequantize_fp8

LSE_API_TRITON = "triton-merge"

# Arrays the fixed-grid kernels read past a plan's entries: padded with their last value
# (padding work items and query rows then have no partials).
_PADDED = ("work_partial_start", "reduce_ptr")
# A fixed plan buffer up to this size goes to the device in one transfer, not four (its page
# fields' used entries and the small fields): each host-to-device copy between two decode steps
# costs more than sending up to 128 KB more in one (docs/performance-notes.md). A batch-1 graph
# bucket's buffer is about 62 KB for DeepSeek-V2-Lite's 160K-token limit at pages of 32.
PLAN_ONE_COPY_BYTES = 128 << 10
# The plan arrays, in their order inside the packed buffer.
_FIELDS = ("page_table", "page_rows", "page_key_start", "work_pages", "work_partial_start",
           "partial_row", "partial_offset", "partial_direct", "reduce_ptr", "reduce_partials",
           "work_key_masks", "key_mask_words", "partial_low")
# The widest key mask the kernels take, in piece rows: a masked row's words cover the piece rows up
# to its causal offset (at most this many). The planner masks a tree window's own piece only, under
# page_size + window rows (80 for 16-row pages and a 64-node tree).
MAX_KEY_MASK_BITS = 256
MAX_KEY_MASK_WORDS = MAX_KEY_MASK_BITS // 32  # int32 words of one row's mask, at most
# Rows per page of the per-head K/V that ``kv_transform`` calls decompress into (naive MLA): the
# GQA kernels' measured 16-row pages (four to a 64-row tile), whatever the latent cache's page size.
DECOMPRESSED_PAGE_SIZE = 16


@dataclass(frozen=True, slots=True)
class PlanCapacity:
    """Fixed maximum sizes of a plan's index arrays (for CUDA-graph replay).

    ``max_rows``: query rows of a step (the graph's batch bucket); ``max_work_rows``: query
    rows one work item may serve (the planner's ``max_query_rows_per_work``);
    ``max_row_partials``: when set, plans merge no row from more partials than that, and with
    work items of one row (``max_work_rows=1``) and a bound the kernels allow, stage 1 merges
    the rows itself (no merge launch in the graph). Stage 1 launches one program per possible
    work item (``max_work``) and KV head: padding ones start and exit, so ``max_work`` should be
    no larger than plans need (thousands of idle programs cost microseconds per launch).
    ``max_key_mask_words``: int32 words of tree windows' key masks (``flatten_plan``'s
    ``key_mask_words``); by default ``max_rows * MAX_KEY_MASK_WORDS``, enough for every query row
    to have one masked partial of the widest mask (the planner masks each tree row in one piece).
    0 leaves masks out: the graph's kernels then compile the mask test away and plans with masks
    exceed the capacity (``prepare`` raises ValueError). ``key_lows``: the buffers hold each
    partial's sliding-window start (``flatten_plan``'s ``partial_low``) and the graph's kernels
    apply it (a windowed model's graphs); without it a plan with key lows exceeds the capacity.
    """

    max_pages: int
    max_work: int
    max_partials: int
    max_rows: int
    max_work_rows: int = 64
    max_row_partials: int | None = None
    max_key_mask_words: int | None = None
    key_lows: bool = False

    def __post_init__(self) -> None:
        for name in ("max_pages", "max_work", "max_partials", "max_rows", "max_work_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"PlanCapacity.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_row_partials is not None and self.max_row_partials < 1:
            raise ValueError(f"PlanCapacity.max_row_partials must be >= 1, got {self.max_row_partials}")
        if self.max_key_mask_words is not None and self.max_key_mask_words < 0:
            raise ValueError(f"PlanCapacity.max_key_mask_words must be >= 0, got {self.max_key_mask_words}")

    @property
    def key_mask_words(self) -> int:
        """The int32 words of key masks the buffers hold (``max_key_mask_words`` or its default)."""
        if self.max_key_mask_words is None:
            return self.max_rows * MAX_KEY_MASK_WORDS
        return self.max_key_mask_words

    def sizes(self) -> dict[str, int]:
        return {
            "page_table": self.max_pages, "page_rows": self.max_pages, "page_key_start": self.max_pages,
            "work_pages": 2 * self.max_work,
            "work_partial_start": self.max_work + 1, "partial_row": self.max_partials,
            "partial_offset": self.max_partials, "partial_direct": self.max_partials,
            "reduce_ptr": self.max_rows + 1, "reduce_partials": self.max_partials,
            "work_key_masks": 2 * self.max_work, "key_mask_words": self.key_mask_words,
            "partial_low": self.max_partials if self.key_lows else 0,
        }


_ALIGN_INT32 = 4  # int32 entries per 16 bytes


@dataclass(slots=True)
class TritonPreparedPlan:
    """A plan as int32 device tensors (see ``kernels.attention.paged_attention.paged_attention``)."""

    plan: AttentionPlan
    arrays: dict[str, torch.Tensor]
    num_partials: int  # partial buffer rows (the capacity's maximum in fixed-size mode)
    max_work_rows: int
    needs_merge: bool  # some row has other than exactly one partial
    fixed: bool = False
    merge_in_stage1: bool = False  # GQA kernels: stage 1 merges the rows (paged_attention's argument)
    reference: object = None  # the reference backend's preparation, where kv_transform calls need it
    decompressed: object = None  # _DecompressedLayout of kv_transform calls (made by the first one)
    key_masks: bool = False  # the kernels read the key-mask arrays (a plan with masks, or fixed buffers)
    key_lows: bool = False  # the kernels read partial_low (a plan with key lows, or fixed buffers holding them)

    def __getattr__(self, name: str) -> torch.Tensor:  # prepared.page_table, ...
        try:
            return self.arrays[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass(slots=True)
class _DecompressedLayout:
    """Where ``kv_transform`` calls put a plan's pieces: the same for every layer of a step.

    ``prepared``: the plan over the decompressed pages (same work, reduce map, route, precision and
    partitions; piece ``k`` on pages of its own, each full but its last), on the device.
    ``sources[k]``: ``(n_k,)`` int64 flat latent-cache slots of piece ``k``'s rows, or None for a
    piece no work item reads or one without rows; ``starts[k]``: its first row in the buffers (a
    page's first). ``num_pages``: pages of the buffers.
    """

    plan: AttentionPlan  # the plan it was made for
    prepared: TritonPreparedPlan
    sources: list[torch.Tensor | None]
    starts: list[int]
    num_pages: int


def flatten_plan(plan: AttentionPlan) -> dict[str, np.ndarray]:
    """The plan's index arrays as int32 numpy arrays (layout documented in ``paged_attention``).

    Page arrays are built with numpy (a long batch has hundreds of thousands of pages per step).
    Key masks (tree verify windows) go into two arrays: ``work_key_masks (2 W,)``, per work item
    the index in ``key_mask_words`` of its first row's first word (-1 when the item has no masks)
    and its words per row, ``ceil(n / 32)`` for the ``n`` piece rows its rows' causal offsets reach;
    ``key_mask_words``, each masked row's mask in turn, piece row ``j`` in bit ``j % 32`` of word
    ``j // 32`` (words are the mask's 32-bit slices as int32). A mask reaching more than
    :data:`MAX_KEY_MASK_BITS` piece rows raises ValueError.
    """
    pieces = plan.pieces
    counts = np.fromiter((len(p.page_ids) for p in pieces), dtype=np.int64, count=len(pieces))
    total = int(counts.sum())
    pages = np.fromiter(chain.from_iterable(p.page_ids for p in pieces), dtype=np.int32, count=total)
    rows = np.fromiter(chain.from_iterable(p.page_rows for p in pieces), dtype=np.int32, count=total)
    starts = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    # position of each page's first row within its piece: an exclusive running sum restarted per piece
    before = np.zeros(total + 1, dtype=np.int64)
    np.cumsum(rows, out=before[1:])
    key_starts = before[:-1] - np.repeat(before[starts[:-1]], counts)
    work_pieces = np.fromiter((item.piece for item in plan.work), dtype=np.int64, count=len(plan.work))
    work_start, offsets = [0], []
    for item in plan.work:
        work_start.append(work_start[-1] + len(item.query_rows))
        offsets.extend(item.causal_offsets)
    work_key_masks, key_mask_words = _key_mask_arrays(plan)
    reduce_ptr, reduce_partials = [0], []
    direct = [-1] * plan.num_partials
    for row, partials in enumerate(plan.reduce_map):
        reduce_partials.extend(partials)
        reduce_ptr.append(len(reduce_partials))
        if len(partials) == 1:
            direct[partials[0]] = row

    def i32(values) -> np.ndarray:
        return np.asarray(values, dtype=np.int32)

    return {
        "page_table": pages, "page_rows": rows, "page_key_start": i32(key_starts),
        "work_pages": i32(np.stack([starts[work_pieces], starts[work_pieces + 1]], axis=1).ravel()),
        "work_partial_start": i32(work_start),
        "partial_row": i32(plan.partial_rows), "partial_offset": i32(offsets), "partial_direct": i32(direct),
        "reduce_ptr": i32(reduce_ptr), "reduce_partials": i32(reduce_partials),
        "work_key_masks": work_key_masks, "key_mask_words": key_mask_words,
        # each partial's sliding-window start within its piece (0: none); empty without windows
        "partial_low": i32([low for item in plan.work for low in (item.key_lows or (0,) * len(item.query_rows))]
                           if plan.has_key_lows else []),
    }


def _key_mask_arrays(plan: AttentionPlan) -> tuple[np.ndarray, np.ndarray]:
    """``work_key_masks`` and ``key_mask_words`` of a plan (:func:`flatten_plan`), int32."""
    work_masks = np.empty((len(plan.work), 2), dtype=np.int32)
    work_masks[:, 0], work_masks[:, 1] = -1, 0
    if not plan.has_key_masks:
        return work_masks.ravel(), np.zeros(0, dtype=np.int32)
    words: list[int] = []
    for index, item in enumerate(plan.work):
        if item.key_masks is None:
            continue
        # the kernels read a row's words up to its causal offset (and the piece's last row)
        width = min(max(item.causal_offsets) + 1, plan.pieces[item.piece].num_rows)
        if width > MAX_KEY_MASK_BITS:
            raise ValueError(f"work item {index} has key masks over {width} piece rows; the Triton kernels "
                             f"take masks of at most MAX_KEY_MASK_BITS = {MAX_KEY_MASK_BITS} rows")
        per_row = max(1, -(-width // 32))
        work_masks[index] = len(words), per_row
        for mask in item.key_masks:
            words.extend(mask >> (32 * i) & 0xFFFFFFFF for i in range(per_row))
    return work_masks.ravel(), np.asarray(words, dtype=np.int64).astype(np.uint32).view(np.int32)


class TritonBackend:
    """Runs attention plans with Triton kernels (CUDA, or the interpreter on the CPU).

    An :class:`~segkv.attention.backend.AttentionBackend`: both cache layouts (GQA kernels for
    ``"mha"``, the latent kernel for ``"mla"``), tree windows' key masks included; ``kv_transform``
    (naive MLA) decompresses each piece once into contiguous pages and runs the GQA kernels over them
    (:meth:`_run_decompressed`); with a :class:`PlanCapacity` its plans live in
    fixed buffers, so CUDA graphs captured over ``run`` replay later plans (of the precision mode of
    the first: ``prepare`` refuses another). Both precision modes (the plan's ``precision``): in
    ``exact``, half-precision P.V uses P split into two half-precision parts (about 16 bits of P,
    float32 sums), within one unit in the last place of float32 attention rounded once; ``fast``
    rounds P to the K/V dtype, one product (``docs/design.md``, "Precision modes", states the bound). The CPU runs it only in Triton's
    interpreter (``TRITON_INTERPRET=1`` before ``triton`` is imported: tests).

    Lifecycle (runnable; plan and prepare once per step, run once per layer)::

        import torch
        from segkv.attention import AttentionShape, DeviceSpec, SequenceQuery, plan_attention
        from segkv.attention.triton_backend import TritonBackend
        from segkv.cache import PagedKVCache
        from segkv.config import CacheConfig, KVLayout

        device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: TRITON_INTERPRET=1
        num_layers, page_size, q_heads, kv_heads, dim = 2, 16, 8, 2, 64
        layout = KVLayout(num_layers=num_layers, num_kv_heads=kv_heads, head_dim=dim, dtype=torch.bfloat16)
        cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=32), device=device)
        backend = TritonBackend(page_size=page_size, device=device)

        # one step: a 37-row prompt chunk and a 3-row turn on a 20-row history
        chains = [cache.new_chain(), cache.new_chain()]
        history = chains[1].append(20)
        for layer in range(num_layers):
            cache.storage.write(layer, history, *torch.randn(2, 20, kv_heads, dim, device=device))
        chains[1].seal()
        new_rows = [37, 3]
        slots = [slot for chain, n in zip(chains, new_rows) for slot in chain.append(n)]

        # once per step: plan the pieces from the chains, prepare the index tensors
        queries = [SequenceQuery.from_chain(chain, n) for chain, n in zip(chains, new_rows)]
        plan = plan_attention(queries, AttentionShape(q_heads, kv_heads, dim, dim), DeviceSpec.detect(device),
                              page_size=page_size)
        prepared = backend.prepare(plan)

        # per layer: write its new K/V rows, then run over its cache with the same prepared plan
        query = torch.randn(num_layers, plan.num_query_rows, q_heads, dim, device=device).to(torch.bfloat16)
        outputs = []
        for layer in range(num_layers):
            cache.storage.write(layer, slots, *torch.randn(2, len(slots), kv_heads, dim, device=device))
            out, lse = backend.run(prepared, query[layer], cache.storage.key_cache(layer),
                                   cache.storage.value_cache(layer), scale=dim ** -0.5)
            outputs.append(out)  # (40, q_heads, dim) bfloat16; lse (40, q_heads) float32
    """

    name = "triton"
    lse_api = LSE_API_TRITON
    capabilities = BackendCapabilities(devices=("cuda",), kv_layouts=("mha", "mla"), kv_transform=True,
                                       cuda_graphs=True, precision_modes=("exact", "fast"), key_masks=True,
                                       sinks=True)

    def __init__(
        self,
        *,
        page_size: int,
        device: str | torch.device = "cuda",
        poison: bool = False,
        capacity: PlanCapacity | None = None,
        launch=None,
        workspace_bytes: int = PARTIAL_WORKSPACE_BYTES,
    ) -> None:
        self.page_size = page_size
        self.device = torch.device(device)
        self.poison = poison  # tests: fill outputs with NaN before every launch
        self.capacity = capacity
        self.launch = launch  # kernels.attention.paged_attention.LaunchConfig, or None for the measured default
        self._fixed: dict[str, torch.Tensor] | None = None
        self._fixed_precision = None  # the precision mode of the plans in the fixed buffers (the first one's)
        self._staging: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        self._reference = None
        # eager steps keep their split partials in one buffer, grown on demand up to
        # workspace_bytes (the planner's bound): no per-step allocation that grows with history
        self.workspace_bytes = workspace_bytes
        self._workspace: torch.Tensor | None = None
        # merge tickets of the GQA kernels (paged_attention's ``counters``): zeros, and every
        # launch leaves them zero; grown, never shrunk (graph captures keep their address)
        self._counters: torch.Tensor | None = None
        if capacity is not None:
            sizes = capacity.sizes()
            total = sum(sizes.values())
            buffer = torch.zeros(total, dtype=torch.int32, device=self.device)
            self._fixed = self._views(buffer, sizes)
            self._fixed_buffer = buffer
            self._staging = torch.zeros(total, dtype=torch.int32, pin_memory=self.device.type == "cuda")
            self._staging_np = self._staging.numpy()  # host writes through numpy: no torch op per field
            offsets = np.cumsum([0] + [sizes[name] for name in _FIELDS])
            self._offsets = dict(zip(_FIELDS, offsets[:-1].tolist()))
            self._small_start = self._offsets["work_pages"]  # the non-page fields: one region

    @staticmethod
    def _views(buffer: torch.Tensor, sizes: dict[str, int], align: int = 1) -> dict[str, torch.Tensor]:
        """One view per field, laid out in ``_FIELDS`` order, each starting at a multiple of ``align``."""
        views, start = {}, 0
        for name in _FIELDS:
            views[name] = buffer[start:start + sizes[name]]
            start += -(-sizes[name] // align) * align
        return views

    def prepare(self, plan: AttentionPlan, *, arrays: dict[str, np.ndarray] | None = None) -> TritonPreparedPlan:
        """Flatten the plan into int32 tensors on the device (once per forward step).
        ``arrays``: ``flatten_plan(plan)`` when the caller already made it (not modified)."""
        arrays = flatten_plan(plan) if arrays is None else dict(arrays)
        if self.capacity is None:
            return self._prepare_eager(plan, arrays)
        max_work_rows = plan.max_work_rows
        cap = self.capacity
        # a graph captured over run() replays the kernels of the precision it was captured with
        if self._fixed_precision is None:
            self._fixed_precision = plan.precision
        elif plan.precision != self._fixed_precision:
            raise ValueError(f"a {plan.precision.value} plan in fixed buffers prepared for "
                             f"{self._fixed_precision.value} plans (their graphs run one precision mode)")
        if plan.num_query_rows > cap.max_rows or max_work_rows > cap.max_work_rows:
            raise ValueError(f"plan with {plan.num_query_rows} rows ({max_work_rows} per work item) exceeds "
                             f"the capacity ({cap.max_rows} rows, {cap.max_work_rows} per work item)")
        if plan.has_key_lows and not cap.key_lows:
            raise ValueError("a plan with a sliding window's key lows in fixed buffers without them")
        if cap.max_row_partials is not None and plan.max_row_partials > cap.max_row_partials:
            raise ValueError(f"plan merges {plan.max_row_partials} partials into a row, capacity is "
                             f"{cap.max_row_partials}")
        sizes = cap.sizes()
        for name in _FIELDS:
            if len(arrays[name]) > sizes[name]:
                raise ValueError(f"plan needs {len(arrays[name])} entries of {name}, capacity is {sizes[name]}")
        if cap.key_lows and not plan.has_key_lows:  # the kernels test lows: none must be an earlier plan's
            arrays["partial_low"] = np.zeros(len(arrays["partial_row"]), dtype=np.int32)
        # the kernels read these past the plan's entries (fixed grids): pad them to be inert
        for name in _PADDED:
            values = arrays[name]
            arrays[name] = np.concatenate([values, np.full(sizes[name] - len(values), values[-1], dtype=np.int32)])
        if self._copied is not None:  # the previous transfer must have read the staging buffer
            self._copied.synchronize()
        for name in _FIELDS:
            start = self._offsets[name]
            self._staging_np[start:start + len(arrays[name])] = arrays[name]
        # one transfer of the whole buffer when it is small, else four: the used entries of each
        # page field (up to the capacity's pages each), then the small fields' whole region;
        # entries past a plan's are never read
        if self._staging_np.nbytes <= PLAN_ONE_COPY_BYTES:
            spans = [(0, len(self._staging_np))]
        else:
            spans = [(self._offsets[name], len(arrays[name])) for name in ("page_table", "page_rows", "page_key_start")]
            spans.append((self._small_start, len(self._staging_np) - self._small_start))
        for start, length in spans:
            if length:
                self._fixed_buffer[start:start + length].copy_(self._staging[start:start + length], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        # the graph's kernels test masks whenever the buffers can hold them (whatever this plan holds)
        return TritonPreparedPlan(plan, self._fixed, cap.max_partials, cap.max_work_rows, True, fixed=True,
                                  merge_in_stage1=merges_in_stage1(cap.max_work_rows, cap.max_row_partials),
                                  key_masks=cap.key_mask_words > 0, key_lows=cap.key_lows)

    def _prepare_eager(self, plan: AttentionPlan, arrays: dict[str, np.ndarray]) -> TritonPreparedPlan:
        """The plan's int32 ``arrays`` (``flatten_plan``) in one device buffer sized for this plan
        (``prepare`` without a capacity)."""
        needs_merge = bool((np.diff(arrays["reduce_ptr"]) != 1).any())  # a row without exactly one partial
        # every field 16-byte aligned: Triton specialises a kernel on its pointers' alignment, so
        # fields at plan-dependent offsets made new variants compile (seconds) as plans changed
        sizes = {name: len(arrays[name]) for name in _FIELDS}
        host = np.concatenate([np.pad(arrays[name], (0, -sizes[name] % _ALIGN_INT32)) for name in _FIELDS])
        device_buffer = torch.from_numpy(host)
        if self.device.type == "cuda":  # page-locked and queued: no wait for the kernels ahead of it
            device_buffer = device_buffer.pin_memory().to(self.device, non_blocking=True)
        else:
            device_buffer = device_buffer.to(self.device)
        max_work_rows = plan.max_work_rows
        return TritonPreparedPlan(plan, self._views(device_buffer, sizes, _ALIGN_INT32), plan.num_partials,
                                  max_work_rows, needs_merge,
                                  merge_in_stage1=needs_merge and merges_in_stage1(max_work_rows,
                                                                                   plan.max_row_partials),
                                  key_masks=plan.has_key_masks, key_lows=plan.has_key_lows)

    def run(
        self,
        prepared: TritonPreparedPlan,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        *,
        scale: float,
        out_dtype: torch.dtype | None = None,
        kv_transform: KVTransform | None = None,
        kv_scales: KVScales | None = None,
        sinks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of one layer: arguments and results as ``AttentionBackend.run`` states them.

        With fixed-size buffers ``query`` may carry padding rows past the plan's rows (a graph
        bucket); they come out 0 with LSE -inf (with ``sinks``: LSE ``sinks[h]``). ``sinks``
        ``(Hq,)`` float32: attention sinks for per-head K/V caches (the GQA kernels); a latent cache
        or a ``kv_transform`` raises ValueError.
        """
        from segkv.kernels.attention.mla_attention import mla_paged_attention
        from segkv.kernels.attention.paged_attention import paged_attention

        plan = prepared.plan
        check_sinks(self.name, self.capabilities, sinks, query)
        if sinks is not None and kv_transform is not None:
            raise ValueError("attention sinks are not supported with kv_transform (naive MLA) in the triton backend")
        if kv_transform is not None:
            return self._run_decompressed(prepared, query, key_cache, value_cache, scale=scale, out_dtype=out_dtype,
                                          kv_transform=kv_transform, kv_scales=kv_scales)

        rows = query.shape[0]
        if prepared.fixed:
            if not plan.num_query_rows <= rows <= self.capacity.max_rows:
                raise ValueError(f"query has {rows} rows; the plan needs {plan.num_query_rows} to "
                                 f"{self.capacity.max_rows} (the capacity)")
        elif rows != plan.num_query_rows:
            raise ValueError(f"query has {rows} rows, the plan {plan.num_query_rows}")
        if query.shape[1] % key_cache.shape[2]:
            raise ValueError(f"{query.shape[1]} query heads for {key_cache.shape[2]} KV heads")
        a = prepared.arrays
        latent = is_latent_cache(key_cache, value_cache)
        dv = value_cache.shape[3]
        workspace = None if prepared.fixed else self._partials_workspace(prepared.num_partials * query.shape[1] * (dv + 1))
        fields = {name: a[name] for name in _FIELDS}
        if not prepared.key_masks:  # the kernels compile the mask test away
            fields["work_key_masks"] = fields["key_mask_words"] = None
        partial_low = fields.pop("partial_low")
        if not prepared.key_lows:  # the kernels compile the window test away
            partial_low = None
        if latent:
            if partial_low is not None:
                raise ValueError("the latent (MLA) kernel takes no sliding window")
            if sinks is not None:
                raise ValueError("the latent (MLA) kernel takes no attention sinks")
            return mla_paged_attention(
                query=query, latent_cache=key_cache.squeeze(2), rank=dv,
                **fields, num_partials=prepared.num_partials,
                max_work_rows=prepared.max_work_rows, scale=scale, out_dtype=out_dtype or query.dtype,
                needs_merge=prepared.needs_merge, poison=self.poison, workspace=workspace,
                kv_scale=None if kv_scales is None else kv_scales[0], fast=plan.precision == "fast",
            )
        return paged_attention(
            query=query, key_cache=key_cache, value_cache=value_cache, **fields,
            num_partials=prepared.num_partials, max_work_rows=prepared.max_work_rows, scale=scale,
            out_dtype=out_dtype or query.dtype, needs_merge=prepared.needs_merge, launch=self.launch,
            poison=self.poison, workspace=workspace, merge_in_stage1=prepared.merge_in_stage1,
            counters=self._merge_counters(rows * query.shape[1]) if prepared.merge_in_stage1 else None,
            kv_scales=kv_scales, fast=plan.precision == "fast", partial_low=partial_low, sinks=sinks,
        )

    def _run_decompressed(
        self,
        prepared: TritonPreparedPlan,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        *,
        scale: float,
        out_dtype: torch.dtype | None,
        kv_transform: KVTransform,
        kv_scales: KVScales | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``run`` with a ``kv_transform`` (naive MLA): each piece a work item reads is gathered from
        the cache (``(n, Hkv, Dk_cache)`` rows; an FP8 cache's dequantized to float32 as the reference
        does), transformed once into keys ``(n, H, Dk)`` and values ``(n, H, Dv)``, and copied into two
        contiguous buffers in ``query``'s dtype, ``(pages, DECOMPRESSED_PAGE_SIZE, H, Dk)`` and
        ``(pages, DECOMPRESSED_PAGE_SIZE, H, Dv)``, each piece from a page's first row (the rows past a
        piece's end are never read: the kernels mask rows past a page's count). The GQA kernels then
        run the plan over those pages (group 1), with the plan's precision mode. A transform whose
        output is not in ``query``'s dtype is rounded to it (``_decompress`` of ``MultiHeadLatentAttention``
        returns the model's dtype, the query's).

        The buffers are allocated per call: about ``pages * 16 * H * (Dk + Dv)`` elements. Fixed
        (graph) preparations run here too, eagerly (graphs never replay naive steps); their padding
        query rows come out 0 with LSE -inf. A plan whose work reads no key row runs on the torch
        reference (nothing to decompress tells ``Dv``).
        """
        plan = prepared.plan
        rows = query.shape[0]
        if prepared.fixed:
            if not plan.num_query_rows <= rows <= self.capacity.max_rows:
                raise ValueError(f"query has {rows} rows; the plan needs {plan.num_query_rows} to "
                                 f"{self.capacity.max_rows} (the capacity)")
        elif rows != plan.num_query_rows:
            raise ValueError(f"query has {rows} rows, the plan {plan.num_query_rows}")
        live = query[:plan.num_query_rows]
        layout = prepared.decompressed
        if layout is None or layout.plan is not plan:  # once per step, shared by its layers
            layout = prepared.decompressed = self._decompressed_layout(plan)
        if not layout.num_pages:
            out, lse = self._reference_run(prepared, live, key_cache, value_cache, scale=scale, out_dtype=out_dtype,
                                           kv_transform=kv_transform, kv_scales=kv_scales)
        else:
            keys, values = key_cache.flatten(0, 1), value_cache.flatten(0, 1)
            key_pages = value_pages = None
            for source, start in zip(layout.sources, layout.starts):
                if source is None:
                    continue
                key, value = keys[source], values[source]
                if kv_scales is not None:  # FP8 bytes -> float32 values, per KV head
                    key, value = dequantize_fp8(key, kv_scales[0]), dequantize_fp8(value, kv_scales[1])
                key, value = kv_transform(key, value)
                if key_pages is None:
                    shape = (layout.num_pages, DECOMPRESSED_PAGE_SIZE)
                    key_pages = query.new_empty(*shape, *key.shape[1:])
                    value_pages = query.new_empty(*shape, *value.shape[1:])
                end = start + key.shape[0]
                key_pages.view(-1, *key.shape[1:])[start:end] = key
                value_pages.view(-1, *value.shape[1:])[start:end] = value
            out, lse = self.run(layout.prepared, live, key_pages, value_pages, scale=scale, out_dtype=out_dtype)
        if rows > live.shape[0]:  # a graph bucket's padding rows see nothing
            out = torch.cat((out, out.new_zeros(rows - live.shape[0], *out.shape[1:])))
            lse = torch.cat((lse, lse.new_full((rows - live.shape[0], lse.shape[1]), float("-inf"))))
        return out, lse

    def _decompressed_layout(self, plan: AttentionPlan) -> _DecompressedLayout:
        """The pages ``kv_transform`` calls decompress ``plan``'s pieces into, and the plan over them
        (:class:`_DecompressedLayout`), its index arrays and source slots on the device (one transfer each)."""
        page = DECOMPRESSED_PAGE_SIZE
        read = {item.piece for item in plan.work}
        pieces, starts, counts, first = [], [], [], 0
        for index, piece in enumerate(plan.pieces):
            n = piece.num_rows if index in read else 0
            full, rest = divmod(n, page)
            page_rows = (page,) * full + ((rest,) if rest else ())
            pieces.append(Piece(tuple(range(first, first + len(page_rows))), page_rows))
            starts.append(first * page)
            counts.append(n)
            first += len(page_rows)
        decompressed = AttentionPlan(plan.route, tuple(pieces), plan.work, plan.reduce_map, plan.num_query_rows,
                                     num_partitions=plan.num_partitions, reason=plan.reason,
                                     precision=plan.precision, window=plan.window)
        prepared = self._prepare_eager(decompressed, flatten_plan(decompressed))
        # the flat cache slots of every read piece's rows (row j of a page at page_id * page_size + j)
        sources = [p for p, n in zip(plan.pieces, counts) if n]
        page_ids = np.fromiter(chain.from_iterable(p.page_ids for p in sources), dtype=np.int64)
        page_rows = np.fromiter(chain.from_iterable(p.page_rows for p in sources), dtype=np.int64)
        before = np.cumsum(page_rows) - page_rows
        slots = np.repeat(page_ids * self.page_size - before, page_rows) + np.arange(int(page_rows.sum()))
        split = iter(torch.from_numpy(slots).to(self.device).split([n for n in counts if n]))
        return _DecompressedLayout(plan, prepared, [next(split) if n else None for n in counts], starts, first)

    def _merge_counters(self, entries: int) -> torch.Tensor:
        """At least ``entries`` int32 merge tickets, all zero (the kernels leave them so). A graph
        bucket's first (uncaptured) step sizes them for its rows, so capture allocates nothing."""
        if self._counters is None or self._counters.numel() < entries:
            self._counters = torch.zeros(max(entries, 1024), dtype=torch.int32, device=self.device)
        return self._counters

    def _partials_workspace(self, floats: int) -> torch.Tensor | None:
        """The eager partials buffer (``workspace_bytes`` on a GPU, grown on demand elsewhere) with
        room for ``floats`` float32 values; None when the plan has no partials, or needs more than
        ``workspace_bytes`` (a forced plan: it allocates for itself)."""
        if not floats or floats > self.workspace_bytes // 4:
            return None
        if self._workspace is None or self._workspace.numel() < floats:
            # on a GPU the whole budget at once, so a later, longer turn finds it in place
            grown = 2 * self._workspace.numel() if self._workspace is not None else 0
            size = self.workspace_bytes // 4 if self.device.type == "cuda" else min(max(floats, grown),
                                                                                  self.workspace_bytes // 4)
            self._workspace = torch.empty(size, dtype=torch.float32, device=self.device)
        return self._workspace

    def _reference_backend(self):
        """The torch reference backend on this device (made once, on demand)."""
        from segkv.attention.reference import TorchReferenceBackend

        if self._reference is None:
            self._reference = TorchReferenceBackend(page_size=self.page_size, device=self.device)
        return self._reference

    def _reference_run(self, prepared: TritonPreparedPlan, *args, **kwargs):
        """The torch reference on the same plan (prepared once per plan, on demand)."""
        reference = self._reference_backend()
        if prepared.reference is None or prepared.reference.plan is not prepared.plan:
            prepared.reference = reference.prepare(prepared.plan)
        return reference.run(prepared.reference, *args, **kwargs)


def merges_in_stage1(max_work_rows: int, max_row_partials: int | None) -> bool:
    """Whether the GQA kernels merge a plan's rows inside stage 1: work items of one query row
    (decode) and at most :func:`stage1_merge_bound` partials per row. The merge launch and its
    wait cost 1.5-2.5% at batch 16 (2 partials per row); batch 1's 33 partials per row are read
    faster by the merge kernel, all at once, than by one last program."""
    return max_work_rows == 1 and max_row_partials is not None and 0 < max_row_partials <= stage1_merge_bound()


def is_latent_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """An MLA latent cache: one KV head, and the values are the keys' first columns (a view)."""
    return (key_cache.shape[2] == 1 and value_cache.data_ptr() == key_cache.data_ptr()
            and value_cache.shape[3] < key_cache.shape[3])
