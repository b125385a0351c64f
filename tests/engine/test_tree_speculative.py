"""Tree verify windows in the engine (``DraftTree`` proposals): greedy decoding gives exactly the
plain tokens whichever branch holds the true continuation, and the accepted path's rows are moved
into place.

A test proposer builds each tree around the TRUE greedy continuation (recorded first by the same
engine decoding plainly: a proposer that drafts nothing): random distractor siblings before and
after each true child (so accepted paths often go through a non-first branch and rows are moved),
sometimes a wrong token on the true path (a rejection mid-tree), random depths up to the room,
sometimes a random tree holding no true token. Batches, single prompts, conversation turns, a
fork, ``n = 2``, stops, lengths, logprobs and penalties must all match plain decoding.

Sampled tree windows: a 24-word random model's first three generated tokens (``spec_sampling_helpers``),
drawn through trees chosen deterministically from the context (the model's top tokens, siblings at
depth 1 with children under some), must have the exact joint distribution computed from its logits
and that of plain sampling (chi-square tests); a wrong tree rule patched in must fail the same
comparison (the tests' power)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

import segkv.engine.generation as generation
from segkv.engine.llm import LLM
from segkv.sampling_params import SamplingParams
from segkv.spec.rejection import TreeVerdict, tree_children
from segkv.spec.tree import DraftTree
from spec_sampling_helpers import (PROMPT, VIEWS, VOCAB, big_batches, build_word_model, draw, exact_joint_of,
                                   goodness_of_fit_p, next_token_probs, p_values, params_of, spec_counts,
                                   view_probs)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef add(",
    "for i in range(10):\n    print(i)\nfor i in",
    "import os\nimport sys\nimport os\nimport sys\nimport",
    "The quick brown fox",
]


class Recorder:
    """Drafts nothing (the engine decodes plainly) and keeps each sequence's output list: once the
    run ends, the true continuation of ``(history, sample index)``."""

    def __init__(self) -> None:
        self.outputs: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def propose(self, seqs, rooms):
        for s in seqs:
            self.outputs[(tuple(s.history), s.index)] = s.output_ids  # the list the run grows
        return [[] for _ in seqs]


class TreeOracle:
    """Trees around the true continuation (see the module docstring). ``keep_tree_rows`` (the
    generator's hook after a tree's kept path was moved into place) checks the chain's last rows
    hold the pending token and the kept nodes' tokens, and counts paths through non-first rows."""

    def __init__(self, truth: dict, rng: random.Random, vocab: int) -> None:
        self.truth, self.rng, self.vocab = truth, rng, vocab
        self.proposed: dict[int, tuple[int, DraftTree]] = {}
        self.trees = self.true_trees = self.moved = self.deep = 0

    def propose(self, seqs, rooms):
        out = []
        for s, room in zip(seqs, rooms):
            assert room >= 1
            true = self.truth.get((tuple(s.history), s.index))
            done = len(s.output_ids)
            ahead = true[done:] if true is not None and true[:done] == s.output_ids else []
            tree = self.tree(ahead, room)
            assert tree.depth <= room
            self.proposed[id(s.chain)] = (s.output_ids[-1], tree)
            self.trees += 1
            out.append(tree)
        return out

    def keep_tree_rows(self, chain, window, keep):
        pending, tree = self.proposed.pop(id(chain))
        # the whole tree, or its first nodes where the step's token budget cut it
        assert window <= len(tree) + 1 and keep[0] == 0
        tree = DraftTree(tree.tokens[: window - 1], tree.parents[: window - 1])
        nodes = [r - 1 for r in keep[1:]]
        assert [tree.parents[n] for n in nodes] == ([-1] + nodes)[: len(nodes)]  # a path from the root
        assert chain.token_ids()[-len(keep):] == [pending] + [tree.tokens[n] for n in nodes]
        self.moved += keep != list(range(len(keep)))
        self.deep += len(keep) > 2

    # -- building trees ---------------------------------------------------------------
    def other(self, taken: set[int]) -> int:
        while True:
            token = self.rng.randrange(self.vocab)
            if token not in taken:
                return token

    def tree(self, ahead: list[int], room: int) -> DraftTree:
        rng = self.rng
        # abstract nodes: (parent index or -1, token); serialised in a random order below
        nodes: list[tuple[int, int]] = []
        if not ahead or rng.random() < 0.15:  # no true token anywhere
            banned = set(ahead[:room])
            for _ in range(rng.randint(0 if not ahead else 1, 6)):
                parent = rng.randrange(-1, len(nodes))
                depth = self.depth_of(nodes, parent) + 1
                if depth > room:
                    parent, depth = -1, 1
                siblings = {t for p, t in nodes if p == parent}
                nodes.append((parent, self.other(banned | siblings)))
            return self.serialise(nodes)
        self.true_trees += 1
        depth = rng.randint(1, min(room, len(ahead)))
        path = list(ahead[:depth])
        if rng.random() < 0.25:  # a wrong token on the path: rejected there
            j = rng.randrange(depth)
            path[j] = self.other({ahead[j]})
        parent = -1
        for d, token in enumerate(path, start=1):
            siblings = {token}
            for _ in range(rng.choice([0, 1, 1, 2, 3])):
                siblings.add(self.other(siblings | {ahead[d - 1]}))
            distractors = sorted(siblings - {token}, key=lambda _: rng.random())
            here = []
            for t in distractors:
                here.append(len(nodes))
                nodes.append((parent, t))
            nodes.append((parent, token))
            true_node = len(nodes) - 1
            for n in here:  # a distractor's own child, where the room allows
                if d < room and rng.random() < 0.4:
                    nodes.append((n, self.other(set())))
            parent = true_node
        return self.serialise(nodes)

    @staticmethod
    def depth_of(nodes, parent: int) -> int:
        depth = 0
        while parent >= 0:
            depth, parent = depth + 1, nodes[parent][0]
        return depth

    def serialise(self, nodes: list[tuple[int, int]]) -> DraftTree:
        """A random topological order: siblings, and so the true child among them, in random order."""
        order, placed, left = [], {}, list(range(len(nodes)))
        while left:
            ready = [n for n in left if nodes[n][0] < 0 or nodes[n][0] in placed]
            n = ready[self.rng.randrange(len(ready))]
            left.remove(n)
            placed[n] = len(order)
            order.append(n)
        return DraftTree(tuple(nodes[n][1] for n in order),
                         tuple(-1 if nodes[n][0] < 0 else placed[nodes[n][0]] for n in order))


