"""The grouped expert GEMM against torch: (row, expert) pairs sorted by expert on the device."""

from __future__ import annotations

import pytest
import torch

from gpu_helpers import DEVICE, GPU
from segkv.kernels.moe.grouped_expert_gemm import group_pairs_by_expert, grouped_expert_gemm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7}


def _inputs(gen, dtype, *, num_rows, in_dim, out_dim, experts):
    """``x (num_rows, in_dim)``, ``weight (E, out_dim, in_dim)`` scaled to unit outputs, random rows."""
    num_experts = int(experts.max()) + 2  # the last expert never chosen
    x = torch.randn(num_rows, in_dim, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(num_experts, out_dim, in_dim, generator=gen) / in_dim**0.5).to(dtype).to(DEVICE)
    rows = torch.randint(0, num_rows, (experts.numel(),), generator=gen).to(DEVICE)
    return x, rows, experts.to(DEVICE), weight


def _assert_matches_torch(out, x, rows, experts, weight):
    """Float32 sums rounded once: within float32 summation noise of the exact products (for
    these unit-sized outputs, about 1e-5 per 2048 inputs), plus one ulp for half types."""
    ref = torch.einsum("noi,ni->no", weight[experts].double(), x[rows].double())
    assert out.dtype == x.dtype and out.shape == ref.shape and torch.isfinite(out).all()
    noise = 2e-5 * max(1.0, x.shape[1] / 2048)
    if out.dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=noise)
    else:
        ulp = ref.abs().clamp_min(2.0**-14) * 2.0 ** -MANTISSA_BITS[out.dtype]
        assert ((out.double() - ref).abs() <= ulp + noise).all()


