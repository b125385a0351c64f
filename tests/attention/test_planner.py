"""The planner: route choice from the device, forced routes, and the shape of each plan."""

from __future__ import annotations

import dataclasses

import pytest

from segkv.attention import (
    AttentionPlan,
    AttentionShape,
    DeviceSpec,
    Piece,
    Route,
    SequenceQuery,
    WorkItem,
    plan_attention,
)
from segkv.cache.segment import ChainSpan
from settings_helpers import setenv

H200_LIKE = DeviceSpec(kind="cuda", name="h200-like", num_multiprocessors=132, blocks_per_multiprocessor=2)
GQA = AttentionShape(num_q_heads=32, num_kv_heads=8, key_dim=128, value_dim=128)
MLA = AttentionShape(num_q_heads=128, num_kv_heads=1, key_dim=576, value_dim=512)
PS = 16
_next_page = [0]


def span(rows: int, *, start: int = 0, segment_id: int | None = None, sealed: bool = True) -> ChainSpan:
    """A span of fresh page ids holding ``rows`` rows."""
    pages = -(-rows // PS)
    first = _next_page[0]
    _next_page[0] += pages
    sid = first if segment_id is None else segment_id
    return ChainSpan(sid, tuple(range(first, first + pages)), rows, start, sealed)


def seq(*rows_per_span: int, num_query_rows: int = 1) -> SequenceQuery:
    spans, start = [], 0
    for rows in rows_per_span:
        spans.append(span(rows, start=start))
        start += rows
    return SequenceQuery(tuple(spans), num_query_rows)


def covered_rows(plan: AttentionPlan, row: int) -> int:
    """Total KV rows the partials of query row ``row`` attend (each row exactly once)."""
    total = 0
    for item in plan.work:
        if row in item.query_rows:
            total += plan.pieces[item.piece].num_rows
    return total


def test_batch_one_long_context_splits_on_a_gpu():
    plan = plan_attention([seq(32768)], GQA, H200_LIKE, page_size=PS)
    assert plan.route == Route.SPLIT
    assert plan.num_partitions > 1
    assert len(plan.work) * GQA.num_kv_heads <= H200_LIKE.wave_size  # fits one wave
    assert covered_rows(plan, 0) == 32768
    assert min(p.num_rows for p in plan.pieces) >= H200_LIKE.min_rows_per_partition


def test_mla_batch_one_splits_and_large_batch_does_not():
    assert plan_attention([seq(65536)], MLA, H200_LIKE, page_size=PS).route == Route.SPLIT
    big = plan_attention([seq(65536) for _ in range(264)], MLA, H200_LIKE, page_size=PS)  # one full wave
    assert big.route == Route.SINGLE and len(big.pieces) == 264


def test_full_batch_stays_single():
    plan = plan_attention([seq(4096) for _ in range(64)], GQA, H200_LIKE, page_size=PS)
    assert plan.route == Route.SINGLE
    assert "fill a wave" in plan.reason


def test_short_context_stays_single_even_at_batch_one():
    plan = plan_attention([seq(300)], GQA, H200_LIKE, page_size=PS)
    assert plan.route == Route.SINGLE and len(plan.pieces) == 1


def test_mixed_long_and_short_batch_splits_only_the_long_one():
    plan = plan_attention([seq(131072), seq(100)], GQA, H200_LIKE, page_size=PS)
    assert plan.route == Route.SPLIT
    short_items = [w for w in plan.work if 1 in w.query_rows]
    long_items = [w for w in plan.work if 0 in w.query_rows]
    assert len(short_items) == 1 and len(long_items) == plan.num_partitions > 1
    assert covered_rows(plan, 0) == 131072 and covered_rows(plan, 1) == 100


def test_cpu_prefers_one_pass():
    plan = plan_attention([seq(32768)], GQA, DeviceSpec.cpu(num_threads=2), page_size=PS)
    assert plan.route == Route.SINGLE


def test_shared_history_is_planned_as_cascade():
    history = span(5000)
    queries = []
    for _ in range(4):
        own = span(40, start=5000, sealed=False)
        queries.append(SequenceQuery((history, own), 2))
    plan = plan_attention(queries, GQA, H200_LIKE, page_size=PS)
    assert plan.route == Route.CASCADE
    # the shared history is read once for all 8 rows (cut into partitions to fill the GPU)
    shared = [w for w in plan.work if len(w.query_rows) == 8]
    assert sum(plan.pieces[w.piece].num_rows for w in shared) == 5000
    assert len(shared) == plan.num_partitions > 1
    assert all(sorted(w.query_rows) == list(range(8)) for w in shared)
    for row in range(8):
        assert covered_rows(plan, row) == 5040
    # causal offsets: the first partition starts at 0, so a row's offset is its position
    first = next(w for w in shared if plan.pieces[w.piece].page_ids[0] == history.page_ids[0])
    assert list(first.causal_offsets[:2]) == [5038, 5039]


def test_forks_of_a_history_sealed_turn_by_turn_share_one_run():
    """A history sealed in 30 segments (ends mid-page) and forked 6 ways: the consecutive shared
    segments form one run, partitioned like one long span, not a piece (and a partial per row)
    for each segment. A segment held by only some forks starts a run of its own."""
    segments, start = [], 0
    for rows in [100 + 37 * i for i in range(30)]:
        segments.append(span(rows, start=start))
        start += rows
    extra = span(300, start=start)  # sealed after 4 of the 6 forks were made
    queries = []
    for fork in range(6):
        tail = (extra,) if fork < 4 else ()
        offset = start + (300 if fork < 4 else 0)
        queries.append(SequenceQuery((*segments, *tail, span(50, start=offset, sealed=False)), 1))
    plan = plan_attention(queries, GQA, H200_LIKE, page_size=PS)
    assert plan.route == Route.CASCADE
    everyone = [w for w in plan.work if len(w.query_rows) == 6]
    four = [w for w in plan.work if len(w.query_rows) == 4]
    assert sum(plan.pieces[w.piece].num_rows for w in everyone) == start  # the 30 segments, once
    assert 1 < len(everyone) <= plan.num_partitions < 30  # cut by the cost model, not by segment
    assert sum(plan.pieces[w.piece].num_rows for w in four) == 300
    for row in range(6):
        assert covered_rows(plan, row) == start + (300 if row < 4 else 0) + 50
        assert len(plan.reduce_map[row]) < 30


@pytest.mark.parametrize("route", list(Route))
def test_every_route_can_be_forced(route):
    queries = [seq(100, 37, 64, num_query_rows=4), seq(20, num_query_rows=4)]
    plan = plan_attention(queries, GQA, H200_LIKE, page_size=PS, route=route)
    assert plan.route == route
    for row in range(8):
        assert covered_rows(plan, row) == (201 if row < 4 else 20)


def test_forced_split_uses_the_partition_count():
    plan = plan_attention([seq(160)], GQA, H200_LIKE, page_size=PS, route="split", num_partitions=4)
    assert plan.num_partitions == 4
    assert [p.num_rows for p in plan.pieces] == [32, 48, 32, 48]  # 10 pages: 2, 3, 2, 3


def test_environment_forces_a_route(monkeypatch):
    setenv(monkeypatch, "SEGKV_ATTENTION_ROUTE", "segments")
    plan = plan_attention([seq(100, 37)], GQA, H200_LIKE, page_size=PS)
    assert plan.route == Route.SEGMENTS and len(plan.pieces) == 2
    setenv(monkeypatch, "SEGKV_ATTENTION_ROUTE", "sideways")
    with pytest.raises(ValueError, match="unknown attention route"):
        plan_attention([seq(10)], GQA, H200_LIKE, page_size=PS)


def test_segment_ends_mid_page_become_short_pages_not_copies():
    queries = [seq(20, 5, 33)]
    plan = plan_attention(queries, GQA, H200_LIKE, page_size=PS, route="single")
    (piece,) = plan.pieces
    assert piece.page_rows == (16, 4, 5, 16, 16, 1)
    assert piece.num_rows == 58


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError):
        plan_attention([seq(10)], GQA, H200_LIKE, page_size=0)
    with pytest.raises(ValueError):
        plan_attention([seq(10)], GQA, H200_LIKE, page_size=PS, route="split", num_partitions=0)
    with pytest.raises(ValueError):
        AttentionShape(num_q_heads=6, num_kv_heads=4, key_dim=8, value_dim=8)
    with pytest.raises(ValueError):
        SequenceQuery((span(10), span(10, start=3)), 1)  # not contiguous
    with pytest.raises(ValueError):
        DeviceSpec(kind="tpu", name="x", num_multiprocessors=1)
    with pytest.raises(ValueError):
        Piece((1, 2), (16,))


