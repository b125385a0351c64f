"""Attention plan value objects: pieces of KV, the work that attends them, the reduce map."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from segkv.cache.segment import ChainSpan


class Route(str, Enum):
    """The shape of a plan, as reported by ``decode_route``."""

    SINGLE = "single"  # one piece per sequence, one pass (the stock route)
    SPLIT = "split"  # long pieces cut into partitions to fill the device
    SEGMENTS = "segments"  # one piece per segment of each chain
    CASCADE = "cascade"  # a segment shared by several sequences is read once for all

    @classmethod
    def parse(cls, value: str | Route) -> Route:
        return _parse(cls, value, "route", "")


class Precision(str, Enum):
    """The contract's precision modes inside a piece (ARCHITECTURE.md, "Numerical contract"); both
    keep the float32 merge and the single rounding. ``exact``: P.V exact to float32 (the default,
    and decode's). ``fast``: each weight of P rounded to the K/V dtype before P.V, float32 sums, as
    FlashAttention does: for compute-bound work such as long prefill chunks."""

    EXACT = "exact"
    FAST = "fast"

    @classmethod
    def parse(cls, value: str | Precision) -> Precision:
        return _parse(cls, value, "precision", " (or auto)")


def _parse(cls: type[Enum], value, what: str, extra: str):
    """``cls(value)``, or a ValueError naming the attention ``what`` and the accepted values."""
    try:
        return cls(value)
    except ValueError:
        names = ", ".join(member.value for member in cls)
        raise ValueError(f"unknown attention {what} {value!r}; expected one of {names}{extra}") from None


@dataclass(slots=True, frozen=True)
class AttentionShape:
    """Head counts and widths of one attention layer.

    MHA/GQA/MQA: ``key_dim == value_dim == head_dim``. Absorbed MLA: ``num_kv_heads == 1``,
    ``key_dim = kv_lora_rank + rope_dim``, ``value_dim = kv_lora_rank``.
    """

    num_q_heads: int
    num_kv_heads: int
    key_dim: int
    value_dim: int

    def __post_init__(self) -> None:
        if min(self.num_q_heads, self.num_kv_heads, self.key_dim, self.value_dim) < 1:
            raise ValueError(f"every AttentionShape field must be >= 1: {self}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def is_latent(self) -> bool:
        """Absorbed MLA: one latent head whose value is a prefix of its key."""
        return self.num_kv_heads == 1 and self.value_dim < self.key_dim


@dataclass(slots=True, frozen=True)
class SequenceQuery:
    """One sequence of a batch: its chain's spans and the query rows it attends with.

    Query row ``i`` (of ``num_query_rows``) sits at absolute position ``query_start + i`` and
    sees the keys at positions ``<= query_start + i`` (causal within the window; history
    fully visible). By default the window is the chain's last ``num_query_rows`` rows,
    i.e. the new tokens were appended before attention. A row at a position before every
    key (for example a padding row at position -1) sees nothing and yields 0.

    ``tree_parents`` makes the window a tree (a tree verify window, EAGLE-3 style): one entry
    per tree node, the index within the tree of the node's parent, ``-1`` for a child of the
    last row before the tree; parents come before children. Every node is a KV row (in node
    order, the tree's first row at :attr:`tree_start`); node ``i`` sees every key before the
    tree and, within it, only its ancestors and itself (never siblings, cousins or later rows).
    The query rows are the tree's last ``num_query_rows`` nodes: all of them for a verify
    window; fewer when a tree grows a level at a time (a draft head's step appends and queries
    its newest nodes, whose ancestors are rows of earlier steps). A tree must lie inside the
    chain. ``None`` is today's causal window; so is a chain-shaped tree (parents ``-1, 0, 1,
    ...``), which :attr:`is_tree` reports as not a tree so that it is planned exactly as the
    causal window.
    """

    spans: tuple[ChainSpan, ...]
    num_query_rows: int
    query_start: int | None = None
    tree_parents: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_query_rows < 0:
            raise ValueError(f"num_query_rows must be >= 0, got {self.num_query_rows}")
        if self.query_start is None:
            object.__setattr__(self, "query_start", self.num_kv_rows - self.num_query_rows)
        position = 0
        for span in self.spans:
            if span.key_start != position:
                raise ValueError(f"spans are not contiguous: expected key_start {position}, got {span}")
            position += span.num_rows
        if self.tree_parents is not None:
            object.__setattr__(self, "tree_parents", tuple(self.tree_parents))
            self._check_tree()

    def _check_tree(self) -> None:
        """ValueError unless ``tree_parents`` is a tree over the window and the window is in the chain."""
        parents = self.tree_parents
        if len(parents) < self.num_query_rows:
            raise ValueError(f"tree_parents has {len(parents)} entries for {self.num_query_rows} query rows "
                             f"(the query rows are the tree's last nodes)")
        for node, parent in enumerate(parents):
            if not isinstance(parent, int) or isinstance(parent, bool):
                raise ValueError(f"tree_parents[{node}] must be an int, got {parent!r}")
            if not -1 <= parent < node:
                raise ValueError(f"tree_parents[{node}] = {parent}: a parent is -1 (the last history row) "
                                 f"or an earlier node of the window (0 .. {node - 1})")
        if self.tree_start < 0 or self.query_start + self.num_query_rows > self.num_kv_rows:
            raise ValueError(f"a tree of {len(parents)} rows at position {self.tree_start} must lie inside "
                             f"the chain's {self.num_kv_rows} rows (its nodes are KV rows)")

    @property
    def num_kv_rows(self) -> int:
        return sum(span.num_rows for span in self.spans)

    @property
    def tree_start(self) -> int:
        """The position of the tree's first node (``query_start`` when every node is a query row)."""
        return self.query_start - (len(self.tree_parents) - self.num_query_rows if self.tree_parents else 0)

    @property
    def is_tree(self) -> bool:
        """Whether the window is a tree that is not a chain (a chain is planned as the causal window)."""
        parents = self.tree_parents
        return parents is not None and any(p != i - 1 for i, p in enumerate(parents))

    def ancestor_masks(self) -> tuple[int, ...]:
        """Per tree node (every query row of a causal window), a bitmask over the tree's rows: bit
        ``j`` of entry ``i`` is set when node ``i`` sees tree row ``j`` (its ancestors and itself).
        A causal window's row ``i`` gets ``2 ** (i + 1) - 1``."""
        parents = self.tree_parents or tuple(range(-1, self.num_query_rows - 1))
        masks: list[int] = []
        for node, parent in enumerate(parents):
            masks.append((1 << node) | (masks[parent] if parent >= 0 else 0))
        return tuple(masks)

    @classmethod
    def from_chain(cls, chain, num_query_rows: int, *, query_start: int | None = None,
                   tree_parents: tuple[int, ...] | None = None) -> SequenceQuery:
        """The query of a :class:`~segkv.cache.KVChain` whose last rows are the window."""
        return cls(tuple(chain.spans()), num_query_rows, query_start, tree_parents)


@dataclass(slots=True, frozen=True)
class Piece:
    """A run of KV rows: pages in order and the valid rows of each page.

    Rows start at offset 0 of every page; a page may hold fewer than ``page_size`` rows
    (a segment that ended mid-page), so a piece may span segment boundaries without
    copying. Row ``j`` of the piece is the ``j``-th valid row in page order.
    """

    page_ids: tuple[int, ...]
    page_rows: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.page_ids) != len(self.page_rows):
            raise ValueError(f"{len(self.page_ids)} pages but {len(self.page_rows)} row counts")
        if self.page_rows and min(self.page_rows) < 1:
            raise ValueError(f"every page of a piece holds at least one row: {self.page_rows}")

    @property
    def num_rows(self) -> int:
        return sum(self.page_rows)


