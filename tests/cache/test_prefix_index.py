"""PrefixIndex: reuse of released histories, partial matches, siblings, LRU eviction, counters."""

from __future__ import annotations

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from segkv.cache import KVChain, OutOfPagesError, PagedKVCache
from segkv.cache.prefix_index import PrefixIndex, PrefixMatch
from segkv.config import CacheConfig, CompactionPolicy, KVLayout

PAGE_SIZES = [1, 4, 16]
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4)
WIDTH = 8  # key and value columns of one row
NO_COMPACTION = CompactionPolicy(enabled=False)


def make_cache(page_size, *, num_pages=64, compaction=NO_COMPACTION):
    return PagedKVCache(LAYOUT, CacheConfig(page_size=page_size, num_pages=num_pages), compaction=compaction)


def write_rows(cache, slots, data):
    """Write ``data`` (n, 8) at ``slots``: columns 0..3 are the key, 4..7 the value."""
    cache.storage.write(0, slots, data[:, :4].reshape(-1, 1, 4), data[:, 4:].reshape(-1, 1, 4))


def read_rows(cache, slots):
    k, v = cache.storage.read(0, list(slots))
    return torch.cat([k.flatten(1), v.flatten(1)], dim=1)


def ref_slots(refs):
    return [s for ref in refs for s in ref.slots()]


def turn(cache, chain, tokens, gen):
    """Append one turn with token ids and fresh random rows, seal it; return the rows."""
    data = torch.randn(len(tokens), WIDTH, generator=gen)
    write_rows(cache, chain.append(len(tokens), token_ids=tokens), data)
    chain.seal()
    return data


def conversation(cache, turns, gen):
    """A chain of sealed turns; returns (chain, all tokens, all rows)."""
    chain = cache.new_chain()
    tokens, rows = [], []
    for t in turns:
        rows.append(turn(cache, chain, t, gen))
        tokens += t
    return chain, tokens, torch.cat(rows)


def pages_of(cache, n):
    return cache.pool.pages_for_rows(n)


TURNS = [list(range(100, 105)), list(range(200, 207)), list(range(300, 303))]


