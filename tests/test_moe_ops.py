"""The MoE router and combine kernels against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch

from segkv.kernels.moe_ops import combine_experts, route_topk

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def torch_route(logits: torch.Tensor, k: int, scoring: str, norm: bool, scaling: float):
    """The unfused router's arithmetic (layers/moe.py, ungrouped)."""
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    ids = scores.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


@pytest.mark.parametrize("experts,k", [(64, 6), (8, 2), (160, 8), (5, 5)])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm,scaling", [(False, 1.0), (True, 2.5)])
def test_route_topk_matches_the_torch_router(experts, k, scoring, norm, scaling, gen):
    logits = (torch.randn(9, experts, generator=gen) * 3).to(DEVICE)
    weights, ids = route_topk(logits, k, scoring=scoring, norm_topk_prob=norm, scaling=scaling)
    ref_w, ref_ids = torch_route(logits, k, scoring, norm, scaling)
    assert ids.dtype == torch.int64 and torch.equal(ids, ref_ids)  # distinct random logits: no ties
    assert torch.isfinite(weights).all()
    torch.testing.assert_close(weights, ref_w, rtol=2e-6, atol=1e-7)


def test_route_topk_breaks_ties_to_the_lower_expert_and_checks_inputs():
    logits = torch.tensor([[0.0, 1.0, 1.0, -1.0, 1.0]], device=DEVICE)
    weights, ids = route_topk(logits, 3)
    assert ids.tolist() == [[1, 2, 4]] and torch.isfinite(weights).all()
    assert torch.allclose(weights, weights[:, :1].expand(1, 3))
    with pytest.raises(ValueError, match="float32"):
        route_topk(logits.half(), 2)
    with pytest.raises(ValueError, match="top_k"):
        route_topk(logits, 6)
    with pytest.raises(ValueError, match="scoring"):
        route_topk(logits, 2, scoring="relu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_shared", [True, False])
def test_combine_experts_matches_the_torch_sum(dtype, with_shared, gen):
    tokens, k, hidden = 3, 6, 1500  # hidden not a multiple of the block
    y = torch.randn(tokens * k, hidden, generator=gen).to(dtype).to(DEVICE)
    weights = torch.rand(tokens, k, generator=gen).to(DEVICE)
    shared = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE) if with_shared else None
    out = combine_experts(y, weights, shared)
    ref = (y.float() * weights.reshape(-1, 1)).view(tokens, k, -1).sum(dim=1).to(dtype)
    if with_shared:
        ref = ref + shared
    assert out.dtype == dtype and torch.isfinite(out).all()
    exact = (y.double() * weights.double().reshape(-1, 1)).view(tokens, k, -1).sum(dim=1)
    if with_shared:
        exact = exact + shared.double()
    # both round float32 sums once (and once more after the shared add): at most an ulp apart
    ulp = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
    bound = exact.abs().clamp_min(1.0) * ulp * (3 if with_shared else 2) + 1e-5
    assert ((out.double() - exact).abs() <= bound).all()
    assert ((out.double() - ref.double()).abs() <= bound).all()


def test_combine_experts_rejects_mismatched_shapes(gen):
    y = torch.randn(6, 8, generator=gen).to(DEVICE)
    weights = torch.rand(3, 2, generator=gen).to(DEVICE)
    with pytest.raises(ValueError, match="combine_experts"):
        combine_experts(y[:5], weights)
    with pytest.raises(ValueError, match="combine_experts"):
        combine_experts(y, weights, torch.zeros(3, 7, device=DEVICE))
    with pytest.raises(ValueError, match="combine_experts"):
        combine_experts(y, weights.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_runs_one_token_in_two_expert_launches(dtype, gen, monkeypatch):
    """A fused, packed MoE layer with two shared experts: one token runs the routed pairs and the
    shared experts in two GEMV launches (no cuBLAS shared product, no separate SiLU-and-mul), more
    tokens keep the shared MLP; both equal the unfused layer."""
    from segkv.kernels import expert_gemv as gemv_module
    from segkv.layers.moe import MixtureOfExperts, RouterSpec

    moe = MixtureOfExperts(40, 24, RouterSpec(num_experts=6, top_k=3), num_shared=2).to(DEVICE)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    moe = moe.to(dtype)
    xs = [torch.randn(t, 40, generator=gen).to(dtype).to(DEVICE) for t in (1, 3)]
    with torch.no_grad():
        unfused = [moe(x) for x in xs]
        moe.pack_experts()
        for module in (moe, moe.gate, moe.shared_experts):
            module.use_fused()
        launches, one_launch = [], gemv_module.expert_gemv_with_shared
        monkeypatch.setattr(gemv_module, "expert_gemv_with_shared",
                            lambda *a, **kw: launches.append(kw) or one_launch(*a, **kw))
        monkeypatch.setattr(moe.shared_experts, "forward", None)  # one token must not call the shared MLP
        one = moe(xs[0])
        assert [kw.get("gated", False) for kw in launches] == [False, True]
        monkeypatch.undo()
        three = moe(xs[1])
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20
    for got, ref in ((one, unfused[0]), (three, unfused[1])):
        assert got.dtype == dtype and torch.isfinite(got).all()
        torch.testing.assert_close(got, ref, rtol=4 * ulp, atol=4 * ulp * ref.abs().max().item())


@pytest.mark.parametrize("tokens,experts,hidden", [(1, 64, 2048), (5, 10, 96), (16, 160, 300)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_router_logits_match_the_float32_product(tokens, experts, hidden, dtype, gen):
    """The router's float32 logits from half-precision inputs: the product of the widened
    tensors, to float32 summation order (expert counts and widths that do not fill a block)."""
    from segkv.kernels.moe_ops import router_logits

    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(experts, hidden, generator=gen) / hidden**0.5).to(dtype).to(DEVICE)
    logits = router_logits(x, weight)
    ref = torch.nn.functional.linear(x.double(), weight.double())
    assert logits.dtype == torch.float32 and logits.shape == (tokens, experts)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits.double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="router_logits"):
        router_logits(x, weight[:, :-1])