@dataclass(slots=True, frozen=True)
class WorkItem:
    """Stage-1 work: query rows attending one piece, with their causal offsets.

    ``causal_offsets[i]`` is the position of ``query_rows[i]`` minus the position of the
    piece's first row in that row's sequence: the row sees piece rows ``j <= offset``
    (none when negative, all when ``>= num_rows - 1``). Each (work item, row) pair makes
    one partial result, numbered in work order.

    ``key_masks`` (tree verify windows) restricts that further: row ``i`` then sees piece row
    ``j`` only when bit ``j`` of ``key_masks[i]`` is set, and every set bit is at most the
    row's causal offset (so the offset still bounds how far a kernel scans). The mask travels
    as one packed bitmask per row over the piece's rows, the way FlashInfer's custom masks and
    tree-attention kernels take it: a fixed-width, position-indexed form a kernel tests with
    one shift per key, where per-row lists of visible keys would vary in length and need an
    index array of their own. It stays small because the planner gives a mask only to a tree
    window's own piece (the window's rows and the part page of history before them, under
    ``page_size + window`` bits); the history itself is a plain causal item.

    ``key_lows`` (sliding-window attention) bounds each row from below: row ``i`` sees piece
    rows ``j >= key_lows[i]`` only (``<= 0``: from the piece's first row). The planner drops
    pages wholly below every row's window, so a decode row's piece starts on its window's page.
    """

    piece: int
    query_rows: tuple[int, ...]
    causal_offsets: tuple[int, ...]
    key_masks: tuple[int, ...] | None = None
    key_lows: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.query_rows) != len(self.causal_offsets):
            raise ValueError("query_rows and causal_offsets differ in length")
        if self.key_lows is not None and len(self.key_lows) != len(self.query_rows):
            raise ValueError(f"{len(self.key_lows)} key lows for {len(self.query_rows)} query rows")
        if not self.query_rows:
            raise ValueError("a work item needs at least one query row")
        if self.key_masks is not None:
            if len(self.key_masks) != len(self.query_rows):
                raise ValueError(f"{len(self.key_masks)} key masks for {len(self.query_rows)} query rows")
            for mask, offset in zip(self.key_masks, self.causal_offsets):
                if mask < 0 or mask.bit_length() > max(offset + 1, 0):
                    raise ValueError(f"key mask {mask:#x} sets a bit past the row's causal offset {offset}")


