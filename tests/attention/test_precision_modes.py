"""The contract's precision modes inside a piece: ``exact`` and ``fast``, their stated bounds
against the float64 oracle, and the planner's choice.

``fast`` rounds each softmax weight (relative to its row's running maximum) to the K/V dtype
before P.V, with float32 sums and the unrounded weights' sum as the normaliser: the error of a
value column is at most ``u * sum_k w_k |v_k|`` (``u`` the dtype's unit roundoff: 2^-8 for
bfloat16, 2^-11 for float16), plus for float16, whose small weights underflow to subnormals, at
most ``2^-25 * max_k w_k * sum_k |v_k|``. ``exact`` splits P into two half-precision parts: about
2^-16 of that sum. Both keep the float32 merge and round once. docs/design.md states the same.
"""

from __future__ import annotations

import pytest
import torch

from attention_helpers import gather_kv
from gpu_helpers import DEVICE, GPU
from segkv.attention import AttentionShape, DeviceSpec, Route, SequenceQuery, TorchReferenceBackend, plan_attention
from segkv.attention.plan import Precision
from segkv.attention.planner import choose_precision
from segkv.attention.triton_backend import TritonBackend
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, KVLayout

UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
# float32 summation over the few hundred keys of these cases, relative to sum w |v|
FLOAT32_NOISE = 2.0 ** -18


def cuda_like(**fields) -> DeviceSpec:
    """A CUDA device's planner view (no GPU needed): 132 SMs, 64 query rows per work item."""
    return DeviceSpec(kind="cuda", name="test", num_multiprocessors=132, blocks_per_multiprocessor=2,
                      max_query_rows_per_work=64, fast_prefill=True, **fields)


def prefill_case(gen, *, dtype, history: int, chunk: int, page_size: int = 16, kv_heads: int = 2, group: int = 4,
                 dim: int = 64, segments: int = 2, scale_q: float = 3.0, spare_pages: int = 8):
    """One chain: a history sealed into ``segments`` segments, then a ``chunk``-row prompt chunk;
    random K/V and a query scaled by ``scale_q`` (peaky weights, so rounding shows)."""
    layout = KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=dim, dtype=dtype)
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=(history + chunk) // page_size + spare_pages),
                         device=DEVICE, compaction=CompactionPolicy(enabled=False))
    chain = cache.new_chain()
    cuts = sorted(int(x) for x in torch.randint(1, history, (segments - 1,), generator=gen)) + [history]
    done = 0
    for cut in cuts:
        slots = chain.append(cut - done)
        cache.storage.write(0, slots, *torch.randn(2, cut - done, kv_heads, dim, generator=gen).to(dtype).to(DEVICE))
        chain.seal()
        done = cut
    slots = chain.append(chunk)
    cache.storage.write(0, slots, *torch.randn(2, chunk, kv_heads, dim, generator=gen).to(dtype).to(DEVICE))
    query = SequenceQuery.from_chain(chain, chunk)
    q = (scale_q * torch.randn(chunk, kv_heads * group, dim, generator=gen)).to(dtype).to(DEVICE)
    return cache, chain, query, q, AttentionShape(kv_heads * group, kv_heads, dim, dim), dim ** -0.5