# -- matching ---------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_released_history_is_matched_without_allocating(page_size, gen):
    cache = make_cache(page_size)
    pool, index = cache.pool, PrefixIndex(cache.pool)
    chain, tokens, rows = conversation(cache, TURNS, gen)
    assert index.insert(chain.refs) == 15 and len(index) == 3
    in_use = pool.pages_in_use
    chain.release()
    assert pool.pages_in_use == in_use  # the index keeps the rows alive
    allocated = pool.pages_allocated_total
    match = index.match(tokens + [7, 8])
    assert isinstance(match, PrefixMatch) and match.num_tokens == 15
    assert [r.num_rows for r in match.refs] == [5, 7, 3]
    assert torch.equal(read_rows(cache, ref_slots(match.refs)), rows)
    assert pool.pages_allocated_total == allocated and pool.pages_in_use == in_use
    # The caller continues the conversation from the matched refs; history is untouched.
    resumed = KVChain(pool, refs=match.refs, copy_rows=cache.storage.copy_rows, compaction=cache.compaction)
    assert resumed.token_ids() == tokens
    turn(cache, resumed, [7, 8], gen)
    again = index.match(tokens)
    assert torch.equal(read_rows(cache, ref_slots(again.refs)), rows)
    again.release()
    resumed.release()
    index.clear()
    assert pool.pages_in_use == 0 and len(index) == 0


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_divergence_mid_segment_gives_a_partial_ref(page_size, gen):
    cache = make_cache(page_size)
    index = PrefixIndex(cache.pool)
    chain, tokens, rows = conversation(cache, TURNS, gen)
    index.insert(chain.refs)
    second = chain.refs[1].segment
    chain.release()
    query = tokens[:8] + [999] + tokens[9:]  # diverges at row 3 of the second turn
    match = index.match(query)
    assert match.num_tokens == 8 and [r.num_rows for r in match.refs] == [5, 3]
    assert match.refs[1].segment is second
    assert len(match.refs[1].page_ids) == pages_of(cache, 3)  # holds only the pages it touches
    assert torch.equal(read_rows(cache, ref_slots(match.refs)), rows[:8])
    # A chain built on the partial ref writes its new rows on fresh pages.
    resumed = KVChain(cache.pool, refs=match.refs)
    turn(cache, resumed, [999], gen)
    assert torch.equal(read_rows(cache, ref_slots(index.match(tokens).refs)), rows)
    miss = index.match([1, 2, 3])
    assert miss.refs == [] and miss.num_tokens == 0


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_separately_computed_chains_are_siblings(page_size, gen):
    cache = make_cache(page_size)
    index = PrefixIndex(cache.pool)
    first = [1, 2, 3, 4, 5, 6]
    a, a_tokens, a_rows = conversation(cache, [first, [10, 11, 12]], gen)
    b, b_tokens, b_rows = conversation(cache, [first, [20, 21, 22, 23]], gen)
    assert index.insert(a.refs) == 9 and index.insert(b.refs) == 10
    assert len(index) == 4 and len(index._root.children[1]) == 2
    a_segs, b_segs = [r.segment for r in a.refs], [r.segment for r in b.refs]
    a.release()
    b.release()
    for tokens, rows, segs in ((a_tokens, a_rows, a_segs), (b_tokens, b_rows, b_segs)):
        match = index.match(tokens + [0])
        assert match.num_tokens == len(tokens)
        assert [r.segment for r in match.refs] == segs  # the longest path wins
        assert torch.equal(read_rows(cache, ref_slots(match.refs)), rows)
        match.release()
    only_first = index.match(first)
    assert only_first.num_tokens == 6 and len(only_first.refs) == 1
    only_first.release()
    # The same tokens computed as one turn: equal matches prefer the path with fewer refs.
    c, _, c_rows = conversation(cache, [a_tokens], gen)
    assert index.insert(c.refs) == 9 and len(index) == 5
    c_segment = c.refs[0].segment
    c.release()
    tie = index.match(a_tokens)
    assert tie.num_tokens == 9 and [r.segment for r in tie.refs] == [c_segment]
    assert torch.equal(read_rows(cache, ref_slots(tie.refs)), c_rows)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_inserting_twice_adds_nothing(page_size, gen):
    cache = make_cache(page_size)
    index = PrefixIndex(cache.pool)
    chain, _, _ = conversation(cache, TURNS, gen)
    index.insert(chain.refs)
    counts = [cache.pool.ref_count(p) for p in range(cache.pool.num_pages)]
    stats = index.stats()
    assert index.insert(chain.refs) == 0 and index.insert(chain.refs[:2]) == 0
    assert index.stats() == stats and len(index) == 3
    assert [cache.pool.ref_count(p) for p in range(cache.pool.num_pages)] == counts


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_longer_ref_extends_a_leaf_and_mid_segment_forks_branch(page_size, gen):
    cache = make_cache(page_size)
    index = PrefixIndex(cache.pool)
    a, tokens, rows = conversation(cache, [list(range(10))], gen)
    short = a.fork()
    short.trim(4)  # [S1 (6 rows)]
    assert index.insert(short.refs) == 6 and index.insert(a.refs) == 4 and len(index) == 1
    assert index.stats()["num_cached_tokens"] == 10
    branch_rows = turn(cache, short, [50, 51], gen)  # [S1 (6), S3]: S3 follows row 6 of S1
    assert index.insert(short.refs) == 2 and len(index) == 3  # S1 (6) -> S3 beside S1 (10)
    whole = index.match(tokens)
    assert [r.num_rows for r in whole.refs] == [10]
    branch = index.match(tokens[:6] + [50, 51])
    assert [r.num_rows for r in branch.refs] == [6, 2]
    assert torch.equal(read_rows(cache, ref_slots(branch.refs)), torch.cat([rows[:6], branch_rows]))
    for held in (whole, branch, a, short):
        held.release()
    assert index.num_evictable_pages() == pages_of(cache, 10) + pages_of(cache, 2)
    assert index.evict(10**6) == pages_of(cache, 10) + pages_of(cache, 2)
    assert cache.pool.pages_in_use == 0 and len(index) == 0


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_a_node_with_children_is_never_extended(page_size, gen):
    cache = make_cache(page_size)
    index = PrefixIndex(cache.pool)
    a, tokens, rows = conversation(cache, [list(range(10))], gen)
    branch, covered = a.fork(), a.fork()
    branch.trim(4)
    branch_rows = turn(cache, branch, [50, 51], gen)  # [S1 (6), S3]
    covered.trim(6)  # [S1 (4)]
    assert index.insert(branch.refs) == 8 and len(index) == 2
    assert index.insert(a.refs) == 4 and len(index) == 3  # S1 (10) beside S1 (6) -> S3
    assert index.insert(covered.refs) == 0 and len(index) == 3  # within S1 (10) already
    for chain in (a, branch, covered):
        chain.release()
    whole, forked = index.match(tokens + [50]), index.match(tokens[:6] + [50, 51])
    assert [r.num_rows for r in whole.refs] == [10] and [r.num_rows for r in forked.refs] == [6, 2]
    assert torch.equal(read_rows(cache, ref_slots(whole.refs)), rows)
    assert torch.equal(read_rows(cache, ref_slots(forked.refs)), torch.cat([rows[:6], branch_rows]))


