"""Per-head one-row products (``kernels.gemv.head_gemv``) against the float64 product, and the latent
attention model that takes them at one token."""

from __future__ import annotations

import pytest
import torch

from gpu_helpers import DEVICE


@pytest.mark.parametrize("heads,out_dim,in_dim", [(4, 64, 32), (3, 40, 24), (2, 16, 100)])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_gemv_is_each_heads_product(heads, out_dim, in_dim, transposed, dtype, gen):
    """Weights laid out (H, Out, In) or read through a transposed (H, In, Out) view (as W_uk is),
    output blocks and inputs that do not fill a power of two, a new output and one written into
    a strided view of a larger buffer (the other columns untouched)."""
    from segkv.kernels.gemv.head_gemv import head_gemv

    stored = torch.randn(heads, in_dim, out_dim) if transposed else torch.randn(heads, out_dim, in_dim)
    stored = (stored / in_dim**0.5).to(dtype).to(DEVICE)
    weight = stored.transpose(1, 2) if transposed else stored
    x = torch.randn(heads, in_dim, generator=gen).to(dtype).to(DEVICE)
    ref = torch.einsum("hoi,hi->ho", weight.double(), x.double())
    tol = 2.0**-7 if dtype == torch.bfloat16 else 1e-5  # one rounding of the float32 sum
    y = head_gemv(x, weight)
    assert y.shape == (heads, out_dim) and y.dtype == dtype and torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)
    buffer = torch.full((1, heads, out_dim + 8), float("nan"), dtype=dtype, device=DEVICE)
    head_gemv(x, weight, out=buffer[0, :, :out_dim])
    torch.testing.assert_close(buffer[0, :, :out_dim], y, rtol=0, atol=0)
    assert buffer[0, :, out_dim:].isnan().all()


def test_head_gemv_rejects_what_it_cannot_compute(gen):
    from segkv.kernels.gemv.head_gemv import head_gemv

    x, w = torch.randn(2, 8, device=DEVICE), torch.randn(2, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="head_gemv"):
        head_gemv(x[:, :7], w)
    with pytest.raises(ValueError, match="unit stride"):
        head_gemv(torch.randn(8, 2, device=DEVICE).T, w)
    with pytest.raises(ValueError, match="weight of"):
        head_gemv(x, w.double())
    with pytest.raises(ValueError, match="out"):
        head_gemv(x, w, out=torch.empty(4, 2, device=DEVICE).T)
    with pytest.raises(ValueError, match="at most"):
        head_gemv(torch.randn(1, 2048, device=DEVICE), torch.randn(1, 4, 2048, device=DEVICE))


def test_mla_model_with_per_head_latent_products_gives_the_plain_logits(tmp_path, monkeypatch):
    """A DeepSeek model fed one token at a time takes both absorbed products through
    ``head_gemv`` (on the CPU too, for this test), the query's latent columns written in place
    after the x launch with RoPE, and gives the unfused model's logits and greedy tokens."""
    from one_row_helpers import (
        GRAPHS,
        counted,
        gemvs_on_the_cpu_too,
        llm,
        same_greedy_tokens,
        same_logits_one_token_at_a_time,
        small_deepseek_dir,
    )

    from segkv.layers import mla

    small_deepseek_dir(tmp_path, num_hidden_layers=2)  # a dense layer, then experts
    plain = llm(tmp_path, fused_ops=False, cuda_graphs=False)
    monkeypatch.setattr(mla, "one_token_on_cuda", lambda rows: rows.shape[0] == 1)
    gemvs_on_the_cpu_too(monkeypatch)
    calls = counted(monkeypatch, heads=(mla, "head_gemv"))
    fused = llm(tmp_path, fused_ops=True, cuda_graphs=GRAPHS)
    layers = fused.runner.model.cfg.num_layers
    tokens = same_logits_one_token_at_a_time(plain, fused)
    assert calls == {"heads": 2 * tokens * layers}  # two products per layer and token
    same_greedy_tokens(plain, fused)
