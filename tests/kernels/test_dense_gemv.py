"""The split-K batch-1 GEMV (``kernels.gemv.dense_gemv``) against the float64 product."""

from __future__ import annotations

import pytest
import torch

from gpu_helpers import DEVICE, GPU


@pytest.mark.parametrize("out_dim,in_dim,block_n,block_k", [(100, 300, 32, 128), (64, 64, 16, 512), (70, 1030, 32, 256),
                                                              (70, 300, 4, 512)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_splitk_gemv_matches_the_product_and_leaves_its_tickets_zero(out_dim, in_dim, block_n, block_k, dtype, gen):
    """Output and input dims that do not fill a block, one split and several, twice with one
    workspace (the tickets are back to 0 after each launch)."""
    from segkv.kernels.gemv.dense_gemv import splitk_gemv

    w = (torch.randn(out_dim, in_dim, generator=gen) / in_dim**0.5).to(dtype).to(DEVICE)
    x = torch.randn(1, in_dim, generator=gen).to(dtype).to(DEVICE)
    workspace = _workspace(out_dim, in_dim, block_n, block_k)
    ref = (x.double() @ w.double().T)
    for evict_first in (False, True):
        y = splitk_gemv(x, w, block_n=block_n, block_k=block_k, workspace=workspace, evict_first=evict_first)
        assert y.shape == (1, out_dim) and y.dtype == dtype and torch.isfinite(y).all()
        assert not workspace[1].any()
        tol = 2.0**-7 if dtype == torch.bfloat16 else 1e-5  # one bf16 rounding of the float32 sum
        torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="splitk_gemv"):
        splitk_gemv(x[:, :-1], w)
    with pytest.raises(ValueError, match="workspace"):
        splitk_gemv(x, w, block_n=block_n, block_k=block_k, workspace=(workspace[0][:1], workspace[1]))


def _workspace(out_dim, in_dim, block_n, block_k):
    from segkv.kernels.gemv.dense_gemv import workspace_size

    floats, tickets = workspace_size(out_dim, in_dim, block_n, block_k)
    return (torch.full((floats,), float("nan"), device=DEVICE), torch.zeros(tickets, dtype=torch.int32, device=DEVICE))


def _bf16_tol(dtype):
    return 2.0**-7 if dtype == torch.bfloat16 else 1e-5  # one rounding of the float32 sum


@pytest.mark.parametrize("out_dim,inner,block_n,block_k", [(100, 300, 32, 128), (48, 1000, 16, 256), (40, 64, 16, 128),
                                                            (42, 300, 4, 512)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_gemv_is_the_down_product_of_silu_and_mul(out_dim, inner, block_n, block_k, dtype, gen):
    """``gated_splitk_gemv([gate | up], W) = W @ silu_and_mul([gate | up])``: the activation rounded
    as the separate kernel rounds it; one split and several, with and without the eviction hint."""
    from segkv.kernels.gemv.dense_gemv import gated_splitk_gemv
    from segkv.kernels.fused.fused_ops import silu_and_mul

    w = (torch.randn(out_dim, inner, generator=gen) / inner**0.5).to(dtype).to(DEVICE)
    gate_up = (2 * torch.randn(1, 2 * inner, generator=gen)).to(dtype).to(DEVICE)
    ref = silu_and_mul(gate_up).double() @ w.double().T
    workspace = _workspace(out_dim, inner, block_n, block_k)
    for evict_first in (False, True):
        y = gated_splitk_gemv(gate_up, w, block_n=block_n, block_k=block_k, workspace=workspace,
                              evict_first=evict_first)
        assert y.shape == (1, out_dim) and y.dtype == dtype and torch.isfinite(y).all()
        assert not workspace[1].any()
        torch.testing.assert_close(y.double(), ref, rtol=_bf16_tol(dtype), atol=_bf16_tol(dtype))
    with pytest.raises(ValueError, match="gated_splitk_gemv"):
        gated_splitk_gemv(gate_up[:, :inner], w)  # the gate half alone


@pytest.mark.parametrize("out_dim,in_dim,block_n,block_k", [(100, 300, 32, 128), (64, 96, 16, 128), (70, 1030, 32, 256),
                                                              (70, 300, 4, 512)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_gemv_is_the_product_of_the_normed_residual_sum(out_dim, in_dim, block_n, block_k, dtype, with_residual,
                                                             gen):
    """``norm_splitk_gemv``: ``h = x + residual`` exactly as the dtype's add rounds it (returned,
    the next residual; ``x`` itself without one) and ``W @ (g * h / rms(h))`` within one rounding of
    the float64 product; the sum of squares spans every split of the row."""
    from segkv.kernels.gemv.dense_gemv import norm_splitk_gemv

    eps = 1e-5
    w = (torch.randn(out_dim, in_dim, generator=gen) / in_dim**0.5).to(dtype).to(DEVICE)
    x = (3 * torch.randn(1, in_dim, generator=gen)).to(dtype).to(DEVICE)
    residual = (3 * torch.randn(1, in_dim, generator=gen)).to(dtype).to(DEVICE) if with_residual else None
    g = (1 + 0.5 * torch.randn(in_dim, generator=gen)).to(dtype).to(DEVICE)
    h_ref = x + residual if with_residual else x
    h64 = h_ref.double()
    ref = (g.double() * h64 / torch.sqrt(h64.square().mean() + eps)) @ w.double().T
    workspace = _workspace(out_dim, in_dim, block_n, block_k)
    for evict_first in (False, True):
        y, h = norm_splitk_gemv(x, residual, g, eps, w, block_n=block_n, block_k=block_k, workspace=workspace,
                                evict_first=evict_first)
        assert y.shape == (1, out_dim) and y.dtype == dtype and torch.isfinite(y).all()
        assert not workspace[1].any()
        assert torch.equal(h, h_ref) and (h is x) == (not with_residual)
        torch.testing.assert_close(y.double(), ref, rtol=_bf16_tol(dtype), atol=_bf16_tol(dtype))
    with pytest.raises(ValueError, match="norm weight"):
        norm_splitk_gemv(x, residual, g[:-1], eps, w)
    with pytest.raises(ValueError, match="residual"):
        norm_splitk_gemv(x, x[:, :-1], g, eps, w)


def test_row_product_uses_the_gemv_only_for_one_cuda_row_without_bias(gen, monkeypatch):
    """``layers.linear.RowProduct``: one row on CUDA takes the split-K GEMV (reusing its
    workspace); a bias, more rows or the CPU take ``F.linear``. Every path gives the product."""
    from segkv.kernels.gemv import dense_gemv
    from segkv.layers import linear

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
    expected = 2 if GPU else 0
    assert len(calls) == expected and all(ws is calls[0] for ws in calls)


@pytest.mark.parametrize("out_dim,in_dim,block_n,block_k", [(100, 300, 32, 128), (64, 96, 16, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_shared", [True, False])
def test_combine_norm_gemv_forms_the_experts_output_in_the_product(out_dim, in_dim, block_n, block_k, dtype,
                                                                     with_shared, gen):
    """``combine_norm_splitk_gemv``: one token's expert outputs combined as ``combine_experts``
    combines them, the residual added (returned: the next residual) and the product of the normed
    sum, within one rounding of float64; bad shapes are clear errors."""
    from segkv.kernels.gemv.dense_gemv import combine_norm_splitk_gemv
    from segkv.kernels.moe.moe_ops import combine_experts

    k, eps = 6, 1e-6
    w = (torch.randn(out_dim, in_dim, generator=gen) / in_dim**0.5).to(dtype).to(DEVICE)
    parts = (2 * torch.randn(k, in_dim, generator=gen)).to(dtype).to(DEVICE)
    expert_weights = torch.rand(1, k, generator=gen).to(DEVICE)
    shared = (2 * torch.randn(1, in_dim, generator=gen)).to(dtype).to(DEVICE) if with_shared else None
    residual = (2 * torch.randn(1, in_dim, generator=gen)).to(dtype).to(DEVICE)
    g = (1 + 0.3 * torch.randn(in_dim, generator=gen)).to(dtype).to(DEVICE)
    h_ref = combine_experts(parts, expert_weights, shared) + residual
    h64 = h_ref.double()
    ref = (g.double() * h64 / torch.sqrt(h64.square().mean() + eps)) @ w.double().T
    workspace = _workspace(out_dim, in_dim, block_n, block_k)
    for _ in range(2):
        y, h = combine_norm_splitk_gemv(parts, expert_weights, shared, residual, g, eps, w, block_n=block_n,
                                        block_k=block_k, workspace=workspace)
        assert y.shape == (1, out_dim) and y.dtype == dtype and torch.isfinite(y).all()
        assert not workspace[1].any()
        # the GPU may contract the combine's products into FMAs: within one rounding of h's dtype
        torch.testing.assert_close(h, h_ref, rtol=_bf16_tol(dtype), atol=_bf16_tol(dtype))
        torch.testing.assert_close(y.double(), ref, rtol=2 * _bf16_tol(dtype), atol=2 * _bf16_tol(dtype))
    with pytest.raises(ValueError, match="combine_norm_splitk_gemv"):
        combine_norm_splitk_gemv(parts[:-1], expert_weights, shared, residual, g, eps, w)
    with pytest.raises(ValueError, match="one token"):
        combine_norm_splitk_gemv(parts.repeat(2, 1), expert_weights.repeat(2, 1), None, residual.repeat(2, 1), g, eps,
                                 w)


@pytest.mark.parametrize("family", ["llama3.1", "qwen3"])
def test_decoder_with_the_norm_and_activation_in_its_gemvs_gives_the_unfused_logits(family, tmp_path, monkeypatch):
    """A grouped-query model fed one row at a time runs each layer as the q/k/v GEMV with the
    residual add and norm inside, the o GEMV, the gate/up GEMV with the second norm inside and
    the down GEMV with SiLU-and-mul inside (on the CPU too, for this test) and gives the unfused
    model's logits and greedy tokens. The RoPE-and-write kernel applies the q/k norms."""
    from model_helpers import build_model_dir
    from one_row_helpers import (
        counted,
        gemvs_on_the_cpu_too,
        llm,
        same_greedy_tokens,
        same_logits_one_token_at_a_time,
    )

    from segkv.kernels.gemv import dense_gemv
    from segkv.models import decoder

    build_model_dir(tmp_path, family)
    plain = llm(tmp_path, fused_ops=False)
    gemvs_on_the_cpu_too(monkeypatch)
    calls = counted(monkeypatch, norm=(dense_gemv, "norm_splitk_gemv"), gated=(dense_gemv, "gated_splitk_gemv"),
                     plain=(dense_gemv, "splitk_gemv"))
    normed_in_rope, rope_and_write = [], decoder.rope_and_write_kv
    monkeypatch.setattr(decoder, "rope_and_write_kv",
                        lambda *a, **k: normed_in_rope.append("q_norm" in k) or rope_and_write(*a, **k))
    fused = llm(tmp_path, fused_ops=True)
    layers = fused.runner.model.cfg.num_layers
    tokens = same_logits_one_token_at_a_time(plain, fused)
    assert calls == {"norm": 2 * tokens * layers, "gated": tokens * layers, "plain": tokens * layers}
    same_greedy_tokens(plain, fused)
    assert calls["gated"] > tokens * layers  # decode steps of one sequence took the fused GEMVs
    # Qwen3's q/k norms in the RoPE-and-write launch wherever that launch runs
    assert normed_in_rope and all(normed_in_rope) if family == "qwen3" else not any(normed_in_rope)


def test_mla_model_with_the_norm_and_rope_in_its_x_gemv_gives_the_unfused_logits(tmp_path, monkeypatch):
    """A DeepSeek model (a dense layer, then routed + shared experts) fed one token at a time
    forms the previous MoE layer's combine, the residual add and the norm inside the x product's
    launch (the dense layer's plain row too), which also rotates the query and writes the latent
    cache row, and gives the unfused model's logits and greedy tokens (on the CPU too, for this
    test)."""
    from one_row_helpers import (
        GRAPHS,
        counted,
        gemvs_on_the_cpu_too,
        llm,
        same_greedy_tokens,
        same_logits_one_token_at_a_time,
        small_deepseek_dir,
    )

    from segkv.kernels.gemv import dense_gemv, mla_x_gemv

    small_deepseek_dir(tmp_path, num_hidden_layers=3)  # layer 2 takes the combine
    plain = llm(tmp_path, fused_ops=False, cuda_graphs=False)
    gemvs_on_the_cpu_too(monkeypatch)
    calls = counted(monkeypatch, combine=(dense_gemv, "combine_norm_splitk_gemv"),
                     norm=(dense_gemv, "norm_splitk_gemv"), rope=(mla_x_gemv, "mla_x_rope_gemv"))
    fused = llm(tmp_path, fused_ops=True, cuda_graphs=GRAPHS)
    layers = fused.runner.model.cfg.num_layers
    tokens = same_logits_one_token_at_a_time(plain, fused)
    # per token: every layer's x product with RoPE, plus the dense layer's gate/up norm GEMV
    assert calls == {"combine": 0, "norm": tokens, "rope": tokens * layers}
    same_greedy_tokens(plain, fused)


def test_one_row_launches_take_whole_rows_up_to_4096_inputs():
    """``launch_for``: products of at most ``WHOLE_ROW_MAX_INPUTS`` inputs take ``WHOLE_ROWS`` whole
    weight rows a program (one split: no partial sums, no tickets) where the launch allows it;
    wider ones, and launches whose partials meet per head, keep split-K blocks. ``RowProduct``
    gives a launch whose partials meet per head (the MLA x launch) split-K blocks whole per head,
    the plain, norm and gated products whole rows."""
    from segkv.layers import linear
    from segkv.layers.linear import RowProduct, launch_for

    assert (linear.WHOLE_ROW_MAX_INPUTS, linear.WHOLE_ROWS) == (4096, 4)
    assert launch_for(4096, whole_rows=True) == (4, 4096) and launch_for(3000, whole_rows=True) == (4, 4096)
    assert launch_for(2048, whole_rows=True) == (4, 2048)
    assert launch_for(14336, whole_rows=True) == (16, 512) and launch_for(4096) == (16, 512)
    assert launch_for(2048) == (32, 256)
    rows = RowProduct()
    w = torch.zeros(6144, 4096)
    whole = rows._launch(w)
    assert (whole["block_n"], whole["block_k"]) == (4, 4096)
    assert whole["workspace"][0].numel() == 6144 + 6144 // 4  # one split: the outputs' partials, no more
    per_head = rows._launch(w, whole=(128,))
    assert (per_head["block_n"], per_head["block_k"]) == (16, 512)
    down = rows._launch(torch.zeros(4096, 14336))
    assert (down["block_n"], down["block_k"]) == (16, 512)


def test_float32_logits_are_the_head_product_in_float32():
    """The output head's float32 logits: ``F.linear`` then ``.float()``."""
    from segkv.layers import linear

    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 256, generator=gen).to(DEVICE, torch.bfloat16)
    weight = (0.05 * torch.randn(1000, 256, generator=gen)).to(DEVICE, torch.bfloat16)
    logits = linear.float32_logits(hidden, weight)
    assert logits.dtype == torch.float32 and logits.shape == (3, 1000) and torch.isfinite(logits).all()
    assert torch.equal(logits, torch.nn.functional.linear(hidden, weight).float())
