"""Attention over an FP8 KV cache equals float32 attention over the dequantized K/V.

The oracle is dense float64 attention over ``fp8 * scale`` of every visible row. The torch
reference and the Triton kernels (GQA and MLA; Triton's interpreter without a GPU) must match it
within the numerical contract on every route, with per-KV-head scales, saturated values and
fully masked rows; no output may be left NaN.
"""

from __future__ import annotations

import pytest
import torch

from attention_helpers import forked_history, ulp, exact_attention  # noqa: F401
from gpu_helpers import DEVICE, GPU
from segkv.attention import AttentionShape, DeviceSpec, Route, SequenceQuery, TorchReferenceBackend, plan_attention
from segkv.attention.triton_backend import TritonBackend
from segkv.cache import PagedKVCache
from segkv.config import FP8_KV_DTYPE, CacheConfig, CompactionPolicy, KVLayout

# the exact contract's checks: exact plans on every device (attention_helpers.exact_attention)
pytestmark = pytest.mark.usefixtures("exact_attention")

ROUTES = [r.value for r in Route]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
RANK, ROPE = (512, 64) if GPU else (64, 16)


def fp8_batch(gen, *, kind: str, page_size: int, rows: int, ratio: int, qdtype: torch.dtype, kv_heads: int = 2):
    """Three sequences over a shared segmented history in an FP8 cache with random per-head scales;
    the first KV head's key scale is small enough that some of its keys saturate at +-448 * scale."""
    if kind == "mha":
        layout = KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=64, dtype=FP8_KV_DTYPE)
        shape = AttentionShape(kv_heads * ratio, kv_heads, 64, 64)
    else:
        layout = KVLayout(num_layers=1, kind="mla", kv_lora_rank=RANK, rope_dim=ROPE, dtype=FP8_KV_DTYPE)
        shape = AttentionShape(ratio, 1, RANK + ROPE, RANK)
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=256), device=DEVICE,
                         compaction=CompactionPolicy(enabled=False))
    heads = kv_heads if kind == "mha" else 1
    k_scale = 2.0 ** torch.randint(-8, -2, (1, heads), generator=gen) * (1 + torch.rand(1, heads, generator=gen))
    v_scale = 2.0 ** torch.randint(-8, -2, (1, heads), generator=gen) * (1 + torch.rand(1, heads, generator=gen))
    k_scale[0, 0] = 2.0 ** -9  # the first head's larger keys saturate
    cache.storage.set_scales(k_scale, v_scale if kind == "mha" else None)
    chains = forked_history(cache, gen, rows=rows, segments=4, scale=0.5)
    queries = [SequenceQuery.from_chain(c, rows) for c in chains]
    total = sum(q.num_query_rows for q in queries)
    query = (0.5 * torch.randn(total, shape.num_q_heads, shape.key_dim, generator=gen)).to(qdtype).to(DEVICE)
    return cache, chains, queries, query, shape


def dense_oracle(cache, chains, queries, query, shape, scale) -> torch.Tensor:
    """Float64 attention of every query row over the dequantized rows it sees: ``(R, Hq, Dv)``."""
    storage, outs, row = cache.storage, [], 0
    for chain, q_info in zip(chains, queries):
        q = query[row: row + q_info.num_query_rows].double().cpu()
        row += q_info.num_query_rows
        rows = storage.read(0, chain.slots())
        if cache.layout.kind == "mla":
            latent = storage.dequantized(rows[0], 0).double().cpu()
            key, value = latent.unsqueeze(1), latent[:, :shape.value_dim].unsqueeze(1)
        else:
            key = storage.dequantized(rows[0], 0).double().cpu()
            value = storage.dequantized(rows[1], 0, value=True).double().cpu()
        num_kv = key.shape[1]
        q = q.reshape(q.shape[0], num_kv, -1, q.shape[2])
        scores = torch.einsum("rhgd,nhd->rhgn", q, key) * scale
        positions = q_info.query_start + torch.arange(q_info.num_query_rows)
        mask = torch.arange(key.shape[0]).unsqueeze(0) <= positions.unsqueeze(1)
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out = torch.einsum("rhgn,nhd->rhgd", probs, value)
        outs.append(out.reshape(out.shape[0], -1, out.shape[-1]))
    return torch.cat(outs)


