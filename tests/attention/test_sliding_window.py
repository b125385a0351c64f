"""Sliding-window attention as a bound of the plan: each row sees its last ``window`` positions
(itself included), on every route, for decode rows, prompt chunks, forks sharing a history
(cascade) and tree verify windows, on the reference and the Triton kernels (the interpreter on
the CPU), against a dense float64 oracle; the plan leaves out the pages before the window."""

from __future__ import annotations

import pytest
import torch

from attention_helpers import forked_history, gather_kv
from gpu_helpers import DEVICE
from segkv.attention import AttentionShape, DeviceSpec, Route, SequenceQuery, TorchReferenceBackend, plan_attention
from segkv.attention.triton_backend import PlanCapacity, TritonBackend
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, KVLayout

ROUTES = [r.value for r in Route]


def windowed_oracle(cache, chains, queries, q, scale, window, masks=None):
    """Float64 attention of each query row over its chain's keys ``pos - window < k <= pos``
    (rows at consecutive positions from ``query_start``), or where ``masks`` gives one, per query
    a bool mask ``(rows, keys)`` of what each row sees (a tree's)."""
    outs, row = [], 0
    batch = type("B", (), {"cache": cache})()
    for index, (chain, query) in enumerate(zip(chains, queries)):
        key, value = (t.double().cpu() for t in gather_kv(batch, chain))
        n, kv_heads, dim = key.shape
        rows = q[row:row + query.num_query_rows].double().cpu()
        row += query.num_query_rows
        heads = rows.shape[1]
        pos = query.query_start + torch.arange(query.num_query_rows)
        keys = torch.arange(n)
        see = (keys[None, :] <= pos[:, None]) & (keys[None, :] > pos[:, None] - window)
        if masks is not None:
            see = masks[index]
        scores = torch.einsum("rhgd,nhd->rhgn", rows.reshape(len(pos), kv_heads, heads // kv_heads, dim), key) * scale
        weights = torch.softmax(scores.masked_fill(~see[:, None, None, :], float("-inf")), dim=-1).nan_to_num(0.0)
        outs.append(torch.einsum("rhgn,nhd->rhgd", weights, value).reshape(len(pos), heads, -1))
    return torch.cat(outs)


def batch(gen, *, dtype, rows: int, page_size: int = 16, segments: int = 4):
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, dtype=dtype)
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=128), device=DEVICE,
                         compaction=CompactionPolicy(enabled=False))
    chains = forked_history(cache, gen, rows=rows, segments=segments)
    queries = [SequenceQuery.from_chain(c, rows) for c in chains]
    q = torch.randn(3 * rows, 8, 32, generator=gen).to(dtype).to(DEVICE)
    return cache, chains, queries, q, AttentionShape(8, 2, 32, 32)


def run(backend_cls, plan, cache, q, *, capacity=None):
    kwargs = {"poison": True, "capacity": capacity} if backend_cls is TritonBackend else {}
    backend = backend_cls(page_size=cache.page_size, device=DEVICE, **kwargs)
    out, lse = backend.run(backend.prepare(plan), q, cache.storage.key_cache(0), cache.storage.value_cache(0),
                           scale=32 ** -0.5, out_dtype=torch.float32)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    return out.double().cpu()


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("rows,window", [(1, 5), (1, 20), (17, 9), (17, 40)])
def test_windows_on_every_route(route, rows, window, gen):
    """Decode rows and prompt chunks of three sequences over a segmented, forked history
    (mid-page boundaries; ``cascade`` shares it), windows shorter and longer than a page."""
    cache, chains, queries, q, shape = batch(gen, dtype=torch.float32, rows=rows)
    plan = plan_attention(queries, shape, DeviceSpec.cpu(), page_size=cache.page_size, route=route,
                          num_partitions=3 if route == "split" else None, window=window)
    assert plan.window == window and plan.describe()["window"] == window
    want = windowed_oracle(cache, chains, queries, q, 32 ** -0.5, window)
    for backend_cls in (TorchReferenceBackend, TritonBackend):
        torch.testing.assert_close(run(backend_cls, plan, cache, q), want, rtol=0, atol=2e-5)


def test_the_plan_leaves_out_pages_before_the_window(gen):
    """A decode row over 300 rows with a 20-row window: its pieces hold only the pages from the
    one holding its window's first row (at most window + page_size - 1 rows before the row)."""
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    cache = PagedKVCache(layout, CacheConfig(page_size=16, num_pages=64), device=DEVICE)
    chain = cache.new_chain()
    for n in (150, 100, 50):  # three sealed segments, then a one-row tail
        chain.append(n)
        chain.seal()
    chain.append(1)
    query = SequenceQuery.from_chain(chain, 1)
    for route in ROUTES:
        plan = plan_attention([query], AttentionShape(8, 2, 32, 32), DeviceSpec.cpu(), page_size=16, route=route,
                              window=20)
        rows = sum(p.num_rows for p in plan.pieces)
        assert rows <= 20 + 16 - 1 + 16, (route, rows)  # the window, its first page's lead, the tail page
        full = plan_attention([query], AttentionShape(8, 2, 32, 32), DeviceSpec.cpu(), page_size=16, route=route)
        assert sum(p.num_rows for p in full.pieces) == 301


