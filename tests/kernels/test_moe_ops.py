"""The MoE router and combine kernels against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch

from gpu_helpers import DEVICE, GPU
from segkv.kernels.moe.moe_ops import combine_experts, route_topk


def torch_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """The router's scores of ``logits (T, E)``: softmax over the experts, or each one's sigmoid."""
    return logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()


def torch_route(logits: torch.Tensor, k: int, scoring: str, norm: bool, scaling: float):
    """The unfused router's arithmetic (layers/moe.py, ungrouped), with ``topk``'s unspecified order
    among equal scores made the kernel's: by logit, then by expert. Distinct logits can tie once
    scored (sigmoid saturates, so logits 6.279085 and 6.279076 both score 0.99812835 in float32);
    both scorings rise with the logit, so ordering by logit is an order by score."""
    scores = torch_scores(logits, scoring)
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
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
    assert ids.dtype == torch.int64 and torch.equal(ids, ref_ids)
    # whatever the tie rule: the chosen scores do not rise, and none left out scores above the last
    scores = torch_scores(logits, scoring).cpu()
    chosen = scores.gather(1, ids.cpu())
    assert (chosen[:, 1:] <= chosen[:, :-1]).all()
    left_out = scores.scatter(1, ids.cpu(), float("-inf"))
    assert (left_out.max(dim=-1).values <= chosen[:, -1]).all()
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
def test_fused_layer_runs_one_token_with_its_shared_experts(dtype, gen, monkeypatch):
    """A fused, packed MoE layer with two shared experts: one token runs the routed pairs and the
    shared experts in one launch (``kernels.moe.expert_mlp``: no cuBLAS shared product, no separate
    SiLU-and-mul); more tokens keep the shared MLP, the routed pairs' gate/up launch writing the
    activation for a plain down launch; both equal the unfused layer."""
    from segkv.kernels.moe import expert_gemv as gemv_module
    from segkv.kernels.moe import expert_mlp
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
        launches, one_launch = [], expert_mlp.expert_mlp_one_token
        monkeypatch.setattr(expert_mlp, "expert_mlp_one_token", lambda *a, **kw: launches.append(1) or one_launch(*a, **kw))
        monkeypatch.setattr(moe.shared_experts, "forward", None)  # one token must not call the shared MLP
        one = moe(xs[0])
        assert launches == [1]
        monkeypatch.undo()
        gemvs, gemv = [], gemv_module.expert_gemv  # 3 tokens: the shared MLP, the routed pairs packed
        monkeypatch.setattr(gemv_module, "expert_gemv", lambda *a, **kw: gemvs.append(kw) or gemv(*a, **kw))
        three = moe(xs[1])
        assert [kw.get("activation", False) for kw in gemvs] == [True, False]
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20
    for got, ref in ((one, unfused[0]), (three, unfused[1])):
        assert got.dtype == dtype and torch.isfinite(got).all()
        torch.testing.assert_close(got, ref, rtol=4 * ulp, atol=4 * ulp * ref.abs().max().item())


@pytest.mark.parametrize("tokens,experts,hidden", [(1, 64, 2048), (5, 10, 96), (16, 160, 300)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_router_logits_match_the_float32_product(tokens, experts, hidden, dtype, gen):
    """The router's float32 logits from half-precision inputs: the product of the widened
    tensors, to float32 summation order (expert counts and widths that do not fill a block)."""
    from segkv.kernels.moe.moe_ops import router_logits

    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(experts, hidden, generator=gen) / hidden**0.5).to(dtype).to(DEVICE)
    logits = router_logits(x, weight)
    ref = torch.nn.functional.linear(x.double(), weight.double())
    assert logits.dtype == torch.float32 and logits.shape == (tokens, experts)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits.double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="router_logits"):
        router_logits(x, weight[:, :-1])


@pytest.mark.parametrize("tokens,experts,hidden,k", [(1, 64, 2048, 6), (3, 10, 96, 2),
                                                     (16, 160, 3000, 8) if GPU else (2, 12, 2100, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scoring,norm_topk", [("softmax", False), ("sigmoid", True)])
def test_norm_route_topk_matches_the_separate_kernels(tokens, experts, hidden, k, dtype, scoring, norm_topk, gen):
    """The fused residual add, RMSNorm, router logits and top-k against the three kernels it
    replaces (norm rows wider than one 2048-column step, expert counts that do not fill a block),
    twice in a row: the per-token tickets are left zero for the next launch."""
    from segkv.kernels.fused.fused_ops import rms_norm
    from segkv.kernels.moe.moe_ops import norm_route_topk, router_logits

    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    residual = (3 * torch.randn(tokens, hidden, generator=gen)).to(dtype).to(DEVICE)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    router_w = (torch.randn(experts, hidden, generator=gen) / hidden**0.5).to(dtype).to(DEVICE)
    tickets = torch.zeros(16, dtype=torch.int32, device=DEVICE)
    ref_h, ref_total = rms_norm(x, norm_w, 1e-6, residual=residual)
    ref_w, ref_ids = route_topk(router_logits(ref_h, router_w), k, scoring=scoring, norm_topk_prob=norm_topk,
                                scaling=1.5)
    for _ in range(2):
        h, total, weights, ids = norm_route_topk(x, residual, norm_w, 1e-6, router_w, k, tickets, scoring=scoring,
                                                 norm_topk_prob=norm_topk, scaling=1.5)
        assert not tickets.any()
        assert torch.equal(total, ref_total)  # one rounded add, as rms_norm's
        assert h.dtype == ref_h.dtype and torch.isfinite(h).all()
        ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-23}[dtype]
        torch.testing.assert_close(h.float(), ref_h.float(), rtol=4 * ulp, atol=0)  # float32 sum order only
        assert ids.dtype == torch.int64 and ids.shape == ref_ids.shape
        if not torch.equal(ids, ref_ids):  # a near-tie of router scores (sum order) may pick either expert
            ref_logits = router_logits(ref_h, router_w)
            torch.testing.assert_close(ref_logits.gather(1, ids), ref_logits.gather(1, ref_ids), rtol=0, atol=1e-5)
            assert (ids != ref_ids).sum() <= 2 * tokens  # swaps of neighbours, not another choice
        torch.testing.assert_close(weights, ref_w, rtol=1e-4, atol=1e-6)


def test_norm_route_topk_rejects_bad_inputs(gen):
    from segkv.kernels.moe.moe_ops import norm_route_topk

    x = torch.randn(2, 32, generator=gen).to(DEVICE)
    w, router = torch.ones(32, device=DEVICE), torch.randn(8, 32, generator=gen).to(DEVICE)
    tickets = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="norm_route_topk"):
        norm_route_topk(x, x[:, :-1], w, 1e-6, router, 2, tickets)
    with pytest.raises(ValueError, match="norm_route_topk"):
        norm_route_topk(x, x, w, 1e-6, router[:, :-1], 2, tickets)
    with pytest.raises(ValueError, match="tickets"):
        norm_route_topk(x, x, w, 1e-6, router, 2, tickets[:1])
    with pytest.raises(ValueError, match="top_k"):
        norm_route_topk(x, x, w, 1e-6, router, 9, tickets)


@pytest.mark.parametrize("tokens", [3, 20])
def test_fused_block_routes_few_tokens_in_the_norm_launch(tokens, gen, monkeypatch):
    """A fused MoE block's second half (``forward_after_norm``): up to 16 tokens the norm, the
    router's logits and its top-k are one launch and the separate kernels do not run; more
    tokens take them apart (one token: the whole block in one launch, ``test_expert_mlp``).
    Either way the result equals the unfused norm and layer."""
    from moe_helpers import random_moe_block
    from segkv.kernels.moe import moe_ops
    from segkv.layers import norm as norm_module

    moe, norm = random_moe_block(gen, DEVICE, top_k=2, num_shared=1)
    x = torch.randn(tokens, 40, generator=gen).to(torch.bfloat16).to(DEVICE)
    residual = torch.randn(tokens, 40, generator=gen).to(torch.bfloat16).to(DEVICE)
    with torch.no_grad():
        ref_out, ref_total = moe.forward_after_norm(x, residual, norm)  # unfused: norm, then the layer
        moe.pack_experts()
        for module in (moe, moe.gate, moe.shared_experts, norm):
            module.use_fused()
        calls = []
        for module, name in ((moe_ops, "norm_route_topk"), (moe_ops, "route_topk"), (norm_module, "rms_norm")):
            original = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, _n=name, _f=original, **kw: calls.append(_n) or _f(*a, **kw))
        out, total = moe.forward_after_norm(x, residual, norm)
    few = tokens <= 16
    assert calls == (["norm_route_topk"] if few else ["rms_norm", "route_topk"])
    assert torch.equal(total, ref_total)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_out, rtol=2**-5, atol=2**-5 * ref_out.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,k,hidden,with_shared", [(1, 6, 2048, True), (3, 2, 100, False)])
def test_combine_add_rms_norm_matches_the_two_kernels(dtype, tokens, k, hidden, with_shared, gen):
    """The combine inside the next block's residual add and RMSNorm against combine_experts then
    rms_norm: the sum as those round it exactly, the normed row to float32 summation order."""
    from segkv.kernels.fused.fused_ops import rms_norm
    from segkv.kernels.moe.moe_ops import combine_add_rms_norm

    y = torch.randn(tokens * k, hidden, generator=gen).to(dtype).to(DEVICE)
    weights = torch.rand(tokens, k, generator=gen).to(DEVICE)
    shared = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE) if with_shared else None
    residual = (4 * torch.randn(tokens, hidden, generator=gen)).to(dtype).to(DEVICE)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    ref_h, ref_total = rms_norm(combine_experts(y, weights, shared), norm_w, 1e-5, residual=residual)
    h, total = combine_add_rms_norm(y, weights, shared, residual, norm_w, 1e-5)
    assert torch.equal(total, ref_total)
    assert h.dtype == ref_h.dtype and torch.isfinite(h).all()
    ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-23}[dtype]
    torch.testing.assert_close(h.float(), ref_h.float(), rtol=4 * ulp, atol=0)
    with pytest.raises(ValueError, match="combine_add_rms_norm"):
        combine_add_rms_norm(y, weights, shared, residual[:, :-1], norm_w, 1e-5)


def test_a_fused_moe_model_forms_each_layers_output_in_the_next_norm(gen, monkeypatch):
    """A fused two-layer DeepSeek-style stack at decode: each MoE layer's output reaches the next
    norm unformed and is combined there (no combine launch), and the hidden states equal the
    unfused model's."""
    from segkv.kernels.moe import moe_ops
    from segkv.layers.moe import MixtureOfExperts, RouterSpec
    from segkv.layers.norm import PendingCombine, RMSNorm

    layers = [MixtureOfExperts(40, 24, RouterSpec(num_experts=6, top_k=2), num_shared=1) for _ in range(2)]
    norms = [RMSNorm(40) for _ in range(5)]  # input and post-attention norms of two blocks, the final norm
    with torch.no_grad():
        for p in (q for m in (*layers, *norms) for q in m.parameters()):
            p.copy_(0.3 * torch.randn(p.shape, generator=gen) + (1 if p.dim() == 1 else 0))
    layers = [m.to(torch.bfloat16).to(DEVICE) for m in layers]
    norms = [m.to(torch.bfloat16).to(DEVICE) for m in norms]
    x = torch.randn(1, 40, generator=gen).to(torch.bfloat16).to(DEVICE)
    residual = torch.randn(1, 40, generator=gen).to(torch.bfloat16).to(DEVICE)

    def run(defer: bool):
        out, res = x, residual
        for i, layer in enumerate(layers):
            h, res = norms[2 * i].add_and_norm(out, res)
            out, res = layer.forward_after_norm(0.5 * h, res, norms[2 * i + 1], defer_combine=defer)  # 0.5 h: attention
        return norms[4].add_and_norm(out, res)

    with torch.no_grad():
        ref_h, ref_total = run(False)
        for m in (*layers, *norms):
            if isinstance(m, MixtureOfExperts):
                m.pack_experts()
                for sub in (m, m.gate, m.shared_experts):
                    sub.use_fused()
            else:
                m.use_fused()
        combines = []
        monkeypatch.setattr(moe_ops, "combine_experts", lambda *a, **kw: combines.append(1))
        pending, _ = layers[0].forward_after_norm(x, residual, norms[1], defer_combine=True)
        assert isinstance(pending, PendingCombine) and pending.parts.shape == (2, 40)
        h, total = run(True)
    assert not combines
    assert torch.isfinite(h).all()
    torch.testing.assert_close(total, ref_total, rtol=2**-5, atol=2**-5 * ref_total.abs().max().item())
    torch.testing.assert_close(h, ref_h, rtol=2**-5, atol=2**-5 * ref_h.abs().max().item())


