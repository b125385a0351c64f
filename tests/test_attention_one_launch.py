"""Stage 1 and the merge in one launch (``kernels.attention_one_launch``, ``SEGKV_ATTENTION_ONE_LAUNCH``)."""

from __future__ import annotations

import pytest
import torch

from segkv.kernels.paged_attention import LaunchConfig
from test_triton_attention import GPU, check_with_the_second_sequence_masked, count_merge_launches


@pytest.mark.parametrize("route", ["split", "segments", "cascade", "single"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_launch_matches_the_reference(route, dtype, gen, monkeypatch):
    """Every route against the reference with a fully masked sequence, rows of many partials (70:
    more than a merge block), several query rows per work item and 8 heads per KV head; no merge
    launch runs."""
    from segkv.kernels import paged_attention

    monkeypatch.setattr(paged_attention, "ONE_LAUNCH", True)
    monkeypatch.setattr("segkv.attention.triton_backend.stage1_merge_bound", lambda: 0)  # every merge: the launch
    merges = count_merge_launches(monkeypatch)
    for rows, ratio, page_size, parts in ((1, 4, 16, 3), (3, 8, 16, 3), (1, 4, 16, 70)):
        check_with_the_second_sequence_masked(gen, dtype, route, rows=rows, ratio=ratio, page_size=page_size,
                                              partitions=parts, launch=LaunchConfig(16, 4, 3))
    assert merges == []


def test_counters_are_left_zero_for_the_next_launch(gen, monkeypatch):
    """Two launches back to back on one backend's counters (a decode step's layers): both right,
    the counters zero after each."""
    from segkv.attention import DeviceSpec, plan_attention
    from segkv.attention.reference import TorchReferenceBackend
    from segkv.attention.triton_backend import TritonBackend
    from segkv.kernels import paged_attention
    from test_triton_attention import check, gqa_batch

    monkeypatch.setattr(paged_attention, "ONE_LAUNCH", True)
    monkeypatch.setattr("segkv.attention.triton_backend.stage1_merge_bound", lambda: 0)
    batch = gqa_batch(gen, dtype=torch.bfloat16, page_size=16, ratio=4, head_dim=64, rows=1)
    device = DeviceSpec.cuda() if GPU else DeviceSpec.cpu()
    plan = plan_attention(batch.queries, batch.shape, device, page_size=16, route="split", num_partitions=3)
    storage = batch.cache.storage
    tb = TritonBackend(page_size=16, device=batch.query.device, poison=True)
    rb = TorchReferenceBackend(page_size=16, device=batch.query.device)
    prepared = tb.prepare(plan)
    for _ in range(2):
        q = torch.randn(batch.query.shape, generator=gen).to(batch.query.dtype).to(batch.query.device)
        out, lse = tb.run(prepared, q, storage.key_cache(0), storage.value_cache(0), scale=batch.scale)
        ref, ref_lse = rb.run(rb.prepare(plan), q, storage.key_cache(0), storage.value_cache(0), scale=batch.scale)
        check(out, lse, ref, ref_lse)
        assert tb._counters is not None and not tb._counters.any()
