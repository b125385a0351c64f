"""PrefixIndex: a radix tree over sealed segments keyed by token ids, evicted LRU-first."""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from segkv.cache.page_pool import PagePool
from segkv.cache.segment import SegRef, Segment, reaches_released_rows


@dataclass(slots=True)
class PrefixMatch:
    """The result of :meth:`PrefixIndex.match`: new references owned by the caller.

    ``refs`` cover the first ``num_tokens`` tokens of the query in order; hand them to
    ``KVChain(pool, refs=match.refs, ...)`` (which adopts them) or call :meth:`release`.
    """

    refs: list[SegRef] = field(default_factory=list)
    num_tokens: int = 0

    def __post_init__(self) -> None:
        assert self.num_tokens == sum(ref.num_rows for ref in self.refs), "refs must cover num_tokens"

    def release(self) -> None:
        """Give the references back (when the caller does not build a chain from them)."""
        for ref in self.refs:
            ref.release()
        self.refs = []
        self.num_tokens = 0


class _Node:
    """One indexed (segment, num_rows) reference; children are the refs that followed it."""

    __slots__ = ("ref", "tokens", "parent", "children", "last_used")

    def __init__(self, parent: _Node | None, now: int) -> None:
        self.ref: SegRef | None = None  # the index's own reference (None for the root)
        self.tokens: list[int] = []
        self.parent = parent
        self.children: dict[int, list[_Node]] = {}  # first token -> nodes starting with it
        self.last_used = now

    def child_list(self) -> list[_Node]:
        return [c for group in self.children.values() for c in group]


