"""Naive MLA (``kv_transform``) on the Triton backend against the torch reference.

The backend decompresses each piece's latent rows once into contiguous 16-row pages of per-head
keys and values and runs the GQA kernels over them; the reference attends the same transformed
rows in float32 einsums. Latent caches are random (bf16, float32, FP8), pieces come from forced
``segments`` and ``split`` routes, and the transform decompresses with random weights as
``MultiHeadLatentAttention._decompress`` does. Outputs are poisoned before every launch.
"""

from __future__ import annotations

import pytest
import torch

from attention_helpers import forked_history, exact_attention  # noqa: F401
from gpu_helpers import DEVICE, GPU
from segkv.attention import AttentionShape, DeviceSpec, Route, SequenceQuery, TorchReferenceBackend, plan_attention
from segkv.attention.reference import piece_slots
from segkv.attention.triton_backend import DECOMPRESSED_PAGE_SIZE, PlanCapacity, TritonBackend
from segkv.cache import PagedKVCache
from segkv.config import FP8_KV_DTYPE, CacheConfig, CompactionPolicy, KVLayout
from segkv.attention.metadata import AttentionMetadata
from segkv.kernels.attention import paged_attention as kernels
from segkv.layers.mla import MLADims, MultiHeadLatentAttention
from segkv.layers.rotary import RotaryEmbedding
from test_triton_attention import check

# the exact contract's checks: exact plans on every device (attention_helpers.exact_attention)
pytestmark = pytest.mark.usefixtures("exact_attention")

RANK, ROPE, NOPE, DV = 32, 16, 32, 32
DK = NOPE + ROPE  # 48
SCALE = DK ** -0.5


@pytest.fixture
def no_reference(monkeypatch):
    """Any call of the Triton backend's reference fallback fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton backend ran the torch reference")

    monkeypatch.setattr(TritonBackend, "_reference_run", refuse)


def latent_cache(gen, dtype, *, rows: int, segments: int = 4, page_size: int = 16):
    """A random latent history forked three ways (mid-page boundaries): ``(cache, chains)``."""
    fp8 = dtype == FP8_KV_DTYPE
    layout = KVLayout(num_layers=1, kind="mla", kv_lora_rank=RANK, rope_dim=ROPE, dtype=dtype)
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=128), device=DEVICE,
                         compaction=CompactionPolicy(enabled=False))
    if fp8:
        cache.storage.set_scales(2.0 ** torch.randint(-7, -4, (1, 1), generator=gen), None)
    return cache, forked_history(cache, gen, rows=rows, segments=segments, scale=0.5)


def decompressor(gen, heads: int, dtype: torch.dtype):
    """A ``kv_transform``: latent rows ``(n, 1, RANK + ROPE)`` -> keys ``(n, H, DK)`` and values
    ``(n, H, DV)`` in ``dtype``, through random weights ``(H * (NOPE + DV), RANK)``."""
    weight = (0.25 * torch.randn(heads * (NOPE + DV), RANK, generator=gen)).to(dtype).to(DEVICE)
    calls = []

    def transform(key, value):
        n = key.shape[0]
        c_kv, k_pe = key[:, 0].split([RANK, ROPE], -1)
        kv = (c_kv.to(dtype) @ weight.T).view(n, heads, NOPE + DV)
        k_nope, v = kv.split([NOPE, DV], -1)
        k_pe = k_pe.to(dtype).unsqueeze(1).expand(n, heads, ROPE)
        calls.append(n)
        return torch.cat((k_nope, k_pe), dim=-1), v

    transform.calls = calls
    return transform


def run_both(cache, queries, heads, route, gen, *, dtype, num_partitions=None, precision=None, backend=None):
    """The plan run by the Triton backend (poisoned outputs) and by the reference, same transform:
    ``(plan, prepared, out, lse, ref, ref_lse)``."""
    shape = AttentionShape(heads, heads, DK, DV)
    device = DeviceSpec.cuda() if GPU else DeviceSpec.cpu()
    plan = plan_attention(queries, shape, device, page_size=cache.page_size, route=route,
                          num_partitions=num_partitions, precision=precision)
    assert plan.route == Route(route)
    query = (0.5 * torch.randn(plan.num_query_rows, heads, DK, generator=gen)).to(dtype).to(DEVICE)
    storage = cache.storage
    k, v, scales = storage.key_cache(0), storage.value_cache(0), storage.kv_scales(0)
    transform = decompressor(gen, heads, dtype)
    tb = backend or TritonBackend(page_size=cache.page_size, device=DEVICE, poison=True)
    prepared = tb.prepare(plan)
    out, lse = tb.run(prepared, query, k, v, scale=SCALE, kv_transform=transform, kv_scales=scales)
    # each piece a work item reads is transformed once, whatever the number of its work items
    assert len(transform.calls) == len({item.piece for item in plan.work if plan.pieces[item.piece].num_rows})
    rb = TorchReferenceBackend(page_size=cache.page_size, device=DEVICE)
    ref, ref_lse = rb.run(rb.prepare(plan), query, k, v, scale=SCALE, kv_transform=transform,
                          kv_scales=scales)
    return plan, prepared, out, lse, ref, ref_lse


def check_layout(plan, prepared, page_size: int) -> None:
    """The decompressed plan keeps the plan's work and shape; its pieces start on fresh pages and
    read the reference's slots."""
    layout = prepared.decompressed
    new = layout.prepared.plan
    assert (new.work, new.reduce_map, new.route, new.precision, new.num_partitions) == (
        plan.work, plan.reduce_map, plan.route, plan.precision, plan.num_partitions)
    for index, (piece, moved) in enumerate(zip(plan.pieces, new.pieces)):
        source = layout.sources[index]
        if source is None:
            continue
        assert moved.num_rows == piece.num_rows
        assert layout.starts[index] == moved.page_ids[0] * DECOMPRESSED_PAGE_SIZE
        assert all(rows == DECOMPRESSED_PAGE_SIZE for rows in moved.page_rows[:-1])
        assert torch.equal(source.cpu(), piece_slots(piece, page_size, torch.device("cpu")))