def test_bf16_windows_within_the_contract(gen):
    """bf16 caches, exact mode: within a unit in the last place of the float64 oracle's float32
    rounding on the reference and the kernels (the window changes what is attended, not how)."""
    cache, chains, queries, q, shape = batch(gen, dtype=torch.bfloat16, rows=17)
    plan = plan_attention(queries, shape, DeviceSpec.cpu(), page_size=cache.page_size, route="segments", window=12)
    want = windowed_oracle(cache, chains, queries, q, 32 ** -0.5, 12)
    for backend_cls in (TorchReferenceBackend, TritonBackend):
        got = run(backend_cls, plan, cache, q)
        assert ((got - want).abs() <= 2.0 ** -14 * want.abs().clamp(min=1.0)).all()


def test_tree_windows_under_a_sliding_window(gen):
    """A tree verify window (nodes at the tree's start plus their depths) under a window shorter
    than the history: each node sees its ancestors and the history within its own window."""
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    cache = PagedKVCache(layout, CacheConfig(page_size=16, num_pages=32), device=DEVICE,
                         compaction=CompactionPolicy(enabled=False))
    chain = cache.new_chain()
    slots = chain.append(70)
    cache.storage.write(0, slots, *torch.randn(2, 70, 2, 32, generator=gen).to(DEVICE))
    parents = (-1, 0, 0, 1, 1, 2, 3)  # a tree of 7 nodes appended after 63 history rows
    query = SequenceQuery.from_chain(chain, 7, tree_parents=parents)
    q = torch.randn(7, 8, 32, generator=gen).to(DEVICE)
    depths = [0, 1, 1, 2, 2, 2, 3]
    see = torch.zeros(7, 70, dtype=torch.bool)
    for node, mask in enumerate(query.ancestor_masks()):
        position = 63 + depths[node]
        see[node, :63] = torch.arange(63) > position - 10  # history rows within the node's window
        for j in range(7):  # its ancestors and itself (all within the window: depth < 10)
            see[node, 63 + j] = bool(mask >> j & 1)
    want = windowed_oracle(cache, [chain], [query], q, 32 ** -0.5, 10, masks=[see])
    plan = plan_attention([query], AttentionShape(8, 2, 32, 32), DeviceSpec.cpu(), page_size=16, window=10)
    for backend_cls in (TorchReferenceBackend, TritonBackend):
        torch.testing.assert_close(run(backend_cls, plan, cache, q), want, rtol=0, atol=2e-5)


def test_fixed_buffers_hold_windows_only_when_asked(gen):
    """Fixed plan buffers (CUDA graphs) take windowed plans only with ``key_lows``; without, a
    clear error (the step then runs eagerly)."""
    cache, chains, queries, q, shape = batch(gen, dtype=torch.float32, rows=1)
    plan = plan_attention(queries, shape, DeviceSpec.cpu(), page_size=cache.page_size, window=6)
    assert plan.has_key_lows
    sizes = dict(max_pages=64, max_work=16, max_partials=64, max_rows=4)
    with pytest.raises(ValueError, match="sliding window"):
        TritonBackend(page_size=16, device=DEVICE, capacity=PlanCapacity(**sizes)).prepare(plan)
    want = windowed_oracle(cache, chains, queries, q, 32 ** -0.5, 6)
    got = run(TritonBackend, plan, cache, torch.cat([q, torch.zeros_like(q[:1])]),
              capacity=PlanCapacity(**sizes, key_lows=True))
    torch.testing.assert_close(got[:3], want, rtol=0, atol=2e-5)


def test_bad_windows_are_refused(gen):
    cache, chains, queries, q, shape = batch(gen, dtype=torch.float32, rows=1)
    with pytest.raises(ValueError, match="window must be >= 1"):
        plan_attention(queries, shape, DeviceSpec.cpu(), page_size=16, window=0)


def test_fixed_buffers_clear_an_earlier_plans_lows(gen):
    """Fixed buffers holding lows, then a windowed plan whose rows' windows all start on a page
    boundary (no key lows): its kernels must not read the earlier plan's lows."""
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    cache = PagedKVCache(layout, CacheConfig(page_size=16, num_pages=16), device=DEVICE,
                         compaction=CompactionPolicy(enabled=False))
    chain = cache.new_chain()
    cache.storage.write(0, chain.append(26), *torch.randn(2, 26, 2, 32, generator=gen).to(DEVICE))
    query, q, shape = SequenceQuery.from_chain(chain, 1), torch.randn(1, 8, 32, generator=gen).to(DEVICE), \
        AttentionShape(8, 2, 32, 32)
    with_lows = plan_attention([query], shape, DeviceSpec.cpu(), page_size=16, window=11)
    no_lows = plan_attention([query], shape, DeviceSpec.cpu(), page_size=16, window=10)  # starts at row 16
    assert with_lows.has_key_lows and not no_lows.has_key_lows
    fixed = TritonBackend(page_size=16, device=DEVICE, capacity=PlanCapacity(
        max_pages=8, max_work=8, max_partials=8, max_rows=1, max_work_rows=1, key_lows=True))
    fixed.prepare(with_lows)
    got, _ = fixed.run(fixed.prepare(no_lows), q, cache.storage.key_cache(0), cache.storage.value_cache(0),
                       scale=32 ** -0.5, out_dtype=torch.float32)
    want = windowed_oracle(cache, [chain], [query], q, 32 ** -0.5, 10)
    torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=2e-5)
