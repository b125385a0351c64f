"""The one-launch q/k/v product with norm, RoPE and cache write (``kernels.qkv_gemv``) against
the kernels it replaces: the norm GEMV, the q/k norms and ``rope_and_write_kv``."""

from __future__ import annotations

import pytest
import torch
from attention_helpers import rope_table
from gpu_helpers import DEVICE


@pytest.mark.parametrize("hq,hkv,dim,hidden,block_n,block_k", [(4, 2, 32, 96, 16, 64), (2, 2, 64, 200, 16, 128),
                                                                (8, 1, 16, 64, 16, 64), (4, 2, 32, 96, 4, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_residual,qk_norm", [(True, False), (False, False), (True, True)])
def test_qkv_rope_gemv_equals_the_kernels_it_replaces(hq, hkv, dim, hidden, block_n, block_k, dtype, with_residual,
                                                       qk_norm, gen):
    """Same q, same key and value rows at the slot (other rows untouched), same next residual as
    the norm GEMV, q/k ``rms_norm`` and ``rope_and_write_kv`` (bit for bit without q/k norms);
    twice with one workspace (tickets back to 0); one split and several, and whole rows (4 a
    program, 8 programs a head)."""
    from segkv.kernels.dense_gemv import norm_splitk_gemv, workspace_size
    from segkv.kernels.fused_ops import rms_norm, rope_and_write_kv
    from segkv.kernels.qkv_gemv import qkv_rope_gemv

    out_dim = (hq + 2 * hkv) * dim
    block_n = min(block_n, dim)
    w = (torch.randn(out_dim, hidden, generator=gen) / hidden**0.5).to(dtype).to(DEVICE)
    g = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    qn, kn = ((1 + 0.3 * torch.randn(dim, generator=gen)).to(dtype).to(DEVICE) for _ in range(2))
    table = rope_table(64, dim, dtype, DEVICE)
    floats, tickets = workspace_size(out_dim, hidden, block_n, block_k)
    workspace = (torch.full((floats,), float("nan"), device=DEVICE), torch.zeros(tickets, dtype=torch.int32,
                                                                                device=DEVICE))
    for _ in range(2):
        x = (2 * torch.randn(1, hidden, generator=gen)).to(dtype).to(DEVICE)
        residual = (2 * torch.randn(1, hidden, generator=gen)).to(dtype).to(DEVICE) if with_residual else None
        pos = torch.randint(0, 64, (1,), generator=gen).to(DEVICE)
        slot = torch.randint(0, 10, (1,), generator=gen).to(DEVICE)
        keys, values = (torch.full((10, hkv, dim), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2))
        ref_keys, ref_values = keys.clone(), values.clone()
        qkv, h_ref = norm_splitk_gemv(x, residual, g, 1e-5, w, block_n=block_n, block_k=block_k)
        q, k, v = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
        q, k, v = q.view(1, hq, dim), k.view(1, hkv, dim), v.view(1, hkv, dim)
        if qk_norm:
            q, k = rms_norm(q, qn, 1e-6)[0], rms_norm(k, kn, 1e-6)[0]
        q_ref = rope_and_write_kv(q, k, v, pos, table, slot, ref_keys, ref_values)
        q_out, h = qkv_rope_gemv(x, residual, g, 1e-5, w, num_heads=hq, num_kv_heads=hkv, positions=pos,
                                 cos_sin=table, slots=slot, key_rows=keys, value_rows=values,
                                 q_norm=qn if qk_norm else None, k_norm=kn if qk_norm else None, qk_eps=1e-6,
                                 block_n=block_n, block_k=block_k, workspace=workspace)
        assert q_out.shape == (1, hq, dim) and torch.isfinite(q_out).all()
        assert not workspace[1].any()
        assert torch.equal(h, h_ref) and (h is x) == (not with_residual)
        s = int(slot)
        assert torch.isfinite(keys[s]).all() and torch.isfinite(values[s]).all()
        others = torch.arange(10, device=DEVICE) != s
        assert keys[others].isnan().all() and values[others].isnan().all()
        # bf16: exact, but for the q/k norms' mean square (summed as two halves, not in rms_norm's
        # order); float32: the GPU may contract RoPE's products and sums into FMAs here (the
        # separate RoPE kernel is compiled without), one float32 rounding apart
        tol = 1e-6 if dtype == torch.float32 else 2.0**-7 if qk_norm else 0.0
        torch.testing.assert_close(q_out, q_ref, rtol=tol, atol=tol)
        torch.testing.assert_close(keys[s], ref_keys[s], rtol=tol, atol=tol)
        torch.testing.assert_close(values[s], ref_values[s], rtol=0, atol=0)


def test_qkv_rope_gemv_rejects_bad_shapes(gen):
    from segkv.kernels.qkv_gemv import qkv_rope_gemv

    dim, hq, hkv, hidden = 32, 4, 2, 64
    w = torch.randn((hq + 2 * hkv) * dim, hidden, generator=gen).to(DEVICE)
    x, g = torch.randn(1, hidden, generator=gen).to(DEVICE), torch.ones(hidden, device=DEVICE)
    table = rope_table(8, dim, torch.float32, DEVICE)
    keys = torch.zeros(4, hkv, dim, device=DEVICE)
    one = torch.zeros(1, dtype=torch.long, device=DEVICE)
    kw = dict(num_heads=hq, num_kv_heads=hkv, positions=one, cos_sin=table, slots=one, key_rows=keys,
              value_rows=keys.clone())
    with pytest.raises(ValueError, match="heads of"):
        qkv_rope_gemv(x, None, g, 1e-5, w[:-dim], **kw)
    with pytest.raises(ValueError, match="cache rows"):
        qkv_rope_gemv(x, None, g, 1e-5, w, **{**kw, "key_rows": keys[:, :1]})
    with pytest.raises(ValueError, match="norm weights"):
        qkv_rope_gemv(x, None, g, 1e-5, w, q_norm=torch.ones(dim, device=DEVICE), **kw)
    with pytest.raises(ValueError, match="one position"):
        qkv_rope_gemv(x, None, g, 1e-5, w, **{**kw, "slots": torch.zeros(2, dtype=torch.long, device=DEVICE)})
    with pytest.raises(ValueError, match="cos/sin"):
        qkv_rope_gemv(x, None, g, 1e-5, w, **{**kw, "cos_sin": table.half()})
