"""Tree verify windows: every node sees the whole history and its ancestors-or-self, nothing else."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from attention_helpers import gather_kv, make_layout, ulp, write_rows, exact_attention  # noqa: F401
from gpu_helpers import DEVICE
from segkv.attention import (AttentionShape, DeviceSpec, Route, SequenceQuery, TorchReferenceBackend,
                             plan_attention)
from segkv.cache import KVChain, PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, KVLayout

# the exact contract's checks: exact plans on every device (attention_helpers.exact_attention)
pytestmark = pytest.mark.usefixtures("exact_attention")

ROUTES = [None] + [route.value for route in Route]
ATOL = 2e-5  # float32 pieces merged in float32, against float64 dense attention


@dataclass
class TreeBatch:
    cache: PagedKVCache
    chains: list[KVChain]
    queries: list[SequenceQuery]
    query: torch.Tensor  # (R, Hq, Dk), the cache's dtype, on the CPU
    shape: object
    scale: float


def _randint(low: int, high: int, gen: torch.Generator) -> int:
    """A uniform integer in ``[low, high]``."""
    return int(torch.randint(low, high + 1, (1,), generator=gen))


def random_parents(num_nodes: int, gen: torch.Generator) -> tuple[int, ...]:
    """A random tree in node order: each node's parent is -1 or an earlier node."""
    return tuple(_randint(-1, node - 1, gen) for node in range(num_nodes))


def random_branchy_parents(num_nodes: int, gen: torch.Generator) -> tuple[int, ...]:
    """A random tree of ``num_nodes >= 2`` nodes that is not a chain (some node has a sibling or
    skips back)."""
    while True:
        parents = random_parents(num_nodes, gen)
        if any(parent != node - 1 for node, parent in enumerate(parents)):
            return parents


def _write_window(cache: PagedKVCache, chain: KVChain, num_nodes: int, gen: torch.Generator) -> int:
    """Append a window of ``num_nodes`` rows and return its position. Sometimes the window is
    sealed part way (it then crosses a segment boundary), sometimes rows follow it (no node sees
    them)."""
    query_start = chain.num_rows
    head = _randint(1, num_nodes - 1, gen) if num_nodes > 1 and _randint(0, 2, gen) == 0 else num_nodes
    write_rows(cache, chain, head, gen)
    if head < num_nodes:
        chain.seal()
        write_rows(cache, chain, num_nodes - head, gen)
    if _randint(0, 3, gen) == 0:
        write_rows(cache, chain, _randint(1, 5, gen), gen)
    return query_start


def _parents(kind: str, num_nodes: int, gen: torch.Generator) -> tuple[int, ...] | None:
    """The window's ``tree_parents`` for a sequence of ``kind`` (build_tree_batch)."""
    if kind == "causal":
        return None
    if kind == "chain":
        return tuple(range(-1, num_nodes - 1))
    return random_branchy_parents(num_nodes, gen) if kind == "branchy" else random_parents(num_nodes, gen)


def _history_rows(chain: KVChain, page_size: int, gen: torch.Generator) -> int:
    """Rows to add to a history: none, up to a page boundary, one short of one, or random."""
    kind = _randint(0, 3, gen)
    to_boundary = -chain.num_rows % page_size
    return [0, to_boundary, (to_boundary - 1) % page_size, _randint(1, 3 * page_size, gen)][kind]


def tree_layout(name: str, dtype: torch.dtype):
    """``make_layout``'s layouts, and ``"mla64"``: a latent cache of rank 64 and 16 RoPE columns
    (the Triton tests: the interpreter's time grows with the latent width)."""
    if name != "mla64":
        return make_layout(name, dtype)
    layout = KVLayout(num_layers=1, kind="mla", kv_lora_rank=64, rope_dim=16, dtype=dtype)
    return layout, AttentionShape(4, 1, 80, 64), 80 ** -0.5