CASES = [("segments", torch.float32, 16), ("split", torch.bfloat16, 16), ("split", torch.float32, 32),
         ("segments", torch.bfloat16, 32)]


@pytest.mark.parametrize("route,dtype,page_size", CASES, ids=[f"{r}-{str(d)[6:]}-{p}" for r, d, p in CASES])
def test_naive_mla_matches_the_reference(route, dtype, page_size, gen, no_reference):
    """Several pieces per sequence (segments, or a history cut in 3 partitions), three sequences of
    3 query rows: float32 within 2e-5, bf16 within one ulp of the reference; the reference never
    runs inside the Triton backend."""
    cache, chains = latent_cache(gen, dtype, rows=3, page_size=page_size)
    queries = [SequenceQuery.from_chain(c, 3) for c in chains]
    plan, prepared, out, lse, ref, ref_lse = run_both(cache, queries, 3, route, gen, dtype=dtype,
                                                      num_partitions=3 if route == "split" else None)
    assert len(plan.pieces) > 3
    if route == "split":
        assert plan.num_partitions > 1
    check_layout(plan, prepared, page_size)
    check(out, lse, ref, ref_lse)


def test_rows_that_see_nothing_give_zero(gen, no_reference):
    """A window before every key and an empty chain: those rows are 0 with LSE -inf, no NaN."""
    cache, chains = latent_cache(gen, torch.bfloat16, rows=2)
    q0, q1 = (SequenceQuery.from_chain(c, 2) for c in chains[:2])
    queries = [q0, SequenceQuery(q1.spans, 2, query_start=-2), SequenceQuery((), 2)]
    for route in ("segments", "split"):
        *_, out, lse, ref, ref_lse = run_both(cache, queries, 2, route, gen, dtype=torch.bfloat16,
                                              num_partitions=2 if route == "split" else None)
        check(out, lse, ref, ref_lse)
        dead = [2, 3, 4, 5]
        assert torch.equal(out[dead], torch.zeros_like(out[dead])) and torch.isneginf(lse[dead]).all()


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_prefill_chunk_runs_the_prefill_programs(precision, gen, no_reference, monkeypatch):
    """A 40-row chunk over a ~100-row history (work items of more than 16 rows): the stage-1
    launch takes the prefill programs (``CAUSAL_END``), in both precision modes."""
    launches = []
    original = kernels.stage1_launch

    def spy(**kwargs):
        meta = original(**kwargs)
        launches.append(meta["CAUSAL_END"])
        return meta

    monkeypatch.setattr(kernels, "stage1_launch", spy)
    cache, chains = latent_cache(gen, torch.bfloat16, rows=40, segments=5)
    queries = [SequenceQuery.from_chain(chains[0], 40)]
    plan, prepared, out, lse, ref, ref_lse = run_both(cache, queries, 2, "split", gen, dtype=torch.bfloat16,
                                                      num_partitions=2, precision=precision)
    assert plan.max_work_rows > kernels.TALL_DECODE_MAX_ROWS and plan.precision == precision
    assert launches == [True]
    check_layout(plan, prepared, 16)
    if precision == "exact":
        check(out, lse, ref, ref_lse)
    else:  # both round P to bf16, the kernel against each tile's running maximum, the reference
        # against the row's, so they differ by about 2^-8 relative (test_precision_modes checks the
        # elementwise bound against the oracle); a wrong key or value would be off by order 1
        diff = (out.double() - ref.double()).norm() / ref.double().norm()
        assert not torch.isnan(out).any() and diff <= 2.0 ** -6, diff
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-4)


