"""The latent (MLA) Triton kernel against the torch reference, absorbed and naive.

On a GPU: kv_lora_rank 512 + rope 64 with 16 to 128 heads, bf16/fp16, pages 16/32, every
route, a mixed long/short batch. Without one, small widths run in Triton's interpreter.
Outputs are poisoned before every launch; each case asserts the plan that ran.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from gpu_helpers import DEVICE, GPU
from segkv.attention import AttentionShape, DeviceSpec, Route, SequenceQuery, TorchReferenceBackend, plan_attention
from segkv.attention.metadata import AttentionMetadata
from segkv.attention.triton_backend import TritonBackend, is_latent_cache
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, KVLayout
from segkv.layers.mla import MLADims, MultiHeadLatentAttention
from segkv.layers.rotary import RotaryEmbedding
from attention_helpers import forked_history, triton_and_reference, exact_attention  # noqa: F401
from test_triton_attention import check

# the exact contract's checks: exact plans on every device (attention_helpers.exact_attention; the
# CUDA planner's fast mode for many-head batches has its own bound in test_precision_modes)
pytestmark = pytest.mark.usefixtures("exact_attention")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
RANK, ROPE = (512, 64) if GPU else (64, 16)


def latent_launch(monkeypatch, **fields) -> None:
    """Every latent launch takes the default launch with ``fields`` (LaunchConfig fields) replaced."""
    import dataclasses

    from segkv.kernels.attention import mla_attention

    default = getattr(mla_attention.default_mla_launch_config, "original", mla_attention.default_mla_launch_config)

    def launch():
        return dataclasses.replace(default(), **fields)

    launch.original = default
    monkeypatch.setattr(mla_attention, "default_mla_launch_config", launch)


def latent_batch(gen, *, dtype, page_size, rows, rank=RANK, rope=ROPE, segments=4):
    """Three sequences over a shared, segmented latent history (mid-page boundaries)."""
    layout = KVLayout(num_layers=1, kind="mla", kv_lora_rank=rank, rope_dim=rope, dtype=dtype)
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=256), device=DEVICE,
                         compaction=CompactionPolicy(enabled=False))
    chains = forked_history(cache, gen, rows=rows, segments=segments, scale=0.5)
    return cache, chains, [SequenceQuery.from_chain(c, rows) for c in chains]


def run_latent(cache, queries, heads, route, gen, *, dtype, num_partitions=None, rank=RANK, rope=ROPE):
    shape = AttentionShape(heads, 1, rank + rope, rank)
    device = DeviceSpec.cuda() if GPU else DeviceSpec.cpu()
    plan = plan_attention(queries, shape, device, page_size=cache.page_size, route=route,
                          num_partitions=num_partitions or (3 if route == "split" else None))
    assert plan.route == Route(route)
    if route == "split":
        assert plan.num_partitions > 1  # split really split
    q = (0.5 * torch.randn(plan.num_query_rows, heads, rank + rope, generator=gen)).to(dtype).to(DEVICE)
    storage = cache.storage
    k, v = storage.key_cache(0), storage.value_cache(0)
    assert is_latent_cache(k, v)
    return triton_and_reference(plan, q, k, v, page_size=cache.page_size, scale=(rank + rope) ** -0.5, device=DEVICE)


if GPU:
    GRID = list(itertools.product([r.value for r in Route], ["bf16", "fp16", "fp32"], [16, 32],
                                  [16, 20, 32, 64, 128]))
else:
    GRID = [("single", "fp32", 16, 4), ("split", "bf16", 16, 20), ("segments", "fp16", 32, 4),
            ("cascade", "bf16", 32, 5)]


@pytest.mark.parametrize("route,dtype,page_size,heads", GRID)
def test_latent_kernel_matches_the_reference(route, dtype, page_size, heads, gen):
    for rows in ([1, 4, 17] if GPU else [1 + heads % 4]):
        cache, _, queries = latent_batch(gen, dtype=DTYPES[dtype], page_size=page_size, rows=rows)
        out, lse, ref, ref_lse = run_latent(cache, queries, heads, route, gen, dtype=DTYPES[dtype])
        assert out.shape[-1] == RANK
        check(out, lse, ref, ref_lse)


def test_latent_fully_masked_rows_give_zero(gen):
    cache, _, (q0, q1, _) = latent_batch(gen, dtype=torch.bfloat16, page_size=16, rows=2)
    queries = [q0, SequenceQuery(q1.spans, 2, query_start=-2), SequenceQuery((), 2)]
    for route in ("single", "split"):
        out, lse, ref, ref_lse = run_latent(cache, queries, 4, route, gen, dtype=torch.bfloat16)
        check(out, lse, ref, ref_lse)
        dead = [2, 3, 4, 5]
        assert torch.equal(out[dead], torch.zeros_like(out[dead])) and torch.isneginf(lse[dead]).all()


VALUE_SPLIT_GRID = (list(itertools.product([r.value for r in Route], ["bf16", "fp16", "fp32"], [16, 32], [16, 20, 128]))
                    if GPU else [("split", "bf16", 16, 4), ("single", "fp32", 32, 20), ("cascade", "fp16", 16, 5)])


@pytest.mark.parametrize("route,dtype,page_size,heads", VALUE_SPLIT_GRID)
def test_value_split_matches_the_reference(route, dtype, page_size, heads, gen, monkeypatch):
    """Two programs per (work item, head block), each with half the value columns, give the
    reference's results on every route, a rank that is not a power of two and fully masked rows
    included (0, LSE -inf, no NaN); so does a plan of more partials than
    the launch's ``value_split_max_partials`` (the first program takes all the values, the second
    exits); so do four programs with a quarter each. By default a batch whose (row, head) pairs
    fit one program launches the two (batch-1 decode); a launch's ``value_split`` 1 / 2 / 4 forces
    it; other values are refused."""
    from segkv.kernels.attention import mla_attention

    def split(rows, num_heads):
        return mla_attention.mla_stage1_launch(dtype=torch.bfloat16, rank=RANK, rope=ROPE, num_heads=num_heads,
                                               page_size=16, max_work_rows=1, element_size=2,
                                               num_rows=rows)["VALUE_SPLIT"]

    assert [split(1, 16), split(1, 4), split(4, 4), split(2, 16), split(8, 16), split(1, 128)] == [2, 2, 2, 1, 1, 1]
    latent_launch(monkeypatch, value_split=1)
    assert split(1, 16) == 1
    latent_launch(monkeypatch, value_split=2)
    assert split(8, 128) == 2
    for rows in ([1, 4, 17] if GPU else [1 + heads % 4]):
        cache, _, queries = latent_batch(gen, dtype=DTYPES[dtype], page_size=page_size, rows=rows)
        check(*run_latent(cache, queries, heads, route, gen, dtype=DTYPES[dtype]))
        # a plan of more partials than the limit: the first program takes all the values
        latent_launch(monkeypatch, value_split=2, value_split_max_partials=1)
        check(*run_latent(cache, queries, heads, route, gen, dtype=DTYPES[dtype]))
        latent_launch(monkeypatch, value_split=2)
    rank, rope = (448, 64) if GPU else (48, 8)
    cache, _, (q0, q1, _) = latent_batch(gen, dtype=torch.bfloat16, page_size=16, rows=2, rank=rank, rope=rope)
    out, lse, ref, ref_lse = run_latent(cache, [q0, SequenceQuery(q1.spans, 2, query_start=-2), SequenceQuery((), 2)],
                                        4, "split", gen, dtype=torch.bfloat16, rank=rank, rope=rope)
    check(out, lse, ref, ref_lse)
    dead = [2, 3, 4, 5]
    assert torch.equal(out[dead], torch.zeros_like(out[dead])) and torch.isneginf(lse[dead]).all()
    # four programs per pair block, a quarter of the values each (a benchmark's launch)
    latent_launch(monkeypatch, value_split=4)
    out, lse, ref, ref_lse = run_latent(cache, [q0, SequenceQuery(q1.spans, 2, query_start=-2), SequenceQuery((), 2)],
                                        heads, route, gen, dtype=torch.bfloat16, rank=rank, rope=rope)
    check(out, lse, ref, ref_lse)
    assert torch.equal(out[dead], torch.zeros_like(out[dead])) and torch.isneginf(lse[dead]).all()
    latent_launch(monkeypatch, value_split=3)  # 0, 1, 2 or 4
    with pytest.raises(ValueError, match="value split"):
        mla_attention.mla_stage1_launch(dtype=torch.bfloat16, rank=RANK, rope=ROPE, num_heads=heads,
                                        page_size=page_size, max_work_rows=1, element_size=2)


@pytest.mark.parametrize("route", ["split", "cascade"] + (["single"] if GPU else []))
def test_adaptive_value_shares_match_the_reference(route, gen, monkeypatch):
    """The automatic split: two programs per pair block take a half of the values each when the
    plan has at most the launch's ``value_split_max_partials`` partials, else the first takes all (the
    other exits before the wait); each gives the reference's results, fully masked rows included."""
    from segkv.kernels.attention import mla_attention

    meta = mla_attention.mla_stage1_launch(dtype=torch.bfloat16, rank=RANK, rope=ROPE, num_heads=4, page_size=16,
                                           max_work_rows=1, element_size=2, num_rows=1)
    assert (meta["VALUE_SPLIT"], meta["ADAPTIVE"]) == (2, True)
    heads = 4
    cache, _, (q0, q1, _) = latent_batch(gen, dtype=torch.bfloat16, page_size=16, rows=1)
    queries = [q0, SequenceQuery(q1.spans, 1, query_start=-1), SequenceQuery((), 1)]  # masked, empty
    shape = AttentionShape(heads, 1, RANK + ROPE, RANK)
    device = DeviceSpec.cuda() if GPU else DeviceSpec.cpu()
    partials = plan_attention(queries, shape, device, page_size=16, route=route,
                              num_partitions=3 if route == "split" else None).num_partials
    assert partials > 1
    for limit in (partials, partials - 1):  # halves, one program
        latent_launch(monkeypatch, value_split_max_partials=limit)
        out, lse, ref, ref_lse = run_latent(cache, queries, heads, route, gen, dtype=torch.bfloat16)
        check(out, lse, ref, ref_lse)
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()


