"""Attention sinks (gpt-oss): a per-head sink logit joins every row's softmax denominator with a
zero value, folded in float32 before the single rounding, on every route and in every place a row
is finished (stage 1's direct store and merge, the merge kernel), against a float64 dense oracle.

Without a GPU the Triton kernels run in Triton's interpreter: small shapes, a few cases.
"""

from __future__ import annotations

import pytest
import torch

import attention_helpers
from attention_helpers import Batch, dense_attention_with_sinks, forked_history, ulp
from gpu_helpers import DEVICE, GPU
from segkv.attention import AttentionShape, DeviceSpec, Route, SequenceQuery, TorchReferenceBackend, plan_attention
from segkv.attention.backend import BackendCapabilities, check_sinks
from segkv.attention.merge import merge_partials, merge_states
from segkv.attention.triton_backend import PlanCapacity, TritonBackend
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, KVLayout

# the exact contract's checks: exact plans on every device (attention_helpers.exact_attention)
exact_attention = attention_helpers.exact_attention
pytestmark = pytest.mark.usefixtures("exact_attention")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HEAD_DIM, KV_HEADS, RATIO = 32, 2, 2


def sink_batch(gen, *, dtype, page_size=16, rows=1, segments=4) -> Batch:
    """Three sequences (a history, a fork trimmed mid-page, a plain fork) over one segmented
    history, each with ``rows`` query rows, on DEVICE."""
    layout = KVLayout(num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype)
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=64), device=DEVICE,
                         compaction=CompactionPolicy(enabled=False))
    shape = AttentionShape(KV_HEADS * RATIO, KV_HEADS, HEAD_DIM, HEAD_DIM)
    chains = forked_history(cache, gen, rows=rows, segments=segments)
    queries = [SequenceQuery.from_chain(c, rows) for c in chains]
    query = torch.randn(3 * rows, shape.num_q_heads, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    return Batch(cache, chains, queries, query, shape, HEAD_DIM**-0.5)


def draw_sinks(gen, num_heads: int) -> torch.Tensor:
    """Sink logits that matter: around the rows' key LSEs (a few tens of keys of unit scores:
    about 4), some well above, some below."""
    return (4.0 + 2.0 * torch.randn(num_heads, generator=gen)).float().to(DEVICE)


def plan_for(batch: Batch, route: str, num_partitions: int | None = None):
    device = DeviceSpec.cuda() if GPU else DeviceSpec.cpu()
    plan = plan_attention(batch.queries, batch.shape, device, page_size=batch.cache.page_size, route=route,
                          num_partitions=num_partitions)
    assert plan.route == Route(route)
    return plan


def run(backend, plan, batch: Batch, sinks=None, query=None, prepared=None):
    storage = batch.cache.storage
    prepared = prepared or backend.prepare(plan)
    return backend.run(prepared, batch.query if query is None else query, storage.key_cache(0),
                       storage.value_cache(0), scale=batch.scale, sinks=sinks)


def assert_exact(out, lse, oracle, oracle_lse, exact32) -> None:
    """The exact contract's bound (test_attention_exactness): float32 within 2e-5 of the float64
    oracle; half precision within one ulp of float32 attention rounded once plus float32
    summation-order noise, with rounding flips past the noise rare. LSEs within 1e-4."""
    out, lse = out.cpu(), lse.cpu()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "an output was left unwritten"
    assert torch.isfinite(lse).all()  # with a sink every row has a finite LSE
    torch.testing.assert_close(lse.double(), oracle_lse, rtol=0, atol=1e-4)
    if out.dtype == torch.float32:
        torch.testing.assert_close(out.double(), oracle, rtol=0, atol=2e-5)
        return
    exact = exact32.to(out.dtype)
    # float32 noise: a few times the float32 oracle's own error (on a GPU also the split P.V's
    # 16 bits of P, as test_triton_attention's check allows)
    noise = 4 * (exact32.double() - oracle).abs().max().item() + (1e-5 if GPU else 0.0)
    diff = (out.double() - exact.double()).abs()
    assert (diff <= ulp(exact) + noise).all(), f"max diff {diff.max().item()}"
    flips = int((diff > noise).sum())
    assert flips <= max(0.01 * diff.numel(), 12), f"{flips} of {diff.numel()} elements flipped"


def oracles(batch: Batch, sinks: torch.Tensor):
    oracle, oracle_lse = dense_attention_with_sinks(batch, sinks, dtype=torch.float64)
    exact32, _ = dense_attention_with_sinks(batch, sinks, dtype=torch.float32)
    return oracle, oracle_lse, exact32


# (route, forced partitions, query rows per sequence, dtype): where each case's rows are finished
CASES = [
    ("single", None, 1, "bf16"),  # every row's only partial: stage 1's direct store
    ("split", 3, 1, "fp16"),  # decode rows of 3 partials: stage 1 merges them (merge_if_last)
    ("split", 3, 5, "fp32"),  # a multi-row chunk of 3 partials a row: the merge kernel
    ("segments", None, 5, "bf16"),  # a chunk over the segments: the merge kernel
    ("cascade", None, 1, "bf16"),  # decode rows of forks sharing a prefix: the merge kernel
]


@pytest.mark.parametrize("route,parts,rows,dtype", CASES, ids=[f"{c[0]}-r{c[2]}-{c[3]}" for c in CASES])
def test_triton_sinks_are_exact(route, parts, rows, dtype, gen):
    """Each route of the Triton backend with sinks against the float64 dense oracle with the sink
    term, within the exact contract's bound; the reference backend too."""
    batch = sink_batch(gen, dtype=DTYPES[dtype], rows=rows)
    sinks = draw_sinks(gen, batch.shape.num_q_heads)
    plan = plan_for(batch, route, parts)
    if route == "cascade":
        assert any(len({r // rows for r in item.query_rows}) > 1 for item in plan.work), "nothing shared"
    if parts:
        assert plan.max_row_partials > 1
    expected = oracles(batch, sinks)
    tb = TritonBackend(page_size=batch.cache.page_size, device=DEVICE, poison=True)
    prepared = tb.prepare(plan)
    if (route, rows) == ("split", 1):
        assert prepared.merge_in_stage1
    assert_exact(*run(tb, plan, batch, sinks, prepared=prepared), *expected)
    rb = TorchReferenceBackend(page_size=batch.cache.page_size, device=DEVICE)
    assert_exact(*run(rb, plan, batch, sinks), *expected)


def test_stage1_merge_by_chunks_folds_the_sink(gen, monkeypatch):
    """A stage-1 merge bound of 32: decode rows are merged by the last program of their heads a
    chunk of partials at a time (``merge_group_if_last``), the sink as the running state's start."""
    from segkv.attention import triton_backend
    from segkv.kernels.attention import paged_attention

    monkeypatch.setattr(paged_attention, "MERGE_IN_STAGE1_MAX_PARTIALS", 32)
    triton_backend.stage1_merge_bound.cache_clear()
    try:
        batch = sink_batch(gen, dtype=torch.bfloat16, rows=1)
        sinks = draw_sinks(gen, batch.shape.num_q_heads)
        plan = plan_for(batch, "split", 3)
        tb = TritonBackend(page_size=batch.cache.page_size, device=DEVICE, poison=True)
        prepared = tb.prepare(plan)
        assert prepared.merge_in_stage1 and plan.max_row_partials > 1
        assert_exact(*run(tb, plan, batch, sinks, prepared=prepared), *oracles(batch, sinks))
    finally:
        triton_backend.stage1_merge_bound.cache_clear()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_reference_sinks_are_exact_on_every_route(dtype, gen):
    """The oracle backend with sinks, every route (split forced to 3 partitions), decode rows and a
    multi-row chunk, against the float64 dense oracle."""
    for rows in (1, 4):
        batch = sink_batch(gen, dtype=DTYPES[dtype], rows=rows, segments=5)
        sinks = draw_sinks(gen, batch.shape.num_q_heads)
        expected = oracles(batch, sinks)
        rb = TorchReferenceBackend(page_size=batch.cache.page_size, device=DEVICE)
        for route in Route:
            plan = plan_for(batch, route.value, 3 if route == Route.SPLIT else None)
            assert_exact(*run(rb, plan, batch, sinks), *expected)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_check_rejects_a_missing_or_late_sink(dtype, gen):
    """Power: the same check rejects the output without the sink, and the sink applied after the
    rounding (the rounded output rescaled by ``exp(lse - lse_with_sink)`` and rounded again: a
    double rounding that moves about a quarter of the elements), while the kernel's passes."""
    batch = sink_batch(gen, dtype=DTYPES[dtype], rows=4)
    sinks = draw_sinks(gen, batch.shape.num_q_heads)
    plan = plan_for(batch, "split", 3)
    expected = oracles(batch, sinks)
    tb = TritonBackend(page_size=batch.cache.page_size, device=DEVICE, poison=True)
    out, lse = run(tb, plan, batch, sinks)
    assert_exact(out, lse, *expected)
    plain, plain_lse = run(tb, plan, batch)
    with pytest.raises(AssertionError):
        assert_exact(plain, lse, *expected)  # the right LSE, the output without the sink
    late = (plain.float() * torch.exp(plain_lse - lse).unsqueeze(-1)).to(plain.dtype)
    with pytest.raises(AssertionError, match="flipped"):
        assert_exact(late, lse, *expected)


def test_rows_that_see_nothing_get_zero_and_the_sink(gen):
    """Rows of no visible key (a sequence before its history, an empty chain), through the merge
    kernel (a multi-row chunk) and through stage 1's merge with fixed buffers whose padding rows
    have no partials: 0 with LSE ``sinks[h]``; the other rows as the reference's with sinks."""
    batch = sink_batch(gen, dtype=torch.bfloat16, rows=2)
    q0, q1, _ = batch.queries
    batch.queries = [q0, SequenceQuery(q1.spans, 2, query_start=-2), SequenceQuery((), 2)]
    sinks = draw_sinks(gen, batch.shape.num_q_heads)
    dead = [2, 3, 4, 5]
    for route, capacity in (("segments", None),
                            ("split", PlanCapacity(max_pages=64, max_work=32, max_partials=64, max_rows=8,
                                                   max_work_rows=1, max_row_partials=8))):
        if capacity is not None:  # decode rows: one query row per sequence
            batch.queries = [SequenceQuery(q.spans, 1, query_start=q.query_start + 1) for q in batch.queries]
            batch.query = batch.query[::2].contiguous()
            dead = [1, 2, 3, 4]  # past the 3 plan rows: a graph bucket's padding rows
        plan = plan_for(batch, route, 2 if route == "split" else None)
        tb = TritonBackend(page_size=batch.cache.page_size, device=DEVICE, poison=True, capacity=capacity)
        prepared = tb.prepare(plan)
        query = batch.query
        if capacity is not None:
            assert prepared.merge_in_stage1
            query = torch.cat([query, torch.randn(2, *query.shape[1:], generator=gen).to(query.dtype).to(DEVICE)])
        out, lse = run(tb, plan, batch, sinks, query=query, prepared=prepared)
        rb = TorchReferenceBackend(page_size=batch.cache.page_size, device=DEVICE)
        ref, ref_lse = run(rb, plan, batch, sinks)
        live = [r for r in range(plan.num_query_rows) if r not in dead]
        diff = (out[live].double() - ref[live].double()).abs()
        assert (diff <= ulp(ref[live]) + 1e-5).all(), route
        torch.testing.assert_close(lse[live], ref_lse[live], rtol=0, atol=1e-4)
        assert torch.equal(out[dead], torch.zeros_like(out[dead])), route
        torch.testing.assert_close(lse[dead], sinks.expand(len(dead), -1), rtol=1e-6, atol=1e-6)
        dead_ref = [r for r in dead if r < plan.num_query_rows]
        assert torch.equal(ref_lse[dead_ref], sinks.expand(len(dead_ref), -1))
        if capacity is not None:
            assert not tb._counters.any()  # the tickets are back to 0


def test_sinks_none_is_todays_result(gen):
    """``sinks=None`` runs today's kernels (bitwise the call without the argument), and sinks of
    -inf (no sink term) give the same bits; the merge helpers with ``sinks=None`` are today's."""
    batch = sink_batch(gen, dtype=torch.bfloat16, rows=3)
    plan = plan_for(batch, "split", 2)
    tb = TritonBackend(page_size=batch.cache.page_size, device=DEVICE, poison=True)
    storage = batch.cache.storage
    prepared = tb.prepare(plan)
    base = tb.run(prepared, batch.query, storage.key_cache(0), storage.value_cache(0), scale=batch.scale)
    for sinks in (None, torch.full((batch.shape.num_q_heads,), float("-inf"), device=DEVICE)):
        out, lse = run(tb, plan, batch, sinks, prepared=prepared)
        assert torch.equal(out, base[0]) and torch.equal(lse, base[1])
    parts_out = torch.randn(5, 3, 8, generator=gen)
    parts_lse = torch.randn(5, 3, generator=gen)
    rows = torch.tensor([0, 0, 1, 2, 2])
    out, lse = merge_partials(parts_out, parts_lse, rows, 4, sinks=None)
    ref_out, ref_lse = merge_partials(parts_out, parts_lse, rows, 4)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_merge_helpers_fold_the_sink_as_one_more_state(gen):
    """``merge_partials`` and ``merge_states`` with sinks equal the merge with one more state of LSE
    ``sink`` and output 0 per (row, head); a row without partials is 0 with LSE ``sink``."""
    parts_out = torch.randn(5, 3, 8, generator=gen)
    parts_lse = torch.randn(5, 3, generator=gen)
    parts_lse[1, 2] = float("-inf")
    sinks = torch.randn(3, generator=gen)
    rows = torch.tensor([0, 0, 1, 2, 2])
    out, lse = merge_partials(parts_out, parts_lse, rows, 4, sinks=sinks)
    with_sink_out = torch.cat([parts_out, torch.zeros(4, 3, 8)])
    with_sink_lse = torch.cat([parts_lse, sinks.expand(4, 3)])
    ref, ref_lse = merge_partials(with_sink_out, with_sink_lse, torch.cat([rows, torch.arange(4)]), 4)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[3], torch.zeros(3, 8)) and torch.equal(lse[3], sinks)
    stacked_out, stacked_lse = merge_states(parts_out[:2], parts_lse[:2], sinks=sinks)
    torch.testing.assert_close(stacked_out, ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stacked_lse, ref_lse[0], rtol=1e-6, atol=1e-6)


def test_sinks_are_refused_clearly(gen):
    """The latent (MLA) kernel and ``kv_transform`` calls of the Triton backend refuse sinks; a
    backend without ``capabilities.sinks`` refuses them; sinks of the wrong shape, dtype or device
    are refused."""
    assert TritonBackend.capabilities.sinks and TorchReferenceBackend.capabilities.sinks
    # a latent cache: one KV head, the values a view of its rows' first columns
    latent = torch.zeros(4, 16, 1, 48, dtype=torch.bfloat16, device=DEVICE)
    shape = AttentionShape(4, 1, 48, 32)
    plan = plan_attention([SequenceQuery((), 1)], shape, DeviceSpec.cpu(), page_size=16)
    tb = TritonBackend(page_size=16, device=DEVICE)
    query = torch.zeros(1, 4, 48, dtype=torch.bfloat16, device=DEVICE)
    sinks = torch.zeros(4, device=DEVICE)
    with pytest.raises(ValueError, match="latent .*sinks"):
        tb.run(tb.prepare(plan), query, latent, latent[..., :32], scale=0.1, sinks=sinks)
    with pytest.raises(ValueError, match="kv_transform"):
        tb.run(tb.prepare(plan), query, latent, latent[..., :32], scale=0.1, sinks=sinks,
               kv_transform=lambda k, v: (k, v))
    without = BackendCapabilities(devices=("cpu",), kv_layouts=("mha",), kv_transform=False, cuda_graphs=False,
                                  precision_modes=("exact",))
    with pytest.raises(ValueError, match="does not take attention sinks"):
        check_sinks("plain", without, sinks, query)
    caps = TorchReferenceBackend.capabilities
    for bad, message in ((torch.zeros(3, device=DEVICE), "shape"), (sinks.double(), "float32"),
                         (sinks.to("meta"), "on meta")):
        with pytest.raises(ValueError, match=message):
            check_sinks("torch", caps, bad, query)
