"""Exact rejection sampling of verify windows: which drafts to keep, and one more token.

A proposer drafts ``d_1..d_k`` after a sequence's last token, each ``d_j`` drawn from its own
distribution ``q_j`` (one-hot for a deterministic proposer such as n-gram lookup). One
target forward over ``[last, d_1..d_k]`` gives ``k + 1`` rows ``p_0..p_k`` (the sampler's
``Sampler.distribution``: ``p_j`` is the target's next-token distribution after ``d_1..d_j``).
Then, for ``j = 1..k`` in order, ``d_j`` is kept with probability
``min(1, p_{j-1}(d_j) / q_j(d_j))``; at the first rejection one token is drawn from the
residual ``normalise(max(0, p_{j-1} - q_j))`` and the window ends; if every draft is kept,
a bonus token is drawn from ``p_k`` (Leviathan et al. 2023; Chen et al. 2023).

Why it is exact: at one position, the token ``x`` comes out as a kept draft with probability
``q(x) min(1, p(x) / q(x)) = min(p, q)(x)``, and as the replacement with probability
``(1 - sum min(p, q)) * max(0, p - q)(x) / sum max(0, p - q)``. The rejection probability
``1 - sum min(p, q)`` equals the residual's mass ``sum max(0, p - q)`` (both are the total
variation distance of ``p`` and ``q``), so the two terms add to
``min(p, q)(x) + max(0, p - q)(x) = p(x)``: each emitted token has the target's conditional
distribution given the tokens before it, whatever ``q`` is. The residual has mass 0 only
when ``p == q``, and then no draft is rejected; a float32 rounding that still gets there
falls back to ``p``. Greedy rows (one-hot ``p``) keep a draft exactly when it is the argmax
and then emit the argmax.

Draws: per sequence, ``k`` uniforms and then ``V`` Exp(1) values from its generator (an
exponential race ``argmax(r / e)`` picks ``i`` with probability ``r[i] / sum r``, as the
sampler does), always the same count, so a seeded request gives the same tokens whatever
else is in the batch. The whole batch costs one device-to-host copy, at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from segkv.layers.transfer import to_device

_SUM_TOLERANCE = 1e-3  # a probability row's sum may be off by float32 rounding, never by more


def verify_window(
    target_probs: torch.Tensor,
    draft_ids: Sequence[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> list[int]:
    """The tokens one verify window emits: the kept drafts, then one more (``1..k + 1``).

    ``target_probs``: ``(k + 1, V)`` float32, the rows ``p_0..p_k`` (see the module
    docstring). ``draft_ids``: the ``k`` drafts. ``draft_probs``: ``(k, V)`` float32, row
    ``j`` the distribution ``d_{j+1}`` was drawn from, or None for a deterministic proposer
    (``q`` one-hot on each draft). ``generator``: the sequence's generator on
    ``target_probs.device`` (None: the device's default one).
    """
    return verify_windows(target_probs, [draft_ids], draft_probs, [generator])[0]


def verify_windows(
    target_probs: torch.Tensor,
    draft_ids: Sequence[Sequence[int]],
    draft_probs: torch.Tensor | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
) -> list[list[int]]:
    """``verify_window`` for ``B`` sequences at once, with one device-to-host copy.

    ``target_probs``: ``(sum(k_i + 1), V)`` float32, sequence ``i``'s ``k_i + 1`` rows after
    those of sequence ``i - 1``. ``draft_ids``: ``B`` lists, ``k_i >= 0`` drafts each.
    ``draft_probs``: ``(sum(k_i), V)`` float32, the drafts' distributions in the same order,
    or None when every proposer is deterministic (pass one-hot rows to mix the two).
    ``generators``: ``B`` entries (None: all the device's default generator). Returns ``B``
    lists of ``1..k_i + 1`` tokens. Raises ValueError on rows that are not probabilities
    (NaN, infinite, negative, or not summing to 1).
    """
    num_drafts = [len(d) for d in draft_ids]
    batch = len(num_drafts)
    if batch == 0:
        return []
    if target_probs.dim() != 2 or target_probs.shape[0] != sum(num_drafts) + batch:
        raise ValueError(f"target_probs must be (sum(k_i + 1), V) = ({sum(num_drafts) + batch}, V) "
                         f"for drafts of lengths {num_drafts}, got shape {tuple(target_probs.shape)}")
    num_rows, vocab = target_probs.shape
    device = target_probs.device
    drafts = [[int(t) for t in d] for d in draft_ids]
    if any(not 0 <= t < vocab for d in drafts for t in d):
        raise ValueError(f"draft ids must be in [0, {vocab}), got {drafts}")
    gens = [None] * batch if generators is None else list(generators)
    if len(gens) != batch:
        raise ValueError(f"generators has {len(gens)} entries for {batch} sequences")
    if draft_probs is not None and tuple(draft_probs.shape) != (sum(num_drafts), vocab):
        raise ValueError(f"draft_probs must be (sum(k_i), V) = ({sum(num_drafts)}, {vocab}), "
                         f"got shape {tuple(draft_probs.shape)}")

    # Host-built index maps: row r of the window batch is sequence seq[r]'s position r - start.
    starts, seq, ids, draft_rows = [], [], [], []
    for i, d in enumerate(drafts):
        starts.append(len(seq))
        draft_rows += range(len(seq), len(seq) + len(d))
        seq += [i] * (len(d) + 1)
        ids += d + [0]  # the last row's "draft" is a placeholder, never kept
    is_draft = [True] * num_rows
    for i, start in enumerate(starts):
        is_draft[start + num_drafts[i]] = False

    p = target_probs.float()
    ids_t = to_device(ids, torch.int64, device)
    is_draft_t = to_device(is_draft, torch.bool, device)
    q = None if draft_probs is None else draft_probs.float()
    p_draft = p.gather(1, ids_t[:, None]).squeeze(1)
    if q is None:  # one-hot q: 1 at each draft
        q_draft = is_draft_t.float()
    else:
        draft_rows_t = to_device(draft_rows, torch.int64, device)
        q_draft = torch.zeros(num_rows, device=device).index_copy_(
            0, draft_rows_t, q.gather(1, ids_t[draft_rows_t, None]).squeeze(1))

    uniform, noise = _draws(num_drafts, starts, gens, num_rows, vocab, device)
    # u < p/q as u * q < p: exact for q > 0, and q = 0 (a draft its proposer could not draw)
    # is kept iff p > 0. A one-hot p keeps its argmax (u * q < 1) and nothing else (< 0).
    keep = (uniform * q_draft < p_draft) & is_draft_t
    # The first row of each window that does not keep its draft (the last row never does).
    row = torch.arange(num_rows, device=device)
    first = torch.full((batch,), num_rows, dtype=torch.int64, device=device).scatter_reduce_(
        0, to_device(seq, torch.int64, device), torch.where(keep, num_rows, row), reduce="amin")
    # q of the rejected draft, or 0 where the window ran to its last row (the bonus draws from p)
    rejected = is_draft_t[first][:, None]
    target = p[first]
    if q is None:
        q_first = torch.zeros_like(target).scatter_(1, ids_t[first][:, None], rejected.float())
    elif q.shape[0] == 0:
        q_first = torch.zeros_like(target)
    else:  # window row r of sequence i is draft row r - i (each earlier window has one last row)
        index = (first - torch.arange(batch, device=device)).clamp_(0, q.shape[0] - 1)
        q_first = q[index] * rejected
    residual = (target - q_first).clamp_min_(0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, target)
    token = (residual / noise).argmax(dim=-1)

    checks = torch.stack([~_are_probabilities(p, device), ~_are_probabilities(draft_probs, device)]).long()
    num_kept = first - to_device(starts, torch.int64, device)
    result = torch.cat([checks, num_kept, token]).tolist()  # the one device-to-host copy
    if result[0]:
        raise ValueError("target_probs rows must be probabilities: finite, >= 0, summing to 1")
    if result[1]:
        raise ValueError("draft_probs rows must be probabilities: finite, >= 0, summing to 1")
    kept, tokens = result[2 : 2 + batch], result[2 + batch :]
    return [d[:n] + [t] for d, n, t in zip(drafts, kept, tokens)]


def _are_probabilities(rows: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A 0-d bool tensor on ``device``: every row of ``(N, V)`` ``rows`` (None: none) is
    finite, >= 0 and sums to 1."""
    if rows is None or rows.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=device)
    rows = rows.to(device=device, dtype=torch.float32)
    sums = rows.sum(dim=-1)
    return rows.isfinite().all() & (rows >= 0).all() & ((sums - 1).abs() <= _SUM_TOLERANCE).all()


def _draws(
    num_drafts: list[int],
    starts: list[int],
    gens: list[torch.Generator | None],
    num_rows: int,
    vocab: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num_rows,)`` U[0, 1) and ``(B, V)`` Exp(1) float32: sequence ``i``'s ``k_i`` uniforms,
    then its ``V`` exponentials, from its own generator; unseeded rows share one draw each."""
    uniform = torch.zeros(num_rows, device=device)  # the last row of a window draws none
    noise = torch.empty(len(num_drafts), vocab, device=device)
    if any(g is None for g in gens):
        uniform.uniform_()
        noise.exponential_()
    for i, g in enumerate(gens):
        if g is not None:
            uniform[starts[i] : starts[i] + num_drafts[i]].uniform_(generator=g)
            noise[i].exponential_(generator=g)
    return uniform, noise.clamp_min_(torch.finfo(torch.float32).tiny)  # e = 0 would give inf or NaN


# -- trees of drafts ------------------------------------------------------------------------
# A tree window: draft node ``i`` (0..N-1) has a parent ``parents[i]`` (an earlier node, or -1:
# the pending token, the root) and a token ``draft_ids[i]``; the siblings of a node hold
# distinct tokens (top-k branches). Row 0 of its ``N + 1`` target rows is the root's distribution,
# row ``i + 1`` node ``i``'s (the target's next-token distribution after the path to it).
#
# The rule, at the current node (first the root), with children c_1..c_m and one uniform u: the
# child c_j with sum_{l<j} p(c_l) <= u < sum_{l<=j} p(c_l) is kept and becomes the current node;
# if u falls past every child, one token is drawn from the residual, p with the children's tokens
# zeroed and renormalised, and the window ends; at a leaf (no children) the residual is p itself,
# the bonus token. Why it is exact: child c_j comes out with probability p(c_j), and a token x
# outside the children with probability (1 - sum_j p(c_j)) * p(x) / (1 - sum_j p(c_j)) = p(x): the
# emitted token has the target's conditional distribution, whatever the tree (drafts chosen
# deterministically from the context, as top-k branches are). This is sequential rejection of
# the siblings with one-hot proposals (accept c_j with p(c_j) / (1 - sum_{l<j} p(c_l))), drawn
# with a single uniform per node: SpecInfer's multi-step speculative sampling (Miao et al.,
# ASPLOS 2024) and recursive rejection sampling over siblings (Jeon et al., 2024, "Recursive
# Speculative Decoding") for drafts without replacement whose draft distributions are one-hot. Greedy rows keep the child that is the argmax, if any, then
# emit the argmax.


@dataclass(frozen=True, slots=True)
class TreeVerdict:
    """What one tree window emits: ``tokens`` (the kept drafts, then one more) and ``nodes``, the
    kept draft nodes in path order (``len(tokens) - 1`` of them)."""

    tokens: list[int]
    nodes: list[int]


def tree_children(parents: Sequence[int]) -> list[list[int]]:
    """``N + 1`` lists: the draft nodes under the root (entry 0) and under node ``i`` (entry
    ``i + 1``), in node order. ValueError unless every parent is -1 or an earlier node."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        if not -1 <= int(parent) < i:
            raise ValueError(f"node {i}'s parent must be -1 (the root) or an earlier node, got {parent}")
        children[int(parent) + 1].append(i)
    return children


def verify_trees(
    target_probs: torch.Tensor,
    parents: Sequence[Sequence[int]],
    draft_ids: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None] | None = None,
) -> list[TreeVerdict]:
    """Verify ``B`` tree windows at once (the rule above), with one device-to-host copy.

    ``target_probs``: ``(sum(N_i + 1), V)`` float32, tree ``i``'s ``N_i + 1`` rows (root first)
    after those of tree ``i - 1``. ``parents[i]``, ``draft_ids[i]``: tree ``i``'s ``N_i`` parents
    and tokens; siblings' tokens must differ. ``generators``: ``B`` entries (None: the device's
    default generator); each tree draws ``N_i + 1`` uniforms, then ``V`` Exp(1) values, from its
    own, so a seeded request gives the same tokens whatever else is in the batch. Raises
    ValueError on malformed trees or rows that are not probabilities.
    """
    batch = len(parents)
    if len(draft_ids) != batch:
        raise ValueError(f"draft_ids has {len(draft_ids)} trees, parents {batch}")
    gens = [None] * batch if generators is None else list(generators)
    if len(gens) != batch:
        raise ValueError(f"generators has {len(gens)} entries for {batch} trees")
    sizes = [len(p) + 1 for p in parents]
    if target_probs.dim() != 2 or target_probs.shape[0] != sum(sizes):
        raise ValueError(f"target_probs must be (sum(N_i + 1), V) = ({sum(sizes)}, V), got "
                         f"{tuple(target_probs.shape)}")
    if batch == 0:
        return []
    num_rows, vocab = target_probs.shape
    device = target_probs.device
    kids, tokens = [], []
    for p, d in zip(parents, draft_ids):
        if len(d) != len(p):
            raise ValueError(f"a tree has {len(p)} parents but {len(d)} draft ids")
        d = [int(t) for t in d]
        if any(not 0 <= t < vocab for t in d):
            raise ValueError(f"draft ids must be in [0, {vocab}), got {d}")
        children = tree_children(p)
        for node, under in enumerate(children):
            if len({d[c] for c in under}) != len(under):
                raise ValueError(f"the children of row {node} repeat a token: {[d[c] for c in under]}")
        kids.append(children)
        tokens.append(d)

    # (rows, width) the children's tokens of each row, padded with a column of probability 0
    width = max((len(c) for children in kids for c in children), default=0) + 1
    table = [[tokens[i][c] for c in under] for i, children in enumerate(kids) for under in children]
    index = to_device([row + [row[0] if row else 0] * (width - len(row)) for row in table], torch.int64, device)
    present = to_device([[True] * len(row) + [False] * (width - len(row)) for row in table], torch.bool, device)
    p = target_probs.float()
    child_mass = p.gather(1, index) * present
    cumulative = child_mass.cumsum(dim=1)
    residual = _tree_residuals(p, index, present)
    uniform, noise = _tree_draws(sizes, gens, vocab, device)
    owner = to_device([i for i, n in enumerate(sizes) for _ in range(n)], torch.int64, device)
    drawn = (residual / noise[owner]).argmax(dim=-1)
    check = (~_are_probabilities(p, device)).double()[None]
    result = torch.cat([check, uniform.double(), drawn.double(), cumulative.double().flatten()]).tolist()
    if result[0]:
        raise ValueError("target_probs rows must be probabilities: finite, >= 0, summing to 1")
    u, picks, cums = result[1 : 1 + num_rows], result[1 + num_rows : 1 + 2 * num_rows], result[1 + 2 * num_rows :]
    out, start = [], 0
    for children, d, n in zip(kids, tokens, sizes):
        path, emitted, row = [], [], 0
        while True:
            r = start + row
            chosen = next((c for j, c in enumerate(children[row]) if u[r] < cums[r * width + j]), None)
            if chosen is None:
                emitted.append(int(picks[r]))
                break
            path.append(chosen)
            emitted.append(d[chosen])
            row = chosen + 1
        out.append(TreeVerdict(emitted, path))
        start += n
    return out