@pytest.mark.parametrize("page_size", [20, 48])
def test_latent_page_sizes_that_do_not_divide_the_tile(page_size, gen):
    """Latent pages of 20 rows (one whole page in a 32-row tile) or 48 (a full and a partial
    32-row tile): every route gives the reference's results."""
    from segkv.kernels.attention import mla_attention

    tile = mla_attention.mla_stage1_launch(dtype=torch.float32, rank=RANK, rope=ROPE, num_heads=4,
                                           page_size=page_size, max_work_rows=1, element_size=4)["BLOCK_N"]
    assert tile == 32 and tile % page_size != 0
    for route in [r.value for r in Route]:
        cache, _, queries = latent_batch(gen, dtype=torch.float32, page_size=page_size, rows=2)
        check(*run_latent(cache, queries, 4, route, gen, dtype=torch.float32))


@pytest.mark.parametrize("page_size", [32, 20])
def test_latent_pages_longer_than_the_tile(page_size, gen, monkeypatch):
    """Latent tiles kept at 16 rows: pages of 32 or 20 rows span two tiles;
    every route, with one program and with the value halves, gives the reference's results."""
    from segkv.kernels.attention import mla_attention

    latent_launch(monkeypatch, block_n=16)
    assert mla_attention.mla_stage1_launch(dtype=torch.float32, rank=RANK, rope=ROPE, num_heads=4,
                                           page_size=page_size, max_work_rows=1, element_size=4)["BLOCK_N"] == 16
    for split in (1, 0):
        latent_launch(monkeypatch, block_n=16, value_split=split)
        for route in [r.value for r in Route]:
            cache, _, queries = latent_batch(gen, dtype=torch.float32, page_size=page_size, rows=1)
            check(*run_latent(cache, queries, 4, route, gen, dtype=torch.float32))


