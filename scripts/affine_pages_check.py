"""Check that the benchmark's cases hold what the ``SEGKV_ATTENTION_PROBE_AFFINE_PAGES`` timing probe
assumes (GPU machine): each plan's work items cover consecutive full pages. Runs the planner's plan
for batch 1 and 16 at 32K and the 16-fork cascade (8B shape, pages of 16) with the kernels as
configured, against float32 attention over contiguous copies of the same rows, and prints the worst
error relative to the output's largest value; exits 1 if it passes 1e-2 or is NaN.

``SEGKV_ATTENTION_PROBE_AFFINE_PAGES=1 python3 scripts/affine_pages_check.py``
"""

from __future__ import annotations

import sys

import torch

from segkv.attention import AttentionShape, DeviceSpec, SequenceQuery, plan_attention
from segkv.attention.triton_backend import TritonBackend
from segkv.bench.decode_attention import _contiguous, _fill_random, forked_prefix
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, KVLayout


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float32 attention of one decode row per sequence: q (B, H, D), k/v (B, KVH, N, D) -> (B, H, D)."""
    b, h, d = q.shape
    group = h // k.shape[1]
    qg = q.float().view(b, k.shape[1], group, d)
    scores = torch.einsum("bkgd,bknd->bkgn", qg, k.float()) * d**-0.5
    return torch.einsum("bkgn,bknd->bkgd", scores.softmax(-1), v.float()).reshape(b, h, d)


def worst(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def main() -> int:
    device, q_heads, kv_heads, dim, page = "cuda", 32, 8, 128, 16
    shape = AttentionShape(q_heads, kv_heads, dim, dim)
    backend = TritonBackend(page_size=page, device=device)
    gen = torch.Generator(device=device).manual_seed(1)
    errors = {}
    for batch in (1, 16):
        context = 32768
        layout = KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=dim, dtype=torch.bfloat16)
        cache = PagedKVCache(layout, CacheConfig(page_size=page, num_pages=batch * context // page + 1), device=device,
                             compaction=CompactionPolicy(enabled=False))
        _fill_random(cache, gen)
        chains = [cache.new_chain() for _ in range(batch)]
        for chain in chains:
            chain.append(context)
        q = torch.randn(batch, q_heads, dim, device=device, dtype=torch.bfloat16, generator=gen)
        plan = plan_attention([SequenceQuery.from_chain(c, 1) for c in chains], shape, DeviceSpec.cuda(), page_size=page)
        out = backend.run(backend.prepare(plan), q, cache.storage.key_cache(0), cache.storage.value_cache(0),
                          scale=dim**-0.5)[0]
        k, v = _contiguous(cache, chains, context)
        errors[f"batch {batch} / 32K"] = worst(out, dense(q, k, v))
    cache, root, chains = forked_prefix(kv_heads=kv_heads, head_dim=dim, dtype=torch.bfloat16, forks=16, prefix=32768,
                                        suffix=512, page_size=page, generator=gen, device=device)
    q = torch.randn(16, q_heads, dim, device=device, dtype=torch.bfloat16, generator=gen)
    plan = plan_attention([SequenceQuery.from_chain(c, 1) for c in chains], shape, DeviceSpec.cuda(), page_size=page)
    out = backend.run(backend.prepare(plan), q, cache.storage.key_cache(0), cache.storage.value_cache(0),
                      scale=dim**-0.5)[0]
    k, v = _contiguous(cache, chains, 32768 + 512)
    errors["cascade"] = worst(out, dense(q, k, v))
    print("worst error / max |output|: " + ", ".join(f"{name} {e:.2e}" for name, e in errors.items()))
    return 0 if all(e <= 1e-2 for e in errors.values()) else 1  # NaN fails the comparison too


if __name__ == "__main__":
    sys.exit(main())
