"""One token's expert MLP in one launch (``kernels.moe.expert_mlp``) against the two GEMV launches."""

from __future__ import annotations

import pytest
import torch

from gpu_helpers import DEVICE, GPU
from segkv.kernels.moe.expert_gemv import expert_gemv_with_shared
from segkv.kernels.moe.expert_mlp import counters_size, expert_mlp_one_token


def _weights(num_experts, hidden, inner, s_inner, dtype, gen):
    """Routed ``[gate | up] (E, 2I, H)`` and ``down (E, H, I)``, shared ``(2S, H)`` and ``(H, S)``."""
    def w(*shape):
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(dtype).to(DEVICE)
    return w(num_experts, 2 * inner, hidden), w(num_experts, hidden, inner), w(2 * s_inner, hidden), w(hidden, s_inner)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden,inner,s_inner,pairs", [(48, 20, 40, 3), (300, 44, 88, 1), (64, 8, 24, 6)]
                         + ([(2048, 1408, 2816, 6)] if GPU else []))
def test_one_launch_equals_the_two_launches(dtype, hidden, inner, s_inner, pairs, gen):
    """Routed pairs and shared experts in one launch give the gate/up launch with the activation
    followed by the plain down launch (to float32 summation order: one rounding apart at most;
    widths that do not fill a block, one and several pairs), with the activation buffers poisoned
    (a down item reading them early would give NaN); three launches back to back on the same
    counters, each on new experts, are all right and leave the counters zero."""
    gate_up, down, s_gate_up, s_down = _weights(7, hidden, inner, s_inner, dtype, gen)
    counters = torch.zeros(counters_size(pairs), dtype=torch.int32, device=DEVICE)
    xs = [torch.randn(1, hidden, generator=gen).to(dtype).to(DEVICE) for _ in range(3)]
    draws = [torch.randperm(7, generator=gen)[:pairs].to(DEVICE) for _ in range(3)]
    # back to back on the same counters (on a GPU with PDL each launch may start before the last ends)
    results = [expert_mlp_one_token(x, experts, gate_up, down, s_gate_up, s_down, counters, poison=True)
               for x, experts in zip(xs, draws)]
    assert torch.equal(counters.cpu(), torch.zeros_like(counters.cpu()))
    for x, experts, (routed, shared) in zip(xs, draws, results):
        act, s_act = expert_gemv_with_shared(x, pairs, experts, gate_up, x, s_gate_up, activation=True)
        ref, s_ref = expert_gemv_with_shared(act, 1, experts, down, s_act, s_down)
        assert routed.dtype == dtype and routed.shape == (pairs, hidden) and shared.shape == (1, hidden)
        _assert_same_sums(routed, ref)
        _assert_same_sums(shared, s_ref)
    # and against the float64 MLP: down[e] @ (silu(gate) * up)
    for n, e in enumerate(experts.tolist()):
        h = gate_up[e].double() @ x[0].double()
        exact = down[e].double() @ (torch.nn.functional.silu(h[:inner]) * h[inner:])
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(routed[n].double(), exact, rtol=tol, atol=tol * exact.abs().max().item())


def _assert_same_weights(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Router weights (float32) equal up to the logits' summation order: the block launch's
    programs have more warps than the norm-route launch's, so their cross-warp sums differ."""
    assert got.dtype == ref.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)