def test_refs_without_tokens_stop_the_insertion(gen):
    cache = make_cache(4)
    index = PrefixIndex(cache.pool)
    chain = cache.new_chain()
    turn(cache, chain, [1, 2, 3], gen)
    chain.append(2)  # rows without token ids
    chain.seal()
    turn(cache, chain, [4, 5], gen)
    assert index.insert(chain.refs) == 3 and len(index) == 1
    assert index.insert(chain.refs[1:]) == 0 and len(index) == 1
    refs = list(chain.refs)
    chain.release()
    with pytest.raises(ValueError, match="released"):
        index.insert(refs)


# -- eviction ---------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_lru_evicts_older_leaves_first(page_size, gen):
    cache = make_cache(page_size)
    pool, index = cache.pool, PrefixIndex(cache.pool)
    sizes = {"a": 5, "b": 9, "c": 3}
    toks = {k: [ord(k) * 100 + i for i in range(n)] for k, n in sizes.items()}
    for k in "abc":
        chain, _, _ = conversation(cache, [toks[k]], gen)
        index.insert(chain.refs)
        chain.release()
    index.match(toks["a"]).release()  # a is now the most recently used; b the least
    in_use = pool.pages_in_use
    assert index.evict(1) == pages_of(cache, 9) and pool.pages_in_use == in_use - pages_of(cache, 9)
    assert index.match(toks["b"]).num_tokens == 0 and len(index) == 2
    assert index.evict(1) == pages_of(cache, 3)  # c before the recently used a
    assert index.evict(0) == 0 and len(index) == 1
    kept = index.match(toks["a"])
    assert kept.num_tokens == 5
    kept.release()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_parents_become_evictable_after_their_children(page_size, gen):
    cache = make_cache(page_size)
    pool, index = cache.pool, PrefixIndex(cache.pool)
    chain, tokens, _ = conversation(cache, TURNS, gen)
    index.insert(chain.refs)
    chain.release()
    assert index.num_evictable_pages() == pool.pages_in_use == sum(pages_of(cache, len(t)) for t in TURNS)
    assert index.evict(1) == pages_of(cache, 3) and len(index) == 2  # the leaf goes first
    match = index.match(tokens)
    assert match.num_tokens == 12
    assert index.evict(10**6) == 0  # the caller's match holds both remaining nodes
    match.release()
    assert index.evict(10**6) == pages_of(cache, 5) + pages_of(cache, 7)  # parent follows child
    assert len(index) == 0 and pool.pages_in_use == 0


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_nodes_held_by_a_chain_or_snapshot_are_never_evicted(page_size, gen):
    cache = make_cache(page_size)
    pool, index = cache.pool, PrefixIndex(cache.pool)
    live, live_tokens, live_rows = conversation(cache, TURNS, gen)
    snapped, snap_tokens, _ = conversation(cache, [[7, 7, 7], [8, 8]], gen)
    dead, _, _ = conversation(cache, [[5] * 6], gen)
    for chain in (live, snapped, dead):
        index.insert(chain.refs)
    snap = snapped.snapshot()
    snapped.release()
    dead.release()
    assert index.num_evictable_pages() == pages_of(cache, 6)
    before = pool.pages_in_use
    assert index.evict(10**6) == pages_of(cache, 6) and pool.pages_in_use == before - pages_of(cache, 6)
    assert len(index) == 5 and index.num_evictable_pages() == 0
    # A chain holding only the first turn (resumed from a match) pins that node only.
    resumed = KVChain(pool, refs=index.match(live_tokens[:5]).refs)
    live.release()
    snap.release()
    expected = sum(pages_of(cache, n) for n in (7, 3, 3, 2))
    assert index.num_evictable_pages() == expected and index.evict(10**6) == expected
    assert len(index) == 1
    assert torch.equal(read_rows(cache, resumed.slots()), live_rows[:5])
    resumed.release()
    assert index.evict(1) == pages_of(cache, 5) and pool.pages_in_use == 0


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_partially_held_node_is_not_evicted(page_size, gen):
    cache = make_cache(page_size)
    index = PrefixIndex(cache.pool)
    chain, tokens, _ = conversation(cache, [list(range(20))], gen)
    index.insert(chain.refs)
    chain.release()
    part = index.match(tokens[:1])  # holds the first page of the node only
    assert index.num_evictable_pages() == 0 and index.evict(10**6) == 0 and len(index) == 1
    part.release()
    assert index.evict(1) == pages_of(cache, 20)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_clear_returns_the_pool_to_empty(page_size, gen):
    cache = make_cache(page_size)
    index = PrefixIndex(cache.pool)
    chains = [conversation(cache, [[i, 1, 2], [3, 4]], gen)[0] for i in range(3)]
    for chain in chains:
        index.insert(chain.refs)
    index.clear()
    assert len(index) == 0 and index.stats()["num_pages_held"] == 0
    assert cache.pool.pages_in_use == sum(pages_of(cache, 3) + pages_of(cache, 2) for _ in chains)
    for chain in chains:
        index.insert(chain.refs)
        chain.release()
    index.clear()
    assert cache.pool.pages_in_use == 0 and index.match([0, 1, 2]).num_tokens == 0