def test_norm_route_topk_breaks_ties_to_the_lower_expert(gen):
    """Experts with equal router rows (equal logits) are chosen and ordered by id, as route_topk
    orders them."""
    from segkv.kernels.moe.moe_ops import norm_route_topk, router_logits

    x = torch.randn(1, 64, generator=gen).to(DEVICE)
    residual = torch.randn(1, 64, generator=gen).to(DEVICE)
    router_w = torch.randn(8, 64, generator=gen).to(DEVICE)
    norm_w, tickets = torch.ones(64, device=DEVICE), torch.zeros(1, dtype=torch.int32, device=DEVICE)
    h = norm_route_topk(x, residual, norm_w, 1e-6, router_w, 4, tickets)[0]
    best = int(router_logits(h, router_w).argmax())
    twins = [e for e in (7, 3, 0) if e != best][:2]
    for twin in twins:  # two more copies of the best row
        router_w[twin] = router_w[best]
    h, _, weights, ids = norm_route_topk(x, residual, norm_w, 1e-6, router_w, 4, tickets)
    ref_w, ref_ids = route_topk(router_logits(h, router_w), 4)
    assert ids[0, :3].tolist() == sorted({best, *twins}) and torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-7)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # NaN arithmetic in the interpreter
def test_norm_route_topk_fills_every_slot_with_a_valid_expert_even_on_nan(gen):
    """A NaN hidden row (an overflowed activation) still routes to k distinct, valid experts, so
    the expert GEMVs never index outside the weights; finite rows are unaffected."""
    from segkv.kernels.moe.moe_ops import norm_route_topk

    x = torch.randn(3, 64, generator=gen).to(DEVICE)
    x[1, 5] = float("nan")
    residual = torch.randn(3, 64, generator=gen).to(DEVICE)
    router_w = torch.randn(10, 64, generator=gen).to(DEVICE)
    tickets = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    _, _, weights, ids = norm_route_topk(x, residual, torch.ones(64, device=DEVICE), 1e-6, router_w, 4, tickets)
    assert ids.min() >= 0 and ids.max() < 10
    assert all(len(set(row)) == 4 for row in ids.tolist())
    assert ids[1].tolist() == [0, 1, 2, 3]  # all logits NaN: ties to the lower ids
    assert torch.isfinite(weights[[0, 2]]).all() and not tickets.any()


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # NaN arithmetic in the interpreter
def test_route_topk_chooses_valid_experts_for_nan_logits():
    """NaN logits (160 experts: the block has padding entries past them) rank first, ties to the
    lower id, and never yield an id past the experts."""
    logits = torch.full((2, 160), float("nan"), device=DEVICE)
    logits[1] = torch.arange(160, device=DEVICE, dtype=torch.float32)
    logits[1, 7] = float("nan")
    weights, ids = route_topk(logits, 3)
    assert ids[0].tolist() == [0, 1, 2] and ids[1].tolist() == [7, 159, 158]
    assert torch.isfinite(weights).sum() == 0  # softmax over a NaN row is NaN, as torch's