def build_tree_batch(layout_name: str, page_size: int, gen: torch.Generator, *, num_sequences: int = 4,
                     kinds: tuple[str, ...] | None = None, device: str = "cpu", max_nodes: int = 16,
                     dtype: torch.dtype = torch.float32) -> TreeBatch:
    """Sequences over fresh random caches of ``dtype``: some fork one sealed history, some start
    empty; each adds history of random length (0, to a page boundary, ...), then its window of
    1..``max_nodes`` rows. ``kinds[i]`` is ``"tree"`` (random parents, maybe chain-shaped),
    ``"branchy"`` (a random tree that is not a chain, 2..``max_nodes`` nodes), ``"causal"`` or
    ``"chain"`` (a chain-shaped tree); by default random, the last one branchy. The query is
    ``(R, Hq, Dk)`` of ``dtype`` on the CPU."""
    layout, shape, scale = tree_layout(layout_name, dtype)
    pages = num_sequences * (24 + 2 * max_nodes // page_size) + 16
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=pages),
                         compaction=CompactionPolicy(enabled=False), device=device)
    shared = cache.new_chain()
    if _randint(0, 2, gen):
        write_rows(cache, shared, _randint(1, 3 * page_size, gen), gen)
        shared.seal()
    if kinds is None:
        kinds = tuple(["tree", "causal", "chain"][_randint(0, 2, gen)] for _ in range(num_sequences - 1)) + ("branchy",)
    chains, queries = [], []
    for kind in kinds:
        chain = shared.fork() if shared.num_rows and _randint(0, 2, gen) else cache.new_chain()
        extra = _history_rows(chain, page_size, gen)
        if extra:
            write_rows(cache, chain, extra, gen)
            if _randint(0, 1, gen):
                chain.seal()
        num_nodes = _randint(2 if kind == "branchy" else 1, max_nodes, gen)
        query_start = _write_window(cache, chain, num_nodes, gen)
        parents = _parents(kind, num_nodes, gen)
        chains.append(chain)
        queries.append(SequenceQuery.from_chain(chain, num_nodes, query_start=query_start, tree_parents=parents))
    rows = sum(q.num_query_rows for q in queries)
    query = torch.randn(rows, shape.num_q_heads, shape.key_dim, generator=gen).to(dtype)
    return TreeBatch(cache, chains, queries, query, shape, scale)


def ancestors_or_self(parents: tuple[int, ...], node: int) -> set[int]:
    """The node and every ancestor, by walking up the parent links."""
    seen = set()
    while node >= 0:
        seen.add(node)
        node = parents[node]
    return seen


def visibility(query: SequenceQuery, num_keys: int, *, siblings_visible: bool = False) -> torch.Tensor:
    """``(rows, num_keys)`` bool, written out key by key: the history before the window, then the
    window's ancestors-or-self (a causal window: every earlier row). ``siblings_visible``: the
    deliberately wrong mask that lets a node see every earlier window row."""
    mask = torch.zeros(query.num_query_rows, num_keys, dtype=torch.bool)
    for node in range(query.num_query_rows):
        if query.tree_parents is None or siblings_visible:
            seen = set(range(node + 1))
        else:
            seen = ancestors_or_self(query.tree_parents, node)
        for key in range(num_keys):
            window_row = key - query.query_start
            mask[node, key] = window_row < 0 or window_row in seen
    return mask


