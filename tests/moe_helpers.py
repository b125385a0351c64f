"""A small random MoE block (the layer and its pre-norm) for the fused-path tests."""

from __future__ import annotations

import torch


def random_moe_block(gen: torch.Generator, device: str, *, top_k: int, num_shared: int, hidden: int = 40):
    """``(MixtureOfExperts(hidden, 24, 6 experts, top_k, num_shared), RMSNorm(hidden))`` in bf16 on
    ``device``, every parameter random (the norm's around 1)."""
    from segkv.layers.moe import MixtureOfExperts, RouterSpec
    from segkv.layers.norm import RMSNorm

    moe = MixtureOfExperts(hidden, 24, RouterSpec(num_experts=6, top_k=top_k, norm_topk_prob=True),
                           num_shared=num_shared)
    norm = RMSNorm(hidden)
    with torch.no_grad():
        for p in (*moe.parameters(), *norm.parameters()):
            p.copy_(0.3 * torch.randn(p.shape, generator=gen) + (1 if p is norm.weight else 0))
    return moe.to(torch.bfloat16).to(device), norm.to(torch.bfloat16).to(device)
