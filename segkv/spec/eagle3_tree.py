"""TreeDrafting: the top-k tree drafts of :class:`~segkv.spec.eagle3.Eagle3Proposer`.

With ``topk`` > 1 the head drafts a tree (EAGLE-2's dynamic tree, as SGLang drafts it; a
:class:`~segkv.spec.tree.DraftTree` per sequence). Depth 1: the ``topk`` best tokens of the
draft vocabulary's log-softmax at the last target row, each scored by its log-probability.
Each further depth ``d`` expands the frontier (the ``topk`` best nodes of depth ``d - 1`` by
score; all of depth 1): one head forward for the whole batch appends a head row per frontier
node at position ``last + d - 1``, reading its parent's head output and its own token and
attending the head's history and its ancestors' rows only (a tree query whose rows are the
tree's newest nodes, ``SequenceQuery.tree_parents``); each row's ``topk`` best tokens are
candidates scored ``parent's score + log-probability``, and the best ``topk`` of the
``topk ** 2`` become the next frontier. The tree is the ``num_draft_tokens - 1`` best nodes of
all those created (the unexpanded candidates too), ties going to the earlier-created node, in
depth then creation order: a child's score never exceeds its parent's (log-probabilities are
clamped to <= 0) and a parent is created first, so the pick keeps every node's ancestors.
Scores and tokens stay on the device, selections are torch ops batched over the sequences,
and the tree comes over in one copy at the end; the attention plan is built on the host, so
each depth also copies which frontier node each new row's parent is (``(B, topk)`` ints).
"""

from __future__ import annotations

import torch

from segkv.cache.page_pool import OutOfPagesError
from segkv.layers.transfer import to_device
from segkv.spec.config import MAX_TREE_NODES
from segkv.spec.tree import DraftTree


