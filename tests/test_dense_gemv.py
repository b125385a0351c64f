"""The split-K batch-1 GEMV (``kernels.dense_gemv``) against the float64 product."""

from __future__ import annotations

import pytest
import torch

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


@pytest.mark.parametrize("out_dim,in_dim,block_n,block_k", [(100, 300, 32, 128), (64, 64, 16, 512), (70, 1030, 32, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_splitk_gemv_matches_the_product_and_leaves_its_tickets_zero(out_dim, in_dim, block_n, block_k, dtype, gen):
    """Output and input dims that do not fill a block, one split and several, twice with one
    workspace (the tickets are back to 0 after each launch)."""
    from segkv.kernels.dense_gemv import splitk_gemv

    w = (torch.randn(out_dim, in_dim, generator=gen) / in_dim**0.5).to(dtype).to(DEVICE)
    x = torch.randn(1, in_dim, generator=gen).to(dtype).to(DEVICE)
    split = -(-in_dim // block_k)
    workspace = (torch.empty(split * out_dim, device=DEVICE), torch.zeros(-(-out_dim // block_n), dtype=torch.int32,
                                                                          device=DEVICE))
    ref = (x.double() @ w.double().T)
    for _ in range(2):
        y = splitk_gemv(x, w, block_n=block_n, block_k=block_k, workspace=workspace)
        assert y.shape == (1, out_dim) and y.dtype == dtype and torch.isfinite(y).all()
        assert not workspace[1].any()
        tol = 2.0**-7 if dtype == torch.bfloat16 else 1e-5  # one bf16 rounding of the float32 sum
        torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="splitk_gemv"):
        splitk_gemv(x[:, :-1], w)


@pytest.mark.parametrize("on", [False, True])
def test_row_product_uses_the_gemv_only_for_one_cuda_row_without_bias(on, gen, monkeypatch):
    """``layers.linear.RowProduct``: with ``SEGKV_BATCH1_GEMV`` on, one row on CUDA takes the
    split-K GEMV (reusing its workspace); a bias, more rows, the CPU or the switch off take
    ``F.linear``. Every path gives the product."""
    from segkv.kernels import dense_gemv
    from segkv.layers import linear

    monkeypatch.setattr(linear, "BATCH1_GEMV", on)
    calls = []
    original = dense_gemv.splitk_gemv
    monkeypatch.setattr(dense_gemv, "splitk_gemv", lambda *a, **kw: calls.append(kw["workspace"]) or original(*a, **kw))
    product = linear.RowProduct()
    w = (torch.randn(96, 600, generator=gen) / 600**0.5).to(torch.bfloat16).to(DEVICE)
    bias = torch.randn(96, generator=gen).to(torch.bfloat16).to(DEVICE)
    for x, b in ((torch.randn(1, 600, generator=gen), None), (torch.randn(1, 600, generator=gen), None),
                 (torch.randn(3, 600, generator=gen), None), (torch.randn(1, 600, generator=gen), bias)):
        x = x.to(torch.bfloat16).to(DEVICE)
        y = product(x, w, b)
        ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        torch.testing.assert_close(y.double(), ref, rtol=2.0**-7, atol=2.0**-7)
    expected = 2 if (on and GPU) else 0
    assert len(calls) == expected and all(ws is calls[0] for ws in calls)
