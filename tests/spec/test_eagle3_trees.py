"""EAGLE-3 tree drafts (topk > 1): well-formed trees of the configured size and depth, whose every
node's children are the best tokens of the head run densely on that node's path alone, whose
nodes are the best-scored of EAGLE-2's dynamic tree (a dense re-drafting), no head rows left behind
(after failures too), head states that follow trims and forks, and topk 1's unchanged chains."""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from segkv.attention.metadata import AttentionMetadata
from segkv.cache.page_pool import OutOfPagesError
from segkv.engine.llm import LLM
from segkv.models.default_models import packaged_dir
from segkv.runner.model_runner import StepInput
from segkv.spec.config import tree_capacity
from segkv.spec.eagle3 import Eagle3Proposer, resolve_head_dir
from segkv.spec.tree import DraftTree
from tools.default_models.training import DenseCausalAttention

HEAD = resolve_head_dir("default", packaged_dir("default"))
TOL = 1e-4  # log-probability slack between the paged head and the dense recomputation


@pytest.fixture(scope="module")
def llm():
    return LLM("default", dtype="float32", device="cpu")


@dataclass(eq=False)
class Seq:
    """A sequence as the proposer reads it: its target chain and its tokens, the last one pending."""

    chain: Any
    tokens: list[int]

    def all_token_ids(self) -> list[int]:
        return list(self.tokens)


class AuxRecord:
    """The target's auxiliary states of every row of each chain (the dense reference's input)."""

    def __init__(self) -> None:
        self.rows: weakref.WeakKeyDictionary[Any, torch.Tensor] = weakref.WeakKeyDictionary()

    def __call__(self, chains, chunks, aux: torch.Tensor) -> None:
        at = 0
        for chain, chunk in zip(chains, chunks):
            first = chain.num_rows - len(chunk)
            before = self.rows.get(chain, aux[:0])[:first]
            assert len(before) == first
            self.rows[chain] = torch.cat([before, aux[at: at + len(chunk)]])
            at += len(chunk)

    def of(self, seq: Seq) -> torch.Tensor:
        """The states of ``seq``'s rows (rows trimmed since the last forward left out)."""
        return self.rows[seq.chain][: len(seq.tokens) - 1]


def proposers(llm, *configs: dict) -> tuple[AuxRecord, list[Eagle3Proposer]]:
    """Proposers of ``configs`` over the target of ``llm``, each and the test's record hearing every forward."""
    record, made, listeners = AuxRecord(), [], []
    for kw in configs:
        made.append(Eagle3Proposer(HEAD, llm.runner, **kw))
        listeners.append(llm.runner.hidden_listener)
    listeners.append(record)
    llm.runner.hidden_listener = lambda *args: [listen(*args) for listen in listeners]
    return record, made


def prefill(llm, n: int, gen: torch.Generator) -> Seq:
    """A sequence of ``n`` random prompt tokens, prefilled, and its greedy pending token."""
    ids = torch.randint(0, llm.model.cfg.vocab_size, (n,), generator=gen).tolist()
    chain = llm.cache.new_chain()
    logits = llm.runner.forward([StepInput(chain, ids)])
    return Seq(chain, ids + [int(logits[0].argmax())])


def advance(llm, seq: Seq, accepted: list[int]) -> None:
    """The pending token and ``accepted`` become rows; the target's greedy next token is pending."""
    logits = llm.runner.forward([StepInput(seq.chain, [seq.tokens[-1], *accepted])])
    seq.tokens += [*accepted, int(logits[0].argmax())]


def verify(llm, seq: Seq, drafts: list[int], accept: int) -> None:
    """A verify window of the pending token and ``drafts`` whose first ``accept`` drafts are kept:
    the rest of its rows are trimmed, the target's token after the last kept row is pending."""
    logits = llm.runner.forward([StepInput(seq.chain, [seq.tokens[-1], *drafts])], logit_rows=[len(drafts) + 1])
    seq.chain.trim(len(drafts) - accept)
    seq.tokens += [*drafts[:accept], int(logits[accept].argmax())]