def _uneven_experts(gen):
    """37 pairs: expert 0 holds 20 (more than one block of 16), 3 none, 5 a single pair; shuffled."""
    ids = torch.tensor([0] * 20 + [1] * 9 + [2] * 3 + [4] * 4 + [5])
    return ids[torch.randperm(ids.numel(), generator=gen)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_dim,out_dim", [(48, 40), (130, 70)] + ([(2048, 2816)] if GPU else []))
def test_uneven_groups_match_torch(dtype, in_dim, out_dim, gen):
    x, rows, experts, weight = _inputs(gen, dtype, num_rows=9, in_dim=in_dim, out_dim=out_dim,
                                       experts=_uneven_experts(gen))
    _assert_matches_torch(grouped_expert_gemm(x, rows, experts, weight), x, rows, experts, weight)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_expert_holding_every_pair(dtype, gen):
    experts = torch.full((50,), 2)  # 50 pairs: three full blocks of 16 and a partial one
    x, rows, experts, weight = _inputs(gen, dtype, num_rows=7, in_dim=72, out_dim=33, experts=experts)
    _assert_matches_torch(grouped_expert_gemm(x, rows, experts, weight), x, rows, experts, weight)


def test_int32_ids_and_wide_blocks(gen):
    experts = torch.randint(0, 4, (45,), generator=gen, dtype=torch.int32)
    x, rows, experts, weight = _inputs(gen, torch.float32, num_rows=5, in_dim=40, out_dim=24, experts=experts)
    rows = rows.int()
    groups = group_pairs_by_expert(experts, weight.shape[0], block_m=64)  # the wide tiles of prefill
    out = grouped_expert_gemm(x, rows, experts, weight, groups=groups)
    _assert_matches_torch(out, x, rows, experts, weight)


def test_groups_cover_every_pair_once(gen):
    experts = _uneven_experts(gen).to(DEVICE)
    groups = group_pairs_by_expert(experts, 7)
    assert groups.block_m == 16 and groups.max_blocks == 3 + 7  # cdiv(37, 16) + the experts
    order = groups.order.cpu()
    assert sorted(order.tolist()) == list(range(37))
    sorted_ids = experts.cpu()[order]
    assert (sorted_ids[1:] >= sorted_ids[:-1]).all()
    counts = (groups.bounds[1:] - groups.bounds[:-1]).cpu()
    assert counts.tolist() == torch.bincount(experts.cpu(), minlength=7).tolist()
    # blocks: 2 for expert 0, one each for 1, 2, 4, 5; the rest of the bound is idle (id 7)
    assert groups.block_expert.cpu().tolist() == [0, 0, 1, 2, 4, 5, 7, 7, 7, 7]


def test_no_pairs_gives_an_empty_output(gen):
    weight = torch.randn(3, 8, 16, generator=gen).to(DEVICE)
    empty = torch.zeros(0, dtype=torch.long, device=DEVICE)
    out = grouped_expert_gemm(torch.randn(2, 16, generator=gen).to(DEVICE), empty, empty, weight)
    assert out.shape == (0, 8) and out.dtype == torch.float32


def test_bad_inputs_are_refused(gen):
    x = torch.randn(2, 16, generator=gen).to(DEVICE)
    weight = torch.randn(3, 8, 16, generator=gen).to(DEVICE)
    ids = torch.zeros(4, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="shapes do not match"):
        grouped_expert_gemm(x[:, :12], ids, ids, weight)
    with pytest.raises(ValueError, match="shapes do not match"):
        grouped_expert_gemm(x, ids, ids[:3], weight)
    with pytest.raises(ValueError, match="one dtype"):
        grouped_expert_gemm(x.bfloat16(), ids, ids, weight)
    with pytest.raises(ValueError, match="one dtype"):
        grouped_expert_gemm(x.double(), ids, ids, weight.double())
    with pytest.raises(ValueError, match="writes float32"):
        grouped_expert_gemm(x, ids, ids, weight, out_dtype=torch.float64)
    with pytest.raises(ValueError, match="int32/int64"):
        grouped_expert_gemm(x, ids.float(), ids, weight)
    with pytest.raises(ValueError, match="unit column strides"):
        grouped_expert_gemm(x, ids, ids, weight.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(ValueError, match="do not match"):
        grouped_expert_gemm(x, ids, ids, weight, groups=group_pairs_by_expert(ids[:3], 3))
    with pytest.raises(ValueError, match="power of two"):
        group_pairs_by_expert(ids, 3, block_m=24)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_layer_past_the_pair_limit_matches_the_expert_loop(dtype, gen, monkeypatch):
    """Batches with more pairs than the per-pair GEMV takes run the grouped GEMM, with the
    looped path's result (one torch GEMM per expert)."""
    from segkv.layers.moe import MixtureOfExperts, RouterSpec

    spec = RouterSpec(num_experts=6, top_k=3)
    moe = MixtureOfExperts(40, 24, spec, num_shared=1).to(DEVICE)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    moe = moe.to(dtype)
    x = torch.randn(30, 40, generator=gen).to(dtype).to(DEVICE)  # 90 pairs
    assert x.shape[0] * spec.top_k > moe.PACKED_PAIRS_LIMIT
    with torch.no_grad():
        looped = moe(x)
        moe.pack_experts()
        monkeypatch.setattr(moe, "_looped_experts", None)  # a packed layer must not come back to the loop
        monkeypatch.setattr(moe, "_packed_experts", None)
        grouped = moe(x)
    assert grouped.dtype == dtype and torch.isfinite(grouped).all()
    if dtype == torch.float32:
        torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-5)
    else:  # float32 sums in another order may round an intermediate to the neighbouring value
        ulp = 2.0 ** -MANTISSA_BITS[dtype]
        torch.testing.assert_close(grouped, looped, rtol=2 * ulp, atol=2 * ulp * looped.abs().max().item())


def test_rows_as_pairs_per_row_read_row_n_over_r(gen):
    """``rows=r``: pair ``n`` reads row ``n // r``, the same result as the explicit index
    tensor; r < 1 is refused."""
    x = torch.randn(6, 40, generator=gen).to(DEVICE)
    weight = torch.randn(4, 24, 40, generator=gen).to(DEVICE)
    experts = torch.randint(0, 4, (18,), generator=gen).to(DEVICE)
    explicit = grouped_expert_gemm(x, torch.arange(6, device=DEVICE).repeat_interleave(3), experts, weight)
    assert torch.equal(grouped_expert_gemm(x, 3, experts, weight), explicit)
    with pytest.raises(ValueError, match="pairs per row"):
        grouped_expert_gemm(x, 0, experts, weight)
