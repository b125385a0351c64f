"""The latent merge and the per-head output product in one launch (``kernels.latent_output``)."""

from __future__ import annotations

import pytest
import torch

from segkv.kernels.head_gemv import head_gemv
from segkv.kernels.latent_output import counters_size, merge_with_head_gemv
from segkv.kernels.paged_attention import merge_into

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def _partials(heads, rank, count, gen, *, dead=()):
    """Float32 partial outputs and LSEs of ``count`` partials (those in ``dead``: -inf) and the CSR."""
    part_out = torch.randn(count, heads, rank, generator=gen).to(DEVICE)
    part_lse = torch.randn(count, heads, generator=gen).to(DEVICE)
    for p in dead:
        part_lse[p] = float("-inf")
    reduce_ptr = torch.tensor([0, count], dtype=torch.int32, device=DEVICE)
    reduce_partials = torch.randperm(count, generator=gen).to(torch.int32).to(DEVICE)
    return part_out, part_lse, reduce_ptr, reduce_partials


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,rank,v_dim,count", [(4, 64, 24, 5), (16, 512, 128, 33), (2, 48, 40, 1)])
def test_one_launch_equals_merge_then_head_gemv(dtype, heads, rank, v_dim, count, gen):
    """Merged rows and LSEs equal the merge launch's; each head's product equals ``head_gemv`` of
    the merged row (to float32 summation order: one rounding at most), for widths that do not
    fill a block, a partial dead for every head and a row with one partial (written by stage 1:
    only the product runs); three launches on the same counters, the outputs poisoned first."""
    w_full = (torch.randn(heads, 2 * v_dim, rank, generator=gen) / rank**0.5).to(dtype).to(DEVICE)
    weight = w_full[:, v_dim:]  # a strided view, as W_uv is of kv_b_proj
    counters = torch.zeros(counters_size(heads), dtype=torch.int32, device=DEVICE)
    kernel_dtype = torch.float32 if not GPU else dtype
    for _ in range(3):
        part_out, part_lse, reduce_ptr, reduce_partials = _partials(heads, rank, count, gen,
                                                                    dead=(0,) if count > 1 else ())
        lat = torch.full((1, heads, rank), float("nan"), dtype=kernel_dtype, device=DEVICE)
        lse = torch.full((1, heads), float("nan"), device=DEVICE)
        if count == 1:  # stage 1 wrote the row itself
            lat.copy_(torch.randn(1, heads, rank, generator=gen).to(dtype))
            lse.zero_()
        ref_lat, ref_lse = lat.clone(), lse.clone()
        if count > 1:
            merge_into(ref_lat, ref_lse, part_out, part_lse, reduce_ptr, reduce_partials)
        out = merge_with_head_gemv(lat, lse, part_out, part_lse, reduce_ptr, reduce_partials, weight, counters)
        assert not counters.any()
        assert torch.equal(lat, ref_lat) and torch.equal(lse, ref_lse)
        ref = head_gemv(ref_lat[0].to(dtype), weight)
        assert out.dtype == dtype and out.shape == (heads, v_dim) and torch.isfinite(out).all()
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20
        ref64 = ref.double()
        assert ((out.double() - ref64).abs() <= ulp * (ref64.abs() + ref64.abs().max()) + 1e-6).all()


def test_bad_input_is_refused(gen):
    part_out, part_lse, reduce_ptr, reduce_partials = _partials(4, 64, 3, gen)
    lat = torch.zeros(2, 4, 64, device=DEVICE)
    lse = torch.zeros(2, 4, device=DEVICE)
    weight = torch.randn(4, 16, 64, generator=gen).to(DEVICE)
    counters = torch.zeros(counters_size(4), dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="one query row"):
        merge_with_head_gemv(lat, lse, part_out, part_lse, reduce_ptr, reduce_partials, weight, counters)
    with pytest.raises(ValueError, match="weights"):
        merge_with_head_gemv(lat[:1], lse[:1], part_out, part_lse, reduce_ptr, reduce_partials, weight[:3], counters)
    with pytest.raises(ValueError, match="int32 counters"):
        merge_with_head_gemv(lat[:1], lse[:1], part_out, part_lse, reduce_ptr, reduce_partials, weight, counters[:2])
    assert not counters.any()


@pytest.mark.parametrize("route", ["split", "single", "segments"])
def test_backend_runs_merge_and_head_product_together(route, gen):
    """``TritonBackend.run(..., head_weight=W)`` on one latent query row (merge and product in one
    launch) equals its run followed by ``head_gemv`` and the reference backend's projection;
    three query rows take the separate projection; ``head_weight`` on a GQA cache is refused."""
    from segkv.attention import AttentionShape, DeviceSpec, TorchReferenceBackend, plan_attention
    from segkv.attention.triton_backend import TritonBackend
    from test_triton_mla import RANK, ROPE, latent_batch

    heads, dtype = 4, torch.bfloat16
    cache, _, queries = latent_batch(gen, dtype=dtype, page_size=16, rows=1)
    weight = (torch.randn(heads, 24, RANK, generator=gen) / RANK**0.5).to(dtype).to(DEVICE)
    k, v = cache.storage.key_cache(0), cache.storage.value_cache(0)
    device = DeviceSpec.cuda() if GPU else DeviceSpec.cpu()
    for count in (1, 3):
        plan = plan_attention(queries[:count], AttentionShape(heads, 1, RANK + ROPE, RANK), device,
                              page_size=cache.page_size, route=route, num_partitions=3 if route == "split" else None)
        q = (0.5 * torch.randn(plan.num_query_rows, heads, RANK + ROPE, generator=gen)).to(dtype).to(DEVICE)
        scale = (RANK + ROPE) ** -0.5
        backend = TritonBackend(page_size=cache.page_size, device=torch.device(DEVICE))
        prepared = backend.prepare(plan)
        together, lse = backend.run(prepared, q, k, v, scale=scale, head_weight=weight)
        latent, ref_lse = backend.run(prepared, q, k, v, scale=scale)
        apart = torch.stack([head_gemv(row, weight) for row in latent])
        reference = TorchReferenceBackend(page_size=cache.page_size, device=torch.device(DEVICE))
        ref, _ = reference.run(reference.prepare(plan), q, k, v, scale=scale, head_weight=weight)
        assert together.shape == (count, heads, 24) and together.dtype == dtype
        assert torch.equal(lse, ref_lse)
        for got, want, ulps in ((together, apart, 1), (together, ref, 4)):
            want = want.double()
            assert ((got.double() - want).abs() <= ulps * 2.0**-7 * (want.abs() + want.abs().max()) + 1e-6).all()
    gqa = torch.zeros(4, 16, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="latent"):
        backend.run(backend.prepare(plan_attention(queries[:1], AttentionShape(4, 2, 8, 8), device, page_size=16)),
                    torch.zeros(1, 4, 8, device=DEVICE), gqa, gqa, scale=1.0, head_weight=weight)