@pytest.fixture(scope="module", params=["default", "default-mla"])
def engines(request):
    """(plain, speculative) engines of one packaged model; the speculative one's proposer is
    replaced per run."""
    kw = {"dtype": "float32", "device": "cpu"}
    return LLM(request.param, **kw), LLM(request.param, speculative_config=NGRAM, **kw)


def run_with_trees(spec: LLM, gen: torch.Generator, run):
    """``run(llm)`` first decoding plainly (recording the truth), then with trees around it;
    returns (plain result, tree result, the oracle)."""
    recorder = Recorder()
    spec.generator.proposer = recorder
    reference = run(spec)
    assert recorder.outputs
    oracle = TreeOracle(recorder.outputs, random.Random(int(torch.randint(0, 2**31, (1,), generator=gen))),
                        spec.model.cfg.vocab_size)
    spec.generator.proposer = oracle
    return reference, run(spec), oracle


def tokens(llm, prompts, params):
    return [[o.token_ids for o in r.outputs] for r in llm.generate(prompts, params)]


def test_greedy_tokens_equal_plain_decoding_through_any_branch(engines, gen):
    plain, spec = engines
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = tokens(plain, PROMPTS, params)
    before, copied = spec_counts(spec), spec.cache.stats()["bytes_copied"]
    recorded, got, oracle = run_with_trees(spec, gen, lambda llm: tokens(llm, PROMPTS, params))
    assert recorded == want  # the recording run decoded plainly
    assert got == want
    drafts, accepted, rejected = (b - a for a, b in zip(before, spec_counts(spec)))
    assert drafts == oracle.trees > 20 and accepted > 0 and rejected > 0
    assert oracle.true_trees > 10 and oracle.moved > 0 and oracle.deep > 0
    assert spec.cache.stats()["bytes_copied"] > copied  # the moved rows were copied
    assert spec.cache.stats()["pages_in_use"] == 0
    # each prompt alone: the same tokens (other trees, other batches)
    alone = run_with_trees(spec, gen, lambda llm: [tokens(llm, [p], params)[0] for p in PROMPTS])
    assert alone[0] == want and alone[1] == want and alone[2].moved > 0
    assert spec.cache.stats()["pages_in_use"] == 0