class DenseHead:
    """The head run densely over one sequence: its history rows (row ``t``: ``fuse(aux_t)``, token
    ``t + 1``, position ``t``) and one draft path after them, causal, no paged cache or tree mask."""

    def __init__(self, head, aux: torch.Tensor, tokens: list[int]) -> None:
        self.head, rows = head, len(tokens) - 1
        assert aux.shape[0] == rows
        with torch.inference_mode():
            self.fused = head.fuse(aux)
        self.next_ids = tokens[1:]
        self._out: dict[tuple[int, ...], torch.Tensor] = {}

    def out(self, path: tuple[int, ...]) -> torch.Tensor:
        """The head output ``(hidden,)`` at the row of ``path``'s last node (``()``: the last history row)."""
        if path not in self._out:
            rows = len(self.next_ids)
            hidden = torch.cat([self.fused] + [self.out(path[:j])[None] for j in range(len(path))])
            ids = torch.tensor(self.next_ids + list(path))
            s = rows + len(path)
            dense = DenseCausalAttention(1, s)
            meta = AttentionMetadata(backend=dense, prepared=None, storage=dense, slots=torch.arange(s))
            with torch.inference_mode():
                self._out[path] = self.head(hidden, ids, torch.arange(s), meta)[-1]
        return self._out[path]

    def logp(self, path: tuple[int, ...]) -> torch.Tensor:
        """Log-probabilities ``(vocab,)`` over the target vocabulary (-inf off the draft vocabulary)."""
        with torch.inference_mode():
            return torch.log_softmax(self.head.compute_target_logits(self.out(path)[None])[0], dim=-1)

    def score(self, path: tuple[int, ...]) -> float:
        return sum(float(self.logp(path[:j])[t]) for j, t in enumerate(path))

    def tree(self, k: int, depth: int, nodes: int) -> tuple[list[tuple[float, tuple[int, ...]]], float]:
        """EAGLE-2's dynamic tree drafted from scratch: the ``nodes`` best (score, path) of every
        candidate created, best first, and the worst score among them."""
        def children(score, path):
            top = self.logp(path).topk(k)
            return [(score + float(v), path + (int(t),)) for v, t in zip(top.values, top.indices)]

        created = frontier = children(0.0, ())
        for _ in range(depth - 1):
            candidates = [c for node in frontier for c in children(*node)]
            created = created + candidates
            frontier = sorted(candidates, key=lambda c: -c[0])[:k]  # stable: ties to the earlier
        best = sorted(created, key=lambda c: -c[0])[:nodes]
        return best, best[-1][0]


def paths(tree: DraftTree) -> list[tuple[int, ...]]:
    return [tuple(tree.tokens[i] for i in tree.path(node)) for node in range(len(tree))]


def check_children_are_top(dense: DenseHead, tree: DraftTree, k: int) -> int:
    """Every node's (and the root's) children are its best ``m <= k`` tokens of the dense head on its
    path alone; returns the number of nodes checked."""
    nodes = [(-1, ())] + list(enumerate(paths(tree)))
    for parent, path in nodes:
        kids = [tree.tokens[i] for i, p in enumerate(tree.parents) if p == parent]
        if not kids:
            continue
        assert len(kids) <= k
        logp = dense.logp(path)
        assert torch.isfinite(logp[kids]).all()  # drafted from the draft vocabulary
        others = logp.clone()
        others[kids] = float("-inf")
        assert float(logp[kids].min()) >= float(others.max()) - TOL, (path, kids)
        assert kids == sorted(kids, key=lambda t: -float(logp[t])) or float(
            logp[kids].max() - logp[kids].min()) < TOL  # siblings best first (creation order)
    return len(nodes)


def check_against_dense_tree(dense: DenseHead, tree: DraftTree, k: int, depth: int, nodes: int) -> None:
    """The tree holds the nodes EAGLE-2's tree drafted densely picks (ties within TOL aside)."""
    best, threshold = dense.tree(k, depth, nodes)
    want = {path for _, path in best}
    got = set(paths(tree))
    assert len(got) == len(want) == nodes
    for path in got ^ want:
        assert abs(dense.score(path) - threshold) < TOL, (path, dense.score(path), threshold)


def head_rows(proposer: Eagle3Proposer, seq: Seq) -> int:
    state = proposer._states.get(seq.chain)
    assert state is not None
    assert state.chain.num_rows == len(state.positions)
    return state.chain.num_rows


