"""The MLA x product with RoPE and the latent write in its launch (``kernels.gemv.mla_x_gemv``)
against the kernels it replaces: the norm (or combine-norm) GEMV and ``mla_rope_and_write_latent``."""

from __future__ import annotations

import pytest
import torch
from attention_helpers import rope_table
from gpu_helpers import DEVICE


@pytest.mark.parametrize("heads,nope,rope,rank,hidden,block_k", [(4, 16, 16, 32, 96, 64), (2, 32, 32, 64, 200, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("source", ["row", "first row", "combine"])
@pytest.mark.parametrize("interleaved", [True, False])
def test_mla_x_rope_gemv_equals_the_kernels_it_replaces(heads, nope, rope, rank, hidden, block_k, dtype, source,
                                                        interleaved, gen):
    """Same no-RoPE query part, same rotated RoPE part in the query buffer, same latent row at
    the slot (other rows untouched), same next residual; twice with one workspace (tickets back
    to 0). Sources: a row plus a residual, the first layer's row alone, a MoE layer's combine."""
    from segkv.kernels.gemv.dense_gemv import combine_norm_splitk_gemv, norm_splitk_gemv, workspace_size
    from segkv.kernels.fused.fused_ops import mla_rope_and_write_latent
    from segkv.kernels.gemv.mla_x_gemv import mla_x_rope_gemv

    out_dim = heads * (nope + rope) + rank + rope
    block_n = 16
    w = (torch.randn(out_dim, hidden, generator=gen) / hidden**0.5).to(dtype).to(DEVICE)
    g = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    kv_w = (1 + 0.3 * torch.randn(rank, generator=gen)).to(dtype).to(DEVICE)
    table = rope_table(64, rope, dtype, DEVICE)
    floats, tickets = workspace_size(out_dim, hidden, block_n, block_k)
    workspace = (torch.full((floats,), float("nan"), device=DEVICE),
                 torch.zeros(tickets, dtype=torch.int32, device=DEVICE))
    launch = dict(block_n=block_n, block_k=block_k)
    for _ in range(2):
        residual = None if source == "first row" else (2 * torch.randn(1, hidden, generator=gen)).to(dtype).to(DEVICE)
        combine = {}
        if source == "combine":
            x = (2 * torch.randn(3, hidden, generator=gen)).to(dtype).to(DEVICE)
            combine = dict(expert_weights=torch.rand(1, 3, generator=gen).to(DEVICE),
                           shared=(2 * torch.randn(1, hidden, generator=gen)).to(dtype).to(DEVICE))
            product, h_ref = combine_norm_splitk_gemv(x, combine["expert_weights"], combine["shared"], residual, g,
                                                      1e-5, w, **launch)
        else:
            x = (2 * torch.randn(1, hidden, generator=gen)).to(dtype).to(DEVICE)
            product, h_ref = norm_splitk_gemv(x, residual, g, 1e-5, w, **launch)
        pos = torch.randint(0, 64, (1,), generator=gen).to(DEVICE)
        slot = torch.randint(0, 10, (1,), generator=gen).to(DEVICE)
        rows = torch.full((10, rank + rope), float("nan"), dtype=dtype, device=DEVICE)
        ref_rows = rows.clone()
        q, latent = product.split([heads * (nope + rope), rank + rope], -1)
        q = q.view(1, heads, nope + rope)
        ref_query = torch.zeros(1, heads, rank + rope, dtype=dtype, device=DEVICE)
        mla_rope_and_write_latent(q[..., nope:], latent[:, rank:], latent[:, :rank], pos, table, slot, ref_rows,
                                  interleaved=interleaved, norm=(kv_w, 1e-6), out=ref_query[..., rank:])
        query = torch.zeros(1, heads, rank + rope, dtype=dtype, device=DEVICE)
        q_nope, h = mla_x_rope_gemv(x, residual, g, 1e-5, w, num_heads=heads, nope_dim=nope, kv_norm=(kv_w, 1e-6),
                                    positions=pos, cos_sin=table, slots=slot, latent_rows=rows,
                                    q_rope_out=query[..., rank:], interleaved=interleaved, workspace=workspace,
                                    **combine, **launch)
        assert q_nope.shape == (1, heads, nope) and not workspace[1].any()
        assert torch.equal(h, h_ref) and (h is x) == (source == "first row")
        s = int(slot)
        assert torch.isfinite(rows[s]).all()
        others = torch.arange(10, device=DEVICE) != s
        assert rows[others].isnan().all()
        # bf16 bit for bit; float32: the GPU may contract RoPE's products into FMAs here
        tol = 1e-6 if dtype == torch.float32 else 0.0
        torch.testing.assert_close(q_nope, q[..., :nope], rtol=0, atol=0)
        torch.testing.assert_close(query, ref_query, rtol=tol, atol=tol)
        torch.testing.assert_close(rows[s], ref_rows[s], rtol=tol, atol=tol)


def test_mla_x_rope_gemv_rejects_bad_shapes(gen):
    from segkv.kernels.gemv.mla_x_gemv import mla_x_rope_gemv

    heads, nope, rope, rank, hidden = 2, 16, 16, 32, 64
    w = torch.randn(heads * (nope + rope) + rank + rope, hidden, generator=gen).to(DEVICE)
    x, g = torch.randn(1, hidden, generator=gen).to(DEVICE), torch.ones(hidden, device=DEVICE)
    one = torch.zeros(1, dtype=torch.long, device=DEVICE)
    query = torch.zeros(1, heads, rank + rope, device=DEVICE)
    kw = dict(num_heads=heads, nope_dim=nope, kv_norm=(torch.ones(rank, device=DEVICE), 1e-6), positions=one,
              cos_sin=rope_table(8, rope, torch.float32, DEVICE), slots=one,
              latent_rows=torch.zeros(4, rank + rope, device=DEVICE),
              q_rope_out=query[..., rank:], interleaved=True, block_n=16)
    with pytest.raises(ValueError, match="heads of"):
        mla_x_rope_gemv(x, None, g, 1e-5, w[:-16], **kw)
    with pytest.raises(ValueError, match="kv norm"):
        mla_x_rope_gemv(x, None, g, 1e-5, w, **{**kw, "kv_norm": (torch.ones(rank - 1, device=DEVICE), 1e-6)})
    with pytest.raises(ValueError, match="q rope output"):
        mla_x_rope_gemv(x, None, g, 1e-5, w, **{**kw, "q_rope_out": query[..., rank + 1:]})
    with pytest.raises(ValueError, match="one position"):
        mla_x_rope_gemv(x, None, g, 1e-5, w, **{**kw, "slots": torch.zeros(2, dtype=torch.long, device=DEVICE)})