def test_counters_and_stats(gen):
    cache = make_cache(4)
    index = PrefixIndex(cache.pool)
    chain, tokens, _ = conversation(cache, TURNS, gen)
    index.insert(chain.refs)
    index.match(tokens).release()  # 15 of 15
    index.match(tokens[:7] + [0, 0]).release()  # 7 of 9
    index.match([0, 1]).release()  # 0 of 2
    assert index.stats() == {
        "num_nodes": 3,
        "num_shared_nodes": 3,  # the live chain holds them too
        "num_cached_tokens": 15,
        "num_pages_held": 2 + 2 + 1,
        "num_queries": 3,
        "num_hits": 2,
        "num_query_tokens": 26,
        "num_hit_tokens": 22,
    }
    chain.release()
    assert index.stats()["num_shared_nodes"] == 0


# -- random operation sequences ----------------------------------------------------------
MAX_CHAINS = 4
TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=7)  # few ids: many shared prefixes


class IndexMachine(RuleBasedStateMachine):
    """Chains, matches and evictions in random order, checked against the rows written.

    Every written row gets an id; ``expected[segment_id]`` lists the row ids of a segment's
    rows as the chains that inserted it wrote them. Every match must read back exactly those
    rows, and its tokens must be the query's prefix.
    """

    @initialize(
        page_size=st.sampled_from(PAGE_SIZES),
        compact=st.booleans(),
        seed=st.integers(0, 2**31 - 1),
        first=TOKENS,
    )
    def setup(self, page_size, compact, seed, first):
        policy = CompactionPolicy(ratio=2.0, max_copy_rows=8) if compact else NO_COMPACTION
        self.cache = make_cache(page_size, num_pages=max(4, 96 // page_size), compaction=policy)
        self.pool, self.index = self.cache.pool, PrefixIndex(self.cache.pool)
        self.gen = torch.Generator().manual_seed(seed)
        self.rows: list[torch.Tensor] = []
        self.expected: dict[int, list[int]] = {}
        self.chains: list[tuple[KVChain, list[int], list[int]]] = []  # chain, tokens, row ids
        self.histories: list[list[tuple[int, int]]] = []  # inserted (segment id, rows) paths
        self.chains.append((self.cache.new_chain(), [], []))
        self.grow(0, first)
        self.insert_chain(0)

    def pick(self, data):
        return data.draw(st.integers(0, len(self.chains) - 1))

    def check_match(self, query, match):
        """Rows and tokens as written; a path some chain inserted; the longest such path."""
        tokens = [t for ref in match.refs for t in ref.token_ids]
        assert tokens == query[: match.num_tokens]
        assert match.num_tokens == self.longest_indexed_prefix(query)
        got = [(ref.segment.segment_id, ref.num_rows) for ref in match.refs]
        assert not got or any(
            h[: len(got) - 1] == got[:-1] and len(h) >= len(got) and h[len(got) - 1][0] == got[-1][0]
            and h[len(got) - 1][1] >= got[-1][1]
            for h in self.histories
        ), (got, self.histories)
        ids = [i for ref in match.refs for i in self.expected[ref.segment.segment_id][: ref.num_rows]]
        event(f"match of {min(len(match.refs), 3)}+ refs, partial={bool(ids) and len(ids) < len(query)}")
        if ids:
            want = torch.stack([self.rows[i] for i in ids])
            assert torch.equal(read_rows(self.cache, ref_slots(match.refs)), want)
        return ids

    def longest_indexed_prefix(self, query):
        """Brute force over every root-to-node path of the index."""
        best = 0
        for node in self.index._nodes():
            path = []
            while node.ref is not None:
                path[:0] = node.tokens
                node = node.parent
            n = 0
            while n < min(len(path), len(query)) and path[n] == query[n]:
                n += 1
            best = max(best, n)
        return best

    def grow(self, k, tokens):
        """Append one sealed turn to chain ``k``, evicting from the index under pressure."""
        chain, model_tokens, ids = self.chains[k]
        need = self.pool.pages_for_rows(len(tokens))
        if need > self.pool.num_free_pages:
            freed = self.index.evict(need - self.pool.num_free_pages)
            assert freed >= 0
        try:
            slots = chain.append(len(tokens), token_ids=tokens)
        except OutOfPagesError:
            return
        data = torch.randn(len(tokens), WIDTH, generator=self.gen)
        write_rows(self.cache, slots, data)
        ids += range(len(self.rows), len(self.rows) + len(tokens))
        self.rows += list(data)
        model_tokens += tokens
        chain.seal()

    @precondition(lambda self: len(self.chains) < MAX_CHAINS)
    @rule(prefix=st.lists(st.integers(0, 3), max_size=20), extra=TOKENS)
    def start_from_match(self, prefix, extra):
        match = self.index.match(prefix)
        ids = self.check_match(prefix, match)
        chain = KVChain(self.pool, refs=match.refs, copy_rows=self.cache.storage.copy_rows,
                        compaction=self.cache.compaction)
        self.chains.append((chain, prefix[: match.num_tokens], ids))
        self.grow(len(self.chains) - 1, extra)

    @precondition(lambda self: self.chains)
    @rule(data=st.data(), tokens=TOKENS, index_it=st.booleans())
    def append_turn(self, data, tokens, index_it):
        k = self.pick(data)
        self.grow(k, tokens)
        if index_it:  # what an engine does at the end of every turn
            self.insert_chain(k)

    @precondition(lambda self: self.chains)
    @rule(data=st.data())
    def insert(self, data):
        self.insert_chain(self.pick(data))

    def insert_chain(self, k):
        chain, _, ids = self.chains[k]
        start = 0
        for ref in chain.refs:
            span = ids[start : start + ref.num_rows]
            known = self.expected.setdefault(ref.segment.segment_id, span)
            assert known[: len(span)] == span[: len(known)]
            if len(span) > len(known):
                self.expected[ref.segment.segment_id] = span
            start += ref.num_rows
        pages = self.pool.pages_in_use
        self.index.insert(chain.refs)
        assert self.pool.pages_in_use == pages  # indexing only adds references
        self.histories.append([(ref.segment.segment_id, ref.num_rows) for ref in chain.refs])

    @precondition(lambda self: self.chains)
    @rule(data=st.data(), frac=st.floats(0, 1))
    def trim(self, data, frac):
        chain, tokens, ids = self.chains[self.pick(data)]
        n = int(frac * chain.num_rows)
        chain.trim(n)
        del tokens[len(tokens) - n :], ids[len(ids) - n :]

    @precondition(lambda self: 0 < len(self.chains) < MAX_CHAINS)
    @rule(data=st.data())
    def fork(self, data):
        chain, tokens, ids = self.chains[self.pick(data)]
        self.chains.append((chain.fork(), list(tokens), list(ids)))

    @precondition(lambda self: self.chains)
    @rule(data=st.data())
    def release(self, data):
        self.chains.pop(self.pick(data))[0].release()

    @precondition(lambda self: self.chains)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), max_size=3))
    def match_history(self, data, extra):
        _, tokens, _ = self.chains[self.pick(data)]
        query = tokens + extra
        match = self.index.match(query)
        self.check_match(query, match)
        match.release()

    @precondition(lambda self: len(self.index))
    @rule(num_pages=st.integers(0, 12))
    def evict(self, num_pages):
        evictable, in_use, nodes = self.index.num_evictable_pages(), self.pool.pages_in_use, len(self.index)
        freed = self.index.evict(num_pages)
        event(f"evict freed {'none' if not freed else 'some'}, index had {min(nodes, 4)}+ nodes")
        assert freed == in_use - self.pool.pages_in_use
        assert min(num_pages, evictable) <= freed <= evictable
        assert len(self.index) <= nodes

    @invariant()
    def index_holds_are_counted(self):
        if hasattr(self, "index"):
            for page, held in self.index.page_holds().items():
                assert 0 < held <= self.pool.ref_count(page)

    def teardown(self):
        if hasattr(self, "index"):
            for chain, _, _ in self.chains:
                chain.release()
            held = self.pool.pages_in_use
            assert self.index.num_evictable_pages() == held and self.index.evict(held) == held
            self.index.clear()
            assert self.pool.pages_in_use == 0 and len(self.index) == 0


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
