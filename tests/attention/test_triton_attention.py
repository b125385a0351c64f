"""Triton kernels against the torch reference: every route, dtypes, page sizes, GQA ratios, head dims.

On a GPU the full grid runs; without one, a subset runs in Triton's interpreter so CI
exercises the kernels too. Outputs are poisoned (NaN) before every launch; each case asserts
the plan that ran.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from attention_helpers import Batch, dense_attention, forked_history, triton_and_reference, ulp, exact_attention  # noqa: F401
from gpu_helpers import DEVICE, GPU
from segkv.attention import AttentionShape, DeviceSpec, Route, SequenceQuery, TorchReferenceBackend, plan_attention
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, KVLayout

import triton  # noqa: E402,F401  (a test dependency: the kernels must run in CI, never skip)

from segkv.attention.merge import merge_partials  # noqa: E402
from segkv.attention.triton_backend import TritonBackend  # noqa: E402

# the exact contract's checks: exact plans on every device (attention_helpers.exact_attention)
pytestmark = pytest.mark.usefixtures("exact_attention")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ROUTES = [r.value for r in Route]


def gqa_batch(gen, *, dtype, page_size, ratio, head_dim, rows, segments=4, kv_heads=2) -> Batch:
    """Three sequences over a shared, segmented history (mid-page boundaries), on DEVICE."""
    layout = KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=256), device=DEVICE,
                         compaction=CompactionPolicy(enabled=False))
    shape = AttentionShape(kv_heads * ratio, kv_heads, head_dim, head_dim)
    chains = forked_history(cache, gen, rows=rows, segments=segments)
    queries = [SequenceQuery.from_chain(c, rows) for c in chains]
    q = torch.randn(3 * rows, shape.num_q_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    return Batch(cache, chains, queries, q, shape, head_dim**-0.5)


def run_both(batch: Batch, route: str, *, num_partitions: int | None = None):
    device = DeviceSpec.cuda() if GPU else DeviceSpec.cpu()
    plan = plan_attention(batch.queries, batch.shape, device, page_size=batch.cache.page_size, route=route,
                          num_partitions=num_partitions or (3 if route == "split" else None))
    assert plan.route == Route(route)
    if route == "split" and max(sum(len(s.page_ids) for s in q.spans) for q in batch.queries) > 1:
        assert plan.num_partitions > 1  # split really split
    storage = batch.cache.storage
    return plan, *triton_and_reference(plan, batch.query, storage.key_cache(0), storage.value_cache(0),
                                       page_size=batch.cache.page_size, scale=batch.scale, device=DEVICE)


def check(out, lse, ref, ref_lse):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "an output was left unwritten"
    assert out.dtype == ref.dtype
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=0, atol=2e-5)
    else:  # both are float32 attention rounded once: at most one ulp apart, rarely
        diff = (out.double() - ref.double()).abs()
        assert (diff <= ulp(ref) + 1e-5).all(), f"max diff {diff.max().item()}"
        assert (diff > 1e-5).float().mean().item() <= 0.01
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=0, atol=1e-4)


if GPU:
    GRID = list(itertools.product(ROUTES, DTYPES, [16, 32, 64], [1, 4, 8], [64, 128, 256]))
else:  # the interpreter is slow: a subset that still covers every route, dtype, ratio and page size
    GRID = [(r, d, p, g, 64) for (r, d), (p, g) in zip(itertools.product(ROUTES, ["fp32", "bf16"]),
                                                        itertools.cycle([(16, 4), (32, 1), (16, 8)]))]


@pytest.mark.parametrize("route,dtype,page_size,ratio,head_dim", GRID)
def test_kernels_match_the_reference(route, dtype, page_size, ratio, head_dim, gen):
    for rows in ([1, 4, 17] if GPU else [1 + (page_size + ratio) % 17]):
        batch = gqa_batch(gen, dtype=DTYPES[dtype], page_size=page_size, ratio=ratio, head_dim=head_dim,
                          rows=rows)
        _, out, lse, ref, ref_lse = run_both(batch, route)
        check(out, lse, ref, ref_lse)
        if dtype == "fp32":
            torch.testing.assert_close(out.double().cpu(), dense_attention(_on_cpu(batch)), rtol=0, atol=2e-5)


def _on_cpu(batch: Batch) -> Batch:
    """The dense oracle gathers on the CPU."""
    import copy

    cpu = copy.copy(batch)
    cpu.query = batch.query.cpu()
    storage = batch.cache.storage
    if storage.device.type != "cpu":
        storage.k = [t.cpu() for t in storage.k]
        storage.v = [t.cpu() for t in storage.v]
        storage.device = torch.device("cpu")
    return cpu


def test_fully_masked_rows_and_empty_chains_give_zero(gen):
    batch = gqa_batch(gen, dtype=torch.bfloat16, page_size=16, ratio=4, head_dim=64, rows=4)
    q0, q1, _ = batch.queries
    batch.queries = [q0, SequenceQuery(q1.spans, 4, query_start=-2), SequenceQuery((), 4)]
    for route in ROUTES:
        _, out, lse, ref, ref_lse = run_both(batch, route)
        check(out, lse, ref, ref_lse)
        dead = [4, 5, 8, 9, 10, 11]
        assert torch.equal(out[dead], torch.zeros_like(out[dead])) and torch.isneginf(lse[dead]).all()


def check_every_route_with_a_masked_row(gen, page_size: int) -> None:
    """Every route against the reference over pages of ``page_size`` rows (float32, 4 heads per KV
    head, 2 rows per sequence), the second sequence's rows fully masked: 0 with LSE -inf."""
    batch = gqa_batch(gen, dtype=torch.float32, page_size=page_size, ratio=4, head_dim=64, rows=2)
    q0, q1, q2 = batch.queries
    batch.queries = [q0, SequenceQuery(q1.spans, 2, query_start=-2), q2]
    for route in ROUTES:
        _, out, lse, ref, ref_lse = run_both(batch, route)
        check(out, lse, ref, ref_lse)
        assert torch.equal(out[2:4], torch.zeros_like(out[2:4])) and torch.isneginf(lse[2:4]).all()


