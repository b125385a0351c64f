"""The attention planner: turns a batch of chains into a plan for the device at hand.

Routes (see ``Route``): ``single`` attends each sequence as one piece; ``segments`` one
piece per segment; ``cascade`` makes a span shared by several sequences of the batch one
piece read once for all of their query rows; ``split`` cuts long pieces into partitions
when the batch alone would leave the device's parallel slots idle. The automatic choice
uses the device's wave size (multiprocessors x resident blocks), never a fixed context
threshold. ``SEGKV_ATTENTION_ROUTE`` forces a route (testing and benchmarks).

Tree verify windows (``SequenceQuery.tree_parents``) are planned as two kinds of pieces: the
history before the window's first page, which every node sees whole, goes through the route
like any causal window (one work item for all the nodes, shared as a cascade piece when
sequences share it); the window's own piece (that part page of history and the window's
rows) gets one work item whose rows carry ``key_masks``, the ancestor mask
(:class:`~segkv.attention.plan.WorkItem`). The window piece is never split: it holds under
``page_size + window`` rows. The exact LSE merge joins the two as it joins any pieces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from segkv.attention.device import DeviceSpec, lean_decode_programs, prefill_programs, tall_decode_programs
from segkv.attention.plan import (
    AttentionPlan,
    AttentionShape,
    Piece,
    Precision,
    Route,
    SequenceQuery,
    WorkItem,
    reduce_map_from_work,
)
from segkv.cache.segment import ChainSpan
import segkv.settings as settings

ROUTE_ENV = "SEGKV_ATTENTION_ROUTE"
# Tile height of a stage-1 program in (query row x query head) units, for the occupancy
# estimate: GQA programs take up to 64 pairs, latent (MLA) programs 16 (their accumulator is
# 16 x kv_lora_rank float32), so a latent piece with H heads makes H / 16 programs.
_TILE_ROWS = 64
_LATENT_TILE_ROWS = 16
# the fast mode's wide latent programs (many heads): 64 pairs over 8 warps, one per multiprocessor
# (mla_attention's LaunchConfig.wide_latent_block_m)
_WIDE_LATENT_TILE_ROWS = 64
# Latent programs hold a 16 x 512 float32 accumulator and use every register a thread may have, so
# at most 2 are resident per multiprocessor (measured) whatever the device spec says: a split that
# overfills that wave measured slower than one partition and must not look free
# (docs/performance-notes.md).
_LATENT_RESIDENT_PER_MULTIPROCESSOR = 2
# A single pass of lean decode programs is re-costed in the waves the device holds of them while it
# makes fewer than this many, over runs of at least this many rows (_lean_single_pass)
LEAN_SINGLE_PASS_MAX_WAVES = 3
LEAN_SINGLE_PASS_MIN_ROWS = 4096


_Part = tuple  # (page_ids, page_rows, key_start) of one partition


@dataclass(slots=True)
class _Run:
    """Consecutive KV rows attended as one unit before partitioning."""

    page_ids: list[int]
    page_rows: list[int]
    key_start: int  # position of the first row, the same in every member sequence
    members: list[int] = field(default_factory=list)  # sequence indices

    @property
    def num_rows(self) -> int:
        return sum(self.page_rows)


def forced_route_from_env() -> Route | None:
    value = (settings.SETTINGS.attention_route or "").strip()
    return Route.parse(value) if value and value != "auto" else None


def forced_precision_from_env() -> Precision | None:
    """``SEGKV_ATTENTION_PRECISION``'s mode (None: unset or ``auto``)."""
    value = (settings.SETTINGS.attention_precision or "").strip()
    return Precision.parse(value) if value and value != "auto" else None


def _bucket_rows(rows: int) -> int:
    """``rows`` rounded up to a power of two (the CUDA graph buckets' sizes)."""
    return 1 << max(0, rows - 1).bit_length()


