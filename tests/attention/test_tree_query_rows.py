"""A tree whose query rows are only its last nodes (a draft head growing a tree a level a step):
each queried node sees the history before the tree and its ancestors-or-self, nothing else."""

from __future__ import annotations

import pytest
import torch

from attention_helpers import gather_kv, make_layout, write_rows
from segkv.attention import DeviceSpec, SequenceQuery, TorchReferenceBackend, plan_attention
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy


def _level_tree(levels: list[int], gen: torch.Generator) -> tuple[int, ...]:
    """A tree built a level at a time: ``levels[d]`` nodes at depth ``d``, each a child of a random
    node of the level above (-1 for depth 0)."""
    parents, above = [], [-1]
    for width in levels:
        level = []
        for _ in range(width):
            parents.append(above[int(torch.randint(0, len(above), (1,), generator=gen))])
            level.append(len(parents) - 1)
        above = level
    return tuple(parents)


def _dense(batch_query, key, value, scale, visible):
    """Float64 attention under an explicit ``visible (R, N)`` mask; ``(R, Hq, Dv)`` and LSE."""
    q = batch_query.double()
    num_kv = key.shape[1]
    q = q.reshape(q.shape[0], num_kv, q.shape[1] // num_kv, q.shape[2])
    scores = torch.einsum("rhgd,nhd->rhgn", q, key.double()) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.einsum("rhgn,nhd->rhgd", torch.softmax(scores, dim=-1).nan_to_num(0.0), value.double())
    return out.reshape(out.shape[0], -1, out.shape[-1]), torch.logsumexp(scores, dim=-1).reshape(out.shape[0], -1)


@pytest.mark.parametrize("layout_name", ["gqa4", "mla"])
@pytest.mark.parametrize("page_size", [4, 16])
def test_last_level_of_a_tree_sees_its_ancestors_only(layout_name, page_size, gen):
    layout, shape, scale = make_layout(layout_name, torch.float32)
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=64),
                         compaction=CompactionPolicy(enabled=False))
    chains, queries = [], []
    for _ in range(3):
        chain = cache.new_chain()
        write_rows(cache, chain, int(torch.randint(1, 3 * page_size, (1,), generator=gen)), gen)
        depth = int(torch.randint(2, 4, (1,), generator=gen))
        # two or more roots: no queried node sees every earlier tree row, so the power check below bites
        levels = [int(torch.randint(2 if d == 0 else 1, 5, (1,), generator=gen)) for d in range(depth)]
        parents = _level_tree(levels, gen)
        write_rows(cache, chain, len(parents), gen)
        queries.append(SequenceQuery.from_chain(chain, levels[-1], tree_parents=parents))
        chains.append(chain)
    rows = sum(q.num_query_rows for q in queries)
    query = torch.randn(rows, shape.num_q_heads, shape.key_dim, generator=gen)
    plan = plan_attention(queries, shape, DeviceSpec.cpu(), page_size=page_size)
    backend = TorchReferenceBackend(page_size=page_size)
    storage = cache.storage
    out, lse = backend.run(backend.prepare(plan), query, storage.key_cache(0), storage.value_cache(0), scale=scale)
    assert not torch.isnan(out).any()
    row = 0
    holder = type("B", (), {"cache": cache})
    for chain, q in zip(chains, queries):
        key, value = (t.double().cpu() for t in gather_kv(holder, chain))
        tree = q.tree_parents
        first = len(tree) - q.num_query_rows
        visible = torch.zeros(q.num_query_rows, key.shape[0], dtype=torch.bool)
        visible[:, : q.tree_start] = True
        for i in range(q.num_query_rows):
            node = first + i
            while node >= 0:
                visible[i, q.tree_start + node] = True
                node = tree[node]
        want, want_lse = _dense(query[row: row + q.num_query_rows], key, value, scale, visible)
        torch.testing.assert_close(out[row: row + q.num_query_rows].double(), want, rtol=0, atol=2e-5)
        torch.testing.assert_close(lse[row: row + q.num_query_rows].double(), want_lse, rtol=0, atol=2e-5)
        # power: the same rows seeing their whole levels (siblings and cousins) differ
        wrong, _ = _dense(query[row: row + q.num_query_rows], key, value, scale,
                          torch.ones_like(visible).tril(q.tree_start + first))
        assert (wrong - want).abs().max() > 1e-3
        row += q.num_query_rows


def test_query_rows_beyond_the_tree_raise(gen):
    layout, _, _ = make_layout("gqa4", torch.float32)
    cache = PagedKVCache(layout, CacheConfig(page_size=4, num_pages=8))
    chain = cache.new_chain()
    write_rows(cache, chain, 6, gen)
    with pytest.raises(ValueError, match="2 entries for 3 query rows"):
        SequenceQuery.from_chain(chain, 3, tree_parents=(-1, 0))
    with pytest.raises(ValueError, match="inside the chain"):
        SequenceQuery.from_chain(chain, 1, tree_parents=(-1,) * 7)
    query = SequenceQuery.from_chain(chain, 2, tree_parents=(-1, -1, 0, 1))
    assert (query.tree_start, query.query_start) == (2, 4)