def test_latent_width_other_than_deepseek(gen):
    """Checkpoints with other latent widths (a rank that is not a power of two)."""
    rank, rope = (256, 32) if GPU else (48, 8)
    cache, _, queries = latent_batch(gen, dtype=torch.bfloat16, page_size=16, rows=3, rank=rank, rope=rope)
    out, lse, ref, ref_lse = run_latent(cache, queries, 8, "split", gen, dtype=torch.bfloat16, rank=rank,
                                        rope=rope)
    check(out, lse, ref, ref_lse)


@pytest.mark.gpu  # a 128K-row latent history
@pytest.mark.parametrize("heads", [16, 128])
def test_latent_mixed_long_and_short_batch(heads, gen):
    layout = KVLayout(num_layers=1, kind="mla", kv_lora_rank=512, rope_dim=64, dtype=torch.bfloat16)
    cache = PagedKVCache(layout, CacheConfig(page_size=16, num_pages=8400), device=DEVICE)
    chains = [cache.new_chain(), cache.new_chain()]
    for chain, n in zip(chains, (131072, 100)):
        for start in range(0, n, 16384):
            m = min(16384, n - start)
            cache.storage.write(0, chain.append(m), 0.5 * torch.randn(m, 576, device=DEVICE))
    queries = [SequenceQuery.from_chain(c, 1) for c in chains]
    plan = plan_attention(queries, AttentionShape(heads, 1, 576, 512), DeviceSpec.cuda(), page_size=16)
    assert plan.route == Route.SPLIT and plan.num_partitions > 1
    assert sum(1 for w in plan.work if 1 in w.query_rows) == 1  # the short one is not split
    q = (0.5 * torch.randn(2, heads, 576, device=DEVICE)).to(torch.bfloat16)
    check(*triton_and_reference(plan, q, cache.storage.key_cache(0), cache.storage.value_cache(0), page_size=16,
                                scale=576**-0.5, device=DEVICE))