@pytest.mark.parametrize("limit", [
    {"max_tokens": 7},
    {"max_tokens": 40, "stop": ("\n\n",)},
    {"max_tokens": 40, "stop_token_ids": (13, 198)},
    {"max_tokens": 40, "logprobs": 3},
    {"max_tokens": 30, "n": 2, "temperature": 0},
    {"max_tokens": 40, "repetition_penalty": 1.3, "frequency_penalty": 0.5},
])
def test_stops_lengths_logprobs_and_penalties_as_in_plain_decoding(engines, gen, limit):
    plain, spec = engines
    params = SamplingParams(**{"temperature": 0, **limit})
    want = plain.generate(PROMPTS, params)
    _, got, oracle = run_with_trees(spec, gen, lambda llm: llm.generate(PROMPTS, params))
    assert oracle.trees > 0
    for w, g in zip(want, got):
        assert len(g.outputs) == len(w.outputs) == params.n
        for a, b in zip(w.outputs, g.outputs):
            assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == \
                (a.token_ids, a.text, a.finish_reason, a.stop_reason)
            assert len(b.token_ids) <= params.max_tokens
            if params.logprobs is not None:
                assert [x.token_id for x in b.logprobs] == [x.token_id for x in a.logprobs] == a.token_ids
                for x, y in zip(a.logprobs, b.logprobs):
                    assert math.isfinite(y.logprob) and y.logprob <= 0
                    assert math.isclose(x.logprob, y.logprob, rel_tol=1e-4, abs_tol=1e-4)
                    assert [t for t, _ in x.top] == [t for t, _ in y.top] and len(y.top) == 3
                    for (_, p), (_, q) in zip(x.top, y.top):
                        assert math.isclose(p, q, rel_tol=1e-4, abs_tol=1e-4)
    assert spec.cache.stats()["pages_in_use"] == 0


def test_conversation_turns_and_a_fork_match_plain(engines, gen):
    def talk(llm):
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        conv = llm.conversation(system="You write Python.")
        replies = [conv.say(PROMPTS[0], params).output.token_ids, conv.say(PROMPTS[1], params).output.token_ids]
        fork = conv.fork()
        replies += [fork.say(PROMPTS[2], params).output.token_ids, conv.say(PROMPTS[3], params).output.token_ids]
        for c in (conv, fork):
            pages = sum(len(span.page_ids) for span in c.chain.spans())
            assert pages >= math.ceil(c.chain.num_rows / llm.cache.page_size)
            assert c.chain.token_ids() is None or len(c.chain.token_ids()) == c.chain.num_rows
        return replies

    plain, spec = engines
    want = talk(plain)
    recorded, got, oracle = run_with_trees(spec, gen, talk)
    assert recorded == want and got == want
    assert oracle.trees > 10 and oracle.moved > 0


# -- sampled tree windows: the exact distribution -------------------------------------------
NUM_SAMPLES = 4_000
NUM_POWER_SAMPLES = 3_000
ALPHA = 1e-5  # a correct engine fails one of these 12 comparisons with probability < 2e-4
TREE_CONFIG = {"method": "ngram", "num_speculative_tokens": 3}  # a placeholder: the proposer is replaced