def choose_precision(shape: AttentionShape, device: DeviceSpec, max_query_rows: int,
                     forced: Precision | str | None = None, tree_windows: bool = False,
                     num_query_rows: int = 0) -> Precision:
    """The precision mode of a plan whose sequences have up to ``max_query_rows`` query rows each
    (``num_query_rows`` in all): ``forced`` (else ``SEGKV_ATTENTION_PRECISION``), else ``fast``
    for prefill chunks (more rows than a verify window, in work items of prefill programs) on a
    device that runs them faster in it (``DeviceSpec.fast_prefill``, measured), and for latent
    batches of at least ``DeviceSpec.fast_latent_min_pairs`` (row x head) pairs (many heads:
    compute-bound; the rows rounded up to a power of two, as CUDA graph buckets are, so every step
    a bucket replays keeps the precision it was captured with), else ``exact``: decode (a cascade's many forks too, whose shared piece has
    work items of many rows), verify windows (``tree_windows`` included), small latent batches,
    the CPU."""
    if forced is not None and forced != "auto":
        return Precision.parse(forced)
    env = forced_precision_from_env()
    if env is not None:
        return env
    rows = min(max_query_rows, device.max_query_rows_per_work)  # a chunk's work items
    if device.fast_prefill and not tree_windows and prefill_programs(rows, (shape.key_dim, shape.value_dim),
                                                                     shape.is_latent):
        return Precision.FAST
    if (shape.is_latent and device.fast_latent_min_pairs and not tree_windows
            and _bucket_rows(num_query_rows) * shape.num_q_heads >= device.fast_latent_min_pairs):
        return Precision.FAST
    return Precision.EXACT