class TreeDrafting:
    """The tree half of the EAGLE-3 proposer (a mixin): it reads ``topk``, ``num_draft_tokens``,
    ``head`` and ``_head_step`` of the proposer; ``work`` lists hold the proposer's work items
    (``eagle3._Work``: ``index``, ``room``, ``state``)."""

    def _tree_nodes(self, room: int) -> int:
        """The nodes of a tree drafted with ``room`` levels at most (before the levels' own limit)."""
        if self.num_draft_tokens is not None:
            return self.num_draft_tokens - 1
        return min(self.topk * room, MAX_TREE_NODES)

    def _draft_trees(self, work: list, hidden: torch.Tensor, drafts: list[list[int] | DraftTree]) -> None:
        """Draft a top-k tree per item from ``hidden (len(work), hidden)`` (each item's head output at
        its last target row) into ``drafts`` (see the module docstring). A level's head rows are
        appended to the item's chain and every one is trimmed at the end; a failure (no pages for a
        level's rows) keeps the levels drafted so far."""
        k, device = self.topk, hidden.device
        width = hidden.shape[-1]
        # levels[d - 1]: (items (positions in work), scores (n, c) float32, target ids (n, c) int64,
        # parents (n, c) int64: each node's parent's creation index, -1 at depth 1); c = k at depth 1,
        # k * k deeper. A node's creation index is its column in the levels concatenated.
        scores, ids = self._top(hidden, k)
        levels = [(list(range(len(work))), scores, ids, torch.full_like(ids, -1))]
        # the frontier (the nodes the next level expands), per item in ``items``: scores (n, k), ids
        # (n, k), creation indices (n, k), the head output each node's row reads (n, k, width), and
        # (host) each node's parent's draft row (-1: the last history row)
        items = levels[0][0]
        front = (scores, ids, torch.arange(k, device=device).expand(len(work), k),
                 hidden[:, None].expand(len(work), k, width))
        front_rows = [[-1] * k for _ in work]
        rows: list[list[int]] = [[] for _ in work]  # each item's draft rows' parents (draft row indices)
        try:
            for depth in range(2, max(w.room for w in work) + 1):
                keep = [r for r, m in enumerate(items) if work[m].room >= depth]
                if len(keep) != len(items):
                    index = to_device(keep, torch.long, device)
                    front = tuple(t[index] for t in front)
                    front_rows = [front_rows[r] for r in keep]
                    items = [items[r] for r in keep]
                f_scores, f_ids, f_created, f_hidden = front
                n = len(items)
                parents = [tuple(rows[m] + f) for m, f in zip(items, front_rows)]
                out = self._head_step([work[m].state.chain for m in items], f_hidden.reshape(n * k, width), None,
                                      [work[m].state.covered - 2 + depth for m in items for _ in range(k)],
                                      [k] * n, device_ids=f_ids.reshape(n * k), tree_parents=parents)
                for m, p in zip(items, parents):
                    rows[m] = list(p)
                logp, child_ids = self._top(out, k)  # (n * k, k): each frontier node's children
                cum = (f_scores[:, :, None] + logp.view(n, k, k)).view(n, k * k)
                child_ids = child_ids.view(n, k * k)
                levels.append((items, cum, child_ids, f_created.repeat_interleave(k, dim=1)))
                if not any(work[m].room > depth for m in items):
                    break
                # the next frontier: the k best candidates (ties: the earlier-created)
                local = torch.sort(cum, dim=1, descending=True, stable=True).indices[:, :k]
                slot = local // k  # the frontier node each one is a child of
                offset = k + (depth - 2) * k * k  # the creation index of this level's first candidate
                front = (cum.gather(1, local), child_ids.gather(1, local), local + offset,
                         out.view(n, k, width)[torch.arange(n, device=device)[:, None], slot])
                # the plan is built on the host: each new row's parent row is this level's row of its slot
                base = (depth - 2) * k
                front_rows = [[base + j for j in js] for js in slot.tolist()]
        except OutOfPagesError:  # no room for a level's rows: the levels so far stand
            pass
        finally:
            for w, r in zip(work, rows):
                if r:
                    w.state.chain.trim(len(r))
            self._collect_trees(work, levels, drafts)

    def _collect_trees(self, work: list, levels: list, drafts: list[list[int] | DraftTree]) -> None:
        """Pick each item's best nodes of ``levels`` (see :meth:`_draft_trees`) into a DraftTree: one
        device-to-host copy."""
        device, size = levels[0][1].device, len(work)
        counts = [0] * size  # nodes created per item
        scores, ids, parents = [], [], []
        for items, s, t, p in levels:
            index = to_device(items, torch.long, device)
            for full, part, fill in ((scores, s, float("-inf")), (ids, t, 0), (parents, p, -1)):
                full.append(part.new_full((size, part.shape[1]), fill).index_copy_(0, index, part))
            for m in items:
                counts[m] += s.shape[1]
        scores, ids, parents = torch.cat(scores, 1), torch.cat(ids, 1), torch.cat(parents, 1)
        wanted = [min(self._tree_nodes(w.room), c) for w, c in zip(work, counts)]
        # best first, ties to the earlier-created; a row's padding (-inf, after its own columns) is never
        # among its first ``wanted`` picks
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :max(wanted)]
        picked = torch.stack([order, ids.gather(1, order), parents.gather(1, order)]).tolist()
        for m, (w, n) in enumerate(zip(work, wanted)):
            nodes = sorted(zip(picked[0][m][:n], picked[1][m][:n], picked[2][m][:n]))  # depth, then creation
            new = {created: i for i, (created, _, _) in enumerate(nodes)}
            drafts[w.index] = DraftTree(tuple(t for _, t, _ in nodes),
                                        tuple(-1 if p < 0 else new[p] for _, _, p in nodes))

    def _top(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` best tokens of head outputs ``hidden (N, hidden)``: their log-probabilities over
        the draft vocabulary ``(N, k)`` float32 (clamped to <= 0, so a child never outscores its
        parent), best first, and their target ids ``(N, k)`` int64."""
        logp = torch.log_softmax(self.head.compute_logits(hidden).float(), dim=-1)
        values, draft_ids = logp.topk(k, dim=-1)
        return values.clamp_(max=0.0), self.head.draft_to_target(draft_ids)

