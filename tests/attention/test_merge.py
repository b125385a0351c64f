"""The exact LSE merge: agreement with whole attention, order independence, -inf handling."""

from __future__ import annotations

import torch

from segkv.attention import attend_piece, merge_partials, merge_states


def _states(gen, num_states: int, rows: int = 3, heads: int = 2, dim: int = 8):
    outs = torch.randn(num_states, rows, heads, dim, generator=gen)
    lses = torch.randn(num_states, rows, heads, generator=gen) * 3
    return outs, lses


def test_merge_equals_attention_over_the_union(gen):
    q = torch.randn(5, 4, 16, generator=gen)
    k = torch.randn(40, 2, 16, generator=gen)
    v = torch.randn(40, 2, 16, generator=gen)
    full = torch.full((5,), 40)
    whole, whole_lse = attend_piece(q, k, v, full, scale=0.25)
    cuts = [0, 7, 8, 25, 40]
    parts = [attend_piece(q, k[a:b], v[a:b], torch.full((5,), b - a), scale=0.25) for a, b in zip(cuts, cuts[1:])]
    out, lse = merge_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    torch.testing.assert_close(out, whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse, whole_lse, rtol=0, atol=1e-5)
    # the same through the scattered reduce map
    p_out = torch.cat([p[0] for p in parts])
    p_lse = torch.cat([p[1] for p in parts])
    rows = torch.arange(5).repeat(len(parts))
    out2, lse2 = merge_partials(p_out, p_lse, rows, 5)
    torch.testing.assert_close(out2, whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse2, whole_lse, rtol=0, atol=1e-5)


def test_merge_is_order_independent(gen):
    outs, lses = _states(gen, 6)
    ref_out, ref_lse = merge_states(outs, lses)
    for _ in range(5):
        perm = torch.randperm(6, generator=gen)
        out, lse = merge_states(outs[perm], lses[perm])
        torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-6)
        p_out = outs[perm].flatten(0, 1).reshape(-1, 2, 8)  # (6*3, H, D), row-major by state
        p_lse = lses[perm].reshape(-1, 2)
        rows = torch.arange(3).repeat(6)
        out2, lse2 = merge_partials(p_out, p_lse, rows, 3)
        torch.testing.assert_close(out2, ref_out, rtol=0, atol=1e-6)
        torch.testing.assert_close(lse2, ref_lse, rtol=0, atol=1e-6)


def test_neg_inf_states_have_zero_weight_even_with_garbage_outputs(gen):
    outs, lses = _states(gen, 3)
    ref_out, ref_lse = merge_states(outs[:2], lses[:2])
    garbage = outs.clone()
    garbage[2] = float("nan")  # an empty state's output must never leak in
    lses = lses.clone()
    lses[2] = float("-inf")
    out, lse = merge_states(garbage, lses)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    rows = torch.arange(3).repeat(3)
    out2, lse2 = merge_partials(garbage.reshape(-1, 2, 8), lses.reshape(-1, 2), rows, 3)
    torch.testing.assert_close(out2, ref_out, rtol=0, atol=1e-6)


def test_two_empty_states_give_zero_and_neg_inf_lse(gen):
    outs = torch.randn(2, 3, 2, 8, generator=gen)  # arbitrary contents, both states empty
    lses = torch.full((2, 3, 2), float("-inf"))
    out, lse = merge_states(outs, lses)
    assert torch.equal(out, torch.zeros(3, 2, 8))
    assert torch.isneginf(lse).all()
    out2, lse2 = merge_partials(outs.reshape(-1, 2, 8), lses.reshape(-1, 2), torch.arange(3).repeat(2), 3)
    assert torch.equal(out2, torch.zeros(3, 2, 8)) and torch.isneginf(lse2).all()


def test_rows_without_partials_are_zero(gen):
    outs, lses = _states(gen, 2, rows=1)
    out, lse = merge_partials(outs.reshape(-1, 2, 8), lses.reshape(-1, 2), torch.tensor([2, 2]), 4)
    assert torch.equal(out[[0, 1, 3]], torch.zeros(3, 2, 8))
    assert torch.isneginf(lse[[0, 1, 3]]).all()
    ref, _ = merge_states(outs, lses)
    torch.testing.assert_close(out[2], ref[0], rtol=0, atol=1e-6)


def test_single_state_passes_through_and_no_states_is_empty(gen):
    outs, lses = _states(gen, 1)
    out, lse = merge_states(outs, lses)
    torch.testing.assert_close(out, outs[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(lse, lses[0], rtol=0, atol=1e-6)
    out, lse = merge_states(torch.empty(0, 3, 2, 8), torch.empty(0, 3, 2))
    assert torch.equal(out, torch.zeros(3, 2, 8)) and torch.isneginf(lse).all()


def test_merge_keeps_float32_and_rounding_once_beats_rounding_twice(gen):
    """Rounding each piece to bf16 before the merge moves many elements by an ulp; the
    contract's single rounding does not (this is what the exactness tests guard)."""
    q = torch.randn(4, 8, 64, generator=gen)
    k = torch.randn(300, 8, 64, generator=gen)
    v = torch.randn(300, 8, 64, generator=gen)
    whole, _ = attend_piece(q, k, v, torch.full((4,), 300), scale=0.125)
    cuts = [0, 100, 200, 300]
    parts = [attend_piece(q, k[a:b], v[a:b], torch.full((4,), 100), scale=0.125) for a, b in zip(cuts, cuts[1:])]
    outs, lses = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    once, _ = merge_states(outs, lses)
    assert once.dtype == torch.float32
    twice, _ = merge_states(outs.to(torch.bfloat16), lses)
    exact = whole.to(torch.bfloat16)
    off_once = (once.to(torch.bfloat16) != exact).float().mean().item()
    off_twice = (twice.to(torch.bfloat16) != exact).float().mean().item()
    assert off_once <= 0.01
    assert off_twice > 5 * max(off_once, 0.01)
