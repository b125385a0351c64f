"""A pre-norm gated MLP of one row in one launch (``kernels.gated_mlp``) against the two split-K launches."""

from __future__ import annotations

import pytest
import torch

from segkv.kernels.dense_gemv import gated_splitk_gemv, norm_splitk_gemv
from segkv.kernels.gated_mlp import counters_size, fits, gated_mlp_one_row

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def _assert_same_sums(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to float32 summation order: within one rounding of the dtype."""
    ulp = 2.0**-7 if got.dtype == torch.bfloat16 else 2.0**-20
    assert got.shape == ref.shape and torch.isfinite(got).all()
    ref = ref.double()
    assert ((got.double() - ref).abs() <= ulp * (ref.abs() + ref.abs().max()) + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden,inner,block_n,block_k,with_residual",
                         [(96, 64, 16, 32, True), (100, 128, 8, 64, False), (40, 32, 16, 16, True)]
                         + ([(4096, 14336, 16, 512, True)] if GPU else []))
def test_one_launch_equals_the_two_launches(dtype, hidden, inner, block_n, block_k, with_residual, gen):
    """The down product and the residual sum of the two launches (to float32 summation order),
    with hidden sizes that do not fill a block; three launches back to back on the same
    counters and workspaces, each leaving the counters and tickets zero."""
    gate_up = (torch.randn(2 * inner, hidden, generator=gen) / hidden**0.5).to(dtype).to(DEVICE)
    down = (torch.randn(hidden, inner, generator=gen) / inner**0.5).to(dtype).to(DEVICE)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    counters = torch.zeros(counters_size(inner, block_k), dtype=torch.int32, device=DEVICE)
    assert fits(hidden, inner, block_n, block_k)
    launch = dict(block_n=block_n, block_k=block_k)
    results, rows = [], []
    for _ in range(3):
        x = torch.randn(1, hidden, generator=gen).to(dtype).to(DEVICE)
        res = torch.randn(1, hidden, generator=gen).to(dtype).to(DEVICE) if with_residual else None
        rows.append((x, res))
        results.append(gated_mlp_one_row(x, res, norm_w, 1e-6, gate_up, down, counters, **launch))
    assert not counters.any()
    for (x, res), (out, total) in zip(rows, results):
        h, ref_total = norm_splitk_gemv(x, res, norm_w, 1e-6, gate_up, **launch)
        ref = gated_splitk_gemv(h, down, **launch)
        assert out.dtype == dtype and out.shape == (1, hidden)
        _assert_same_sums(out, ref)
        assert torch.equal(total, ref_total)
        # and against the float64 MLP of the rounded sum
        s = total[0].double()
        gu = gate_up.double() @ (norm_w.double() * s / torch.sqrt((s * s).mean() + 1e-6))
        exact = down.double() @ (torch.nn.functional.silu(gu[:inner]) * gu[inner:])
        tol = 1e-4 if dtype == torch.float32 else 6e-2
        torch.testing.assert_close(out[0].double(), exact, rtol=tol, atol=tol * exact.abs().max().item())


def test_bad_shapes_are_refused(gen):
    gate_up = torch.randn(64, 40, generator=gen).to(DEVICE)
    down = torch.randn(40, 32, generator=gen).to(DEVICE)
    x = torch.randn(1, 40, generator=gen).to(DEVICE)
    norm_w = torch.ones(40, device=DEVICE)
    counters = torch.zeros(counters_size(32, 16), dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="do not make an MLP"):
        gated_mlp_one_row(x, None, norm_w, 1e-6, gate_up[:60], down, counters, block_n=16, block_k=16)
    with pytest.raises(ValueError, match="whole blocks"):
        gated_mlp_one_row(x, None, norm_w, 1e-6, gate_up, down, counters, block_n=16, block_k=64)
    with pytest.raises(ValueError, match="int32 counters"):
        gated_mlp_one_row(x, None, norm_w, 1e-6, gate_up, down, counters[:2], block_n=16, block_k=16)
    assert not counters.any()


@pytest.mark.parametrize("inner", [256, 96])
def test_row_product_runs_the_mlp_in_one_launch_where_it_fits(inner, gen, monkeypatch):
    """``RowProduct.mlp_after_norm`` with ``SEGKV_BATCH1_MLP_ONE_LAUNCH``: one launch where both
    products take the same blocks in whole slices (inner 256), the two launches otherwise (96);
    the same results as with the switch off."""
    from segkv.kernels import gated_mlp
    from segkv.layers import linear
    from segkv.layers.linear import RowProduct

    hidden, dtype = 64, torch.bfloat16
    gate_up = (torch.randn(2 * inner, hidden, generator=gen) / hidden**0.5).to(dtype).to(DEVICE)
    down = (torch.randn(hidden, inner, generator=gen) / inner**0.5).to(dtype).to(DEVICE)
    norm_w = torch.ones(hidden, dtype=dtype, device=DEVICE)
    x, res = (torch.randn(1, hidden, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    rows = RowProduct(fused_decoder=True)
    apart = rows.mlp_after_norm(x, res, norm_w, 1e-6, gate_up, down)
    calls = []
    launch = gated_mlp.gated_mlp_one_row
    monkeypatch.setattr(gated_mlp, "gated_mlp_one_row", lambda *a, **kw: calls.append(1) or launch(*a, **kw))
    monkeypatch.setattr(linear, "BATCH1_MLP_ONE_LAUNCH", True)
    together = rows.mlp_after_norm(x, res, norm_w, 1e-6, gate_up, down)
    assert len(calls) == (1 if inner == 256 else 0)
    assert torch.equal(together[1], apart[1])
    _assert_same_sums(together[0], apart[0])