def dense_tree_attention(batch: TreeBatch, *, siblings_visible: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention of every row over its whole chain under an explicit boolean mask:
    ``(R, Hq, Dv)`` and its LSE ``(R, Hq)`` (0 and -inf for a row that sees nothing)."""
    outs, lses, row = [], [], 0
    for chain, query in zip(batch.chains, batch.queries):
        q = batch.query[row:row + query.num_query_rows].double()
        row += query.num_query_rows
        key, value = (t.double().cpu() for t in gather_kv(batch, chain))
        num_kv = key.shape[1]
        q = q.reshape(q.shape[0], num_kv, q.shape[1] // num_kv, q.shape[2])
        scores = torch.einsum("rhgd,nhd->rhgn", q, key) * batch.scale
        mask = visibility(query, key.shape[0], siblings_visible=siblings_visible)
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out = torch.einsum("rhgn,nhd->rhgd", probs, value)
        outs.append(out.reshape(out.shape[0], -1, out.shape[-1]))
        lses.append(torch.logsumexp(scores, dim=-1).reshape(out.shape[0], -1))
    return torch.cat(outs), torch.cat(lses)


def check(out: torch.Tensor, lse: torch.Tensor, want: torch.Tensor, want_lse: torch.Tensor, atol: float = ATOL):
    """The output and LSE match the dense oracle; NaN never passes (assert_close rejects it too)."""
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "NaN in the result"
    torch.testing.assert_close(out.double().cpu(), want, rtol=0, atol=atol)
    torch.testing.assert_close(lse.double().cpu(), want_lse, rtol=0, atol=atol)


def run_reference(batch: TreeBatch, plan) -> tuple[torch.Tensor, torch.Tensor]:
    backend = TorchReferenceBackend(page_size=batch.cache.page_size, device=batch.cache.storage.device)
    storage = batch.cache.storage
    return backend.run(backend.prepare(plan), batch.query, storage.key_cache(0), storage.value_cache(0),
                       scale=batch.scale)


def _plan(batch: TreeBatch, route=None, **kwargs):
    return plan_attention(batch.queries, batch.shape, DeviceSpec.cpu(), page_size=batch.cache.page_size,
                          route=route, **kwargs)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("layout", ["gqa4", "mla"])
@pytest.mark.parametrize("page_size", [4, 16])
def test_tree_windows_match_masked_dense_attention(route, layout, page_size, gen):
    batch = build_tree_batch(layout, page_size, gen)
    plan = _plan(batch, route)
    assert plan.has_key_masks
    out, lse = run_reference(batch, plan)
    check(out, lse, *dense_tree_attention(batch))


@pytest.mark.parametrize("layout", ["gqa4", "mla"])
def test_split_histories_with_tree_windows(layout, gen):
    """Long histories cut into partitions; each tree window's piece stays one masked item."""
    batch = build_tree_batch(layout, 4, gen, kinds=("branchy", "causal", "branchy"))
    plan = _plan(batch, "split", num_partitions=3)
    check(*run_reference(batch, plan), *dense_tree_attention(batch))


def test_plan_shape_of_tree_windows(gen):
    """Each tree's nodes share one unmasked history item per history piece and one masked item
    over the window piece; causal and chain-shaped windows carry no masks."""
    batch = build_tree_batch("gqa4", 16, gen, kinds=("branchy", "causal", "chain", "tree"))
    plan = _plan(batch, "single")
    row = 0
    for query in batch.queries:
        rows = tuple(range(row, row + query.num_query_rows))
        row += query.num_query_rows
        items = [item for item in plan.work if item.query_rows[0] in rows]
        masked = [item for item in items if item.key_masks is not None]
        assert all(item.query_rows == rows for item in items)
        assert len(masked) == (1 if query.is_tree else 0)
        if query.is_tree:
            piece = plan.pieces[masked[0].piece]
            lead = masked[0].causal_offsets[0]
            assert 0 <= lead < 16 and piece.num_rows == lead + query.num_query_rows
            assert len(items) == (2 if query.query_start > lead else 1)  # no history piece when it is all in the window's page


def test_tree_histories_share_a_cascade_piece(gen):
    """Two tree windows over one sealed history: the history is one piece read for both."""
    layout, shape, scale = make_layout("gqa4", torch.float32)
    cache = PagedKVCache(layout, CacheConfig(page_size=16, num_pages=32), compaction=CompactionPolicy(enabled=False))
    history = cache.new_chain()
    write_rows(cache, history, 40, gen)
    history.seal()
    chains = [history.fork(), history.fork()]
    queries = []
    for chain, parents in zip(chains, [(-1, 0, 0, 1), (-1, -1, 1)]):
        write_rows(cache, chain, len(parents), gen)
        queries.append(SequenceQuery.from_chain(chain, len(parents), tree_parents=parents))
    query = torch.randn(7, shape.num_q_heads, shape.key_dim, generator=gen)
    batch = TreeBatch(cache, chains, queries, query, shape, scale)
    plan = _plan(batch)
    assert plan.route == Route.CASCADE
    shared = [item for item in plan.work if item.key_masks is None and len(item.query_rows) == 7]
    assert len(shared) == 1 and plan.pieces[shared[0].piece].num_rows == 40
    check(*run_reference(batch, plan), *dense_tree_attention(batch))


@pytest.mark.parametrize("layout", ["gqa4", "mla"])
def test_chain_shaped_tree_is_the_causal_window_exactly(layout, gen):
    batch = build_tree_batch(layout, 16, gen, kinds=("causal", "causal", "causal"))
    causal_plan = _plan(batch)
    causal = run_reference(batch, causal_plan)
    batch.queries = [SequenceQuery(q.spans, q.num_query_rows, q.query_start,
                                   tree_parents=tuple(range(-1, q.num_query_rows - 1))) for q in batch.queries]
    assert not any(q.is_tree for q in batch.queries)
    tree_plan = _plan(batch)
    assert tree_plan == causal_plan
    for got, want in zip(run_reference(batch, tree_plan), causal):
        assert torch.equal(got, want)


@pytest.mark.parametrize(("parents", "num_rows", "query_start", "message"), [
    ((-1, 0), 3, None, "2 entries for 3 query rows"),
    ((-1, 1), 2, None, r"tree_parents\[1\] = 1"),
    ((-1, 2, 0), 3, None, r"tree_parents\[1\] = 2"),
    ((0,), 1, None, r"tree_parents\[0\] = 0"),
    ((-1, -2), 2, None, r"tree_parents\[1\] = -2"),
    ((-1, 0.0), 2, None, "must be an int"),
    ((-1, True), 2, None, "must be an int"),
    ((-1, 0), 2, -1, "inside the chain"),
    ((-1, 0), 2, 5, "inside the chain"),
])
def test_invalid_trees_raise(parents, num_rows, query_start, message, gen):
    layout, _, _ = make_layout("gqa4", torch.float32)
    cache = PagedKVCache(layout, CacheConfig(page_size=4, num_pages=8))
    chain = cache.new_chain()
    write_rows(cache, chain, 6, gen)
    with pytest.raises(ValueError, match=message):
        SequenceQuery.from_chain(chain, num_rows, query_start=query_start, tree_parents=parents)


def test_the_check_has_power(gen):
    """A mask that lets siblings see each other fails the comparison, and so does NaN."""
    batch = build_tree_batch("gqa4", 4, gen, kinds=("branchy", "causal"))
    num_nodes = batch.queries[0].num_query_rows
    if num_nodes < 3:  # the random tree must have siblings: make one that has
        chain = batch.chains[0]
        write_rows(batch.cache, chain, 3, gen)
        batch.queries[0] = SequenceQuery.from_chain(chain, num_nodes + 3,
                                                    tree_parents=(-1,) * (num_nodes + 3))
        batch.query = torch.cat([torch.randn(3, *batch.query.shape[1:], generator=gen), batch.query])
    else:
        batch.queries[0] = SequenceQuery(batch.queries[0].spans, num_nodes, tree_parents=(-1, 0, 0) + tuple(
            _randint(-1, node - 1, gen) for node in range(3, num_nodes)))
    out, lse = run_reference(batch, _plan(batch))
    right = dense_tree_attention(batch)
    check(out, lse, *right)
    with pytest.raises(AssertionError):
        check(out, lse, *dense_tree_attention(batch, siblings_visible=True))
    poisoned = out.clone()
    poisoned[0, 0, 0] = float("nan")
    with pytest.raises(AssertionError, match="NaN"):
        check(poisoned, lse, *right)


# -- the Triton kernels with key masks (Triton's interpreter on the CPU) --------------------------

def check_rounded(out: torch.Tensor, lse: torch.Tensor, want: torch.Tensor, want_lse: torch.Tensor):
    """``out`` (float32 or bfloat16) against the float64 oracle: float32 attention rounded once, so
    within half a unit in the last place of ``out``'s dtype (plus float32 summation noise); LSEs
    finite in the same places, and close there. No NaN."""
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "NaN in the result"
    got = out.double().cpu()
    if out.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=0, atol=5e-5)
    else:
        diff = (got - want).abs()
        bound = ulp(want.to(out.dtype)) + 1e-5
        assert (diff <= bound).all(), f"max diff {diff.max().item()}"
    lse = lse.double().cpu()
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=0, atol=1e-4)