def oracle_and_bounds(cache, chain, query, q, scale):
    """Float64 attention of the chunk ``(R, Hq, D)``, ``sum_k w_k |v_k|`` and ``max_k w_k sum_k |v_k|``
    per output element (the fast mode's bound terms)."""
    batch = type("B", (), {"cache": cache})()
    key, value = (t.double().cpu() for t in gather_kv(batch, chain))
    rows, heads, dim = q.shape
    kv_heads = key.shape[1]
    qd = q.double().cpu().reshape(rows, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("rhgd,nhd->rhgn", qd, key) * scale
    positions = query.query_start + torch.arange(rows)
    mask = torch.arange(key.shape[0]).unsqueeze(0) <= positions.unsqueeze(1)
    weights = torch.softmax(scores.masked_fill(~mask[:, None, None, :], float("-inf")), dim=-1)
    out = torch.einsum("rhgn,nhd->rhgd", weights, value).reshape(rows, heads, dim)
    spread = torch.einsum("rhgn,nhd->rhgd", weights, value.abs()).reshape(rows, heads, dim)
    visible_abs = torch.einsum("rhgn,nhd->rhgd", mask[:, None, None, :].double().expand_as(weights), value.abs())
    underflow = (weights.amax(dim=-1, keepdim=True) * visible_abs).reshape(rows, heads, dim)
    return out, spread, underflow


def fast_bound(spread, underflow, dtype):
    u = UNIT_ROUNDOFF[dtype]
    return u * spread + (2.0 ** -25 * underflow if dtype == torch.float16 else 0.0) + FLOAT32_NOISE * spread


def run_plan(backend_cls, plan, cache, q, scale, out_dtype=torch.float32):
    kwargs = {"poison": True} if backend_cls is TritonBackend else {}
    backend = backend_cls(page_size=cache.page_size, device=DEVICE, **kwargs)
    out, lse = backend.run(backend.prepare(plan), q, cache.storage.key_cache(0), cache.storage.value_cache(0),
                           scale=scale, out_dtype=out_dtype)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    return out.double().cpu(), lse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend_cls", [TorchReferenceBackend, TritonBackend])
def test_fast_mode_meets_its_bound_and_exact_mode_rejects_it(backend_cls, dtype, gen):
    """Fast-mode partials (float32 output: the error before the single rounding) are within the
    fast bound of the oracle, across a split plan's several pieces. Power: the exact mode's bound
    (2^-14 of the same sum, far looser than exact's 2^-16) rejects fast-mode outputs, and exact
    mode meets it on the same inputs."""
    cache, chain, query, q, shape, scale = prefill_case(gen, dtype=dtype, history=150, chunk=40)
    oracle, spread, underflow = oracle_and_bounds(cache, chain, query, q, scale)
    device = cuda_like()
    fast = plan_attention([query], shape, device, page_size=cache.page_size, route="segments")
    assert fast.precision == Precision.FAST and len(fast.pieces) >= 2
    exact = plan_attention([query], shape, device, page_size=cache.page_size, route="segments", precision="exact")
    out_fast, _ = run_plan(backend_cls, fast, cache, q, scale)
    out_exact, _ = run_plan(backend_cls, exact, cache, q, scale)
    err_fast, err_exact = (out_fast - oracle).abs(), (out_exact - oracle).abs()
    assert (err_fast <= fast_bound(spread, underflow, dtype)).all(), (err_fast / spread).max().item()
    exact_bound = 2.0 ** -14 * spread
    assert (err_exact <= exact_bound).all(), (err_exact / spread).max().item()
    assert (err_fast > exact_bound).any(), "fast mode rounded nothing the exact bound can see"


@pytest.mark.parametrize("route", [r.value for r in Route])
def test_fast_mode_rounds_once_into_the_output_dtype(route, gen):
    """bfloat16 output in fast mode, every route: within the fast bound plus half a unit in the
    last place of the output (the single rounding)."""
    dtype = torch.bfloat16
    cache, chain, query, q, shape, scale = prefill_case(gen, dtype=dtype, history=100, chunk=33, segments=3)
    oracle, spread, underflow = oracle_and_bounds(cache, chain, query, q, scale)
    plan = plan_attention([query], shape, cuda_like(), page_size=cache.page_size, route=route,
                          num_partitions=3 if route == "split" else None)
    assert plan.precision == Precision.FAST
    out, lse = run_plan(TritonBackend, plan, cache, q, scale, out_dtype=dtype)
    half_ulp = torch.finfo(dtype).eps / 2 * (oracle.abs() + fast_bound(spread, underflow, dtype))
    assert ((out - oracle).abs() <= fast_bound(spread, underflow, dtype) + half_ulp).all()
    ref, ref_lse = run_plan(TorchReferenceBackend, plan, cache, q, scale)
    torch.testing.assert_close(lse.cpu(), ref_lse.cpu(), rtol=0, atol=1e-4)  # the LSE is never rounded


def test_float32_fast_equals_exact(gen):
    """In float32 rounding P to the K/V dtype changes nothing: the two modes give equal results
    (the kernels' greedy tokens cannot depend on the mode)."""
    cache, chain, query, q, shape, scale = prefill_case(gen, dtype=torch.float32, history=90, chunk=20)
    for backend_cls in (TorchReferenceBackend, TritonBackend):
        outs = [run_plan(backend_cls, plan_attention([query], shape, cuda_like(), page_size=cache.page_size,
                                                     precision=mode), cache, q, scale)[0]
                for mode in ("exact", "fast")]
        assert torch.equal(outs[0], outs[1])


def test_latent_kernel_fast_mode_meets_the_bound(gen):
    """The latent (MLA) kernel forced to fast: within the fast bound of the float64 oracle over
    the latent rows (values: their first ``rank`` columns)."""
    rank, rope, heads, page = 32, 16, 4, 16
    layout = KVLayout(num_layers=1, kind="mla", kv_lora_rank=rank, rope_dim=rope, dtype=torch.bfloat16)
    cache = PagedKVCache(layout, CacheConfig(page_size=page, num_pages=16), device=DEVICE,
                         compaction=CompactionPolicy(enabled=False))
    chain = cache.new_chain()
    slots = chain.append(70)
    latent = torch.randn(70, rank + rope, generator=gen).to(torch.bfloat16).to(DEVICE)
    cache.storage.write(0, slots, latent)
    query = SequenceQuery.from_chain(chain, 24)
    q = (3 * torch.randn(24, heads, rank + rope, generator=gen)).to(torch.bfloat16).to(DEVICE)
    scale = 0.1
    shape = AttentionShape(heads, 1, rank + rope, rank)
    plan = plan_attention([query], shape, cuda_like(), page_size=page, precision="fast")
    assert plan.precision == Precision.FAST
    storage = cache.storage
    backend = TritonBackend(page_size=page, device=DEVICE, poison=True)
    out, _ = backend.run(backend.prepare(plan), q, storage.key_cache(0), storage.value_cache(0), scale=scale,
                         out_dtype=torch.float32)
    lat = latent.double().cpu()
    scores = torch.einsum("rhd,nd->rhn", q.double().cpu(), lat) * scale
    mask = torch.arange(70)[None, :] <= (query.query_start + torch.arange(24))[:, None]
    weights = torch.softmax(scores.masked_fill(~mask[:, None, :], float("-inf")), dim=-1)
    oracle = torch.einsum("rhn,nd->rhd", weights, lat[:, :rank])
    spread = torch.einsum("rhn,nd->rhd", weights, lat[:, :rank].abs())
    err = (out.double().cpu() - oracle).abs()
    assert (err <= fast_bound(spread, 0, torch.bfloat16)).all()
    assert (err > 2.0 ** -14 * spread).any()  # it did round


def test_planner_picks_fast_for_prefill_programs_only(monkeypatch):
    """Automatic: fast for GQA plans of prefill programs (work items of more than 16 rows, values
    of at most 128 columns, keys of at most 256: naive MLA's prefill too) on a device that
    measured it faster; exact for decode, verify windows of 16 rows, tree windows, latent
    attention, values wider than 128 and the CPU. A setting or argument
    forces it; a bad name is a clear error."""
    import segkv.settings as settings

    gqa, latent, wide = AttentionShape(32, 8, 128, 128), AttentionShape(16, 1, 576, 512), AttentionShape(8, 2, 256, 256)
    naive_mla = AttentionShape(16, 16, 192, 128)  # DeepSeek's prefill: per-head keys 192 wide, values 128
    cuda = cuda_like()
    assert choose_precision(gqa, cuda, 64) == Precision.FAST
    assert choose_precision(gqa, cuda, 17) == Precision.FAST
    assert choose_precision(gqa, cuda, 16) == Precision.EXACT
    assert choose_precision(gqa, cuda, 1) == Precision.EXACT
    assert choose_precision(gqa, cuda, 64, tree_windows=True) == Precision.EXACT
    assert choose_precision(latent, cuda, 64) == Precision.EXACT
    assert choose_precision(wide, cuda, 64) == Precision.EXACT
    assert choose_precision(naive_mla, cuda, 64) == Precision.FAST
    assert choose_precision(gqa, DeviceSpec.cpu(), 4096) == Precision.EXACT
    assert choose_precision(gqa, cuda, 1, "fast") == Precision.FAST
    assert choose_precision(gqa, cuda, 64, "exact") == Precision.EXACT
    assert choose_precision(gqa, cuda, 64, "auto") == Precision.FAST
    with pytest.raises(ValueError, match="unknown attention precision 'quick'.*exact, fast"):
        choose_precision(gqa, cuda, 1, "quick")
    monkeypatch.setenv("SEGKV_ATTENTION_PRECISION", "fast")
    monkeypatch.setattr(settings, "SETTINGS", settings.load_settings())
    assert choose_precision(gqa, DeviceSpec.cpu(), 1) == Precision.FAST
    monkeypatch.setenv("SEGKV_ATTENTION_PRECISION", "exact")
    monkeypatch.setattr(settings, "SETTINGS", settings.load_settings())
    assert choose_precision(gqa, cuda, 64) == Precision.EXACT
    monkeypatch.setenv("SEGKV_ATTENTION_PRECISION", "sloppy")
    monkeypatch.setattr(settings, "SETTINGS", settings.load_settings())
    with pytest.raises(ValueError, match="sloppy"):
        choose_precision(gqa, cuda, 64)


def test_many_head_latent_batches_plan_fast_wide_programs():
    """Latent decode of 128 heads: batch 32 (4096 pairs, compute-bound) is fast, planned for the
    wide programs (64 pairs, one per SM: 2 partitions fill 132 SMs, the split measured fastest);
    batch 1 and 16 heads stay exact; a forced mode and the CPU are obeyed."""
    from segkv.cache.segment import ChainSpan

    shape, few_heads = AttentionShape(128, 1, 576, 512), AttentionShape(16, 1, 576, 512)
    cuda = cuda_like(fast_latent_min_pairs=4096)
    ctx, page = 32768, 32

    def batch(n):
        return [SequenceQuery((ChainSpan(b, tuple(range(b * ctx // page, (b + 1) * ctx // page)), ctx, 0, False),), 1)
                for b in range(n)]
    wide = plan_attention(batch(32), shape, cuda, page_size=page)
    assert (wide.precision, wide.route, wide.num_partitions) == (Precision.FAST, Route.SPLIT, 2), wide.reason
    one = plan_attention(batch(1), shape, cuda, page_size=page)
    assert one.precision == Precision.EXACT and one.num_partitions > 8
    assert plan_attention(batch(32), few_heads, cuda, page_size=page).precision == Precision.EXACT
    # the batches a CUDA graph bucket of 32 replays (17-32) keep its precision; 16 and fewer stay exact
    assert [choose_precision(shape, cuda, 1, num_query_rows=n) for n in (16, 17, 31, 33)] == \
        [Precision.EXACT, Precision.FAST, Precision.FAST, Precision.FAST]
    assert plan_attention(batch(32), shape, cuda, page_size=page, precision="exact").precision == Precision.EXACT
    assert choose_precision(shape, cuda_like(), 1, num_query_rows=32) == Precision.EXACT  # the spec says never
    assert choose_precision(shape, DeviceSpec.cpu(), 1, num_query_rows=32) == Precision.EXACT
    assert choose_precision(shape, cuda, 1, tree_windows=True, num_query_rows=32) == Precision.EXACT


def test_the_plan_reports_its_precision(gen):
    """The plan carries the mode and ``describe()`` (logs, /health, benchmark tables) shows it."""
    cache, chain, query, q, shape, scale = prefill_case(gen, dtype=torch.bfloat16, history=40, chunk=20,
                                                        spare_pages=30)
    plan = plan_attention([query], shape, cuda_like(), page_size=cache.page_size)
    assert plan.precision == Precision.FAST and plan.describe()["precision"] == "fast"
    decode = plan_attention([SequenceQuery.from_chain(chain, 1)], shape, cuda_like(), page_size=cache.page_size)
    assert decode.precision == Precision.EXACT and decode.describe()["precision"] == "exact"
    # 20 forks decoding over one shared history: a cascade piece whose work item holds 20 rows
    # (the prefill programs' kernel) is still decode, exact
    chain.seal()
    forks = [chain.fork() for _ in range(20)]
    for fork in forks:
        fork.append(1)
    cascade = plan_attention([SequenceQuery.from_chain(f, 1) for f in forks], shape, cuda_like(),
                             page_size=cache.page_size)
    assert cascade.route == Route.CASCADE and cascade.max_work_rows == 20
    assert cascade.precision == Precision.EXACT
    with pytest.raises(ValueError, match="unknown attention precision"):
        plan_attention([query], shape, cuda_like(), page_size=cache.page_size, precision="loose")


def test_fixed_buffers_keep_one_precision(gen):
    """A backend with fixed plan buffers (CUDA graphs replay the kernels they captured) refuses a
    plan of the other mode with a clear error; the engine then runs that step eagerly."""
    from segkv.attention.triton_backend import PlanCapacity

    cache, chain, query, q, shape, scale = prefill_case(gen, dtype=torch.bfloat16, history=40, chunk=20)
    backend = TritonBackend(page_size=cache.page_size, device=DEVICE,
                            capacity=PlanCapacity(max_pages=64, max_work=64, max_partials=256, max_rows=32))
    device = cuda_like()
    backend.prepare(plan_attention([query], shape, device, page_size=cache.page_size, precision="exact"))
    with pytest.raises(ValueError, match="fast plan in fixed buffers prepared for exact plans"):
        backend.prepare(plan_attention([query], shape, device, page_size=cache.page_size, precision="fast"))
    backend.prepare(plan_attention([query], shape, device, page_size=cache.page_size, precision="exact"))


@pytest.mark.skipif(not GPU, reason="a long chunk: the interpreter would take minutes")
def test_long_prefill_chunk_fast_mode_on_the_gpu(gen):
    """A 512-row chunk over 4K rows of history on the GPU, pages of 32 (the engine's): prefill
    programs in fast mode within the bound."""
    cache, chain, query, q, shape, scale = prefill_case(gen, dtype=torch.bfloat16, history=4096, chunk=512,
                                                        page_size=32, kv_heads=8, dim=128, segments=3, scale_q=1.0)
    oracle, spread, underflow = oracle_and_bounds(cache, chain, query, q, scale)
    plan = plan_attention([query], shape, DeviceSpec.cuda(), page_size=32)
    assert plan.precision == Precision.FAST
    out, _ = run_plan(TritonBackend, plan, cache, q, scale)
    assert ((out - oracle).abs() <= fast_bound(spread, underflow, torch.bfloat16)).all()


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_prefill_programs_with_keys_wider_than_values(precision, gen):
    """Keys of 160 columns and values of 64 (naive MLA's shape: per-head keys wider than 128,
    values of at most 128): prefill programs with the halved tile, against the reference on the
    same plan (bf16 within one unit in the last place for exact, the fast bound for fast)."""
    from segkv.kernels.attention.paged_attention import stage1_launch

    meta = stage1_launch(dtype=torch.bfloat16, dk=160, dv=64, group=1, page_size=16, max_work_rows=64, element_size=2)
    assert meta["CAUSAL_END"] and meta["BLOCK_N"] == 32 and meta["BLOCK_M"] == 64
    cache, chain, query, _, _, _ = prefill_case(gen, dtype=torch.bfloat16, history=70, chunk=24, kv_heads=2, group=1,
                                                dim=160, segments=2)
    keys = cache.storage.key_cache(0)
    values = torch.randn(*keys.shape[:3], 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    q = torch.randn(24, 2, 160, generator=gen).to(torch.bfloat16).to(DEVICE)
    shape, scale = AttentionShape(2, 2, 160, 64), 160 ** -0.5
    plan = plan_attention([query], shape, cuda_like(), page_size=16, route="segments", precision=precision)
    outs = []
    for backend_cls in (TritonBackend, TorchReferenceBackend):
        backend = backend_cls(page_size=16, device=DEVICE)
        out, _ = backend.run(backend.prepare(plan), q, keys, values, scale=scale, out_dtype=torch.float32)
        assert not torch.isnan(out).any()
        outs.append(out.double().cpu())
    slots = chain.slots()
    flat_v = values.flatten(0, 1)[torch.as_tensor(slots, device=values.device)].double().cpu()
    flat_k = keys.flatten(0, 1)[torch.as_tensor(slots, device=keys.device)].double().cpu()
    scores = torch.einsum("rhd,nhd->rhn", q.double().cpu(), flat_k) * scale
    mask = torch.arange(len(slots))[None, :] <= (query.query_start + torch.arange(24))[:, None]
    weights = torch.softmax(scores.masked_fill(~mask[:, None, :], float("-inf")), dim=-1)
    spread = torch.einsum("rhn,nhd->rhd", weights, flat_v.abs())
    bound = fast_bound(spread, 0, torch.bfloat16) if precision == "fast" else 2.0 ** -14 * spread
    assert ((outs[0] - outs[1]).abs() <= 2 * bound).all()


def test_many_head_latent_fast_programs(gen):
    """Latent decode of many heads (64 pairs or more a work item) in fast mode takes the wide
    programs (64 pairs, 8 warps, no value split), within the fast bound of the float64 oracle;
    exact keeps the 16-pair programs."""
    from segkv.kernels.attention.mla_attention import mla_stage1_launch

    wide = mla_stage1_launch(dtype=torch.bfloat16, rank=512, rope=64, num_heads=128, page_size=32, max_work_rows=1,
                             element_size=2, num_rows=32, fast=True)
    assert wide["BLOCK_M"] == 64 and wide["num_warps"] == 8 and wide["VALUE_SPLIT"] == 1
    narrow = mla_stage1_launch(dtype=torch.bfloat16, rank=512, rope=64, num_heads=128, page_size=32, max_work_rows=1,
                               element_size=2, num_rows=32)
    assert narrow["BLOCK_M"] == 16
    rank, rope, heads, page, rows = 32, 16, 64, 16, 60
    layout = KVLayout(num_layers=1, kind="mla", kv_lora_rank=rank, rope_dim=rope, dtype=torch.bfloat16)
    cache = PagedKVCache(layout, CacheConfig(page_size=page, num_pages=16), device=DEVICE,
                         compaction=CompactionPolicy(enabled=False))
    chains, latents = [], []
    for n in (rows, rows // 2):
        chain = cache.new_chain()
        latent = torch.randn(n, rank + rope, generator=gen).to(torch.bfloat16).to(DEVICE)
        cache.storage.write(0, chain.append(n), latent)
        chains.append(chain)
        latents.append(latent)
    queries = [SequenceQuery.from_chain(c, 1) for c in chains]
    q = (3 * torch.randn(2, heads, rank + rope, generator=gen)).to(torch.bfloat16).to(DEVICE)
    plan = plan_attention(queries, AttentionShape(heads, 1, rank + rope, rank), cuda_like(), page_size=page,
                          precision="fast")
    backend = TritonBackend(page_size=page, device=DEVICE, poison=True)
    out, _ = backend.run(backend.prepare(plan), q, cache.storage.key_cache(0), cache.storage.value_cache(0),
                         scale=0.1, out_dtype=torch.float32)
    for i, lat in enumerate(latents):
        lat = lat.double().cpu()
        weights = torch.softmax(torch.einsum("hd,nd->hn", q[i].double().cpu(), lat) * 0.1, dim=-1)
        oracle = weights @ lat[:, :rank]
        spread = weights @ lat[:, :rank].abs()
        assert ((out[i].double().cpu() - oracle).abs() <= fast_bound(spread, 0, torch.bfloat16)).all()