@pytest.mark.parametrize("page_size", [20, 48, 100])
def test_page_sizes_that_do_not_divide_the_tile(page_size, gen):
    """Pages of 20, 48 or 100 rows: a 64-row tile covers 3 or 1 whole pages and its rows past them
    count nothing (they are the next step's); a 100-row page spans a full and a partial 64-row
    tile. Every route gives the reference's results, fully masked rows included. (Rows past whole
    pages once counted the next page twice.)"""
    from segkv.kernels.attention.paged_attention import stage1_launch

    meta = stage1_launch(dtype=torch.float32, dk=64, dv=64, group=4, page_size=page_size, max_work_rows=1,
                         element_size=4)
    assert meta["BLOCK_N"] == 64 and meta["BLOCK_N"] % page_size != 0
    check_every_route_with_a_masked_row(gen, page_size)


def small_tiles(monkeypatch, **tiles) -> None:
    """Every GQA launch takes the default launch with ``tiles`` (LaunchConfig fields) replaced."""
    import dataclasses

    from segkv.kernels.attention import paged_attention

    default = paged_attention.default_launch_config
    monkeypatch.setattr(paged_attention, "default_launch_config",
                        lambda *, head_dim: dataclasses.replace(default(head_dim=head_dim), **tiles))


@pytest.mark.parametrize("page_size", [32, 48, 20])
def test_pages_longer_than_the_tile(page_size, gen, monkeypatch):
    """Tiles kept at 16 rows: pages of 32, 48 or 20 rows are walked 2, 3 or 2 tiles at a time (the last one partly past the page),
    every route, fully masked rows included, against the reference."""
    from segkv.kernels.attention.paged_attention import stage1_launch

    small_tiles(monkeypatch, block_n=16)
    assert stage1_launch(dtype=torch.float32, dk=64, dv=64, group=4, page_size=page_size,
                         max_work_rows=1, element_size=4)["BLOCK_N"] == 16
    check_every_route_with_a_masked_row(gen, page_size)


@pytest.mark.parametrize("block_m", [128, 64])
def test_prefill_chunks_over_pages_longer_than_the_tile(block_m, gen, monkeypatch):
    """Chunks of 17 query rows (causal among themselves; 68 row-head pairs: one prefill program per
    work item, or two of 64 pairs, each stopping at its causal end) over pages of 48 rows walked in
    16-row tiles, the last one partly past the page: every route against the reference."""
    from segkv.kernels.attention.paged_attention import stage1_launch

    small_tiles(monkeypatch, block_n=16, tall_block_n=16, prefill_block_n=16, prefill_block_m=block_m)
    meta = stage1_launch(dtype=torch.bfloat16, dk=64, dv=64, group=4, page_size=48, max_work_rows=17, element_size=2)
    assert meta["BLOCK_N"] == 16 and meta["BLOCK_M"] == block_m and meta["CAUSAL_END"]
    # one KV head and two sealed segments (boundaries mid-page) are enough for every route's page
    # walk (the interpreter runs one merge program per row and head)
    batch = gqa_batch(gen, dtype=torch.bfloat16, page_size=48, ratio=4, head_dim=64, rows=17, segments=3,
                      kv_heads=1)
    for route in ROUTES:
        _, out, lse, ref, ref_lse = run_both(batch, route)
        check(out, lse, ref, ref_lse)


@pytest.mark.gpu  # a 128K-row history
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_long_and_short_batch_in_one_launch(dtype, gen):
    torch_dtype = DTYPES[dtype]
    layout = KVLayout(num_layers=1, num_kv_heads=8, head_dim=128, dtype=torch_dtype)
    cache = PagedKVCache(layout, CacheConfig(page_size=16, num_pages=8400), device=DEVICE)
    chains = [cache.new_chain(), cache.new_chain()]
    for chain, n in zip(chains, (131072, 100)):
        for start in range(0, n, 8192):
            m = min(8192, n - start)
            slots = chain.append(m)
            kv = torch.randn(2, m, 8, 128, device=DEVICE, dtype=torch_dtype)
            cache.storage.write(0, slots, kv[0], kv[1])
    queries = [SequenceQuery.from_chain(c, 1) for c in chains]
    shape = AttentionShape(32, 8, 128, 128)
    plan = plan_attention(queries, shape, DeviceSpec.cuda(), page_size=16)
    assert plan.route == Route.SPLIT and plan.num_partitions > 1
    assert sum(1 for w in plan.work if 1 in w.query_rows) == 1  # the short one is not split
    q = torch.randn(2, 32, 128, device=DEVICE, dtype=torch_dtype)
    check(*triton_and_reference(plan, q, cache.storage.key_cache(0), cache.storage.value_cache(0), page_size=16,
                                scale=128**-0.5, device=DEVICE))