class PrefixIndex:
    """Sealed segments of past chains, matchable by token prefix (one index per pool).

    Each node holds its own :class:`SegRef`, so indexed rows outlive the chains that wrote
    them. Separately computed segments with equal tokens are sibling nodes (a SegRef always
    starts at row 0, so nodes are never split); :meth:`match` returns the longest path.
    Two nodes may reference the same segment with different row counts (a chain forked
    mid-segment continued differently), so pages held by the index are counted per page.
    """

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self._clock = itertools.count(1)  # logical time for LRU: deterministic, no wall clock
        self._root = _Node(None, 0)
        self._num_nodes = 0
        # (segment, page index) -> references the index holds on that page: keyed by position,
        # not page id, since a segment's rows may leave their pages for a lower tier and come back
        self._holds: Counter[tuple[Segment, int]] = Counter()
        # the sliding window of a model whose every layer has one, when chains release the rows
        # behind it (KVChain.release_rows_before): a match must end with its last window live
        self.window: int | None = None
        self.num_queries = self.num_hits = self.num_query_tokens = self.num_hit_tokens = 0

    def __len__(self) -> int:
        return self._num_nodes

    # -- insert -----------------------------------------------------------------------
    def insert(self, refs: Sequence[SegRef]) -> int:
        """Index a chain's sealed references (chain order); return the rows newly held.

        Insertion stops at the first reference without token ids. A path already indexed
        adds nothing; a longer reference to a leaf's segment extends that leaf.
        """
        usable = self._usable_prefix(refs)
        node, added, now = self._root, 0, next(self._clock)
        for i, ref in enumerate(usable):
            node, gained = self._step(node, ref, i == len(usable) - 1, now)
            added += gained
            if node is None:
                break
        return added

    def _usable_prefix(self, refs: Sequence[SegRef]) -> list[SegRef]:
        """The references to index: up to the first without tokens, empty ones skipped."""
        out = []
        for ref in refs:
            if ref.segment.pool is not self.pool:
                raise ValueError("reference belongs to another page pool")
            if not ref.live:
                raise ValueError(f"cannot index released reference {ref!r}")
            if ref.token_ids is None:
                break
            if ref.num_rows:
                out.append(ref)
        return out

    def _step(self, parent: _Node, ref: SegRef, is_last: bool, now: int) -> tuple[_Node | None, int]:
        """Place ``ref`` under ``parent``; return (node to continue from, rows newly held)."""
        same = [c for c in parent.children.get(ref.token_ids[0], ()) if c.ref.segment is ref.segment]
        for child in same:
            if child.ref.num_rows == ref.num_rows:
                child.last_used = now
                return child, 0
        if is_last and any(c.ref.num_rows > ref.num_rows for c in same):
            return None, 0  # already covered by a longer reference to the same segment
        gained = max(0, ref.num_rows - max((c.ref.num_rows for c in same), default=0))
        leaves = [c for c in same if not c.children and c.ref.num_rows < ref.num_rows]
        if leaves:  # extend the leaf: share the longer reference, release the shorter
            node = max(leaves, key=lambda c: c.ref.num_rows)
            node.last_used = now
        else:  # a new node (a sibling if another reference to the segment has children)
            node = _Node(parent, now)
            parent.children.setdefault(ref.token_ids[0], []).append(node)
            self._num_nodes += 1
        self._set_ref(node, ref.share())
        return node, gained

    def _set_ref(self, node: _Node, ref: SegRef | None) -> None:
        """Replace the node's reference (None drops it), keeping page hold counts exact."""
        if ref is not None:
            self._holds.update(_page_keys(ref))
            node.tokens = list(ref.token_ids)
        if node.ref is not None:
            for key in _page_keys(node.ref):
                self._holds[key] -= 1
                if not self._holds[key]:
                    del self._holds[key]
            node.ref.release()
        node.ref = ref

    # -- match ------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest indexed prefix of ``token_ids`` along one path, as new caller-owned refs.

        The last reference may be partial (``share(m)``, possibly mid-page). Matched
        nodes become most recently used. Ties prefer the path with fewer references.
        """
        tokens = list(token_ids)
        end, node, partial = self._search(tokens)
        refs, now = [], next(self._clock)
        while node is not None and node is not self._root:
            node.last_used = now
            refs.append(node.ref.share(partial if partial and not refs else None))
            node = node.parent
        refs.reverse()
        if self.window is not None and _reaches_released_rows(refs, end, self.window):
            for ref in refs:  # the rows a continuation would attend were released: recompute them
                ref.release()
            refs, end = [], 0
        self.num_queries += 1
        self.num_query_tokens += len(tokens)
        self.num_hits += end > 0
        self.num_hit_tokens += end
        return PrefixMatch(refs, end)

    def _search(self, tokens: list[int]) -> tuple[int, _Node | None, int]:
        """Depth-first search: (tokens matched, last node, rows of it used or 0 for all)."""
        best = (0, 0, None, 0)  # (end, -depth, node, partial rows)
        stack = [(self._root, 0, 0)]
        while stack:
            node, pos, depth = stack.pop()
            if pos >= len(tokens):
                continue
            for child in node.children.get(tokens[pos], ()):
                m = _common_prefix(child.tokens, tokens, pos)
                full = m == len(child.tokens)
                cand = (pos + m, -(depth + 1), child, 0 if full else m)
                if cand[:2] > best[:2]:
                    best = cand
                if full:
                    stack.append((child, pos + m, depth + 1))
        return best[0], best[2], best[3]

    # -- eviction ---------------------------------------------------------------------
    def _held_by_index_only(self, node: _Node) -> bool:
        """True when nobody outside the index holds any page of ``node``."""
        return all(_holders(key) == self._holds[key] for key in _page_keys(node.ref))

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages if possible, dropping LRU evictable leaves.

        A leaf is evictable when only the index holds its pages; a parent whose last child
        goes becomes a leaf and may follow in the same call. A segment in a lower KV tier holds no
        pages: dropping it would free none and lose the copy that spares its recompute, so it
        stays. Returns pages actually freed.
        """
        before = self.pool.num_free_pages
        tie = itertools.count()
        heap = [(n.last_used, next(tie), n) for n in self._nodes() if not n.children and self._frees_pages(n)]
        heapq.heapify(heap)
        while heap and self.pool.num_free_pages - before < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._remove(node)
            if parent is not self._root and not parent.children and self._frees_pages(parent):
                heapq.heappush(heap, (parent.last_used, next(tie), parent))
        return self.pool.num_free_pages - before

    def _frees_pages(self, node: _Node) -> bool:
        """Whether dropping ``node`` frees its pages: they are in the pool and only the index holds them."""
        return not node.ref.segment.in_lower_tier and self._held_by_index_only(node)

    def num_evictable_pages(self) -> int:
        """Pages that :meth:`evict` could free right now (whole evictable subtrees)."""
        holders: Counter[tuple[Segment, int]] = Counter()
        for node in self._evictable_subtrees():
            holders.update(_page_keys(node.ref))
        return sum(1 for key, n in holders.items() if not key[0].in_lower_tier and n == _holders(key))

    def segments_by_last_use(self) -> list[Segment]:
        """The indexed segments, least recently used first, each once: what the KV tiers take
        first when pages run short."""
        seen: dict[int, Segment] = {}
        for node in sorted(self._nodes(), key=lambda n: n.last_used):
            seen.setdefault(id(node.ref.segment), node.ref.segment)
        return list(seen.values())

    def page_holds(self) -> Counter[int]:
        """Page id -> references the index holds on it, for the pages in the pool (accounting checks)."""
        return Counter({segment.page_ids[i]: n for (segment, i), n in self._holds.items()
                        if not segment.in_lower_tier})

    def num_pages_held_only(self) -> int:
        """Pages nobody but the index holds: cached prefixes, freed first when pages run out."""
        return sum(1 for key, n in self._holds.items() if not key[0].in_lower_tier and _holders(key) == n)

    def _evictable_subtrees(self) -> list[_Node]:
        """Nodes whose whole subtree is held by the index only (children before parents)."""
        ok: dict[int, bool] = {}
        for node in reversed(self._nodes()):  # _nodes lists every parent before its children
            kids = all(ok[id(c)] for c in node.child_list())
            ok[id(node)] = kids and self._held_by_index_only(node)
        return [n for n in self._nodes() if ok[id(n)]]

    def _remove(self, node: _Node) -> None:
        """Unlink a leaf and release its reference."""
        assert not node.children, "only leaves are removed"
        group = node.parent.children[node.tokens[0]]
        group.remove(node)
        if not group:
            del node.parent.children[node.tokens[0]]
        self._set_ref(node, None)
        self._num_nodes -= 1

    # -- bookkeeping ------------------------------------------------------------------
    def _nodes(self) -> list[_Node]:
        """Every node except the root."""
        out, stack = [], self._root.child_list()
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.child_list())
        return out

    def clear(self) -> None:
        """Release every indexed reference (counters are kept)."""
        for node in self._nodes():
            node.ref.release()
        self._root = _Node(None, 0)
        self._holds = Counter()
        self._num_nodes = 0

    def stats(self) -> dict[str, int]:
        """Counters for health reports, metrics and tests."""
        nodes = self._nodes()
        return {
            "num_nodes": self._num_nodes,
            "num_shared_nodes": sum(not self._held_by_index_only(n) for n in nodes),  # also held elsewhere
            "num_cached_tokens": sum(n.ref.num_rows for n in nodes),
            "num_pages_held": sum(1 for segment, _ in self._holds if not segment.in_lower_tier),
            "num_queries": self.num_queries,
            "num_hits": self.num_hits,
            "num_query_tokens": self.num_query_tokens,
            "num_hit_tokens": self.num_hit_tokens,
        }


