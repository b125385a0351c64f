"""Rows that see no key give 0 (never NaN); empty pieces weigh nothing."""

from __future__ import annotations

import pytest
import torch

from attention_helpers import build_batch, dense_attention
from segkv.attention import (
    AttentionPlan,
    DeviceSpec,
    Piece,
    Route,
    SequenceQuery,
    TorchReferenceBackend,
    WorkItem,
    plan_attention,
    reduce_map_from_work,
)


def _run(batch, plan):
    backend = TorchReferenceBackend(page_size=batch.cache.page_size)
    storage = batch.cache.storage
    return backend.run(backend.prepare(plan), batch.query, storage.key_cache(0), storage.value_cache(0),
                       scale=batch.scale)


@pytest.mark.parametrize("route", [r.value for r in Route])
@pytest.mark.parametrize("layout", ["gqa4", "mla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_rows_and_empty_chains_give_zero(route, layout, dtype, gen):
    batch = build_batch(layout, dtype, page_size=16, num_segments=3, num_query_rows=4, gen=gen)
    # sequence 1: padding rows at positions -2..1 (two see nothing, two see a prefix);
    # sequence 2: an empty chain with query rows.
    q0, q1, _ = batch.queries
    batch.queries = [q0, SequenceQuery(q1.spans, 4, query_start=-2), SequenceQuery((), 4)]
    batch.chains[2].release()
    plan = plan_attention(batch.queries, batch.shape, DeviceSpec.cpu(), page_size=16, route=route)
    assert plan.route == Route(route)
    out, lse = _run(batch, plan)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    dead = [4, 5, 8, 9, 10, 11]
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))
    assert torch.isneginf(lse[dead]).all()
    assert torch.isfinite(lse[[0, 1, 2, 3, 6, 7]]).all()
    expected = dense_attention(batch, dtype=torch.float32).to(dtype)
    torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=1e-5 if dtype == torch.float32 else 8e-3)


def test_empty_pieces_weigh_nothing(gen):
    batch = build_batch("gqa4", torch.float32, page_size=16, num_segments=2, num_query_rows=3, gen=gen)
    plan = plan_attention(batch.queries, batch.shape, DeviceSpec.cpu(), page_size=16, route="segments")
    ref, ref_lse = _run(batch, plan)
    # the same plan with an empty piece attended by every row, first and last
    empty = len(plan.pieces)
    rows = tuple(range(plan.num_query_rows))
    extra = WorkItem(empty, rows, tuple(100 for _ in rows))
    work = (extra,) + plan.work + (extra,)
    padded = AttentionPlan(Route.SEGMENTS, plan.pieces + (Piece((), ()),), work,
                           reduce_map_from_work(work, plan.num_query_rows), plan.num_query_rows)
    out, lse = _run(batch, padded)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-6)


def test_piece_rows_invisible_to_an_early_row_give_it_nothing(gen):
    """A verify window split across partitions: early rows see nothing of the last one."""
    batch = build_batch("gqa8", torch.float32, page_size=1, num_segments=1, num_query_rows=17, gen=gen)
    plan = plan_attention(batch.queries, batch.shape, DeviceSpec.cpu(), page_size=1, route="split",
                          num_partitions=64)
    assert plan.num_partitions >= 17  # every row of the window falls in its own partition
    out, _ = _run(batch, plan)
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=0, atol=2e-5)