@pytest.mark.parametrize("rows", [1, 5])
def test_mla_layer_absorbed_on_triton_matches_naive_reference(rows, gen):
    """A whole MLA layer: the latent kernel (absorbed) against the reference's naive form,
    which decompresses every piece into per-head keys and values."""
    rank, rope = (512, 64) if GPU else (32, 16)
    dims = MLADims(hidden_size=64, num_heads=4, q_lora_rank=None, kv_lora_rank=rank, qk_nope_head_dim=16,
                   qk_rope_head_dim=rope, v_head_dim=16)
    rotary = RotaryEmbedding(rope, base=10000.0, max_position=4096, interleaved=True)
    layer = MultiHeadLatentAttention(dims, 0, rotary, scale=(16 + rope) ** -0.5)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    layer = layer.to(DEVICE)
    rotary.init_buffers(DEVICE)
    layout = KVLayout(num_layers=1, kind="mla", kv_lora_rank=rank, rope_dim=rope, dtype=torch.float32)
    cache = PagedKVCache(layout, CacheConfig(page_size=16, num_pages=64), device=DEVICE)
    chain = cache.new_chain()
    history = 150
    cache.storage.write(0, chain.append(history), torch.randn(history, rank + rope, generator=gen).to(DEVICE))
    chain.seal()
    slots = torch.tensor(chain.append(rows), device=DEVICE)
    x = torch.randn(rows, 64, generator=gen).to(DEVICE)
    positions = torch.arange(history, history + rows, device=DEVICE)
    outputs = {}
    for name, backend, mode in (("triton", TritonBackend(page_size=16, device=DEVICE, poison=True), "absorbed"),
                                ("naive", TorchReferenceBackend(page_size=16, device=DEVICE), "naive")):
        plan = plan_attention([SequenceQuery.from_chain(chain, rows)], dims.attention_shape(mode),
                              DeviceSpec.cpu(), page_size=16, route="split", num_partitions=3)
        meta = AttentionMetadata(backend, backend.prepare(plan), cache.storage, slots, mla_mode=mode)
        with torch.no_grad():
            outputs[name] = layer(x, positions, meta)
    assert torch.isfinite(outputs["triton"]).all()
    torch.testing.assert_close(outputs["triton"], outputs["naive"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("wide", [False, True])
def test_latent_page_offsets_in_32_or_64_bits_give_the_reference(wide, gen, monkeypatch):
    """Both page-offset widths of the latent stage 1 (forced: the caches here are small)."""
    from segkv.kernels.attention import mla_attention

    calls = []
    monkeypatch.setattr(mla_attention, "wide_offsets", lambda *caches: calls.append(caches) or wide)
    cache, _, queries = latent_batch(gen, dtype=torch.bfloat16, page_size=16, rows=2)
    for route in ("single", "split"):
        out, lse, ref, ref_lse = run_latent(cache, queries, 4, route, gen, dtype=torch.bfloat16)
        check(out, lse, ref, ref_lse)
    assert calls