def assert_contract(out: torch.Tensor, oracle: torch.Tensor) -> None:
    assert not torch.isnan(out).any(), "an output was left unwritten"
    diff = (out.double().cpu() - oracle).abs()
    noise = 2e-5 * oracle.abs().amax().clamp(min=1.0).item()
    if out.dtype == torch.float32:
        assert diff.max().item() <= noise, f"max diff {diff.max().item()}"
    else:  # float32 attention rounded once to the output dtype: within one ulp of it
        assert (diff <= ulp(oracle.to(out.dtype)) + noise).all(), f"max diff {diff.max().item()}"


def run(backend, cache, queries, query, shape, route, scale):
    device = DeviceSpec.cuda() if GPU else DeviceSpec.cpu()
    plan = plan_attention(queries, shape, device, page_size=cache.page_size, route=route,
                          num_partitions=3 if route == "split" else None)
    assert plan.route == Route(route)
    storage = cache.storage
    out, lse = backend.run(backend.prepare(plan), query, storage.key_cache(0), storage.value_cache(0), scale=scale,
                           kv_scales=storage.kv_scales(0))
    assert not torch.isnan(lse).any()
    return out, lse


REFERENCE_GRID = [(route, kind) for route in ROUTES for kind in ("mha", "mla")]


@pytest.mark.parametrize("route,kind", REFERENCE_GRID)
def test_reference_equals_float32_attention_over_dequantized_kv(route, kind, gen):
    for qdtype, ratio in ((torch.float32, 4), (torch.bfloat16, 1)):
        cache, chains, queries, query, shape = fp8_batch(gen, kind=kind, page_size=16, rows=3, ratio=ratio,
                                                         qdtype=qdtype)
        scale = shape.key_dim ** -0.5
        rb = TorchReferenceBackend(page_size=16, device=DEVICE)
        out, _ = run(rb, cache, queries, query, shape, route, scale)
        assert out.dtype == qdtype
        assert_contract(out, dense_oracle(cache, chains, queries, query, shape, scale))
        raw = cache.storage.read(0, chains[0].slots())[0]
        assert raw.dtype == FP8_KV_DTYPE and raw.float().abs().max() == 448  # some rows saturated


if GPU:
    TRITON_GRID = [(r, k, d, p) for r in ROUTES for k in ("mha", "mla") for d in DTYPES for p in (16, 32)]
else:  # the interpreter is slow: every route, both layouts, float32 and half-precision queries
    TRITON_GRID = [("single", "mha", "fp32", 16), ("split", "mha", "bf16", 16), ("segments", "mha", "fp16", 32),
                   ("cascade", "mha", "fp32", 16), ("single", "mla", "bf16", 16), ("split", "mla", "fp32", 16),
                   ("segments", "mla", "fp16", 32), ("cascade", "mla", "bf16", 16)]


@pytest.mark.parametrize("route,kind,dtype,page_size", TRITON_GRID)
def test_triton_kernels_equal_float32_attention_over_dequantized_kv(route, kind, dtype, page_size, gen):
    qdtype = DTYPES[dtype]
    cache, chains, queries, query, shape = fp8_batch(gen, kind=kind, page_size=page_size, rows=2,
                                                     ratio=4 if kind == "mha" else 5, qdtype=qdtype)
    scale = shape.key_dim ** -0.5
    tb = TritonBackend(page_size=page_size, device=DEVICE, poison=True)
    out, lse = run(tb, cache, queries, query, shape, route, scale)
    assert_contract(out, dense_oracle(cache, chains, queries, query, shape, scale))
    rb = TorchReferenceBackend(page_size=page_size, device=DEVICE)
    _, ref_lse = run(rb, cache, queries, query, shape, route, scale)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-4)


def test_fully_masked_rows_are_zero(gen):
    for kind in ("mha", "mla"):
        cache, chains, (q0, q1, _), query, shape = fp8_batch(gen, kind=kind, page_size=16, rows=2, ratio=2,
                                                             qdtype=torch.bfloat16)
        queries = [q0, SequenceQuery(q1.spans, 2, query_start=-2), SequenceQuery((), 2)]
        for backend in (TorchReferenceBackend(page_size=16, device=DEVICE),
                        TritonBackend(page_size=16, device=DEVICE, poison=True)):
            out, lse = run(backend, cache, queries, query, shape, "split", shape.key_dim ** -0.5)
            dead = [2, 3, 4, 5]
            assert torch.equal(out[dead], torch.zeros_like(out[dead])) and torch.isneginf(lse[dead]).all()