def run_triton(batch: TreeBatch, plan, backend=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan on the Triton backend (outputs poisoned before the kernels run) over layer 0."""
    from segkv.attention.triton_backend import TritonBackend

    backend = backend or TritonBackend(page_size=batch.cache.page_size, device=DEVICE, poison=True)
    storage = batch.cache.storage
    return backend.run(backend.prepare(plan), batch.query.to(DEVICE), storage.key_cache(0),
                       storage.value_cache(0), scale=batch.scale)


TRITON_ROUTES = [(None, None), ("split", 3), ("cascade", None)]


@pytest.mark.parametrize(("route", "partitions"), TRITON_ROUTES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["gqa4", "mla64"])
def test_triton_kernels_take_key_masks(layout, dtype, route, partitions, gen):
    """Random trees of 1-64 nodes beside causal windows, every masked item in the kernels: against
    dense attention under an explicit mask (float64) and the reference on the same plan."""
    batch = build_tree_batch(layout, 16, gen, num_sequences=3, max_nodes=64, dtype=dtype, device=DEVICE,
                             kinds=("tree", "causal", "branchy"))
    plan = _plan(batch, route, num_partitions=partitions)
    assert plan.has_key_masks
    out, lse = run_triton(batch, plan)
    assert out.dtype == dtype
    check_rounded(out, lse, *dense_tree_attention(batch))
    ref, ref_lse = run_reference(batch, plan)
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=2e-5)
    else:  # both float32 attention rounded once
        assert ((out.double().cpu() - ref.double()).abs() <= ulp(ref) + 1e-5).all()


@pytest.mark.parametrize("layout", ["gqa4", "mla64"])
def test_triton_backend_with_tree_windows_alone(layout, gen):
    """Tree windows over no history: every item masked, every row from the kernels."""
    from segkv.attention.triton_backend import TritonBackend

    assert TritonBackend.capabilities.key_masks and TorchReferenceBackend.capabilities.key_masks
    kv_layout, shape, scale = tree_layout(layout, torch.float32)
    cache = PagedKVCache(kv_layout, CacheConfig(page_size=16, num_pages=8), device=DEVICE)
    chain = cache.new_chain()
    parents = random_branchy_parents(_randint(2, 64, gen), gen)
    write_rows(cache, chain, len(parents), gen)
    query = torch.randn(len(parents), shape.num_q_heads, shape.key_dim, generator=gen)
    batch = TreeBatch(cache, [chain], [SequenceQuery.from_chain(chain, len(parents), tree_parents=parents)],
                      query, shape, scale)
    plan = _plan(batch)
    assert all(item.key_masks is not None for item in plan.work)
    check(*run_triton(batch, plan), *dense_tree_attention(batch), atol=5e-5)


@pytest.mark.parametrize("layout", ["gqa4", "mla64"])
def test_fixed_plan_buffers_take_key_masks(layout, gen):
    """A backend with a PlanCapacity (fixed buffers, as CUDA graphs replay them) prepares plans
    with tree windows, one after another with a plan without masks in between (stale words must
    not leak), and gives the eager results (the same float32 work, rounded once)."""
    from segkv.attention.triton_backend import MAX_KEY_MASK_WORDS, PlanCapacity, TritonBackend

    capacity = PlanCapacity(max_pages=128, max_work=64, max_partials=512, max_rows=160, max_work_rows=160)
    assert capacity.sizes()["key_mask_words"] == 160 * MAX_KEY_MASK_WORDS
    fixed = TritonBackend(page_size=16, device=DEVICE, poison=True, capacity=capacity)
    eager = TritonBackend(page_size=16, device=DEVICE, poison=True)
    addresses = set()
    for kinds in [("branchy", "causal"), ("causal", "chain"), ("causal", "branchy", "chain")]:
        batch = build_tree_batch(layout, 16, gen, num_sequences=len(kinds), kinds=kinds, max_nodes=48,
                                 device=DEVICE)
        plan = _plan(batch)
        assert plan.has_key_masks == ("branchy" in kinds)
        prepared = fixed.prepare(plan)
        assert prepared.fixed and prepared.key_masks
        addresses.add(prepared.key_mask_words.data_ptr())
        out, lse = run_triton(batch, plan, fixed)
        want, want_lse = run_triton(batch, plan, eager)
        check(out, lse, *dense_tree_attention(batch), atol=5e-5)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
        assert torch.equal(torch.isfinite(lse), torch.isfinite(want_lse))
    assert len(addresses) == 1
    # a capacity without a mask region compiles the test away and refuses masked plans
    bare = TritonBackend(page_size=16, device=DEVICE,
                         capacity=PlanCapacity(max_pages=128, max_work=64, max_partials=256, max_rows=160,
                                               max_work_rows=64, max_key_mask_words=0))
    masked = _plan(build_tree_batch(layout, 16, gen, num_sequences=1, kinds=("branchy",), device=DEVICE))
    with pytest.raises(ValueError, match="key_mask_words"):
        bare.prepare(masked)


def _wide_plan(page_size: int, num_rows: int, offsets: list[int], masks: list[int]):
    """One piece of ``num_rows`` rows (pages 0, 1, ...) and one masked work item of rows 0.."""
    from segkv.attention.plan import AttentionPlan, Piece, WorkItem, reduce_map_from_work

    pages = -(-num_rows // page_size)
    piece = Piece(tuple(range(pages)), tuple(min(page_size, num_rows - i * page_size) for i in range(pages)))
    work = (WorkItem(0, tuple(range(len(offsets))), tuple(offsets), tuple(masks)),)
    return AttentionPlan(Route.SINGLE, (piece,), work, reduce_map_from_work(work, len(offsets)), len(offsets))


@pytest.mark.parametrize("layout", ["gqa4", "mla64"])
@pytest.mark.parametrize("wide", [True, False], ids=["widest", "few-rows"])
def test_widest_key_masks_and_rows_that_see_nothing(layout, wide, gen):
    """Masks over the widest piece the kernels take (MAX_KEY_MASK_BITS rows, every word, bit 31
    set), or few rows over a short piece (a latent launch of one program per work item, its values
    split between two): the kernels equal the reference; a row whose mask is empty is 0 with LSE
    -inf."""
    from segkv.attention.triton_backend import MAX_KEY_MASK_BITS, TritonBackend

    kv_layout, shape, scale = tree_layout(layout, torch.float32)
    page_size = 16
    if wide:
        n, offsets = MAX_KEY_MASK_BITS, [MAX_KEY_MASK_BITS - 1, 200, 31, 32, 63, 100, 5]
    else:
        n, offsets = 40, [39, 33, 7]
    cache = PagedKVCache(kv_layout, CacheConfig(page_size=page_size, num_pages=n // page_size + 1),
                         compaction=CompactionPolicy(enabled=False), device=DEVICE)
    write_rows(cache, cache.new_chain(), n, gen)  # pages 0.. in order
    masks = []
    for offset in offsets:
        bits = torch.rand(offset + 1, generator=gen) < 0.4
        bits[-1] = True
        if offset >= 31:
            bits[31] = True
        masks.append(sum(1 << j for j in range(offset + 1) if bits[j]))
    masks[-1] = 0  # sees nothing of the piece
    plan = _wide_plan(page_size, n, offsets, masks)
    query = torch.randn(len(offsets), shape.num_q_heads, shape.key_dim, generator=gen).to(DEVICE)
    storage = cache.storage
    backend = TritonBackend(page_size=page_size, device=DEVICE, poison=True)
    out, lse = backend.run(backend.prepare(plan), query, storage.key_cache(0), storage.value_cache(0),
                           scale=scale)
    reference = TorchReferenceBackend(page_size=page_size, device=DEVICE)
    ref, ref_lse = reference.run(reference.prepare(plan), query, storage.key_cache(0), storage.value_cache(0),
                                 scale=scale)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-4)
    assert (out[-1] == 0).all() and (lse[-1] == float("-inf")).all()


def test_key_masks_wider_than_the_maximum_raise():
    from segkv.attention.triton_backend import MAX_KEY_MASK_BITS, TritonBackend, flatten_plan

    n = MAX_KEY_MASK_BITS + 1
    plan = _wide_plan(16, n, [n - 1, 3], [(1 << n) - 1, 0b1011])
    with pytest.raises(ValueError, match="MAX_KEY_MASK_BITS"):
        flatten_plan(plan)
    with pytest.raises(ValueError, match="MAX_KEY_MASK_BITS"):
        TritonBackend(page_size=16, device=DEVICE).prepare(plan)
    # the same piece is fine where the rows reach no further than the maximum
    flatten_plan(_wide_plan(16, n, [MAX_KEY_MASK_BITS - 1, 3], [1 << (MAX_KEY_MASK_BITS - 1), 0b1011]))


def test_flattened_key_mask_layout():
    """``work_key_masks``: each item's first word and words per row (-1, 0 unmasked);
    ``key_mask_words``: each row's 32-bit slices as int32, low rows first."""
    from segkv.attention.plan import AttentionPlan, Piece, WorkItem, reduce_map_from_work
    from segkv.attention.triton_backend import flatten_plan

    pieces = (Piece((0, 1, 2), (16, 16, 8)), Piece((3,), (4,)))
    mask = (1 << 39) | (1 << 31) | 1
    work = (WorkItem(1, (0, 1), (3, 3)), WorkItem(0, (0, 1), (39, 2), (mask, 0b101)))
    plan = AttentionPlan(Route.SINGLE, pieces, work, reduce_map_from_work(work, 2), 2)
    arrays = flatten_plan(plan)
    assert arrays["work_key_masks"].tolist() == [-1, 0, 0, 2]
    assert arrays["key_mask_words"].tolist() == [(1 << 31 | 1) - (1 << 32), 1 << 7, 0b101, 0]
    assert arrays["key_mask_words"].dtype == arrays["work_key_masks"].dtype == np.int32