class TopTokenTrees:
    """Trees from the context (the tokens generated after ``PROMPT``), by the word model's ranking
    of its next tokens (``ranks[context]``: token ids, most probable first). After one token
    (room 2): four siblings (ranks 1, 0, 2 and the least probable), the first three with children
    (ranks 0 and 1, 0 and 1, and 3 of the next position), nodes interleaved so that kept paths move
    rows. After two tokens (room 1): three siblings (ranks 2, 0, 1)."""

    def __init__(self, ranks: dict[tuple[int, ...], list[int]]) -> None:
        self.ranks = ranks
        self.trees = self.moved = self.deep = 0

    def propose(self, seqs, rooms):
        out = []
        for s, room in zip(seqs, rooms):
            context = tuple(s.all_token_ids()[len(PROMPT):])
            assert s.all_token_ids()[: len(PROMPT)] == PROMPT and room == 3 - len(context)
            top = self.ranks[context]
            if len(context) == 1:
                a, b, c, d = top[1], top[0], top[2], top[-1]
                under = {t: self.ranks[context + (t,)] for t in (a, b, c)}
                tokens = (a, under[a][0], under[a][1], b, under[b][1], under[b][0], c, under[c][3], d)
                parents = (-1, 0, 0, -1, 3, 3, -1, 6, -1)
            else:
                tokens, parents = (top[2], top[0], top[1]), (-1, -1, -1)
            out.append(DraftTree(tokens, parents))
            self.trees += 1
        return out

    def keep_tree_rows(self, chain, window, keep):
        self.moved += keep != list(range(len(keep)))
        self.deep += len(keep) > 2


def sibling_blind_trees(target_probs, parents, draft_ids, generators):
    """A wrong tree rule (``verify_trees``' signature): each child in turn is kept with its own
    probability ``p(c)``, blind to the mass of the siblings before it, and when every child is
    rejected the token is drawn from ``p`` itself instead of the residual (child tokens again)."""
    out, start = [], 0
    for tree_parents, tokens, generator in zip(parents, draft_ids, generators):
        children = tree_children(tree_parents)
        nodes, emitted, row = [], [], 0
        while True:
            p = target_probs[start + row]
            kept = next((c for c in children[row]
                         if float(torch.rand((), generator=generator)) < float(p[tokens[c]])), None)
            if kept is None:
                emitted.append(int(torch.multinomial(p, 1, generator=generator)))
                break
            nodes.append(kept)
            emitted.append(tokens[kept])
            row = kept + 1
        out.append(TreeVerdict(emitted, nodes))
        start += len(tree_parents) + 1
    return out


@pytest.fixture(scope="module")
def word_engines(tmp_path_factory):
    """(plain engine, tree engine, the HF model) of one random word model."""
    directory = tmp_path_factory.mktemp("tree-word-model") / "target"
    hf = build_word_model(directory, seed=0)
    kw = {"page_size": 16, "num_pages": 4096}  # 1024 running sequences and the shared prompt fit
    plain = big_batches(LLM(directory, **kw))
    trees = big_batches(LLM(directory, speculative_config=TREE_CONFIG, **kw))
    p1, p2, p3 = next_token_probs(hf, plain.generator.sampler, params_of("temperature-1"))
    ranks = {(x,): p2[x].argsort(descending=True).tolist() for x in range(VOCAB)}
    ranks |= {(x, y): p3[x, y].argsort(descending=True).tolist() for x in range(VOCAB) for y in range(VOCAB)}
    trees.generator.proposer = TopTokenTrees(ranks)
    # its trees outgrow the config's window, which the step budget reserves: lift the cut, so that
    # every first window is a whole tree (the budget has a test of its own)
    trees.generator.max_step_rows = None
    return plain, trees, hf


_exact: dict[str, torch.Tensor] = {}
_plain: list = []


def exact_joint(word_engines, setting: str) -> torch.Tensor:
    """The exact joint distribution of the first three tokens under ``setting`` (computed once)."""
    if setting not in _exact:
        plain, _, hf = word_engines
        _exact[setting] = exact_joint_of(hf, plain.generator.sampler, params_of(setting))
    return _exact[setting]