def test_plan_validates_its_reduce_map():
    piece = Piece((0,), (4,))
    item = WorkItem(0, (0, 1), (3, 3))
    plan = AttentionPlan(Route.SINGLE, (piece,), (item,), ((0,), (1,)), 2)
    assert plan.max_work_rows == 2 and plan.partial_rows == (0, 1)
    with pytest.raises(ValueError):
        AttentionPlan(Route.SINGLE, (piece,), (item,), ((1,), (0,)), 2)
    with pytest.raises(ValueError):
        AttentionPlan(Route.SINGLE, (piece,), (item,), ((0,), ()), 2)
    with pytest.raises(ValueError):
        AttentionPlan(Route.SINGLE, (piece,), (WorkItem(3, (0,), (0,)),), ((0,), ()), 2)


H200 = DeviceSpec(kind="cuda", name="h200", num_multiprocessors=132, blocks_per_multiprocessor=2,
                  max_partitions=256, partition_overhead_rows=256, key_tile_rows=64)


@pytest.mark.parametrize("batch,context,parts", [(1, 131072, 33), (1, 32768, 32), (4, 16384, 8), (4, 131072, 8),
                                                 (16, 16384, 2), (16, 131072, 2)])
def test_cost_model_fills_whole_waves(batch, context, parts):
    """The H200 partition sweep of the pipelined kernel (docs/benchmarks.md): programs fill one wave
    of 2 x 132 slots. Measured best there: 33, 32-33, 8, 8, 2, and 4 for batch 16 / 128K (2 partitions
    1% slower; the 16 that taking the most partitions within 3% gave ran 3% slower)."""
    plan = plan_attention([seq(context) for _ in range(batch)], GQA, H200, page_size=PS)
    assert plan.route == Route.SPLIT and plan.num_partitions == parts
    programs = len(plan.work) * GQA.num_kv_heads
    waves = -(-programs // H200.wave_size)
    assert programs > (waves - 1) * H200.wave_size + 0.9 * H200.wave_size or waves >= 3  # no sliver of a wave
    for row in range(batch):
        assert covered_rows(plan, row) == context


@pytest.mark.parametrize("context,parts", [(32768, 32), (65536, 32), (131072, 33)])
def test_partitions_cost_whole_tiles(context, parts):
    """A partition costs its whole 64-row tiles: where 33 partitions of 992-1008 rows take as many
    tiles as 32 of 1024 (16 each, the last one partial), the 32 of whole tiles win (0.3-1% faster
    at batch 1 on the H200, pages of 16); at 128K 33 partitions take 63 tiles against 64 and stay.
    Costed in rows (``key_tile_rows=1``) the 33 shorter partitions look cheaper."""
    plan = plan_attention([seq(context)], GQA, H200, page_size=PS)
    assert plan.route == Route.SPLIT and plan.num_partitions == parts
    lengths = [sum(piece.page_rows) for piece in plan.pieces]
    assert sum(lengths) == context
    if parts == 32:
        assert set(lengths) == {context // 32} and lengths[0] % 64 == 0
    in_rows = plan_attention([seq(context)], GQA, dataclasses.replace(H200, key_tile_rows=1), page_size=PS)
    assert in_rows.num_partitions == 33
    with pytest.raises(ValueError, match="key_tile_rows"):
        dataclasses.replace(H200, key_tile_rows=0)


def test_cost_model_splits_a_batch_just_over_one_wave():
    """400 programs unsplit = 2 waves, the second almost empty: shorter partitions in more, fuller
    waves cost less, so the batch splits although it already fills the device."""
    plan = plan_attention([seq(8192) for _ in range(50)], GQA, H200, page_size=PS)
    assert plan.route == Route.SPLIT and plan.num_partitions > 1 and "fill a wave of wave" not in plan.reason
    full = plan_attention([seq(8192) for _ in range(99)], GQA, H200, page_size=PS)  # 792 = 2 full waves
    assert full.route == Route.SINGLE


def test_latent_waves_count_two_resident_programs_per_multiprocessor():
    """Latent programs fill all 255 registers, so at most 2 run per SM whatever the device spec says
    (here 3, as for a lighter GQA kernel). 128 heads x batch 32 is 256 programs: at 2K a 3-way split
    made 768 programs, 3 latent waves, and ran 1.35x slower than one pass (H200,
    docs/benchmarks.md), so it stays single; batch 1 still splits into one latent wave of 16-head
    programs."""
    three = DeviceSpec(kind="cuda", name="h200", num_multiprocessors=132, blocks_per_multiprocessor=3,
                       max_partitions=256, partition_overhead_rows=256)
    plan = plan_attention([seq(2048) for _ in range(32)], MLA, three, page_size=PS)
    assert plan.route == Route.SINGLE and "264" in plan.reason
    assert plan_attention([seq(8192) for _ in range(32)], MLA, three, page_size=PS).route == Route.SINGLE
    one = plan_attention([seq(32768)], AttentionShape(16, 1, 576, 512), three, page_size=PS)
    assert one.route == Route.SPLIT and one.num_partitions <= 264
    assert plan_attention([seq(32768)], GQA, three, page_size=PS).num_partitions == 49  # GQA: 3 x 132 slots


def test_a_split_estimated_dearer_than_one_pass_is_never_chosen():
    """128 latent heads x batch 32 at 32K: 256 programs leave 8 of a 264-program wave idle, and 4
    partitions (4 waves) are estimated within 3% of one pass but dearer (measured 3% slower on the
    H200): the planner takes the cheapest estimate, so one pass."""
    spec = DeviceSpec(kind="cuda", name="h200", num_multiprocessors=132, blocks_per_multiprocessor=2,
                      min_rows_per_partition=64, max_partitions=256, partition_overhead_rows=256)
    plan = plan_attention([seq(32768) for _ in range(32)], MLA, spec, page_size=PS)
    assert plan.route == Route.SINGLE and plan.num_partitions == 1
    # batch 8 leaves most of the wave idle: the split is far cheaper and still chosen
    assert plan_attention([seq(32768) for _ in range(8)], MLA, spec, page_size=PS).route == Route.SPLIT


def test_short_context_small_batch_splits_down_to_one_tile():
    """1K rows at batch 1: partitions as short as the device spec allows, so the 8 KV heads'
    programs fill more of the device (4 partitions of 256+ rows left it latency-bound)."""
    spec = DeviceSpec(kind="cuda", name="h200", num_multiprocessors=132, blocks_per_multiprocessor=3,
                      min_rows_per_partition=64, max_partitions=256, partition_overhead_rows=256)
    plan = plan_attention([seq(1056)], GQA, spec, page_size=PS)
    assert plan.route == Route.SPLIT and plan.num_partitions >= 12
    assert min(p.num_rows for p in plan.pieces) >= 64 and covered_rows(plan, 0) == 1056
    wide = DeviceSpec(kind="cuda", name="h200", num_multiprocessors=132, blocks_per_multiprocessor=3,
                      min_rows_per_partition=256, max_partitions=256, partition_overhead_rows=256)
    assert plan_attention([seq(1056)], GQA, wide, page_size=PS).num_partitions == 4


def test_latent_partitions_have_their_own_minimum():
    """Latent attention's shortest partition is its own setting (one 32-row latent tile on CUDA):
    at batch 1 / 1K it cuts one partition per 32 rows (33) where the GQA minimum (64) would give
    14, and a GQA plan on the same device keeps the 64-row minimum."""
    spec = DeviceSpec(kind="cuda", name="h200", num_multiprocessors=132, blocks_per_multiprocessor=2,
                      min_rows_per_partition=64, min_rows_per_latent_partition=32, max_partitions=256,
                      partition_overhead_rows=256)
    latent16 = AttentionShape(num_q_heads=16, num_kv_heads=1, key_dim=576, value_dim=512)
    plan = plan_attention([seq(1056)], latent16, spec, page_size=PS)
    assert plan.route == Route.SPLIT and plan.num_partitions == 33
    assert min(p.num_rows for p in plan.pieces) >= 32 and covered_rows(plan, 0) == 1056
    as_gqa = DeviceSpec(kind="cuda", name="h200", num_multiprocessors=132, blocks_per_multiprocessor=2,
                        min_rows_per_partition=64, min_rows_per_latent_partition=64, max_partitions=256,
                        partition_overhead_rows=256)
    assert plan_attention([seq(1056)], latent16, as_gqa, page_size=PS).num_partitions == 14
    gqa = plan_attention([seq(1056)], GQA, spec, page_size=PS)
    assert min(p.num_rows for p in gqa.pieces) >= 64
    with pytest.raises(ValueError, match="min_rows_per_latent_partition"):
        DeviceSpec(kind="cuda", name="x", num_multiprocessors=1, min_rows_per_latent_partition=0)


def test_a_merge_launch_costs_decode_plans_of_many_partials_per_row():
    """GQA decode at batch 1: with the merge launch costed (``merge_launch_rows``), a short context
    takes at most the partials stage 1 merges itself (1K: 8 partitions of 128 rows instead of 16 of
    64; 2K: 8 of 256 at a cost of 256), a long one still splits for the whole device (16K: 32); a
    cost of 0 changes nothing, nor does it change plans whose work items hold several rows."""
    def spec(launch_rows: int, bound: int = 8) -> DeviceSpec:
        return DeviceSpec(kind="cuda", name="h200", num_multiprocessors=132, blocks_per_multiprocessor=2,
                          min_rows_per_partition=64, min_rows_per_latent_partition=32, max_partitions=256,
                          partition_overhead_rows=256, merge_launch_rows=launch_rows,
                          stage1_merge_max_partials=bound)
    llama = AttentionShape(num_q_heads=32, num_kv_heads=8, key_dim=128, value_dim=128)
    parts = {(context, cost): plan_attention([seq(context)], llama, spec(cost), page_size=PS).num_partitions
             for context in (1024, 2048, 16384) for cost in (0, 256)}
    assert parts == {(1024, 0): 16, (1024, 256): 8, (2048, 0): 32, (2048, 256): 8, (16384, 0): 32,
                     (16384, 256): 32}
    plan = plan_attention([seq(1024)], llama, spec(256), page_size=PS)
    assert plan.max_row_partials == 8 and {p.num_rows for p in plan.pieces} == {128}
    assert plan_attention([seq(1024)], llama, spec(256, bound=0), page_size=PS).num_partitions == 16
    rows4 = [seq(1024, num_query_rows=4)]  # a verify window: work items of 4 rows
    assert (plan_attention(rows4, llama, spec(256), page_size=PS).num_partitions
            == plan_attention(rows4, llama, spec(0), page_size=PS).num_partitions)
    with pytest.raises(ValueError, match="merge_launch_rows"):
        DeviceSpec(kind="cuda", name="x", num_multiprocessors=1, merge_launch_rows=-1)


def test_each_latent_partition_costs_the_merge():
    """Batch 1 latent attention: with the merge's cost per partition (its 512-wide partials are read
    one after another) 16K rows make 128 partitions of 128 rows, not 256 of 64 (measured 423 against
    395-409 tok/s for DeepSeek-V2-Lite on the H200); 1K still makes one partition per 32-row tile,
    batch 8 keeps its one wave of partitions, and GQA plans do not change."""
    def spec(merge_rows: int) -> DeviceSpec:
        return DeviceSpec(kind="cuda", name="h200", num_multiprocessors=132, blocks_per_multiprocessor=2,
                          min_rows_per_partition=64, min_rows_per_latent_partition=32, max_partitions=256,
                          partition_overhead_rows=256, latent_merge_rows_per_partition=merge_rows)
    latent16 = AttentionShape(num_q_heads=16, num_kv_heads=1, key_dim=576, value_dim=512)
    free, costed = spec(0), spec(1)
    assert plan_attention([seq(16384)], latent16, free, page_size=PS).num_partitions == 256
    plan = plan_attention([seq(16384)], latent16, costed, page_size=PS)
    assert plan.num_partitions == 128 and covered_rows(plan, 0) == 16384
    assert {p.num_rows for p in plan.pieces} == {128}
    assert plan_attention([seq(1024)], latent16, costed, page_size=PS).num_partitions == 32
    assert plan_attention([seq(16384) for _ in range(8)], latent16, costed, page_size=PS).num_partitions == 32
    assert (plan_attention([seq(16384)], GQA, costed, page_size=PS).num_partitions
            == plan_attention([seq(16384)], GQA, free, page_size=PS).num_partitions)
    with pytest.raises(ValueError, match="latent_merge_rows_per_partition"):
        DeviceSpec(kind="cuda", name="x", num_multiprocessors=1, latent_merge_rows_per_partition=-1)


def test_prefill_chunk_over_long_history_keeps_partials_within_the_workspace():
    """A 1002-row follow-up over 20K and 50K rows of history: the split's float32 partials stay
    within ``max_partial_bytes`` (the cost model alone would cut the 50K history into 7), and the
    budget never stops a decode step from splitting."""
    spec = DeviceSpec(kind="cuda", name="h200", num_multiprocessors=132, blocks_per_multiprocessor=3,
                      min_rows_per_partition=64, max_partitions=256, partition_overhead_rows=256)
    row_bytes = GQA.num_q_heads * (GQA.value_dim + 1) * 4
    for history in (20200, 50200):
        plan = plan_attention([seq(history, num_query_rows=1002)], GQA, spec, page_size=PS)
        assert plan.route == Route.SPLIT and covered_rows(plan, 1001) == history
        assert plan.num_partials * row_bytes <= spec.max_partial_bytes
    unbounded = DeviceSpec(kind="cuda", name="h200", num_multiprocessors=132, blocks_per_multiprocessor=3,
                           min_rows_per_partition=64, max_partitions=256, partition_overhead_rows=256,
                           max_partial_bytes=1 << 40)
    assert plan_attention([seq(50200, num_query_rows=1002)], GQA, unbounded, page_size=PS).num_partitions == 7
    assert plan_attention([seq(131072)], GQA, spec, page_size=PS).num_partitions > 16


def test_cuda_settings_from_the_environment_are_checked():
    """``SEGKV_CUDA_*`` overrides: an integer is taken, anything else is a clear error."""
    from segkv.settings import load_settings

    assert load_settings({"SEGKV_CUDA_MIN_PARTITION_ROWS": " 128 "}).cuda_min_partition_rows == 128
    assert load_settings({"SEGKV_CUDA_MIN_PARTITION_ROWS": ""}).cuda_min_partition_rows is None  # the default
    with pytest.raises(ValueError, match="SEGKV_CUDA_MIN_PARTITION_ROWS must be an integer"):
        load_settings({"SEGKV_CUDA_MIN_PARTITION_ROWS": "lots"})


@pytest.mark.parametrize("batch,context", [(1, 32768), (4, 16384), (16, 16384), (16, 131072)])
def test_automatic_plan_of_a_segmented_history_is_the_contiguous_one(batch, context):
    """A history sealed into 8 segments (page-aligned, as the engine seals turns) is planned
    exactly as the same pages in one piece: the same pieces, work and merge, so the same kernel
    launches over the same bytes. (Only a forced ``segments`` route keeps the cuts.)"""
    from segkv.attention.triton_backend import flatten_plan

    whole = [seq(context) for _ in range(batch)]
    cut = []
    for n, query in enumerate(whole):
        (only,) = query.spans
        pages, bounds = only.page_ids, [round(i * len(only.page_ids) / 8) for i in range(9)]
        spans = tuple(ChainSpan(10_000 + 8 * n + i, pages[bounds[i]:bounds[i + 1]],
                                (bounds[i + 1] - bounds[i]) * PS, bounds[i] * PS, True) for i in range(8))
        cut.append(SequenceQuery(spans, 1))
    auto_whole = plan_attention(whole, GQA, H200_LIKE, page_size=PS)
    auto_cut = plan_attention(cut, GQA, H200_LIKE, page_size=PS)
    a, b = flatten_plan(auto_whole), flatten_plan(auto_cut)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert auto_cut.route == auto_whole.route
    forced = plan_attention(cut, GQA, H200_LIKE, page_size=PS, route="segments")
    assert min(len(p.page_ids) for p in forced.pieces) <= len(whole[0].spans[0].page_ids) // 8 + 1


def test_cuda_device_spec_from_properties_and_environment(monkeypatch):
    """``DeviceSpec.cuda`` (run on a GPU only) on a stand-in device: the SM count from the device's
    properties, the measured defaults, the ``SEGKV_CUDA_*`` overrides, and the stage-1 merge bound
    the GQA kernels use."""
    import types
    from unittest import mock

    props = types.SimpleNamespace(name="stand-in", multi_processor_count=132)
    with mock.patch("torch.cuda.get_device_properties", return_value=props):
        spec = DeviceSpec.cuda()
        assert (spec.kind, spec.num_multiprocessors, spec.blocks_per_multiprocessor, spec.min_rows_per_partition,
                spec.min_rows_per_latent_partition, spec.latent_merge_rows_per_partition, spec.merge_launch_rows,
                spec.stage1_merge_max_partials, spec.lean_blocks_per_multiprocessor) == (
                    "cuda", 132, 2, 64, 32, 1, 0, 8, 3)
        for name, value in (("SEGKV_CUDA_BLOCKS_PER_SM", "3"), ("SEGKV_CUDA_MIN_PARTITION_ROWS", "128"),
                            ("SEGKV_CUDA_MIN_LATENT_PARTITION_ROWS", "64")):
            setenv(monkeypatch, name, value)
        spec = DeviceSpec.cuda()
        assert (spec.blocks_per_multiprocessor, spec.min_rows_per_partition, spec.min_rows_per_latent_partition,
                spec.latent_merge_rows_per_partition, spec.merge_launch_rows,
                spec.lean_wave_size) == (3, 128, 64, 1, 0, 396)
        setenv(monkeypatch, "SEGKV_CUDA_MIN_LATENT_PARTITION_ROWS", "0")
        with pytest.raises(ValueError, match="min_rows_per_latent_partition"):
            DeviceSpec.cuda()


def test_tall_programs_plan_with_the_tall_wave():
    """16 forks of a 32K prefix (16 rows x 4 heads: 64-pair programs) are planned for the tall
    wave, 3 x 132 (their 32-row tiles under 168 registers fit 3 to an SM; H200: 0.0645 ms against
    0.0762 with 2): 33 prefix partitions, not the 51 of 2 x 132. Decode rows keep the wave of 2."""
    spec = DeviceSpec(kind="cuda", name="h200", num_multiprocessors=132, blocks_per_multiprocessor=2,
                      tall_blocks_per_multiprocessor=3, min_rows_per_partition=64, max_partitions=256,
                      partition_overhead_rows=256)
    assert spec.wave_size == 264 and spec.tall_wave_size == 396
    prefix = span(32768)
    forks = [SequenceQuery((prefix, span(512, start=32768, sealed=False)), 1) for _ in range(16)]
    plan = plan_attention(forks, GQA, spec, page_size=PS)
    assert plan.route == Route.CASCADE and "wave 396: 33 partitions" in plan.reason
    two = plan_attention(forks, GQA, dataclasses.replace(spec, tall_blocks_per_multiprocessor=0), page_size=PS)
    assert "wave 264: 51 partitions" in two.reason
    decode = plan_attention([seq(32768)], GQA, spec, page_size=PS)
    assert "wave 264" in decode.reason


@pytest.mark.parametrize("rows,group,head_dim", [(1, 4, 128), (8, 4, 128), (9, 4, 128), (16, 4, 128), (4, 8, 128),
                                                 (5, 8, 128), (16, 8, 128), (17, 4, 128), (64, 4, 128),
                                                 (64, 1, 64), (33, 1, 128), (32, 1, 128), (17, 4, 256), (16, 8, 256)])
def test_the_planners_tall_decode_programs_are_the_launchers(rows, group, head_dim):
    """``tall_decode_programs`` (the planner's tall wave) agrees with the launcher: 64-pair programs
    of at most 16 query rows take 32-row tiles and a 168-register cap; prefill-sized ones (more
    rows) and all others keep the launch's tile and no cap."""
    import torch

    from segkv.attention import device
    from segkv.kernels.attention import paged_attention

    assert device.TALL_DECODE_MAX_ROWS == paged_attention.TALL_DECODE_MAX_ROWS
    meta = paged_attention.stage1_launch(dtype=torch.bfloat16, dk=head_dim, dv=head_dim, group=group, page_size=32,
                                         max_work_rows=rows, element_size=2)
    tall_decode = meta["BLOCK_M"] >= 64 and rows <= 16
    assert device.tall_decode_programs(rows, group, head_dim) == tall_decode
    if tall_decode:
        assert meta["BLOCK_N"] == 32 and meta["maxnreg"] == 168
    else:
        assert "maxnreg" not in meta and meta["BLOCK_N"] == (32 if head_dim > 128 else 64)


GQA70 = AttentionShape(num_q_heads=64, num_kv_heads=8, key_dim=128, value_dim=128)


def test_a_full_device_of_lean_programs_is_costed_in_the_waves_it_holds():
    """``lean_blocks_per_multiprocessor``: the 70B shape's decode programs at pages of 16 (8 pairs,
    four page scalars) fit 3 to an SM, so batch 64 in one piece is 512 programs in 1.29 waves of
    396 (0.81x SDPA on the H200), and the planner cuts 3 partitions (4 even waves; 0.961-0.965
    against 1.148-1.157 ms at 16K). Off, pages of 32, the 8B shape (4 pairs) and an idle device
    (batch 16: 2 partitions, a wave of 264) plan as before."""
    from segkv.attention.device import lean_decode_programs

    lean = dataclasses.replace(H200, min_rows_per_partition=64, lean_blocks_per_multiprocessor=3)
    assert lean.lean_wave_size == 396 and H200.lean_wave_size == H200.wave_size == 264
    batch64 = [seq(16384) for _ in range(64)]
    plan = plan_attention(batch64, GQA70, lean, page_size=PS)
    assert plan.route == Route.SPLIT and plan.num_partitions == 3 and "waves of 396 held" in plan.reason
    assert len(plan.work) * GQA70.num_kv_heads == 1536
    for row in range(64):
        assert covered_rows(plan, row) == 16384
    off = plan_attention(batch64, GQA70, dataclasses.replace(lean, lean_blocks_per_multiprocessor=0), page_size=PS)
    assert off.route == Route.SINGLE and "waves of" not in off.reason
    assert plan_attention(batch64, GQA, lean, page_size=PS).route == Route.SINGLE  # 4 pairs: not lean
    idle = plan_attention([seq(16384) for _ in range(16)], GQA70, lean, page_size=PS)
    assert idle.num_partitions == 2 and "wave 264" in idle.reason and "held" not in idle.reason

    assert lean_decode_programs(1, 8, 128, 16, 64) and lean_decode_programs(2, 8, 128, 16, 64)
    assert lean_decode_programs(1, 16, 128, 16, 64)  # the 405B shape: 3 per SM too (the driver)
    assert not lean_decode_programs(1, 8, 128, 32, 64)  # two-page tiles
    assert not lean_decode_programs(1, 4, 128, 16, 64)  # 4 pairs
    assert not lean_decode_programs(3, 8, 128, 16, 64)  # 24 pairs: a 32-row M tile
    assert not lean_decode_programs(1, 8, 256, 16, 64)  # wide heads
    assert not lean_decode_programs(1, 8, 64, 16, 64)  # narrow heads: other programs, not asked
    with pytest.raises(ValueError, match="lean_blocks_per_multiprocessor"):
        dataclasses.replace(H200, lean_blocks_per_multiprocessor=-1)


@pytest.mark.parametrize("batch,context,lean_parts,parts", [
    (64, 4096, 3, 1), (64, 131072, 10, 1), (60, 8192, 4, 1), (128, 16384, 3, 1),  # one pass, 1-3 lean waves
    (50, 16384, 5, 5), (80, 16384, 2, 2), (112, 16384, 2, 2),  # already split for the aimed-at wave
    (256, 16384, 1, 1),  # 5.2 lean waves
    (66, 1024, 1, 1), (72, 1024, 1, 1),  # runs under LEAN_SINGLE_PASS_MIN_ROWS
    (33, 16384, 1, 1), (48, 16384, 2, 2),  # fewer programs than a lean wave
])
def test_only_a_single_pass_of_few_lean_waves_is_recosted(batch, context, lean_parts, parts):
    """Where the lean wave changes the plan, measured on the H200 (docs/benchmarks.md): the one
    passes of 1-3 lean waves it splits ran 4-25% faster; re-costing the others lost 2-12%."""
    from segkv.attention.planner import LEAN_SINGLE_PASS_MAX_WAVES, LEAN_SINGLE_PASS_MIN_ROWS

    assert (LEAN_SINGLE_PASS_MAX_WAVES, LEAN_SINGLE_PASS_MIN_ROWS) == (3, 4096)
    lean = dataclasses.replace(H200, min_rows_per_partition=64, lean_blocks_per_multiprocessor=3)
    queries = [seq(context) for _ in range(batch)]
    plan = plan_attention(queries, GQA70, lean, page_size=PS)
    off = plan_attention(queries, GQA70, dataclasses.replace(lean, lean_blocks_per_multiprocessor=0), page_size=PS)
    assert (plan.num_partitions, off.num_partitions) == (lean_parts, parts)
    assert ("waves of 396 held" in plan.reason) == (lean_parts != parts)
    for row in (0, batch - 1):
        assert covered_rows(plan, row) == context


@pytest.mark.parametrize("rows,group,page_size", [(1, 8, 16), (2, 4, 16), (1, 16, 16), (1, 4, 16), (1, 8, 32),
                                                  (3, 8, 16), (1, 8, 64)])
def test_the_planners_lean_decode_programs_are_the_launchers(rows, group, page_size):
    """``lean_decode_programs`` agrees with the launcher: one 16-row M tile of 8-16 pairs taking a
    64-row tile's four page entries as scalars (``FOUR``)."""
    import torch

    from segkv.attention.device import CUDA_KEY_TILE_ROWS, lean_decode_programs
    from segkv.kernels.attention import paged_attention

    meta = paged_attention.stage1_launch(dtype=torch.bfloat16, dk=128, dv=128, group=group, page_size=page_size,
                                         max_work_rows=rows, element_size=2)
    launched = meta["BLOCK_M"] == 16 and meta["FOUR"] and meta["BLOCK_N"] == 4 * page_size and rows * group >= 8
    assert lean_decode_programs(rows, group, 128, page_size, CUDA_KEY_TILE_ROWS) == launched