def plan_attention(
    queries: Sequence[SequenceQuery],
    shape: AttentionShape,
    device: DeviceSpec,
    *,
    page_size: int,
    route: Route | str | None = None,
    num_partitions: int | None = None,
    cascade_min_rows: int | None = None,
    precision: Precision | str | None = None,
    window: int | None = None,
) -> AttentionPlan:
    """Build the attention plan of one forward step.

    ``queries`` are the batch's sequences in query-row order. ``route`` forces a route
    (else ``SEGKV_ATTENTION_ROUTE``, else automatic); ``num_partitions`` forces how many
    partitions each run is cut into (``split``, ``segments`` and ``cascade``; without it
    those routes cut long runs only as far as the device has idle slots, ``single`` never). ``cascade_min_rows`` is the fewest
    rows a shared span needs to be planned as a cascade piece (default: one page,
    or any shared span when ``cascade`` is forced). A tree window's history is planned by
    the route; its window piece is added after the route's pieces (module docstring).
    ``precision`` forces the mode inside the pieces (else :func:`choose_precision`).
    ``window``: sliding-window attention (each row sees its last ``window`` positions, itself
    included): pages wholly before a sequence's first row's window are left out of its pieces
    (:func:`_windowed`), and work items whose rows' windows start inside their piece carry
    ``key_lows``; tree windows' masks lose the bits before each node's window.
    """
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if num_partitions is not None and num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    forced = Route.parse(route) if route is not None else forced_route_from_env()
    if cascade_min_rows is None:  # forced: share whatever is shared; auto: at least a page
        cascade_min_rows = 1 if forced == Route.CASCADE else page_size

    # tree windows: the route plans their histories (as causal queries that see all of them);
    # their window pieces are added after the route's pieces
    windows = [_split_tree(query, page_size) if query.is_tree else None for query in queries]  # tree windows
    full_queries, queries = queries, [query if tree is None else tree.history
                                      for query, tree in zip(queries, windows)]
    if window is not None:  # after the tree split: a tree's history is windowed by its nodes' lowest key
        queries = [_windowed(query, window, page_size) for query in queries]
    _check_no_released_pages(queries, window, page_size)
    max_query_rows = max((q.num_query_rows for q in full_queries), default=0)
    mode = choose_precision(shape, device, max_query_rows, precision, any(w is not None for w in windows),
                            sum(q.num_query_rows for q in queries))
    wide = shape.is_latent and mode == Precision.FAST  # the latent kernel's wide programs
    shared = _shared_spans(queries, cascade_min_rows)
    if forced is None:
        use_cascade = bool(shared)
        layout = Route.CASCADE if use_cascade else Route.SINGLE
    else:
        layout = forced if forced != Route.SPLIT else Route.SINGLE
    runs = _build_runs(queries, layout, shared, page_size)

    if num_partitions is not None and forced != Route.SINGLE:
        cuts = _forced_cuts(runs, num_partitions)
        reason = f"{forced.value if forced else 'auto'} route, {num_partitions} partitions"
    elif forced == Route.SPLIT:  # as many partitions as the device has idle slots, at least 2
        chunks, reason = _auto_chunk(runs, queries, shape, device, page_size, wide)
        cuts = [_cut_rows(run, chunks[i] if chunks else None) for i, run in enumerate(runs)]
        cuts = [parts if len(parts) > 1 else _cut_pages(run, 2) for parts, run in zip(cuts, runs)]
        reason = f"forced split; {reason}"
    elif forced in (None, Route.SEGMENTS, Route.CASCADE):
        # segments and cascade pieces are split further when the batch leaves the device idle
        chunks, reason = _auto_chunk(runs, queries, shape, device, page_size, wide)
        cuts = [_cut_rows(run, chunks[i] if chunks else None) for i, run in enumerate(runs)]
        if forced is not None:
            reason = f"forced {forced.value}; {reason}"
    else:
        cuts, reason = [_cut_rows(run, None) for run in runs], f"forced {forced.value}"
    # a tree's nodes sit at the tree's start plus their depths, which bound their windows from below
    positions = None if window is None else [
        None if tree is None else [query.tree_start + d for d in
                                   tree_depths(query.tree_parents)[len(query.tree_parents) - query.num_query_rows:]]
        for query, tree in zip(full_queries, windows)]
    pieces, work, max_parts = _partition(runs, cuts, queries, device.max_query_rows_per_work, window, positions)
    _add_tree_windows(pieces, work, full_queries, windows, device.max_query_rows_per_work, window)

    if forced is not None:
        final = forced
    elif layout == Route.CASCADE:
        final = Route.CASCADE
    else:
        final = Route.SPLIT if max_parts > 1 else Route.SINGLE
    num_rows = sum(q.num_query_rows for q in queries)
    return AttentionPlan(
        route=final,
        pieces=tuple(pieces),
        work=tuple(work),
        reduce_map=reduce_map_from_work(tuple(work), num_rows),
        num_query_rows=num_rows,
        num_partitions=max_parts,
        reason=reason,
        precision=mode,
        window=window,
    )


# -- runs ----------------------------------------------------------------------------------
def _span_key(span: ChainSpan) -> tuple[int, int, int]:
    return (span.segment_id, span.num_rows, span.key_start)


def _shared_spans(queries: Sequence[SequenceQuery], min_rows: int) -> dict[tuple[int, int, int], set[int]]:
    """Sealed spans that two or more sequences of the batch hold identically, with the indices
    of the sequences holding each."""
    holders: dict[tuple[int, int, int], set[int]] = {}
    for index, query in enumerate(queries):
        if query.num_query_rows:
            for s in query.spans:
                if s.sealed and s.num_rows >= max(min_rows, 1):
                    holders.setdefault(_span_key(s), set()).add(index)
    return {key: held for key, held in holders.items() if len(held) >= 2}


def _append_span(run: _Run, span: ChainSpan, page_size: int) -> None:
    run.page_ids.extend(span.page_ids)
    run.page_rows.extend(span.page_rows(page_size))