def plain_samples(word_engines) -> list[tuple[int, int, int]]:
    """Plain samples at temperature 1 (drawn once; top-p is compared with the exact distribution only)."""
    if not _plain:
        _plain.append(draw(word_engines[0], "temperature-1", NUM_SAMPLES, seed=100))
    return _plain[0]


def comparisons(word_engines, setting: str, samples) -> dict[str, float]:
    """Each view's p-value against the exact distribution, and at temperature 1 against plain samples."""
    joint = exact_joint(word_engines, setting)
    if setting == "temperature-1":
        return p_values(samples, plain_samples(word_engines), joint)
    return {f"{view} vs exact": goodness_of_fit_p(Counter(map(key, samples)), view_probs(joint, view))
            for view, key in VIEWS.items()}


@pytest.mark.parametrize("setting", ["temperature-1", "top-p-0.9"])
def test_sampled_tree_windows_have_the_target_distribution(word_engines, setting):
    _, llm, _ = word_engines
    proposer = llm.generator.proposer
    before, trees, moved = spec_counts(llm), proposer.trees, proposer.moved
    copied = llm.cache.stats()["bytes_copied"]
    samples = draw(llm, setting, NUM_SAMPLES, seed=200)
    windows, accepted, rejected = (b - a for a, b in zip(before, spec_counts(llm)))
    assert windows == proposer.trees - trees >= NUM_SAMPLES  # a tree at (nearly) every first window
    assert accepted > NUM_SAMPLES // 2 and rejected > 0, (windows, accepted, rejected)
    assert proposer.moved - moved > NUM_SAMPLES // 10 and proposer.deep > 0  # non-first branches kept
    assert llm.cache.stats()["bytes_copied"] > copied
    result = comparisons(word_engines, setting, samples)
    assert len(result) == (8 if setting == "temperature-1" else 4)
    print("trees", setting, (windows, accepted, rejected), result)  # shown with -s
    assert all(math.isfinite(p) for p in result.values())
    failed = {name: p for name, p in result.items() if p <= ALPHA}
    assert not failed, (failed, result)


def test_a_wrong_tree_rule_fails_the_same_comparison(word_engines, monkeypatch):
    """The tests' power: with a sibling-blind rule patched into the generator, the second token's
    distribution and the joint of the first two are told apart from plain sampling and from the
    exact distribution."""
    monkeypatch.setattr(generation, "verify_trees", sibling_blind_trees)
    _, llm, _ = word_engines
    before = spec_counts(llm)
    samples = draw(llm, "temperature-1", NUM_POWER_SAMPLES, seed=300)
    assert spec_counts(llm)[0] - before[0] >= NUM_POWER_SAMPLES
    result = comparisons(word_engines, "temperature-1", samples)
    print("wrong tree rule", result)  # shown with -s
    for name in ("token 2 vs plain", "token 2 vs exact", "tokens 1-2 vs plain", "tokens 1-2 vs exact"):
        assert result[name] < 1e-6, (name, result)  # far below ALPHA, what a correct rule must pass


def test_draft_rows_stay_within_the_step_token_budget(gen):
    """With a token budget of 6 rows a step, a batch of 3 decoding sequences leaves 3 rows for
    drafts: windows are cut (trees to their first nodes) and every forward fits; tokens stay plain."""
    kw = {"dtype": "float32", "device": "cpu", "max_num_batched_tokens": 6}
    plain, spec = LLM("default", **kw), LLM("default", speculative_config=NGRAM, **kw)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [p[:6] for p in PROMPTS[:3]]
    rows: list[int] = []
    forward = spec.runner.forward

    def counted(inputs, **kwargs):
        rows.append(sum(len(item.token_ids) for item in inputs))
        return forward(inputs, **kwargs)

    spec.runner.forward = counted
    want, got, oracle = run_with_trees(spec, gen, lambda llm: tokens(llm, prompts, params))
    assert got == want == tokens(plain, prompts, params)
    assert oracle.trees > 0 and max(rows) <= 6
    assert spec.generator.spec_stats.draft_tokens > 0
