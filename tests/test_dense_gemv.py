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