@pytest.mark.parametrize("topk, num_draft_tokens, rooms", [
    (4, 17, [3, 1, 2]),
    (2, 8, [4, 3, 4]),
    (3, None, [2, 2, 1]),
])
def test_trees_are_the_dense_eagle2_trees(llm, gen, topk, num_draft_tokens, rooms):
    record, (proposer,) = proposers(llm, dict(topk=topk, num_draft_tokens=num_draft_tokens))
    seqs = [prefill(llm, n, gen) for n in (int(torch.randint(5, 40, (1,), generator=gen)) for _ in rooms)]
    trees = proposer.propose(seqs, rooms)
    checked = 0
    for seq, room, tree in zip(seqs, rooms, trees):
        assert isinstance(tree, DraftTree)
        nodes = min(num_draft_tokens - 1 if num_draft_tokens else min(topk * room, 64),
                    tree_capacity(room, topk))
        assert len(tree) == nodes and 1 <= tree.depth <= room
        rows = len(seq.tokens) - 1
        assert head_rows(proposer, seq) == rows  # the catch-up's rows stay, no draft row does
        dense = DenseHead(proposer.head, record.of(seq), seq.tokens)
        checked += check_children_are_top(dense, tree, topk)
        check_against_dense_tree(dense, tree, topk, room, nodes)
        assert [tree.tokens[i] for i in range(len(tree)) if tree.parents[i] == -1] == \
            dense.logp(()).topk(sum(p == -1 for p in tree.parents)).indices.tolist()
    assert checked > len(seqs) * 2
    assert max(t.depth for t in trees) >= 2


def test_topk_1_drafts_todays_greedy_chains(llm, gen):
    record, (chain_proposer, tree_proposer) = proposers(llm, dict(), dict(topk=4, num_draft_tokens=9))
    seqs = [prefill(llm, n, gen) for n in (12, 31, 6)]
    rooms = [3, 1, 4]
    chains = chain_proposer.propose(seqs, rooms)
    trees = tree_proposer.propose(seqs, rooms)
    for seq, room, chain, tree in zip(seqs, rooms, chains, trees):
        assert isinstance(chain, list) and len(chain) == room
        dense = DenseHead(chain_proposer.head, record.of(seq), seq.tokens)
        for j, token in enumerate(chain):  # each draft is the argmax after the ones before
            logp = dense.logp(tuple(chain[:j]))
            assert float(logp[token]) >= float(logp.max()) - TOL
        assert tree.tokens[0] == chain[0] and tree.parents[0] == -1
        assert head_rows(chain_proposer, seq) == head_rows(tree_proposer, seq) == len(seq.tokens) - 1
    assert chain_proposer.propose(seqs, [0, 0, 2]) == [[], [], chains[2][:2]]


def test_trims_and_forks_resync_the_head(llm, gen):
    """Accepted drafts, rejected ones (trimmed), a restore to an earlier row and a fork: each tree is
    the dense one of the sequence as it is then."""
    k, n = 3, 10
    record, (proposer,) = proposers(llm, dict(topk=k, num_draft_tokens=n))
    seq = prefill(llm, 25, gen)

    def check(s: Seq, room: int = 3) -> DraftTree:
        tree = proposer.propose([s], [room])[0]
        assert isinstance(tree, DraftTree) and len(tree) == n - 1
        dense = DenseHead(proposer.head, record.of(s), s.tokens)
        check_children_are_top(dense, tree, k)
        check_against_dense_tree(dense, tree, k, room, n - 1)
        assert head_rows(proposer, s) == len(s.tokens) - 1
        return tree

    def random_tokens(n: int) -> list[int]:
        return torch.randint(0, llm.model.cfg.vocab_size, (n,), generator=gen).tolist()

    tree = check(seq)
    verify(llm, seq, tree.first_branch(), 2)  # two drafts accepted, the rest trimmed
    check(seq)
    verify(llm, seq, random_tokens(3), 0)  # none accepted: the target's own token
    check(seq)
    seq.chain.trim(6)  # back to an earlier row (a restore): its state went with the forward before
    del seq.tokens[len(seq.tokens) - 6:]
    assert proposer.propose([seq], [3]) == [[]]
    advance(llm, seq, random_tokens(2))
    check(seq)  # the head's rows trimmed to the common prefix, then caught up
    child = Seq(seq.chain.fork(), list(seq.tokens))
    record.rows[child.chain] = record.rows[seq.chain].clone()
    advance(llm, child, random_tokens(3))
    check(child)  # forks the parent's head rows
    check(seq, room=2)
    assert proposer.num_sequences == 2
    del child
    gc.collect()
    proposer.release_all()
    assert proposer.cache.pool.pages_in_use == 0