def test_kv_write_kernel(gen):
    from segkv.kernels.attention.paged_attention import write_rows

    cache = torch.zeros(8, 16, 2, 64, device=DEVICE, dtype=torch.bfloat16)
    rows = torch.randn(5, 2, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    slots = torch.tensor([3, 17, 18, 100, 127], device=DEVICE)
    write_rows(rows=rows, cache=cache, slots=slots)
    flat = cache.view(128, 2, 64)
    assert torch.equal(flat[slots], rows)
    untouched = torch.ones(128, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(flat[untouched], torch.zeros_like(flat[untouched]))


def test_single_route_skips_the_merge_and_writes_rows_directly(gen):
    batch = gqa_batch(gen, dtype=torch.bfloat16, page_size=16, ratio=4, head_dim=64, rows=2)
    plan = plan_attention(batch.queries, batch.shape, DeviceSpec.cpu(), page_size=16, route="single")
    tb = TritonBackend(page_size=16, device=DEVICE, poison=True)
    prepared = tb.prepare(plan)
    assert not prepared.needs_merge and (prepared.partial_direct >= 0).all()
    storage = batch.cache.storage
    out, lse = tb.run(prepared, batch.query, storage.key_cache(0), storage.value_cache(0), scale=batch.scale)
    rb = TorchReferenceBackend(page_size=16, device=DEVICE)
    ref, ref_lse = rb.run(rb.prepare(plan), batch.query, storage.key_cache(0), storage.value_cache(0),
                          scale=batch.scale)
    check(out, lse, ref, ref_lse)


def test_head_major_page_layout_view(gen):
    """The kernels take strides: a (page, head, row, dim) cache viewed as (page, row, head, dim)."""
    batch = gqa_batch(gen, dtype=torch.float32, page_size=16, ratio=2, head_dim=64, rows=3)
    plan = plan_attention(batch.queries, batch.shape, DeviceSpec.cpu(), page_size=16, route="split",
                          num_partitions=3)
    storage = batch.cache.storage
    k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (storage.key_cache(0), storage.value_cache(0)))
    assert k.stride(2) == 16 * 64  # really head-major
    tb = TritonBackend(page_size=16, device=DEVICE, poison=True)
    out, lse = tb.run(tb.prepare(plan), batch.query, k, v, scale=batch.scale)
    rb = TorchReferenceBackend(page_size=16, device=DEVICE)
    ref, ref_lse = rb.run(rb.prepare(plan), batch.query, storage.key_cache(0), storage.value_cache(0),
                          scale=batch.scale)
    check(out, lse, ref, ref_lse)


def test_fixed_size_plan_buffers_serve_any_plan_that_fits(gen):
    """One backend with a capacity: successive plans reuse the same device buffers (the
    addresses a CUDA graph would bake in); padding query rows come out 0 with LSE -inf; on a
    GPU a graph captured with one plan replays another correctly."""
    from segkv.attention.triton_backend import PlanCapacity

    capacity = PlanCapacity(max_pages=256, max_work=64, max_partials=256, max_rows=16,
                            max_work_rows=64)
    tb = TritonBackend(page_size=16, device=DEVICE, poison=not GPU, capacity=capacity)
    rb = TorchReferenceBackend(page_size=16, device=DEVICE)
    batches = [gqa_batch(gen, dtype=torch.bfloat16, page_size=16, ratio=4, head_dim=64, rows=rows)
               for rows in (1, 3)]
    routes = ["split", "cascade"]
    addresses = set()
    for batch, route in zip(batches, routes):
        plan = plan_attention(batch.queries, batch.shape, DeviceSpec.cpu(), page_size=16, route=route,
                              num_partitions=2 if route == "split" else None)
        prepared = tb.prepare(plan)
        addresses.add(prepared.page_table.data_ptr())
        storage = batch.cache.storage
        padded = torch.zeros(capacity.max_rows, *batch.query.shape[1:], dtype=batch.query.dtype, device=DEVICE)
        padded[:plan.num_query_rows] = batch.query
        out, lse = tb.run(prepared, padded, storage.key_cache(0), storage.value_cache(0), scale=batch.scale)
        ref, ref_lse = rb.run(rb.prepare(plan), batch.query, storage.key_cache(0), storage.value_cache(0),
                              scale=batch.scale)
        n = plan.num_query_rows
        check(out[:n], lse[:n], ref, ref_lse)
        assert torch.equal(out[n:], torch.zeros_like(out[n:])) and torch.isneginf(lse[n:]).all()
    assert len(addresses) == 1
    small = TritonBackend(page_size=16, device=DEVICE, capacity=PlanCapacity(256, 64, 4, 16))
    with pytest.raises(ValueError, match="partial_row, capacity is 4"):
        small.prepare(plan_attention(batches[1].queries, batches[1].shape, DeviceSpec.cpu(), page_size=16,
                                     route="split", num_partitions=2))


@pytest.mark.parametrize("one_copy", [True, False])
def test_fixed_plan_buffers_hold_each_plan_after_one_or_four_transfers(one_copy, gen, monkeypatch):
    """A small fixed plan buffer goes to the device in one transfer, a large one in four (each page
    field's used entries, then the small fields): either way, after a larger plan and then a
    smaller one, every field's used entries are the smaller plan's arrays (padded fields: padded
    with their last value to the capacity) at the same addresses."""
    from segkv.attention import triton_backend
    from segkv.attention.triton_backend import PlanCapacity, flatten_plan

    capacity = PlanCapacity(max_pages=256, max_work=64, max_partials=256, max_rows=16, max_work_rows=64)
    tb = TritonBackend(page_size=16, device=DEVICE, capacity=capacity)
    monkeypatch.setattr(triton_backend, "PLAN_ONE_COPY_BYTES", tb._staging.numel() * 4 if one_copy else 0)
    plans = [plan_attention(gqa_batch(gen, dtype=torch.bfloat16, page_size=16, ratio=4, head_dim=64,
                                      rows=rows).queries, AttentionShape(8, 2, 64, 64), DeviceSpec.cpu(),
                            page_size=16, route="split", num_partitions=parts) for rows, parts in ((3, 4), (1, 2))]
    addresses = set()
    for plan in plans:
        prepared = tb.prepare(plan)
        if GPU:
            torch.cuda.synchronize()
        sizes = capacity.sizes()
        for name, values in flatten_plan(plan).items():
            if name not in sizes:
                continue
            got = getattr(prepared, name).cpu()
            assert torch.equal(got[:len(values)], torch.from_numpy(values)), name
            if name in triton_backend._PADDED:
                assert (got[len(values):] == int(values[-1])).all(), name
        addresses.add(prepared.page_table.data_ptr())
    assert len(addresses) == 1


@pytest.mark.gpu  # real CUDA graphs
def test_cuda_graph_replays_a_new_plan(gen):
    from segkv.attention.triton_backend import PlanCapacity

    capacity = PlanCapacity(max_pages=512, max_work=128, max_partials=512, max_rows=8)
    tb = TritonBackend(page_size=16, device=DEVICE, capacity=capacity)
    rb = TorchReferenceBackend(page_size=16, device=DEVICE)
    batch = gqa_batch(gen, dtype=torch.bfloat16, page_size=16, ratio=4, head_dim=128, rows=1)
    storage = batch.cache.storage
    kc, vc = storage.key_cache(0), storage.value_cache(0)
    query = torch.zeros(8, *batch.query.shape[1:], dtype=batch.query.dtype, device=DEVICE)
    plans = [plan_attention(batch.queries, batch.shape, DeviceSpec.cuda(), page_size=16, route=r,
                            num_partitions=n) for r, n in (("single", None), ("split", 3), ("cascade", None))]
    prepared = tb.prepare(plans[0])
    query[:3] = batch.query
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tb.run(prepared, query, kc, vc, scale=batch.scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = tb.run(prepared, query, kc, vc, scale=batch.scale)
    for plan in plans:
        query[:3] = torch.randn(batch.query.shape, generator=gen).to(query.dtype).to(DEVICE)
        tb.prepare(plan)
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = rb.run(rb.prepare(plan), query[:3].clone(), kc, vc, scale=batch.scale)
        check(out[:3].clone(), lse[:3].clone(), ref, ref_lse)


@pytest.mark.parametrize("route", ["cascade"] if not GPU else ROUTES)
def test_kernel_matches_the_reference_at_every_pipeline_depth(route, gen):
    """1, 2 and 3 pipeline stages (3: two K/V buffers, page indices carried one block ahead), over
    pieces that end inside a tile and on a tile boundary. The interpreter has no pipeline (every
    depth runs the same program), so without a GPU only the default depth runs, over the cascade
    route (shared and own pieces; the other routes' tiles are in the tests around)."""
    from segkv.kernels.attention.paged_attention import LaunchConfig

    depths = (1, 2, 3) if GPU else (3,)
    for (rows, page_size, block_n), stages in itertools.product(((1, 16, 16), (5, 16, 64), (17, 32, 64)), depths):
        batch = gqa_batch(gen, dtype=torch.bfloat16, page_size=page_size, ratio=4, head_dim=64, rows=rows,
                          kv_heads=2 if GPU else 1)
        plan = plan_attention(batch.queries, batch.shape, DeviceSpec.cpu(), page_size=page_size, route=route,
                              num_partitions=3 if route == "split" else None)
        storage = batch.cache.storage
        check(*triton_and_reference(plan, batch.query, storage.key_cache(0), storage.value_cache(0),
                                    page_size=page_size, scale=batch.scale, device=DEVICE,
                                    launch=LaunchConfig(block_n, 4, stages)))


def check_with_the_second_sequence_masked(gen, dtype, route: str, *, rows: int, ratio: int, page_size: int,
                                          partitions: int, launch) -> None:
    """One launch configuration against the reference: three sequences of ``rows`` query rows
    each (head_dim 64), the second fully masked (0 with LSE -inf), the split route in
    ``partitions``."""
    batch = gqa_batch(gen, dtype=dtype, page_size=page_size, ratio=ratio, head_dim=64, rows=rows,
                      kv_heads=2 if GPU else 1)  # the interpreter: a merge program per row and head
    batch.queries[1] = SequenceQuery(batch.queries[1].spans, rows, query_start=-rows)  # fully masked
    plan = plan_attention(batch.queries, batch.shape, DeviceSpec.cpu(), page_size=page_size, route=route,
                          num_partitions=partitions if route == "split" else None)
    storage = batch.cache.storage
    out, lse, ref, ref_lse = triton_and_reference(plan, batch.query, storage.key_cache(0), storage.value_cache(0),
                                                  page_size=page_size, scale=batch.scale, device=DEVICE, launch=launch)
    check(out, lse, ref, ref_lse)
    dead = slice(rows, 2 * rows)
    assert torch.equal(out[dead], torch.zeros_like(out[dead])) and torch.isneginf(lse[dead]).all()


@pytest.mark.parametrize("route", ["split", "cascade"] if not GPU else ROUTES)
def test_plan_reads_before_the_wait_match_the_reference(route, gen, monkeypatch):
    """Decode programs of at most 16 pairs read their plan share before waiting for the previous
    kernel (tall ones, cascade and prefill, after it), and the merge its first partial ids: the same
    results as the reference, over pieces that end inside a tile, with fully masked rows, more
    partials than one merge block and the merge inside stage 1."""
    from segkv.kernels.attention import paged_attention
    from segkv.kernels.attention.paged_attention import LaunchConfig

    def reads_early(group: int, rows: int = 1) -> bool:
        meta = paged_attention.stage1_launch(dtype=torch.bfloat16, dk=64, dv=64, group=group, page_size=16,
                                             max_work_rows=rows, element_size=2, launch=LaunchConfig(16, 4, 3))
        return meta["PLAN_EARLY"]

    assert [reads_early(4), reads_early(8), reads_early(4, rows=16)] == [True, True, False]
    for rows, ratio, page_size, block_n, parts in ((1, 8, 16, 16, 3), (3, 4, 16, 64, 3), (1, 4, 16, 16, 70)):
        check_with_the_second_sequence_masked(gen, torch.bfloat16, route, rows=rows, ratio=ratio, page_size=page_size,
                                              partitions=parts, launch=LaunchConfig(block_n, 4, 3))


def decode_rows_batch(gen, *, dtype, long_rows: int, ratio: int, num_pages: int, kv_heads: int = 2) -> Batch:
    """Four decode rows over ``kv_heads`` KV heads: a ``long_rows`` history, a fully masked row,
    an empty chain and a 37-row history."""
    layout = KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=64, dtype=dtype)
    cache = PagedKVCache(layout, CacheConfig(page_size=16, num_pages=num_pages), device=DEVICE)
    chains = [cache.new_chain() for _ in range(2)]
    for chain, n in zip(chains, (long_rows, 37)):
        slots = chain.append(n)
        kv = torch.randn(2, n, kv_heads, 64, generator=gen).to(dtype).to(DEVICE)
        cache.storage.write(0, slots, kv[0], kv[1])
    a, b = (SequenceQuery.from_chain(c, 1) for c in chains)
    heads = kv_heads * ratio
    return Batch(cache, chains, [a, SequenceQuery(b.spans, 1, query_start=-2), SequenceQuery((), 1), b],
                 torch.randn(4, heads, 64, generator=gen).to(dtype).to(DEVICE), AttentionShape(heads, kv_heads, 64, 64),
                 0.125)


def check_merges_inside_stage1(batch, gen, *, parts: int, bound: int, capacity, merges: list, launch=None):
    """A ``parts``-way split of ``batch`` against the reference, launched per backend (free
    arrays once, and twice over the fixed buffers of ``capacity`` with 4 padding rows when
    ``parts <= bound``, as a graph replays them; twice through the merge kernel above it):
    stage 1 merges the rows itself up to ``bound`` partials (no merge launch, tickets back to 0),
    the merge kernel runs above it; masked, empty and padding rows are 0 with LSE -inf."""
    k, v = batch.cache.storage.key_cache(0), batch.cache.storage.value_cache(0)
    plan = plan_attention(batch.queries, batch.shape, DeviceSpec.cpu(), page_size=16, route="split",
                          num_partitions=parts)
    assert plan.max_row_partials == parts and plan.max_work_rows == 1
    rb = TorchReferenceBackend(page_size=16, device=DEVICE)
    ref, ref_lse = rb.run(rb.prepare(plan), batch.query, k, v, scale=batch.scale)
    for fixed in (False, True) if parts <= bound else (False,):
        merges.clear()
        tb = TritonBackend(page_size=16, device=DEVICE, poison=True, capacity=capacity if fixed else None,
                           launch=launch)
        prepared = tb.prepare(plan)
        assert prepared.merge_in_stage1 == (parts <= bound)
        query = batch.query
        if fixed:  # a graph bucket: 4 padding rows past the plan's
            query = torch.cat([query, torch.randn(4, *query.shape[1:], generator=gen).to(query.dtype).to(DEVICE)])
        for _ in range(2 if fixed or parts > bound else 1):  # the tickets must come back to 0 for a replay
            out, lse = tb.run(prepared, query, k, v, scale=batch.scale)
            check(out[:4], lse[:4], ref, ref_lse)
            dead = [1, 2, *range(4, len(query))]
            assert torch.equal(out[dead], torch.zeros_like(out[dead])) and torch.isneginf(lse[dead]).all()
            if parts <= bound:
                assert tb._counters is not None and not tb._counters.any()
        assert len(merges) == (0 if parts <= bound else 2)
    return plan


def count_merge_launches(monkeypatch) -> list:
    """A list that grows by one per merge-kernel launch."""
    from segkv.kernels.attention import paged_attention

    merges = []
    merge_into = paged_attention.merge_into
    monkeypatch.setattr(paged_attention, "merge_into", lambda *a: merges.append(1) or merge_into(*a))
    return merges


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_decode_rows_of_few_partials_merge_inside_stage1(dtype, gen, monkeypatch):
    """Work items of one query row (decode) and at most 8 partials per row: the last program of
    each (row, head) merges it, so no merge launch runs. Rows of several partials, a fully masked
    row, an empty chain and (fixed buffers) padding rows all come out as the reference's; the
    tickets are back to 0 after every launch, so a second launch is right too. A plan of 12
    partials per row launches the merge kernel instead, and a fixed buffer bounded at 8 refuses it."""
    from segkv.attention.triton_backend import PlanCapacity, stage1_merge_bound

    merges = count_merge_launches(monkeypatch)
    batch = decode_rows_batch(gen, dtype=DTYPES[dtype], long_rows=200, ratio=4, num_pages=64)  # 13 and 3 pages
    capacity = PlanCapacity(max_pages=256, max_work=64, max_partials=256, max_rows=8, max_work_rows=1,
                            max_row_partials=8)
    assert stage1_merge_bound() == 8
    for parts in (3, 12):
        plan = check_merges_inside_stage1(batch, gen, parts=parts, bound=8, capacity=capacity, merges=merges)
    with pytest.raises(ValueError, match=f"merges {plan.max_row_partials} partials into a row, capacity is 8"):
        TritonBackend(page_size=16, device=DEVICE, capacity=capacity).prepare(plan)


@pytest.mark.parametrize("ratio", [4, 32])  # chunks of 16 partials and several programs per row
def test_rows_of_many_partials_merge_inside_stage1_by_chunks(ratio, gen, monkeypatch):
    """A stage-1 merge bound of 32: decode rows of up to 32 partials are merged by the last
    program of their query row's heads, a chunk of partials at a time (16 at 4 heads per KV head,
    8 at 8, so several chunks and a running maximum; 32 heads per KV head in programs of 16 pairs,
    two programs per row), with no merge launch: rows of 20-way splits' partials and, at 4 heads
    per KV head, 33-way ones (above the bound: the merge kernel), a fully masked row, an empty chain and a fixed buffer's padding rows
    come out as the reference's, and the tickets are back to 0."""
    from segkv.attention import triton_backend
    from segkv.attention.triton_backend import PlanCapacity
    from segkv.kernels.attention import paged_attention
    from segkv.kernels.attention.paged_attention import LaunchConfig

    monkeypatch.setattr(paged_attention, "MERGE_IN_STAGE1_MAX_PARTIALS", 32)
    triton_backend.stage1_merge_bound.cache_clear()
    try:
        merges = count_merge_launches(monkeypatch)
        # 34 and 3 pages (33-way splits need 33 pages; the 20-way one at 32 heads per KV head 21)
        # one KV head (two per row: test_decode_rows_of_few_partials_merge_inside_stage1); at 32
        # heads per KV head its two programs per row share the ticket
        batch = decode_rows_batch(gen, dtype=torch.bfloat16, long_rows=540 if ratio == 4 else 330, ratio=ratio,
                                  num_pages=128, kv_heads=1)
        capacity = PlanCapacity(max_pages=256, max_work=128, max_partials=256, max_rows=8, max_work_rows=1,
                                max_row_partials=32)
        # above the bound (the merge kernel) once is enough: at 4 heads per KV head
        for parts in (20, 33) if ratio == 4 else (20,):
            check_merges_inside_stage1(batch, gen, parts=parts, bound=32, capacity=capacity, merges=merges,
                                       launch=LaunchConfig(16, 4, 3, block_m=16))
    finally:
        triton_backend.stage1_merge_bound.cache_clear()


def test_merge_of_many_partials_per_row(gen):
    """More partials per row than the merge kernel reads at once (blocks of 64)."""
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    cache = PagedKVCache(layout, CacheConfig(page_size=16, num_pages=160), device=DEVICE)
    chains = [cache.new_chain() for _ in range(2)]
    for chain, n in zip(chains, (1100, 37)):
        slots = chain.append(n)
        kv = torch.randn(2, n, 2, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
        cache.storage.write(0, slots, kv[0], kv[1])
    queries = [SequenceQuery.from_chain(c, 2) for c in chains]
    shape = AttentionShape(8, 2, 64, 64)
    plan = plan_attention(queries, shape, DeviceSpec.cpu(), page_size=16, route="split", num_partitions=69)
    assert max(len(p) for p in plan.reduce_map) == 69
    q = torch.randn(4, 8, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    check(*triton_and_reference(plan, q, cache.storage.key_cache(0), cache.storage.value_cache(0), page_size=16,
                                scale=0.125, device=DEVICE))


def test_merge_kernel_folds_blocks_of_partials_exactly(gen):
    """The one-pass merge against the contract's formula (``merge_partials``) on synthetic partials:
    rows of 150 partials (three blocks of 64) whose first block is all empty, whose last is, whose
    live LSEs span 80 nats (the running maximum grows across blocks and earlier sums are rescaled),
    a row of 64 empties, and a row with no partials. Empty partials hold NaN outputs: weight 0."""
    from segkv.kernels.attention.paged_attention import merge_into

    heads, dim = 3, 96
    counts = [150, 150, 150, 64, 0, 2]
    num = sum(counts)
    lse = (torch.rand(num, heads, generator=gen) * 80 - 40).to(DEVICE)
    part_out = torch.randn(num, heads, dim, generator=gen).to(DEVICE)
    rows = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).to(DEVICE)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    lse[starts[0]:starts[0] + 64] = float("-inf")  # row 0: first block empty
    lse[starts[1] + 128:starts[1] + 150] = float("-inf")  # row 1: last block empty
    lse[starts[2]:starts[2] + 150] = torch.linspace(-40, 40, 150, device=DEVICE)[:, None]  # row 2: max rises
    lse[starts[3]:starts[3] + 64] = float("-inf")  # row 3: nothing visible
    part_out[torch.isneginf(lse)] = float("nan")
    order = torch.randperm(num, generator=gen).to(DEVICE)  # partial ids in the CSR are not contiguous
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(num, device=DEVICE)
    reduce_ptr = torch.tensor([0] + list(itertools.accumulate(counts)), dtype=torch.int32, device=DEVICE)
    reduce_partials = inverse.to(torch.int32)  # row r's CSR entries name where its partials now live
    out = torch.full((len(counts), heads, dim), float("nan"), device=DEVICE)
    out_lse = torch.full((len(counts), heads), float("nan"), device=DEVICE)
    merge_into(out, out_lse, part_out[order].contiguous(), lse[order].contiguous(), reduce_ptr, reduce_partials)
    ref, ref_lse = merge_partials(torch.nan_to_num(part_out), lse, rows, len(counts))
    live = [0, 1, 2, 5]
    assert not torch.isnan(out).any() and not torch.isnan(out_lse).any()
    torch.testing.assert_close(out[live], ref[live], rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(out_lse[live], ref_lse[live], rtol=1e-6, atol=1e-5)
    assert (out[3:5] == 0).all() and torch.isneginf(out_lse[3:5]).all()


def test_merge_splits_value_columns_over_programs(gen, monkeypatch):
    """The merge runs one program per (row, head, block of value columns): with 16-column blocks a
    64-wide value takes four programs per row and head, and every column and LSE is written."""
    from segkv.kernels.attention import paged_attention

    assert (paged_attention.merge_block_dv(128), paged_attention.merge_block_dv(512),
            paged_attention.merge_block_dv(32)) == (64, 32, 32)  # GQA, latent, narrow
    monkeypatch.setattr(paged_attention, "GQA_MERGE_BLOCK_DV", 16)
    assert paged_attention.merge_block_dv(64) == 16
    batch = gqa_batch(gen, dtype=torch.bfloat16, page_size=16, ratio=4, head_dim=64, rows=3)
    plan, out, lse, ref, ref_lse = run_both(batch, "split")
    assert max(len(p) for p in plan.reduce_map) > 1  # rows really merged
    check(out, lse, ref, ref_lse)


def test_split_partials_reuse_one_workspace_and_stay_exact(gen):
    """Eager steps keep their partials in the backend's one buffer: two plans of different sizes
    through one backend reuse it (no per-step buffer), each still equal to the reference; a plan
    needing more than ``workspace_bytes`` allocates for itself and is as exact."""
    batch = gqa_batch(gen, dtype=torch.float32, page_size=16, ratio=4, head_dim=32, rows=3)
    storage = batch.cache.storage
    tb = TritonBackend(page_size=16, device=DEVICE, poison=True)
    rb = TorchReferenceBackend(page_size=16, device=DEVICE)
    spec = DeviceSpec.cuda() if GPU else DeviceSpec.cpu()
    pointers = []
    for parts in (4, 2):
        plan = plan_attention(batch.queries, batch.shape, spec, page_size=16, route="split", num_partitions=parts)
        assert plan.num_partials > plan.num_query_rows  # rows really have several partials
        out, lse = tb.run(tb.prepare(plan), batch.query, storage.key_cache(0), storage.value_cache(0),
                          scale=batch.scale)
        check(out, lse, *rb.run(rb.prepare(plan), batch.query, storage.key_cache(0), storage.value_cache(0),
                                scale=batch.scale))
        pointers.append(tb._workspace.data_ptr())
    assert pointers[0] == pointers[1]
    small = TritonBackend(page_size=16, device=DEVICE, poison=True, workspace_bytes=64)
    out, lse = small.run(small.prepare(plan), batch.query, storage.key_cache(0), storage.value_cache(0),
                         scale=batch.scale)
    assert small._workspace is None
    check(out, lse, *rb.run(rb.prepare(plan), batch.query, storage.key_cache(0), storage.value_cache(0),
                            scale=batch.scale))


def test_eager_plan_fields_start_16_byte_aligned(gen):
    """Triton compiles a kernel variant per pointer alignment: every plan field of an eager step
    starts 16-byte aligned whatever the plan's sizes, so new plan shapes reuse the compiled kernels."""
    batch = gqa_batch(gen, dtype=torch.float32, page_size=16, ratio=2, head_dim=16, rows=3)
    tb = TritonBackend(page_size=16, device=DEVICE)
    spec = DeviceSpec.cuda() if GPU else DeviceSpec.cpu()
    sizes = set()
    for parts in (1, 2, 3, 5):
        plan = plan_attention(batch.queries, batch.shape, spec, page_size=16, route="split", num_partitions=parts)
        arrays = tb.prepare(plan).arrays
        sizes.add(tuple(t.numel() for t in arrays.values()))
        assert all(t.data_ptr() % 16 == 0 for t in arrays.values())
    assert len(sizes) > 1 and any(n % 4 for shape in sizes for n in shape)  # the offsets really varied


def test_default_launches():
    """The measured launches: GQA 64-row tiles (32 above head dim 128), 4 warps, 3 stages, tall
    decode programs at 32-row tiles under 168 registers; latent 32-row tiles, 16 pairs, the value
    split chosen per launch."""
    from segkv.kernels.attention.mla_attention import default_mla_launch_config
    from segkv.kernels.attention.paged_attention import default_launch_config

    gqa, wide, latent = default_launch_config(head_dim=128), default_launch_config(head_dim=256), \
        default_mla_launch_config()
    assert (gqa.block_n, wide.block_n, gqa.num_warps, gqa.num_stages, gqa.block_m) == (64, 32, 4, 3, 64)
    assert (gqa.tall_block_n, gqa.tall_maxnreg, gqa.maxnreg) == (32, 168, None)
    assert (latent.block_n, latent.block_m, latent.value_split, latent.maxnreg) == (32, 16, 0, None)


def test_pipeline_stages_shrink_to_fit_shared_memory():
    """Two K/V buffers of float32 64 x 256-wide tiles (256 KB) do not fit a Hopper program's shared
    memory (227 KB): those launches keep one buffer; bf16 tiles and the latent tiles keep three stages."""
    from segkv.kernels.attention.paged_attention import stages_that_fit

    assert stages_that_fit(3, 64 * (256 + 256) * 4) == 2  # float32, head_dim 256, page 64
    assert stages_that_fit(3, 64 * (256 + 256) * 2) == 3  # bf16, same tile
    assert stages_that_fit(3, 32 * 576 * 4) == 3  # float32 latent rows, 32 per tile
    assert stages_that_fit(3, 64 * 576 * 4) == 2  # float32 latent rows, page 64
    assert stages_that_fit(2, 1) == 2 and stages_that_fit(3, 10**9) == 1


@pytest.mark.gpu  # programmatic dependent launch
def test_a_graphs_merge_without_partials_still_orders_the_next_kernel(gen):
    """A CUDA graph captured over a split plan keeps its merge launch; replayed over a one-piece
    plan every row has a single partial, stage 1 writes the rows itself and the merge has nothing
    to do. The kernel after the merge (here the o-projection GEMV, as in a decode step) waits only
    for the merge under programmatic dependent launch, so the merge must not end before stage 1
    has: a long stage 1 (64K rows, one program per KV head) and poisoned outputs before every
    replay would show a read that came too early."""
    from segkv.attention.triton_backend import PlanCapacity
    from segkv.kernels.gemv.dense_gemv import splitk_gemv, workspace_size

    layout = KVLayout(num_layers=1, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    rows = 65536
    cache = PagedKVCache(layout, CacheConfig(page_size=16, num_pages=rows // 16 + 8), device=DEVICE)
    chain = cache.new_chain()
    for start in range(0, rows, 8192):
        slots = chain.append(8192)
        kv = torch.randn(2, 8192, 8, 128, device=DEVICE, dtype=torch.bfloat16)
        cache.storage.write(0, slots, kv[0], kv[1])
    queries = [SequenceQuery.from_chain(chain, 1)]
    shape = AttentionShape(32, 8, 128, 128)
    split = plan_attention(queries, shape, DeviceSpec.cuda(), page_size=16, route="split", num_partitions=4)
    single = plan_attention(queries, shape, DeviceSpec.cuda(), page_size=16, route="single")
    capacity = PlanCapacity(max_pages=rows // 16 + 8, max_work=64, max_partials=64, max_rows=1)
    tb = TritonBackend(page_size=16, device=DEVICE, capacity=capacity)
    kc, vc = cache.storage.key_cache(0), cache.storage.value_cache(0)
    query = torch.randn(1, 32, 128, device=DEVICE, dtype=torch.bfloat16)
    weight = (torch.randn(4096, 4096, device=DEVICE) * 0.02).to(torch.bfloat16)
    floats, tickets = workspace_size(4096, 4096, 32, 512)  # allocated here: no fill kernel in the graph
    workspace = (torch.zeros(floats, device=DEVICE), torch.zeros(tickets, dtype=torch.int32, device=DEVICE))
    prepared = tb.prepare(split)
    assert prepared.needs_merge
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out, _ = tb.run(prepared, query, kc, vc, scale=128**-0.5)
        splitk_gemv(out.reshape(1, -1), weight, workspace=workspace)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = tb.run(prepared, query, kc, vc, scale=128**-0.5)
        projected = splitk_gemv(out.reshape(1, -1), weight, workspace=workspace)
    from segkv.attention.triton_backend import flatten_plan
    reduce_ptr = flatten_plan(single)["reduce_ptr"]
    assert (reduce_ptr[1:] - reduce_ptr[:-1] == 1).all()  # stage 1 writes every row itself
    single_prepared = tb.prepare(single)
    assert single_prepared.fixed and single_prepared.needs_merge  # fixed buffers: the merge launch stays
    for trial in range(8):
        query.copy_(torch.randn(1, 32, 128, generator=gen).to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.isnan(out).any()
        expected = (weight.float() @ out.reshape(-1).float()).to(torch.bfloat16)
        assert not torch.isnan(projected).any(), f"trial {trial}: the GEMV read the attention output too early"
        # outputs of about 5e-3 (attention over 64K random rows averages them): one bf16 rounding apart
        torch.testing.assert_close(projected.reshape(-1), expected, rtol=2e-2, atol=1e-4)


def test_wide_offsets_follow_the_caches_extent():
    """Page offsets are int32 unless some element of a cache (any strided view) lies at 2^31 or
    beyond; meta tensors, so no memory is taken."""
    from segkv.kernels.attention.paged_attention import wide_offsets

    page = 16 * 8 * 128  # elements of one page of 16 rows, 8 KV heads, head_dim 128
    small = torch.empty(256, 16, 8, 128, device="meta")
    fits = torch.empty(2**31 // page, 16, 8, 128, device="meta")  # last element at 2^31 - 1
    past = torch.empty(2**31 // page + 1, 16, 8, 128, device="meta")
    assert not wide_offsets(small, small) and not wide_offsets(fits)
    assert wide_offsets(past) and wide_offsets(small, past)
    assert not wide_offsets(past[:-1])
    head_major = torch.empty(2**31 // page + 1, 8, 16, 128, device="meta").transpose(1, 2)
    assert wide_offsets(head_major) and not wide_offsets(head_major[:-1])


def test_which_launches_take_int64_page_offsets():
    """Only those whose cache needs them: every program shape and page size takes int32 offsets
    otherwise."""
    from segkv.kernels.attention.paged_attention import stage1_launch

    launch = dict(dtype=torch.bfloat16, dk=128, dv=128, element_size=2)
    for page_size in (16, 32, 64):
        for group, rows, config in ((4, 1, None), (8, 1, None), (4, 16, None)):
            args = dict(group=group, page_size=page_size, max_work_rows=rows, launch=config, **launch)
            assert not stage1_launch(**args)["WIDE_OFFSETS"], (page_size, group, rows, config)
            assert stage1_launch(cache_needs_int64=True, **args)["WIDE_OFFSETS"], (page_size, group, rows, config)


@pytest.mark.parametrize("wide", [False, True])
def test_page_offsets_in_32_or_64_bits_give_the_reference(wide, gen, monkeypatch):
    """Both page-offset widths of stage 1 on every route (forced: the caches here are small)."""
    from segkv.kernels.attention import paged_attention

    calls = []
    monkeypatch.setattr(paged_attention, "wide_offsets", lambda *caches: calls.append(caches) or wide)
    batch = gqa_batch(gen, dtype=torch.bfloat16, page_size=16, ratio=4, head_dim=64, rows=3)
    for route in ROUTES:
        _, out, lse, ref, ref_lse = run_both(batch, route)
        check(out, lse, ref, ref_lse)
    assert calls  # the launcher asked


@pytest.mark.gpu  # a cache past 2^31 elements: 8 GB of device memory
def test_pages_past_two_to_the_31_elements(gen):
    """A cache whose pages lie past 2^31 elements (int64 page offsets): the history's pages are
    taken after 131072 others, so every one of them starts beyond int32."""
    from segkv.kernels.attention.paged_attention import wide_offsets

    layout = KVLayout(num_layers=1, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    filler_pages = 2**31 // (16 * 8 * 128)
    cache = PagedKVCache(layout, CacheConfig(page_size=16, num_pages=filler_pages + 80), device=DEVICE,
                         compaction=CompactionPolicy(enabled=False))
    filler = cache.new_chain()
    filler.append(filler_pages * 16)  # bookkeeping only: never read
    chain = cache.new_chain()
    slots = chain.append(1000)
    kv = torch.randn(2, 1000, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    cache.storage.write(0, slots, kv[0], kv[1])
    k, v = cache.storage.key_cache(0), cache.storage.value_cache(0)
    assert wide_offsets(k, v)
    assert min(p for span in chain.spans() for p in span.page_ids) >= filler_pages
    queries = [SequenceQuery.from_chain(chain, 1)]
    shape = AttentionShape(32, 8, 128, 128)
    for route in ("single", "split"):
        plan = plan_attention(queries, shape, DeviceSpec.cuda(), page_size=16, route=route)
        q = torch.randn(1, 32, 128, device=DEVICE, dtype=torch.bfloat16)
        check(*triton_and_reference(plan, q, k, v, page_size=16, scale=128**-0.5, device=DEVICE))