def _build_runs(
    queries: Sequence[SequenceQuery], layout: Route, shared: dict[tuple[int, int, int], set[int]], page_size: int
) -> list[_Run]:
    """The batch's runs: each sequence's consecutive spans, except (cascade) ``shared`` spans
    (:func:`_shared_spans`), which form runs of their own serving every holder. Consecutive
    shared spans held by the same sequences join one run (a history sealed turn by turn and then
    forked is one shared run, cut into partitions like any other, not a piece and a partial per
    sealed segment)."""
    runs: list[_Run] = []
    shared_runs: dict[tuple[int, int, int], _Run] = {}  # a shared span's key -> the run holding it
    for index, query in enumerate(queries):
        if not query.num_query_rows:
            continue
        current: _Run | None = None
        previous: tuple[int, int, int] | None = None  # the shared span just before, if any
        for span in query.spans:
            if span.num_rows == 0:
                continue
            key = _span_key(span)
            if layout == Route.CASCADE and key in shared:
                current = None
                run = shared_runs.get(key)
                if run is None:
                    joins = (previous is not None and shared[previous] == shared[key]
                             and previous[2] + previous[1] == span.key_start)
                    if joins:
                        run = shared_runs[previous]
                    else:
                        run = _Run([], [], span.key_start)
                        runs.append(run)
                    _append_span(run, span, page_size)
                    shared_runs[key] = run
                if not run.members or run.members[-1] != index:
                    run.members.append(index)
                previous = key
                continue
            previous = None
            if current is None or layout == Route.SEGMENTS:
                current = _Run([], [], span.key_start, [index])
                runs.append(current)
            _append_span(current, span, page_size)
    return runs


# -- partition sizes -----------------------------------------------------------------------
def _forced_cuts(runs: list[_Run], num_partitions: int) -> list[list[_Part]]:
    """``num_partitions`` per run, cut on page boundaries, fewer only where the run has
    fewer pages."""
    return [_cut_pages(run, num_partitions) for run in runs]


def _work_units(rows: int, shape: AttentionShape, wide: bool = False) -> int:
    """Stage-1 work items one partition of a run with ``rows`` query rows makes (KV heads x row
    tiles; ``wide``: the fast mode's wide latent programs)."""
    tile = (_WIDE_LATENT_TILE_ROWS if wide else _LATENT_TILE_ROWS) if shape.is_latent else _TILE_ROWS
    return shape.num_kv_heads * max(1, math.ceil(rows * shape.group_size / tile))


def _tall(shape: AttentionShape, max_work_rows: int) -> bool:
    """Whether the plan's GQA stage-1 programs are tall decode programs (:func:`device.tall_decode_programs`)."""
    return not shape.is_latent and tall_decode_programs(max_work_rows, shape.group_size,
                                                        max(shape.key_dim, shape.value_dim))


def _wave(device: DeviceSpec, shape: AttentionShape, tall: bool) -> int:
    """Stage-1 programs of ``shape`` the device runs at once (latent programs: at most 2 per unit;
    ``tall`` GQA decode programs, :func:`_tall`: the device's tall wave)."""
    if not shape.is_latent:
        return device.tall_wave_size if tall else device.wave_size
    return device.num_multiprocessors * min(device.blocks_per_multiprocessor, _LATENT_RESIDENT_PER_MULTIPROCESSOR)


