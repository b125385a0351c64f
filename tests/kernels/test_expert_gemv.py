"""The expert GEMV kernel against torch: per-row expert weights chosen by device-side ids."""

from __future__ import annotations

import pytest
import torch

from gpu_helpers import DEVICE, GPU
from segkv.kernels.moe.expert_gemv import expert_gemv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_dim,out_dim", [(48, 40), (256, 64)] + ([(2048, 2816)] if GPU else []))
def test_expert_gemv_matches_torch(dtype, in_dim, out_dim, gen):
    experts_count, n = 5, 7
    x = torch.randn(3, in_dim, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(experts_count, out_dim, in_dim, generator=gen) / in_dim**0.5).to(dtype).to(DEVICE)
    rows = torch.randint(0, 3, (n,), generator=gen).to(DEVICE)
    experts = torch.randint(0, experts_count, (n,), generator=gen).to(DEVICE)
    out = expert_gemv(x, rows, experts, weight)
    ref = torch.einsum("noi,ni->no", weight[experts].double(), x[rows].double())
    assert out.dtype == dtype and out.shape == (n, out_dim) and torch.isfinite(out).all()
    # the eviction hint of one token's distinct experts changes where lines go in L2, not the result
    assert torch.equal(expert_gemv(x, rows, experts, weight, distinct_experts=True), out)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    else:  # float32 sums rounded once to bf16: within one bf16 ulp of the exact product
        ulp = ref.abs().clamp_min(2.0**-126) * 2.0**-7
        assert ((out.double() - ref).abs() <= ulp + 1e-6).all()


def test_expert_gemv_rejects_mismatched_shapes(gen):
    x = torch.randn(2, 8, generator=gen).to(DEVICE)
    weight = torch.randn(3, 4, 6, generator=gen).to(DEVICE)
    with pytest.raises(ValueError, match="shapes do not match"):
        expert_gemv(x, torch.zeros(1, dtype=torch.long, device=DEVICE), torch.zeros(1, dtype=torch.long,
                    device=DEVICE), weight)