def _assert_same_sums(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to float32 summation order: within one rounding of the output dtype."""
    ulp = 2.0**-7 if got.dtype == torch.bfloat16 else 2.0**-20
    assert got.shape == ref.shape and torch.isfinite(got).all()
    ref = ref.double()
    assert ((got.double() - ref).abs() <= ulp * (ref.abs() + ref.abs().max()) + 1e-6).all()


def test_bad_input_is_refused_and_counters_untouched(gen):
    gate_up, down, s_gate_up, s_down = _weights(4, 32, 8, 16, torch.float32, gen)
    experts = torch.tensor([1, 3], device=DEVICE)
    counters = torch.zeros(counters_size(2), dtype=torch.int32, device=DEVICE)
    x = torch.randn(2, 32, generator=gen).to(DEVICE)
    with pytest.raises(ValueError, match="one contiguous row"):
        expert_mlp_one_token(x, experts, gate_up, down, s_gate_up, s_down, counters)
    with pytest.raises(ValueError, match="shapes do not match"):
        expert_mlp_one_token(x[:1], experts, gate_up, down[:, :16], s_gate_up, s_down, counters)
    with pytest.raises(ValueError, match="int32 counters"):
        expert_mlp_one_token(x[:1], experts, gate_up, down, s_gate_up, s_down, counters[:2])
    with pytest.raises(ValueError, match="dtype"):
        expert_mlp_one_token(x[:1], experts, gate_up.double(), down, s_gate_up, s_down, counters)
    assert not counters.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_layer_runs_one_token_in_one_expert_launch(dtype, gen, monkeypatch):
    """A packed, fused MoE layer with shared experts runs one token's experts in one launch, with
    the unfused layer's output (to float32 summation order and the combine's rounding); 2 tokens
    keep the two-launch path."""
    from segkv.kernels.moe import expert_mlp
    from segkv.layers.moe import MixtureOfExperts, RouterSpec

    moe = MixtureOfExperts(40, 24, RouterSpec(num_experts=6, top_k=3), num_shared=2).to(DEVICE)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        moe = moe.to(dtype)
        xs = [torch.randn(t, 40, generator=gen).to(dtype).to(DEVICE) for t in (1, 1, 2)]
        unfused = [moe(x) for x in xs]
        moe.pack_experts()
        for module in (moe, moe.gate, moe.shared_experts):
            module.use_fused()
        calls = []
        launch = expert_mlp.expert_mlp_one_token
        monkeypatch.setattr(expert_mlp, "expert_mlp_one_token", lambda *a, **kw: calls.append(1) or launch(*a, **kw))
        one = [moe(x) for x in xs]
    assert len(calls) == 2  # the one-token calls only
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20
    for got, ref in zip(one, unfused):
        assert got.dtype == dtype and torch.isfinite(got).all()
        torch.testing.assert_close(got, ref, rtol=4 * ulp, atol=4 * ulp * ref.abs().max().item())
    assert len(moe._counters) == 1 and not next(iter(moe._counters.values())).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden,experts_count,top_k", [(48, 6, 3), (96, 64, 6)])
def test_whole_block_in_one_launch_equals_route_then_experts(dtype, hidden, experts_count, top_k, gen):
    """``moe_block_one_token``: the router's programs and the expert items in one launch give the
    norm-route launch's sum, weights and ids exactly and the expert launch's outputs on them (to
    float32 summation order), with poisoned activations, twice on the same counters and tickets."""
    from segkv.kernels.moe.moe_ops import norm_route_topk
    from segkv.kernels.moe.expert_mlp import moe_block_one_token

    inner, s_inner = 20, 40
    gate_up, down, s_gate_up, s_down = _weights(experts_count, hidden, inner, s_inner, dtype, gen)
    router = (torch.randn(experts_count, hidden, generator=gen) / hidden**0.5).to(dtype).to(DEVICE)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    counters = torch.zeros(counters_size(top_k), dtype=torch.int32, device=DEVICE)
    tickets = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for _ in range(2):
        x, res = (torch.randn(1, hidden, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
        total, weights, ids, routed, shared = moe_block_one_token(
            x, res, norm_w, 1e-6, router, top_k, tickets, gate_up, down, s_gate_up, s_down, counters,
            scoring="softmax", norm_topk_prob=True, scaling=1.5, poison=True)
        assert not counters.any() and not tickets.any()
        h, ref_total, ref_weights, ref_ids = norm_route_topk(x, res, norm_w, 1e-6, router, top_k, tickets,
                                                             scoring="softmax", norm_topk_prob=True, scaling=1.5)
        assert torch.equal(total, ref_total) and torch.equal(ids, ref_ids)
        _assert_same_weights(weights, ref_weights)
        assert len(set(ids[0].tolist())) == top_k
        ref, s_ref = expert_mlp_one_token(h, ids[0], gate_up, down, s_gate_up, s_down, counters)
        _assert_same_sums(routed, ref)
        _assert_same_sums(shared, s_ref)


def test_whole_block_refuses_bad_input(gen):
    from segkv.kernels.moe.expert_mlp import moe_block_one_token

    gate_up, down, s_gate_up, s_down = _weights(6, 32, 8, 16, torch.float32, gen)
    router = torch.randn(6, 32, generator=gen).to(DEVICE)
    counters = torch.zeros(counters_size(2), dtype=torch.int32, device=DEVICE)
    tickets = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    x = torch.randn(2, 32, generator=gen).to(DEVICE)
    norm_w = torch.ones(32, device=DEVICE)
    with pytest.raises(ValueError, match="one contiguous row"):
        moe_block_one_token(x, x, norm_w, 1e-6, router, 2, tickets, gate_up, down, s_gate_up, s_down, counters)
    with pytest.raises(ValueError, match="moe_block_one_token"):
        moe_block_one_token(x[:1], x[:1], norm_w[:16], 1e-6, router, 2, tickets, gate_up, down, s_gate_up, s_down,
                            counters)
    with pytest.raises(ValueError, match="int32 counters"):
        moe_block_one_token(x[:1], x[:1], norm_w, 1e-6, router, 2, tickets, gate_up, down, s_gate_up, s_down,
                            counters[:3])
    assert not counters.any() and not tickets.any()


@pytest.mark.parametrize("defer", [False, True])
def test_moe_block_runs_one_token_in_one_launch(defer, gen, monkeypatch):
    """A fused block's second half (``forward_after_norm``) at one token is one launch (no
    norm-route launch, no expert launch), with the sum, the combined output (or its deferred
    parts) of the norm-route launch followed by the layer's experts; 2 tokens keep them apart."""
    from moe_helpers import random_moe_block
    from segkv.kernels.moe import expert_mlp, moe_ops
    from segkv.layers.norm import PendingCombine

    moe, norm = random_moe_block(gen, DEVICE, top_k=3, num_shared=2)
    with torch.no_grad():
        moe.pack_experts()
        for module in (moe, moe.gate, moe.shared_experts, norm):
            module.use_fused()
        rows = [[torch.randn(t, 40, generator=gen).to(torch.bfloat16).to(DEVICE) for _ in range(2)] for t in (1, 1, 2)]
        s = moe.gate.spec

        def route_then_experts(x, residual):
            h, total, weights, ids = moe_ops.norm_route_topk(
                x, residual, norm.weight, norm.eps, moe.gate.weight, s.top_k, moe.gate.tickets(x.device),
                scoring=s.scoring, norm_topk_prob=s.norm_topk_prob, scaling=s.routed_scaling_factor)
            return moe._experts(h, weights, ids, defer), total

        apart = [route_then_experts(x, r) for x, r in rows]
        calls = []
        for module, name in ((moe_ops, "norm_route_topk"), (expert_mlp, "moe_block_one_token")):
            original = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, _n=name, _f=original, **kw: calls.append(_n) or _f(*a, **kw))
        together = [moe.forward_after_norm(x, r, norm, defer_combine=defer) for x, r in rows]
    assert calls == ["moe_block_one_token", "moe_block_one_token", "norm_route_topk"]
    for (out, total), (ref_out, ref_total) in zip(together, apart):
        assert torch.equal(total, ref_total)
        if defer:
            assert isinstance(out, PendingCombine) and isinstance(ref_out, PendingCombine)
            _assert_same_weights(out.weights, ref_out.weights)
            out, ref_out = out.materialize(), ref_out.materialize()
        _assert_same_sums(out, ref_out)