def test_tree_window_key_masks(gen, no_reference):
    """A tree verify window (masked work items) beside a causal window."""
    cache, chains = latent_cache(gen, torch.bfloat16, rows=6)
    parents = (-1, 0, 0, 1, 2, 2)
    queries = [SequenceQuery.from_chain(chains[0], 6, tree_parents=parents),
               SequenceQuery.from_chain(chains[1], 6)]
    plan, prepared, out, lse, ref, ref_lse = run_both(cache, queries, 2, "segments", gen,
                                                      dtype=torch.bfloat16)
    assert plan.has_key_masks and prepared.decompressed.prepared.key_masks
    check(out, lse, ref, ref_lse)


def test_fp8_cache_and_fixed_buffers(gen, no_reference):
    """An FP8 latent cache (dequantized before the transform) on a backend with fixed plan buffers,
    its query padded past the plan's rows: the padding rows are 0 with LSE -inf."""
    cache, chains = latent_cache(gen, FP8_KV_DTYPE, rows=2)
    queries = [SequenceQuery.from_chain(c, 2) for c in chains]
    capacity = PlanCapacity(max_pages=64, max_work=64, max_partials=64, max_rows=8)
    tb = TritonBackend(page_size=16, device=DEVICE, poison=True, capacity=capacity)
    plan = plan_attention(queries, AttentionShape(2, 2, DK, DV), DeviceSpec.cpu(), page_size=16,
                          route="split", num_partitions=2)
    prepared = tb.prepare(plan)
    assert prepared.fixed
    query = (0.5 * torch.randn(8, 2, DK, generator=gen)).to(DEVICE)
    storage = cache.storage
    k, v, scales = storage.key_cache(0), storage.value_cache(0), storage.kv_scales(0)
    transform = decompressor(gen, 2, torch.float32)
    out, lse = tb.run(prepared, query, k, v, scale=SCALE, kv_transform=transform, kv_scales=scales)
    rb = TorchReferenceBackend(page_size=16, device=DEVICE)
    ref, ref_lse = rb.run(rb.prepare(plan), query[:6], k, v, scale=SCALE, kv_transform=transform,
                          kv_scales=scales)
    check(out[:6], lse[:6], ref, ref_lse)
    assert torch.equal(out[6:], torch.zeros_like(out[6:])) and torch.isneginf(lse[6:]).all()


def test_mla_layer_naive_on_triton_matches_the_reference(gen, no_reference):
    """A whole MLA layer in naive mode (its own ``_decompress``): a 20-row chunk over a 120-row
    history on the Triton backend and on the reference."""
    dims = MLADims(hidden_size=64, num_heads=4, q_lora_rank=None, kv_lora_rank=RANK, qk_nope_head_dim=16,
                   qk_rope_head_dim=ROPE, v_head_dim=16)
    rotary = RotaryEmbedding(ROPE, base=10000.0, max_position=4096, interleaved=True)
    layer = MultiHeadLatentAttention(dims, 0, rotary, scale=(16 + ROPE) ** -0.5)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    layer = layer.to(DEVICE)
    rotary.init_buffers(DEVICE)
    layout = KVLayout(num_layers=1, kind="mla", kv_lora_rank=RANK, rope_dim=ROPE, dtype=torch.float32)
    outputs = {}
    x = torch.randn(20, 64, generator=gen).to(DEVICE)
    history = torch.randn(120, RANK + ROPE, generator=gen).to(DEVICE)
    for name, backend in (("triton", TritonBackend(page_size=16, device=DEVICE, poison=True)),
                          ("reference", TorchReferenceBackend(page_size=16, device=DEVICE))):
        cache = PagedKVCache(layout, CacheConfig(page_size=16, num_pages=64), device=DEVICE)
        chain = cache.new_chain()
        cache.storage.write(0, chain.append(120), history)
        chain.seal()
        slots = torch.tensor(chain.append(20), device=DEVICE)
        plan = plan_attention([SequenceQuery.from_chain(chain, 20)], dims.attention_shape("naive"),
                              DeviceSpec.cpu(), page_size=16, route="split", num_partitions=3)
        meta = AttentionMetadata(backend, backend.prepare(plan), cache.storage, slots, mla_mode="naive")
        with torch.no_grad():
            outputs[name] = layer(x, torch.arange(120, 140, device=DEVICE), meta)
    assert torch.isfinite(outputs["triton"]).all()
    torch.testing.assert_close(outputs["triton"], outputs["reference"], rtol=0, atol=2e-5)
