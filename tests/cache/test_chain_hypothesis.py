"""Random operation sequences on KV chains checked against a pure-Python model.

Every row ever appended gets a unique id; its random per-layer data is kept in ``rows``.
The model of a chain or snapshot is its list of row ids. After every step the gathered
storage of each chain and snapshot must equal the model's rows bit for bit (rows released
behind a sliding window excepted: they have no storage), and every page's reference count
must equal the number of live holders (SegRefs and tails).
"""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from segkv.cache import OutOfPagesError, PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, KVLayout

LAYOUTS = {
    "mha": KVLayout(num_layers=2, kind="mha", num_kv_heads=1, head_dim=2),
    "mla": KVLayout(num_layers=2, kind="mla", kv_lora_rank=3, rope_dim=1),
}
WIDTH = 4  # 2 * num_kv_heads * head_dim == kv_lora_rank + rope_dim
MAX_CHAINS, MAX_SNAPS = 4, 4


class Held:
    """A chain or snapshot with its model: row ids, and whether tokenless rows ever entered."""

    def __init__(self, obj, ids, tainted):
        self.obj, self.ids, self.tainted = obj, list(ids), tainted


class ChainMachine(RuleBasedStateMachine):
    @initialize(
        kind=st.sampled_from(sorted(LAYOUTS)),
        page_size=st.sampled_from([1, 2, 4, 16]),
        capacity=st.integers(8, 120),
        compact=st.booleans(),
        seed=st.integers(0, 2**31 - 1),
    )
    def setup(self, kind, page_size, capacity, compact, seed):
        num_pages = max(2, -(-capacity // page_size))  # a small pool: about `capacity` rows
        policy = CompactionPolicy(ratio=2.0, max_copy_rows=16) if compact else CompactionPolicy(enabled=False)
        config = CacheConfig(page_size=page_size, num_pages=num_pages)
        self.cache = PagedKVCache(LAYOUTS[kind], config, compaction=policy)
        self.pool = self.cache.pool
        self.gen = torch.Generator().manual_seed(seed)
        self.rows: dict[int, torch.Tensor] = {}
        self.chains: list[Held] = [Held(self.cache.new_chain(), [], False)]
        self.snaps: list[Held] = []
        self.dead_snaps: list = []
        self.compact = compact

    # -- helpers --------------------------------------------------------------------------
    def gather(self, slots):
        read = self.cache.storage.read
        layers = [torch.cat([t.flatten(1) for t in read(i, slots)], dim=1) for i in range(2)]
        return torch.stack(layers, dim=1)

    def expected(self, ids):
        return torch.stack([self.rows[i] for i in ids]) if ids else torch.empty(0, 2, WIDTH)

    @staticmethod
    def parts(obj):
        """(segment, rows used) of a chain (tail last) or a snapshot, in order."""
        parts = [(ref.segment, ref.num_rows) for ref in obj.refs]
        if getattr(obj, "tail", None) is not None:
            parts.append((obj.tail, obj.tail.num_rows))
        return parts

    def live(self, held):
        """(storage slots, model row ids) of the rows of ``held`` that were not released."""
        slots, ids, start = [], [], 0
        for segment, n in self.parts(held.obj):
            first = min(segment.released_rows, n)
            slots += segment.slots(first, n)
            ids += held.ids[start + first : start + n]
            start += n
        return slots, ids

    def state(self, held):
        chain = held.obj
        return chain.num_rows, self.live(held), chain.token_ids(), self.pool.stats(), self.pool.rows_copied

    def pick(self, data, items):
        return items[data.draw(st.integers(0, len(items) - 1))]

    def counters(self):
        return self.pool.pages_allocated_total, self.pool.bytes_copied

    # -- rules ----------------------------------------------------------------------------
    @precondition(lambda self: len(self.chains) < MAX_CHAINS)
    @rule()
    def new_chain(self):
        self.chains.append(Held(self.cache.new_chain(), [], False))

    @precondition(lambda self: self.chains)
    @rule(data=st.data(), n=st.integers(0, 9), with_tokens=st.booleans())
    def append(self, data, n, with_tokens):
        self._append(self.pick(data, self.chains), n, with_tokens)

    @precondition(lambda self: self.chains)
    @rule(data=st.data(), n=st.integers(1, 6))
    def turn(self, data, n):
        """A follow-up turn: append and seal (where compaction happens)."""
        held = self.pick(data, self.chains)
        self._append(held, n, True)
        self._seal_like(held, held.obj.seal)

    def _append(self, held, n, with_tokens):
        ids = list(range(len(self.rows), len(self.rows) + n))
        before = self.state(held)
        try:
            slots = held.obj.append(n, token_ids=ids if with_tokens else None)
        except OutOfPagesError:
            assert self.state(held) == before
            assert n > 0
            event("append: out of pages")
            return
        assert len(slots) == n and held.obj.num_rows == len(held.ids) + n
        values = torch.randn(n, 2, WIDTH, generator=self.gen)
        for layer in range(2):
            x = values[:, layer]
            if self.cache.layout.kind == "mha":
                self.cache.storage.write(layer, slots, x[:, :2].reshape(n, 1, 2), x[:, 2:].reshape(n, 1, 2))
            else:
                self.cache.storage.write(layer, slots, x)
        self.rows.update(zip(ids, values, strict=True))
        held.ids.extend(ids)
        held.tainted |= not with_tokens

    def _seal_like(self, held, op):
        """Run seal/snapshot/fork; a failed compaction may raise OutOfPagesError (a known bug)."""
        open_tail = held.obj.num_tail_rows > 0
        counters, in_use = self.counters(), self.pool.pages_in_use
        try:
            result = op()
        except OutOfPagesError:
            assert self.compact and self.pool.pages_in_use == in_use and self.counters() == counters
            event("seal: compaction out of pages")
            return None
        if not (self.compact and open_tail):  # nothing to seal or to merge: no page, no copy
            assert self.counters() == counters
        elif self.counters() != counters:
            event("seal: compaction merged")
        return result

    @precondition(lambda self: self.chains)
    @rule(data=st.data())
    def seal(self, data):
        held = self.pick(data, self.chains)
        self._seal_like(held, held.obj.seal)
        assert held.obj.tail is None

    @precondition(lambda self: self.chains and len(self.snaps) < MAX_SNAPS)
    @rule(data=st.data())
    def snapshot(self, data):
        held = self.pick(data, self.chains)
        snap = self._seal_like(held, held.obj.snapshot)
        if snap is not None:
            self.snaps.append(Held(snap, held.ids, held.tainted))

    @precondition(lambda self: self.chains and len(self.chains) < MAX_CHAINS)
    @rule(data=st.data())
    def fork(self, data):
        held = self.pick(data, self.chains)
        child = self._seal_like(held, held.obj.fork)
        if child is not None:
            assert self.live(Held(child, held.ids, False)) == self.live(held)
            self.chains.append(Held(child, held.ids, held.tainted))

    @precondition(lambda self: self.chains and self.snaps)
    @rule(data=st.data())
    def restore(self, data):
        held, snap = self.pick(data, self.chains), self.pick(data, self.snaps)
        counters = self.counters()
        held.obj.restore(snap.obj)
        assert self.counters() == counters
        held.ids, held.tainted = list(snap.ids), snap.tainted

    @precondition(lambda self: self.chains and self.dead_snaps)
    @rule(data=st.data())
    def restore_released(self, data):
        held, dead = self.pick(data, self.chains), self.pick(data, self.dead_snaps)
        before = self.state(held)
        try:
            held.obj.restore(dead)
        except ValueError:
            assert self.state(held) == before
        else:
            raise AssertionError("restore of a released snapshot did not raise")

    @precondition(lambda self: self.chains)
    @rule(data=st.data())
    def trim(self, data):
        held = self.pick(data, self.chains)
        n = data.draw(st.integers(0, len(held.ids)))
        counters, before = self.counters(), self.state(held)
        try:
            held.obj.trim(n)
        except ValueError:  # the tail would end among released rows: nothing changes
            assert held.obj.num_released_rows and self.state(held) == before
            event("trim: into released rows")
            return
        assert self.counters() == counters
        del held.ids[len(held.ids) - n :]

    @precondition(lambda self: self.chains)
    @rule(data=st.data())
    def release_behind_a_window(self, data):
        """Give back the pages before a position that the chain alone holds (a sliding window)."""
        held = self.pick(data, self.chains)
        position = data.draw(st.integers(0, len(held.ids)))
        counters, in_use = self.counters(), self.pool.pages_in_use
        freed = held.obj.release_rows_before(position)
        assert self.pool.pages_in_use == in_use - freed and self.counters() == counters
        assert held.obj.num_rows == len(held.ids)
        if freed:
            event("release behind a window: pages freed")

    @precondition(lambda self: self.chains)
    @rule(data=st.data(), drop=st.booleans())
    def release_chain(self, data, drop):
        held = self.pick(data, self.chains)
        held.obj.release()
        held.ids, held.tainted = [], False
        if drop:
            self.chains.remove(held)

    @precondition(lambda self: self.snaps)
    @rule(data=st.data())
    def release_snapshot(self, data):
        snap = self.pick(data, self.snaps)
        snap.obj.release()
        snap.obj.release()  # idempotent
        self.snaps.remove(snap)
        if snap.ids:  # an empty released snapshot still reports live (see test_chain.py)
            self.dead_snaps.append(snap.obj)

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def contents_match_the_model(self):
        for held in self.chains:
            slots, ids = self.live(held)
            assert held.obj.num_rows == len(held.ids) and len(slots) == len(set(slots)) == len(ids)
            assert len(ids) == len(held.ids) - held.obj.num_released_rows
            assert torch.equal(self.gather(slots), self.expected(ids))
            tokens = held.obj.token_ids()
            if not held.tainted:
                assert tokens == held.ids
            elif tokens is not None:
                assert tokens == held.ids
        for snap in self.snaps:
            slots, ids = self.live(snap)
            assert snap.obj.num_rows == len(snap.ids) and snap.obj.live
            assert torch.equal(self.gather(slots), self.expected(ids))
            if not snap.tainted:
                assert snap.obj.token_ids() == snap.ids

    @invariant()
    def ref_counts_match_holders(self):
        holders: Counter[int] = Counter()
        for held in self.chains:
            for ref in held.obj.refs:
                holders.update(ref.page_ids)
            if held.obj.tail is not None:
                holders.update(held.obj.tail.live_page_ids)
        for snap in self.snaps:
            for ref in snap.obj.refs:
                holders.update(ref.page_ids)
        for page in range(self.pool.num_pages):
            assert self.pool.ref_count(page) == holders[page], page
        assert self.pool.pages_in_use == len(holders)
        pages_for = self.pool.pages_for_rows
        for held in self.chains:
            tail = held.obj.tail
            if tail is not None:  # a tail's pages belong to its chain alone, and no spare page
                assert all(self.pool.ref_count(p) == 1 for p in tail.live_page_ids)
                assert len(tail.page_ids) == pages_for(tail.num_rows)
        for ref in [r for h in self.chains + self.snaps for r in h.obj.refs]:
            # exactly the pages its rows touch, less the released ones (ids -1 in place)
            assert len(ref.page_tuple) == pages_for(ref.num_rows)
            assert len(ref.page_ids) == pages_for(ref.num_rows) - min(ref.segment.released_pages, len(ref.page_tuple))
            assert all(p >= 0 for p in ref.page_ids)
        assert self.pool.bytes_copied == self.pool.rows_copied * self.cache.layout.row_bytes

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for held in self.chains:
            held.obj.release()
        for snap in self.snaps:
            snap.obj.release()
        assert self.pool.pages_in_use == 0
        assert all(self.pool.ref_count(p) == 0 for p in range(self.pool.num_pages))


ChainMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestChainMachine = ChainMachine.TestCase