def _tree_residuals(p: torch.Tensor, index: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """``(rows, V)``: each row of ``p`` with its children's tokens (``index``, where ``present``)
    zeroed (the unnormalised residual an exponential race draws from); a row whose children hold
    all its mass (float32 rounding only: it is then never reached) keeps ``p``."""
    # counted, not scattered: padding columns repeat a child's index, and scatter's duplicates race
    is_child = torch.zeros(p.shape, dtype=torch.int32, device=p.device).scatter_add_(1, index, present.int()) > 0
    residual = p.masked_fill(is_child, 0.0)
    return torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)


def _tree_draws(sizes: list[int], gens: list[torch.Generator | None], vocab: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum(sizes),)`` U[0, 1) and ``(B, V)`` Exp(1) float32, tree ``i``'s from its generator."""
    uniform = torch.empty(sum(sizes), device=device)
    noise = torch.empty(len(sizes), vocab, device=device)
    if any(g is None for g in gens):
        uniform.uniform_()
        noise.exponential_()
    start = 0
    for i, (g, n) in enumerate(zip(gens, sizes)):
        if g is not None:
            uniform[start : start + n].uniform_(generator=g)
            noise[i].exponential_(generator=g)
        start += n
    return uniform, noise.clamp_min_(torch.finfo(torch.float32).tiny)
