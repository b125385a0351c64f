"""The row argmax kernel against ``torch.argmax``: first of equal maxima, NaN wins, any width."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_helpers import DEVICE, GPU
from segkv.kernels.fused.sampling_ops import row_argmax


@pytest.mark.parametrize("vocab", [1, 7, 4096, 5000, 128256 if GPU else 12289])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_argmax_matches_torch(vocab, dtype, gen):
    rows = torch.randn(6, vocab, generator=gen) * 4
    rows[1] = torch.round(rows[1])  # many equal values: the first of the maxima
    rows[2, vocab // 2:] = rows[2].max() + 1  # a tie spanning chunks: the first one
    rows[3] = -math.inf  # all -inf: index 0
    rows[4, -1] = math.inf  # the last entry
    if vocab > 3:
        rows[5, 3] = math.nan  # a NaN wins over +inf elsewhere
        rows[5, 0] = math.inf
    x = rows.to(dtype).to(DEVICE)
    got = row_argmax(x)
    assert got.dtype == torch.int64 and got.shape == (6,)
    assert torch.equal(got, x.argmax(dim=-1))


def test_row_argmax_of_a_strided_view_and_bad_input(gen):
    x = torch.randn(4, 9000, generator=gen).to(DEVICE)
    view = x[::2, 100:]  # row stride 18000, unit last stride
    assert torch.equal(row_argmax(view), view.argmax(dim=-1))
    x[0, 8000] = math.nan
    x[0, 8500] = math.nan
    assert row_argmax(x)[0].item() == 8000
    for bad in (x[0], x.t(), x.to(torch.int32), x[:, :0]):
        with pytest.raises(ValueError, match="row_argmax"):
            row_argmax(bad)
    assert row_argmax(x[:0]).shape == (0,)