def _page_keys(ref: SegRef) -> list[tuple[Segment, int]]:
    """(segment, page index) of each page ``ref`` holds (released leading pages left out)."""
    segment = ref.segment
    return [(segment, i) for i in range(segment.released_pages, segment.pool.pages_for_rows(ref.num_rows))]


def _holders(key: tuple[Segment, int]) -> int:
    """References on one page of a segment: the pool's count, or the segment's own while its rows
    are in a lower tier."""
    segment, index = key
    if segment.tier_holds is not None:
        return segment.tier_holds[index]
    return segment.pool.ref_count(segment.page_ids[index])


def _reaches_released_rows(refs: list[SegRef], end: int, window: int) -> bool:
    """Whether a continuation of the ``end`` rows of ``refs`` would attend released rows: its
    first query sits at ``end`` (``end - 1`` when the last matched token is recomputed), and
    sees the ``window`` positions up to it."""
    return reaches_released_rows(((ref.segment, ref.num_rows) for ref in refs), end - window)


def _common_prefix(node_tokens: list[int], tokens: list[int], pos: int) -> int:
    """Length of the common prefix of ``node_tokens`` and ``tokens[pos:]``."""
    n = min(len(node_tokens), len(tokens) - pos)
    if tokens[pos : pos + n] == node_tokens[:n]:
        return n
    i = 0
    while i < n and node_tokens[i] == tokens[pos + i]:
        i += 1
    return i