def test_rows_as_pairs_per_row_read_row_n_over_r(gen):
    """``rows=r``: pair ``n`` reads row ``n // r`` (a router's (token, k) pairs), the same
    result as the explicit index tensor; r < 1 is refused."""
    x = torch.randn(4, 40, generator=gen).to(DEVICE)
    weight = torch.randn(5, 24, 40, generator=gen).to(DEVICE)
    experts = torch.randint(0, 5, (12,), generator=gen).to(DEVICE)
    explicit = expert_gemv(x, torch.arange(4, device=DEVICE).repeat_interleave(3), experts, weight)
    assert torch.equal(expert_gemv(x, 3, experts, weight), explicit)
    assert torch.equal(expert_gemv(x.repeat_interleave(3, 0), 1, experts, weight), explicit)
    with pytest.raises(ValueError, match="pairs per row"):
        expert_gemv(x, 0, experts, weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_with_shared_weight_in_one_launch(dtype, gen):
    """``expert_gemv_with_shared``: the routed pairs and a dense shared weight on every row in one
    launch, the gate/up products and the down products of their activation; each output equals
    the separate products."""
    from segkv.kernels.moe.expert_gemv import expert_gemv_with_shared
    from segkv.kernels.fused.fused_ops import silu_and_mul

    tokens, k, experts_count, inner, hidden, shared_inner = 3, 2, 4, 24, 40, 48
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    gate_up = (torch.randn(experts_count, 2 * inner, hidden, generator=gen) / hidden**0.5).to(dtype).to(DEVICE)
    down = (torch.randn(experts_count, hidden, inner, generator=gen) / inner**0.5).to(dtype).to(DEVICE)
    s_gate_up = (torch.randn(2 * shared_inner, hidden, generator=gen) / hidden**0.5).to(dtype).to(DEVICE)
    s_down = (torch.randn(hidden, shared_inner, generator=gen) / shared_inner**0.5).to(dtype).to(DEVICE)
    experts = torch.randint(0, experts_count, (tokens * k,), generator=gen).to(DEVICE)

    def same(a, b):  # float32 sums over other input blocks may differ in their last bits
        assert a.dtype == b.dtype and torch.isfinite(a).all()
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20
        torch.testing.assert_close(a, b, rtol=ulp, atol=ulp * b.abs().max().item())

    first = torch.zeros(tokens, dtype=torch.long, device=DEVICE)  # the shared weight as expert 0 of one
    h, sh = expert_gemv_with_shared(x, k, experts, gate_up, x, s_gate_up)
    assert h.shape == (tokens * k, 2 * inner) and sh.shape == (tokens, 2 * shared_inner)
    same(h, expert_gemv(x, k, experts, gate_up))
    same(sh, expert_gemv(x, 1, first, s_gate_up[None]))
    y, sy = expert_gemv_with_shared(silu_and_mul(h), 1, experts, down, silu_and_mul(sh), s_down)
    same(y, expert_gemv(silu_and_mul(h), 1, experts, down))
    same(sy, expert_gemv(silu_and_mul(sh), 1, first, s_down[None]))
    ref = torch.nn.functional.linear(silu_and_mul(sh).double(), s_down.double())  # the shared MLP's down product
    ulp = ref.abs().clamp_min(2.0**-126) * (2.0**-7 if dtype == torch.bfloat16 else 2.0**-20)
    assert torch.isfinite(sy).all() and ((sy.double() - ref).abs() <= ulp + 1e-5).all()
    with pytest.raises(ValueError, match="shapes do not match"):
        expert_gemv_with_shared(silu_and_mul(h), 1, experts, down, x, s_down)  # shared rows of the wrong width


def test_inputs_per_step_can_be_chosen_by_the_caller(gen):
    """``block_i`` sets the inputs per step of a launch (one token's few pairs take 256 by default,
    many pairs 128); the sums are the same, and a width that is not a power of two >= 16 is
    refused before any launch."""
    from segkv.kernels.moe.expert_gemv import default_block_i

    assert (default_block_i(6), default_block_i(48)) == (256, 128)
    x = torch.randn(2, 200, generator=gen).to(DEVICE)
    weight = torch.randn(4, 24, 200, generator=gen).to(DEVICE)
    experts = torch.randint(0, 4, (6,), generator=gen).to(DEVICE)
    ref = torch.einsum("noi,ni->no", weight[experts].double(), x.repeat_interleave(3, 0).double())
    for width in (32, 64):
        torch.testing.assert_close(expert_gemv(x, 3, experts, weight, block_i=width).double(), ref,
                                   rtol=1e-5, atol=1e-4)
    for bad in (96, 8):
        with pytest.raises(ValueError, match="block_i a power of two >= 16"):
            expert_gemv(x, 3, experts, weight, block_i=bad)


def test_outputs_and_warps_per_program_can_be_chosen_by_the_caller(gen):
    """``block_o`` and ``num_warps`` set the launch; the products stay the same, and values the
    kernel cannot take are refused before any launch."""
    x = torch.randn(2, 40, generator=gen).to(DEVICE)
    weight = torch.randn(4, 24, 40, generator=gen).to(DEVICE)
    experts = torch.randint(0, 4, (6,), generator=gen).to(DEVICE)
    expected = expert_gemv(x, 3, experts, weight)
    ref = torch.einsum("noi,ni->no", weight[experts].double(), x.repeat_interleave(3, 0).double())
    torch.testing.assert_close(expected.double(), ref, rtol=1e-5, atol=1e-4)
    for block_o, warps in ((8, 2), (32, 8)):
        torch.testing.assert_close(expert_gemv(x, 3, experts, weight, block_o=block_o, num_warps=warps),
                                   expected, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="block_o must be a power of two"):
        expert_gemv(x, 3, experts, weight, block_o=12)
    with pytest.raises(ValueError, match="num_warps must be 1, 2, 4, 8 or 16"):
        expert_gemv(x, 3, experts, weight, num_warps=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_activation_in_the_gate_up_product_equals_silu_and_mul_of_it(dtype, gen):
    """``activation``: programs of 8 gate rows and their 8 up rows store ``silu(gate) * up``,
    bit-equal to ``silu_and_mul`` of the stored ``[gate | up]`` product, routed and shared, with
    inner sizes that leave the last program part empty (44, 20); an odd number of rows is refused."""
    from segkv.kernels.moe.expert_gemv import expert_gemv_with_shared
    from segkv.kernels.fused.fused_ops import silu_and_mul

    hidden, inner, shared_inner, k = 40, 44, 20, 3
    x = (2 * torch.randn(2, hidden, generator=gen)).to(dtype).to(DEVICE)
    gate_up = (torch.randn(6, 2 * inner, hidden, generator=gen) / hidden**0.5).to(dtype).to(DEVICE)
    s_gate_up = (torch.randn(2 * shared_inner, hidden, generator=gen) / hidden**0.5).to(dtype).to(DEVICE)
    experts = torch.tensor([4, 0, 5, 1, 2, 3], device=DEVICE)
    plain, s_plain = expert_gemv_with_shared(x, k, experts, gate_up, x, s_gate_up)
    act, s_act = expert_gemv_with_shared(x, k, experts, gate_up, x, s_gate_up, activation=True)
    assert act.shape == (6, inner) and s_act.shape == (2, shared_inner) and act.dtype == dtype
    assert torch.equal(act, silu_and_mul(plain)) and torch.equal(s_act, silu_and_mul(s_plain))
    assert torch.equal(expert_gemv(x, k, experts, gate_up, activation=True), act)
    with pytest.raises(ValueError, match="even"):
        expert_gemv(x, k, experts, gate_up[:, 1:], activation=True)


@pytest.mark.parametrize("tokens", [2, 5])
def test_moe_layer_with_the_activation_in_the_gate_up_product_matches_the_expert_loop(tokens, gen, monkeypatch):
    """A packed, fused MoE layer with shared experts at 2 tokens and 5 (10 pairs) writes the
    activation in the gate/up launch, reads it in a plain down launch and gives the expert loop's
    output (one token's experts run in one launch: ``test_expert_mlp``)."""
    from segkv.kernels.moe import expert_gemv as module
    from segkv.layers.moe import MixtureOfExperts, RouterSpec

    moe = MixtureOfExperts(32, 24, RouterSpec(num_experts=6, top_k=2), num_shared=2).to(DEVICE)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        x = torch.randn(tokens, 32, generator=gen).to(DEVICE)
        looped = moe(x)
        moe.pack_experts()
        moe.use_fused()
        moe.shared_experts.use_fused()
        calls = []
        launch = module._launch

        def counted(*args, **kwargs):
            calls.append(args[12] if len(args) > 12 else kwargs.get("activation", False))  # _launch's activation
            return launch(*args, **kwargs)

        monkeypatch.setattr(module, "_launch", counted)
        torch.testing.assert_close(moe(x), looped, rtol=1e-5, atol=1e-5)
    assert calls and calls[0] is True and not any(calls[1:]), calls  # gate/up with the activation, then down