def _lean_single_pass(base: int, longest: int, work_rows: int, shape: AttentionShape, device: DeviceSpec,
                      page_size: int) -> bool:
    """Whether a single pass of ``base`` stage-1 programs over runs of up to ``longest`` rows is
    re-costed in the waves the device holds of lean decode programs (``device.lean_wave_size``,
    :func:`lean_decode_programs`: 3 per SM where the planner aims at 2). One pass over 1-3 such
    waves ends in a partial one whose programs run alone on their SMs, which measured slower than
    splitting it into partitions. Re-costing plans the aimed-at wave already splits, more waves or
    runs under :data:`LEAN_SINGLE_PASS_MIN_ROWS` (where a partition's fixed cost weighs most)
    measured slower, so none of them is (docs/performance-notes.md, batch 64 and lean programs)."""
    lean_wave = device.lean_wave_size
    # (tall decode programs hold more than 32 pairs, so they are never lean)
    return (bool(device.lean_blocks_per_multiprocessor) and not shape.is_latent
            and lean_wave <= base < LEAN_SINGLE_PASS_MAX_WAVES * lean_wave and longest >= LEAN_SINGLE_PASS_MIN_ROWS
            and lean_decode_programs(work_rows, shape.group_size, max(shape.key_dim, shape.value_dim), page_size,
                                     device.key_tile_rows))