@dataclass(slots=True, frozen=True)
class AttentionPlan:
    """The attention of one forward step: pieces, stage-1 work and the reduce map.

    ``reduce_map[r]`` lists the partial results merged into query row ``r``; a row with
    no partials (nothing visible) is 0 with LSE ``-inf``. ``num_partitions`` records the
    most partitions any single run was cut into (1 unless the route split).
    ``max_work_rows``: the most query rows of one work item (1 for a plain decode step);
    ``max_row_partials``: the most partials merged into one query row. ``has_key_masks``: some
    work item carries key masks (a tree verify window's own piece); ``has_key_lows``: some
    carries key lows (a sliding window). ``precision``: the mode
    inside the pieces (:class:`Precision`), the planner's choice. ``window``: the sliding window
    the plan was made for (each row sees its last ``window`` positions, itself included; the work
    items' ``key_lows``), None for full attention.
    """

    route: Route
    pieces: tuple[Piece, ...]
    work: tuple[WorkItem, ...]
    reduce_map: tuple[tuple[int, ...], ...]
    num_query_rows: int
    num_partitions: int = 1
    reason: str = ""
    precision: Precision = Precision.EXACT
    window: int | None = None
    partial_rows: tuple[int, ...] = field(init=False)
    max_work_rows: int = field(init=False)
    max_row_partials: int = field(init=False)
    has_key_masks: bool = field(init=False)
    has_key_lows: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", Precision.parse(self.precision))
        partial_rows = tuple(row for item in self.work for row in item.query_rows)
        object.__setattr__(self, "partial_rows", partial_rows)
        # made once with the plan (planned ahead, off a graph step's path), read every step
        object.__setattr__(self, "max_work_rows", max((len(item.query_rows) for item in self.work), default=1))
        object.__setattr__(self, "max_row_partials", max(map(len, self.reduce_map), default=0))
        object.__setattr__(self, "has_key_masks", any(item.key_masks is not None for item in self.work))
        object.__setattr__(self, "has_key_lows", any(item.key_lows is not None for item in self.work))
        if len(self.reduce_map) != self.num_query_rows:
            raise ValueError(f"reduce map has {len(self.reduce_map)} rows, expected {self.num_query_rows}")
        seen = set()
        for row, partials in enumerate(self.reduce_map):
            for p in partials:
                if not 0 <= p < len(partial_rows) or partial_rows[p] != row or p in seen:
                    raise ValueError(f"reduce map entry {p} for row {row} does not match the work")
                seen.add(p)
        if len(seen) != len(partial_rows):
            raise ValueError("some partial results are not reduced into any row")
        for item in self.work:
            if not 0 <= item.piece < len(self.pieces):
                raise ValueError(f"work item names piece {item.piece} of {len(self.pieces)}")

    @property
    def num_partials(self) -> int:
        return len(self.partial_rows)

    def describe(self) -> dict[str, object]:
        """A small summary for logs, health reports and benchmark tables."""
        return {
            "route": self.route.value,
            "pieces": len(self.pieces),
            "work_items": len(self.work),
            "partials": self.num_partials,
            "query_rows": self.num_query_rows,
            "max_partitions": self.num_partitions,
            "precision": self.precision.value,
            "window": self.window,
            "reason": self.reason,
        }


def reduce_map_from_work(work: tuple[WorkItem, ...], num_query_rows: int) -> tuple[tuple[int, ...], ...]:
    """The reduce map implied by the work list: each row merges its partials in work order."""
    per_row: list[list[int]] = [[] for _ in range(num_query_rows)]
    index = 0
    for item in work:
        for row in item.query_rows:
            per_row[row].append(index)
            index += 1
    return tuple(tuple(p) for p in per_row)