def test_failures_leave_no_head_rows(llm, gen, monkeypatch):
    """No pages for a level's rows: the levels before stand; no pages at all: no tree."""
    k = 4
    record, (proposer,) = proposers(llm, dict(topk=k, num_draft_tokens=30))
    seqs = [prefill(llm, 20, gen), prefill(llm, 9, gen)]
    step = proposer._head_step
    levels = []

    def failing(*args, tree_parents=None, **kw):
        if tree_parents is not None:
            levels.append(tree_parents)
            if len(levels) == 2:
                raise OutOfPagesError("no pages for the third level")
        return step(*args, tree_parents=tree_parents, **kw)

    monkeypatch.setattr(proposer, "_head_step", failing)
    trees = proposer.propose(seqs, [4, 4])
    for seq, tree in zip(seqs, trees):
        assert tree.depth == 2 and len(tree) == tree_capacity(2, k) < 29  # all the two levels created
        assert head_rows(proposer, seq) == len(seq.tokens) - 1
        dense = DenseHead(proposer.head, record.of(seq), seq.tokens)
        check_children_are_top(dense, tree, k)
        check_against_dense_tree(dense, tree, k, 2, len(tree))
    # the level that failed asked for every draft row so far: the first level's and its own
    assert [len(p) for p in levels[1]] == [2 * k, 2 * k]
    assert all(p[:k] == (-1,) * k and all(0 <= q < k for q in p[k:]) for p in levels[1])
    monkeypatch.undo()
    _, (small,) = proposers(llm, dict(topk=k, num_draft_tokens=30, num_pages=2))
    seq = prefill(llm, 30, gen)
    assert small.propose([seq], [4]) == [[]]  # the tree's rows would not fit: nothing drafted
    assert small.cache.pool.pages_in_use == 0


def test_a_kept_tree_path_moves_its_states(llm, gen):
    """A tree verify window whose accepted path is not its first rows: the generator moves the
    path's rows into place and tells the proposer (``keep_tree_rows``), whose recorded states move
    the same way; the next tree is the dense one of the path computed as a chain."""
    k, n = 3, 10
    record, (proposer,) = proposers(llm, dict(topk=k, num_draft_tokens=n))
    seq = prefill(llm, int(torch.randint(8, 30, (1,), generator=gen)), gen)
    tree = proposer.propose([seq], [3])[0]
    path = tree.path(len(tree) - 1)  # 9 nodes, at most 3 deep: the last one's path is out of place
    keep = [0] + [i + 1 for i in path]
    assert keep != list(range(len(keep)))
    accepted = [tree.tokens[i] for i in path]
    base, window = len(seq.tokens) - 1, len(tree) + 1
    fork = seq.chain.fork()  # the accepted path as a chain, for the test's own record
    record.rows[fork] = record.of(seq).clone()
    llm.runner.forward([StepInput(fork, [seq.tokens[-1], *accepted])])
    logits = llm.runner.forward([StepInput(seq.chain, [seq.tokens[-1], *tree.tokens], tree.window_parents())],
                                logit_rows=[window])
    seq.chain.keep_last_rows(window, keep)
    proposer.keep_tree_rows(seq.chain, window, keep)
    seq.tokens += [*accepted, int(logits[keep[-1]].argmax())]
    record.rows[seq.chain] = record.rows[fork]
    del fork
    torch.testing.assert_close(proposer._aux[seq.chain].rows_from(base), record.of(seq)[base:], rtol=1e-4, atol=1e-4)
    tree = proposer.propose([seq], [3])[0]
    dense = DenseHead(proposer.head, record.of(seq), seq.tokens)
    check_children_are_top(dense, tree, k)
    check_against_dense_tree(dense, tree, k, 3, n - 1)
    assert head_rows(proposer, seq) == len(seq.tokens) - 1