def _auto_chunk(
    runs: list[_Run],
    queries: Sequence[SequenceQuery],
    shape: AttentionShape,
    device: DeviceSpec,
    page_size: int,
    wide: bool = False,
) -> tuple[dict[int, int] | None, str]:
    """The page-aligned partition size with the lowest estimated time on the device (``wide``:
    latent work in the fast mode's wide programs, :data:`_WIDE_LATENT_TILE_ROWS` pairs each, one
    resident per multiprocessor).

    Without splitting, the batch makes ``base`` work items. Each candidate count ``p`` of partitions of the longest run
    (partitions of at least ``device.min_rows_per_partition`` rows, ``min_rows_per_latent_partition``
    for latent attention, at most
    ``device.max_partitions`` per run) is costed as ``waves x (rows per partition +
    partition_overhead_rows)``, the rows in whole ``device.key_tile_rows`` tiles for GQA programs
    (not tall decode ones): a partial wave costs a whole one (a single pass of 1-3 waves of lean
    decode programs is re-costed with the wave the device holds of them, :func:`_lean_single_pass`),
    and every partition pays a
    fixed prologue, epilogue and merge share (latent attention adds
    ``latent_merge_rows_per_partition`` per partition: its merge reads 512-wide partials; a GQA
    decode batch adds ``merge_launch_rows`` when a row gets more partials than stage 1 merges).
    When the unsplit batch leaves slots idle, among the cheapest estimates partitions of whole
    tiles first, then the most partitions win; otherwise the fewest. A split is therefore
    never chosen over an equally cheap or cheaper single pass when the device is full.
    Candidates whose float32 partials exceed ``device.max_partial_bytes`` are out.
    """
    if not runs:
        return None, "empty batch"
    query_rows = [sum(queries[m].num_query_rows for m in run.members) for run in runs]
    units = [_work_units(rows, shape, wide) for rows in query_rows]
    run_rows = [run.num_rows for run in runs]  # a sum over pages: computed once
    base = sum(units)
    work_rows = min(max(query_rows), device.max_query_rows_per_work)
    tall = _tall(shape, work_rows)
    wave = device.num_multiprocessors if wide else _wave(device, shape, tall)
    longest = max(run_rows)
    min_rows = device.min_rows_per_latent_partition if shape.is_latent else device.min_rows_per_partition
    min_chunk = max(page_size, math.ceil(min_rows / page_size) * page_size)
    if longest < 2 * min_chunk:
        return None, f"longest run {longest} rows < 2 x {min_chunk} rows per partition"

    # every candidate at once: parts p (rows) x runs (columns), in numpy (a long batch has
    # hundreds of runs and this runs every step)
    parts_all = np.arange(1, min(device.max_partitions, longest // min_chunk) + 1, dtype=np.int64)
    chunk_all = -(-(-(-longest // parts_all)) // page_size) * page_size
    rows_arr = np.asarray(run_rows, dtype=np.int64)
    per_run = np.minimum(device.max_partitions, -(-rows_arr[None, :] // chunk_all[:, None]))
    items_all = per_run @ np.asarray(units, dtype=np.int64)
    # a GQA program's partition costs its whole KV tiles (tall decode and latent programs: rows)
    key_tile = 1 if shape.is_latent or tall else device.key_tile_rows
    tiled_all = -(-chunk_all // key_tile) * key_tile
    # partials a candidate adds (one per partition and query row): over the workspace, it is out
    partial_bytes = (per_run @ np.asarray(query_rows, dtype=np.int64)) * shape.num_q_heads * (shape.value_dim + 1) * 4
    too_big = (partial_bytes > device.max_partial_bytes) & (parts_all > 1)

    def estimates(full_wave: int) -> np.ndarray:
        """Each candidate's cost, ``full_wave`` programs to a wave on a full device."""
        cost_all = -(-items_all // full_wave) * (tiled_all + device.partition_overhead_rows)
        if shape.is_latent:  # the merge reads each row's wide latent partials one after another
            cost_all = cost_all + parts_all * device.latent_merge_rows_per_partition
        elif device.merge_launch_rows and all(rows == 1 for rows in query_rows):
            # decode rows: stage 1 merges rows of few partials itself, more need the merge launch
            launches = per_run.max(axis=1) > device.stage1_merge_max_partials
            cost_all = cost_all + launches * device.merge_launch_rows
        return np.where(too_big, np.iinfo(np.int64).max, cost_all)

    def cheapest(cost_all: np.ndarray) -> int:
        """The cheapest estimate; among equal ones an idle device takes the most partitions, a full
        one the fewest. (Taking the most within 3% of the best, as before the pipelined kernel,
        measured slower at small batches and long contexts: docs/performance-notes.md.)"""
        near = np.flatnonzero(cost_all <= cost_all.min())
        if base < wave:  # an idle device: partitions of whole tiles first (a partial last tile only adds work)
            waste = tiled_all[near] - chunk_all[near]
            near = near[waste == waste.min()]
        return int(near.max() if base < wave else near.min())

    full_wave = wave
    pick = cheapest(estimates(wave))
    if parts_all[pick] == 1 and _lean_single_pass(base, longest, work_rows, shape, device, page_size):
        full_wave = device.lean_wave_size  # one pass would end in a wave of programs alone on their SMs
        pick = cheapest(estimates(full_wave))
    parts, chunk, items = int(parts_all[pick]), int(chunk_all[pick]), int(items_all[pick])
    if parts == 1:
        fill = f"fill a wave of {wave}" if base >= wave else f"< wave {wave}"
        return None, f"{base} work items {fill}; splitting does not pay"
    chunks = {i: max(chunk, -(-rows // device.max_partitions)) for i, rows in enumerate(run_rows)}
    fill = "fill a wave of" if base >= wave else "< wave"
    held = f", waves of {full_wave} held" if full_wave != wave else ""
    return chunks, (f"{base} work items {fill} {wave}{held}: {parts} partitions of {chunk} rows ({items} items, "
                    f"{math.ceil(items / full_wave)} waves)")


# -- pieces and work -----------------------------------------------------------------------
def _partition(
    runs: list[_Run],
    cuts: list[list[_Part]],
    queries: Sequence[SequenceQuery],
    max_rows_per_work: int,
    window: int | None = None,
    positions: Sequence[list[int] | None] | None = None,
) -> tuple[list[Piece], list[WorkItem], int]:
    """Pieces from the runs' partitions, and work items serving every member's rows (with
    ``key_lows`` where a sliding ``window`` starts inside the piece for some row; ``positions``:
    per query, its rows' positions where they are not ``query_start + i``: a tree's nodes)."""
    row_base, total = [], 0
    for query in queries:
        row_base.append(total)
        total += query.num_query_rows
    pieces: list[Piece] = []
    work: list[WorkItem] = []
    for run, parts in zip(runs, cuts):
        for page_ids, page_rows, key_start in parts:
            pieces.append(Piece(tuple(page_ids), tuple(page_rows)))
            rows: list[int] = []
            offsets: list[int] = []
            lows: list[int] = []
            for member in run.members:
                query = queries[member]
                where = positions[member] if positions is not None else None
                for i in range(query.num_query_rows):
                    rows.append(row_base[member] + i)
                    offsets.append(query.query_start + i - key_start)
                    if window is not None:
                        lows.append((where[i] if where is not None else query.query_start + i) - window + 1 - key_start)
            for start in range(0, len(rows), max_rows_per_work):
                stop = start + max_rows_per_work
                item_lows = tuple(lows[start:stop]) if lows and max(lows[start:stop]) > 0 else None
                work.append(WorkItem(len(pieces) - 1, tuple(rows[start:stop]), tuple(offsets[start:stop]),
                                     key_lows=item_lows))
    max_parts = max((len(parts) for parts in cuts), default=1)
    return pieces, work, max_parts


def tree_depths(parents: tuple[int, ...]) -> list[int]:
    """Each tree node's depth (a child of the last history row, parent -1, has depth 0)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def _check_no_released_pages(queries: Sequence[SequenceQuery], window: int | None, page_size: int) -> None:
    """ValueError when a query still reaches pages its chain released (``ChainSpan.released_pages``:
    rows outside a sliding window, given back): the plan would read freed pages."""
    for query in queries:
        for span in query.spans:
            if span.in_lower_tier:
                raise ValueError(f"rows {span.key_start}..{span.key_start + span.num_rows - 1} of a query are in a "
                                 f"lower KV tier (segment {span.segment_id}): bring them back before planning")
            if span.released_pages:
                raise ValueError(
                    f"a query from position {query.query_start} needs rows {span.key_start}.."
                    f"{span.key_start + span.released_pages * page_size - 1} that were released "
                    f"outside the sliding window ({'no window' if window is None else f'window {window}'})")


def _windowed(query: SequenceQuery, window: int, page_size: int) -> SequenceQuery:
    """``query`` without the pages that end before its first row's window (position
    ``query_start - window + 1``): whole spans dropped, a span's leading full pages cut. The
    result's spans start past position 0, so it is made without ``SequenceQuery``'s checks (the
    planner's internal form; its rows, positions and tree are the query's)."""
    low = query.query_start - window + 1
    if low <= 0:
        return query
    spans = []
    for span in query.spans:
        if span.num_rows == 0 or span.key_start + span.num_rows <= low:
            continue
        drop = max(0, (low - span.key_start) // page_size)  # whole pages before the window (all full)
        if drop:
            span = replace(span, page_ids=span.page_ids[drop:], num_rows=span.num_rows - drop * page_size,
                           key_start=span.key_start + drop * page_size,
                           released_pages=max(0, span.released_pages - drop))
        spans.append(span)
    trimmed = object.__new__(SequenceQuery)
    for name, value in (("spans", tuple(spans)), ("num_query_rows", query.num_query_rows),
                        ("query_start", query.query_start), ("tree_parents", query.tree_parents)):
        object.__setattr__(trimmed, name, value)
    return trimmed


def _cut_rows(run: _Run, limit: int | None) -> list[_Part]:
    """Cut a run on page boundaries into ``ceil(rows / limit)`` partitions of near-equal page
    counts, so no partition is a short straggler."""
    if limit is None or run.num_rows <= limit:
        return [(run.page_ids, run.page_rows, run.key_start)]
    return _cut_pages(run, math.ceil(run.num_rows / limit))


def _cut_pages(run: _Run, num_parts: int) -> list[_Part]:
    """``min(num_parts, pages)`` partitions of near-equal page counts."""
    pages = len(run.page_ids)
    parts = max(1, min(num_parts, pages))
    return _parts_at(run, [i * pages // parts for i in range(parts)])


def _parts_at(run: _Run, bounds: list[int]) -> list[_Part]:
    """Partitions starting at page indices ``bounds`` (the first is 0)."""
    parts, key_start = [], run.key_start
    ends = bounds[1:] + [len(run.page_ids)]
    for start, end in zip(bounds, ends):
        rows = run.page_rows[start:end]
        parts.append((run.page_ids[start:end], rows, key_start))
        key_start += sum(rows)
    return parts


# -- tree verify windows -------------------------------------------------------------------
@dataclass(slots=True)
class _TreeWindow:
    """A tree window's two parts: ``history``, the query over the spans before the page holding
    the window's first row (every node sees all of it), and the window piece: the pages from
    there to the window's last row, whose first row sits at position ``key_start``."""

    history: SequenceQuery
    page_ids: list[int]
    page_rows: list[int]
    key_start: int


def _split_tree(query: SequenceQuery, page_size: int) -> _TreeWindow:
    """Cut a tree query's spans at the page holding its first window row (pieces start at a
    page's row 0, so up to ``page_size - 1`` history rows go with the window piece, all visible
    to every node); rows after the window are left out (no node sees them)."""
    start = query.tree_start
    end = query.query_start + query.num_query_rows
    history: list[ChainSpan] = []
    page_ids: list[int] = []
    page_rows: list[int] = []
    cut: int | None = None
    for span in query.spans:
        if span.num_rows == 0:
            continue
        if cut is None and span.key_start + span.num_rows <= start:
            history.append(span)
            continue
        first = 0
        if cut is None:  # the span holding the window's first row
            first = (start - span.key_start) // page_size
            cut = span.key_start + first * page_size
            if first:
                history.append(replace(span, page_ids=span.page_ids[:first], num_rows=first * page_size))
        rows = span.page_rows(page_size)
        for page in range(first, len(span.page_ids)):
            page_start = span.key_start + page * page_size
            if page_start >= end:
                break
            page_ids.append(span.page_ids[page])
            page_rows.append(min(rows[page], end - page_start))
        if span.key_start + span.num_rows >= end:
            break
    assert cut is not None, "a tree window lies inside its chain (SequenceQuery checks it)"
    return _TreeWindow(SequenceQuery(tuple(history), query.num_query_rows, start), page_ids, page_rows, cut)


def _add_tree_windows(
    pieces: list[Piece],
    work: list[WorkItem],
    queries: Sequence[SequenceQuery],
    windows: Sequence[_TreeWindow | None],
    max_rows_per_work: int,
    window: int | None = None,
) -> None:
    """Append each tree window's piece and its masked work items (rows in node order): node
    ``i`` sees the piece's leading history rows and its ancestors-or-self (under a sliding
    ``window``, only those at or after its window's first position)."""
    row_base = 0
    for query, tree in zip(queries, windows):
        if tree is not None:
            pieces.append(Piece(tuple(tree.page_ids), tuple(tree.page_rows)))
            lead = query.tree_start - tree.key_start  # history rows at the head of the piece
            history_bits = (1 << lead) - 1
            first = len(query.tree_parents) - query.num_query_rows  # the query rows: the tree's last nodes
            masks = [history_bits | (mask << lead) for mask in query.ancestor_masks()[first:]]
            rows = [row_base + i for i in range(query.num_query_rows)]
            offsets = [lead + first + i for i in range(query.num_query_rows)]
            if window is not None:  # a node's window starts at its position (the tree's start + depth) - window + 1
                for i, depth in enumerate(tree_depths(query.tree_parents)[first:]):
                    low = query.tree_start + depth - window + 1 - tree.key_start
                    masks[i] &= ~((1 << max(low, 0)) - 1)
            for start in range(0, len(rows), max_rows_per_work):
                stop = start + max_rows_per_work
                work.append(WorkItem(len(pieces) - 1, tuple(rows[start:stop]), tuple(offsets[start:stop]),
                                     tuple(masks[start:stop])))
        row_base += query.num_query_rows
