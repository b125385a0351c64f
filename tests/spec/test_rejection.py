"""Rejection sampling of verify windows: exact in distribution (chi-square against the analytic
distribution and against plain sampling, with a wrong rule shown to fail), greedy, reproducible."""

from __future__ import annotations

import math

import pytest
import torch

from segkv.layers.sampler import Sampler, make_generator
from segkv.sampling_params import SamplingParams
from segkv.spec.rejection import verify_window, verify_windows

SAMPLER = Sampler()
VOCAB, LENGTH, START = 10, 3, 0  # a toy model over 10 tokens; 3 generated tokens after START
NUM = 30_000  # trials per case
ALPHA = 1e-5  # every chi-square p-value of a correct sampler must exceed this
TOP_P = SamplingParams(top_p=0.9)


# ---------------------------------------------------------------- chi-square


def _chi2_pvalue(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _fit_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of ``counts`` (C,) to ``probs`` (C,); cells expected below 5 are pooled.
    A cell of probability 0 must be empty."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was emitted"
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    if obs.numel() == 1:  # one possible outcome (a filter kept one token): nothing to test
        return 1.0
    return _chi2_pvalue(float(((obs - exp) ** 2 / exp).sum()), obs.numel() - 1)


def _same_pvalue(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test that two samples' counts (C,) come from one distribution; cells with
    fewer than 10 draws in all are pooled."""
    a, b = a.double().flatten(), b.double().flatten()
    small = (a + b) < 10
    table = torch.stack([torch.cat([a[~small], a[small].sum()[None]]), torch.cat([b[~small], b[small].sum()[None]])])
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    return _chi2_pvalue(float(((table - expected) ** 2 / expected).sum()), table.shape[1] - 1)


def _joint_counts(tokens: torch.Tensor, positions: int) -> torch.Tensor:
    """(VOCAB,) * positions counts of the first ``positions`` tokens of (N, LENGTH) ``tokens``."""
    code = torch.zeros(tokens.shape[0], dtype=torch.int64)
    for j in range(positions):
        code = code * VOCAB + tokens[:, j]
    return torch.bincount(code, minlength=VOCAB**positions).reshape((VOCAB,) * positions)


# ---------------------------------------------------------------- toy models


class Target:
    """A fixed target model: logits from a random table indexed by the last token, sampled
    through ``Sampler`` with ``params`` (penalties, if any, see the whole output)."""

    def __init__(self, gen: torch.Generator, params: SamplingParams) -> None:
        self.logits = torch.randn(VOCAB, VOCAB, generator=gen) * 1.5
        self.params = params

    def _args(self, prefixes: list[list[int]]):
        last = torch.tensor([p[-1] if p else START for p in prefixes])
        return self.logits[last], [self.params] * len(prefixes), {
            "prompt_token_ids": [[START]] * len(prefixes), "output_token_ids": prefixes}

    def probs(self, prefixes: list[list[int]]) -> torch.Tensor:
        """(len(prefixes), VOCAB) float32: the next-token distribution after each prefix."""
        logits, params, histories = self._args(prefixes)
        return SAMPLER.distribution(logits, params, **histories)

    def sample(self, prefixes: list[list[int]]) -> list[int]:
        logits, params, histories = self._args(prefixes)
        return SAMPLER(logits, params, **histories).token_ids.tolist()

    def exact(self) -> torch.Tensor:
        """(VOCAB,) * LENGTH float64: the analytic joint distribution of the first tokens."""
        joint = torch.ones(())
        prefixes = [[]]
        for _ in range(LENGTH):
            step = self.probs(prefixes).double().reshape(joint.shape + (VOCAB,))
            joint = joint[..., None] * step
            prefixes = [p + [t] for p in prefixes for t in range(VOCAB)]
        return joint


def _spread_target(gen: torch.Generator, params: SamplingParams) -> Target:
    """A ``Target`` whose joint distribution has at least 20 outcomes expected 5 times in
    ``NUM`` trials: a random table can be so peaked that a filter keeps one token, and a test
    of one outcome tells nothing. Redraws (from ``gen``) until it is spread."""
    for _ in range(100):
        target = Target(gen, params)
        if int((target.exact() * NUM >= 5).sum()) >= 20:
            return target
    raise AssertionError("no spread target in 100 draws")


def _plain(target: Target, num: int) -> torch.Tensor:
    """(num, LENGTH) tokens drawn one step at a time by ``Sampler.forward``."""
    out = [[] for _ in range(num)]
    for _ in range(LENGTH):
        for o, t in zip(out, target.sample(out)):
            o.append(t)
    return torch.tensor(out)


def _speculative(target: Target, draft: torch.Tensor, num: int, *, deterministic: bool,
                 max_drafts: int = 3, ragged: bool = False, verify=verify_windows) -> torch.Tensor:
    """(num, LENGTH) tokens from verify windows. ``draft`` (VOCAB, VOCAB) float32 is a Markov
    proposer: ``q(. | last)`` rows, sampled from, or (``deterministic``) its argmax taken."""
    out = [[] for _ in range(num)]
    while active := [o for o in out if len(o) < LENGTH]:
        n = len(active)
        last = torch.tensor([o[-1] if o else START for o in active])
        k = torch.randint(0, max_drafts + 1, (n,)) if ragged else torch.full((n,), max_drafts)
        drafts, rows = [], []
        prev = last
        for _ in range(max_drafts):
            rows.append(draft[prev])
            prev = draft[prev].argmax(-1) if deterministic else torch.multinomial(draft[prev], 1)[:, 0]
            drafts.append(prev)
        drafts, rows = torch.stack(drafts, 1), torch.stack(rows, 1)  # (n, K), (n, K, V)
        mask = torch.arange(max_drafts)[None, :] < k[:, None]
        draft_ids = [d[:m] for d, m in zip(drafts.tolist(), k.tolist())]
        prefixes = [o + d[:j] for o, d in zip(active, draft_ids) for j in range(len(d) + 1)]
        emitted = verify(target.probs(prefixes), draft_ids, None if deterministic else rows[mask])
        for o, e in zip(active, emitted):
            o.extend(e)
    return torch.tensor([o[:LENGTH] for o in out])


def _draft_model(gen: torch.Generator, target: Target) -> torch.Tensor:
    """A proposer that is related to the target but clearly different from it."""
    return (0.5 * target.logits + torch.randn(VOCAB, VOCAB, generator=gen) * 1.5).softmax(-1)


def _check_exact(tokens: torch.Tensor, exact: torch.Tensor) -> dict[str, float]:
    """p-values of ``tokens`` against ``exact``: the joint of all positions and of the first
    two, and each position's marginal."""
    pvalues = {"joint": _fit_pvalue(_joint_counts(tokens, LENGTH), exact),
               "joint 1-2": _fit_pvalue(_joint_counts(tokens, 2), exact.sum(-1))}
    for j in range(LENGTH):
        marginal = exact.sum(dim=[d for d in range(LENGTH) if d != j])
        pvalues[f"position {j + 1}"] = _fit_pvalue(torch.bincount(tokens[:, j], minlength=VOCAB), marginal)
    return pvalues


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize(
    "params, deterministic, ragged",
    [
        (SamplingParams(), False, False),
        (TOP_P, False, False),
        (SamplingParams(), True, False),
        (TOP_P, True, False),
        (SamplingParams(temperature=1.3, top_k=6, top_p=0.95), False, True),
    ],
    ids=["t1-sampled", "top_p-sampled", "t1-deterministic", "top_p-deterministic", "filters-ragged"],
)
def test_speculative_tokens_have_the_target_distribution(gen, params, deterministic, ragged):
    target = _spread_target(gen, params)
    exact = target.exact()
    plain = _plain(target, NUM)
    spec = _speculative(target, _draft_model(gen, target), NUM, deterministic=deterministic, ragged=ragged)
    pvalues = {f"speculative {name}": p for name, p in _check_exact(spec, exact).items()}
    pvalues["plain joint"] = _fit_pvalue(_joint_counts(plain, LENGTH), exact)
    pvalues["speculative vs plain, joint 1-2"] = _same_pvalue(_joint_counts(spec, 2), _joint_counts(plain, 2))
    assert min(pvalues.values()) > ALPHA, pvalues


def test_penalties_see_the_drafts_before_each_row(gen):
    """A window's rows pass the drafts before them as output, so penalties stay exact."""
    params = SamplingParams(temperature=0.8, presence_penalty=1.5, repetition_penalty=1.3)
    target = _spread_target(gen, params)
    exact = target.exact()
    unpenalised = Target(gen, SamplingParams(temperature=0.8))
    unpenalised.logits = target.logits
    assert (exact - unpenalised.exact()).abs().max() > 0.01  # the penalties matter
    spec = _speculative(target, _draft_model(gen, target), NUM // 2, deterministic=False)
    pvalues = _check_exact(spec, exact)
    assert min(pvalues.values()) > ALPHA, pvalues


def _wrong_verify(resample_from_target: bool):
    """A batched verify with a wrong rule: resample from ``p`` instead of the residual at the
    first rejection, or keep every draft."""

    def verify(target_probs, draft_ids, draft_probs):
        n, k = len(draft_ids), len(draft_ids[0])
        p = target_probs.reshape(n, k + 1, VOCAB)
        d = torch.tensor(draft_ids)
        p_d = p[:, :k].gather(2, d[..., None])[..., 0]
        q_d = draft_probs.reshape(n, k, VOCAB).gather(2, d[..., None])[..., 0]
        keep = torch.rand(n, k) * q_d < p_d if resample_from_target else torch.ones(n, k, dtype=torch.bool)
        kept = keep.long().cumprod(1).sum(1)
        token = torch.multinomial(p[torch.arange(n), kept], 1)[:, 0]
        return [ids[:m] + [t] for ids, m, t in zip(draft_ids, kept.tolist(), token.tolist())]

    return verify


@pytest.mark.parametrize("resample_from_target", [True, False], ids=["resample-from-p", "keep-every-draft"])
def test_a_wrong_rule_fails_the_same_test(gen, resample_from_target):
    target = _spread_target(gen, TOP_P)
    exact = target.exact()
    wrong = _speculative(target, _draft_model(gen, target), NUM, deterministic=False,
                         verify=_wrong_verify(resample_from_target))
    pvalue = _fit_pvalue(_joint_counts(wrong, LENGTH).masked_fill(exact == 0, 0), exact)
    assert pvalue < 1e-12, pvalue


# ---------------------------------------------------------------- greedy, errors, seeds


def test_greedy_rows_keep_drafts_while_they_are_the_argmax(gen):
    num, k, vocab = 200, 4, 50
    logits = torch.randn(num * (k + 1), vocab, generator=gen) * 3
    greedy = SAMPLER.distribution(logits, [SamplingParams(temperature=0)] * logits.shape[0])
    argmax = logits.argmax(-1).reshape(num, k + 1)
    matches = torch.randint(0, k + 1, (num,), generator=gen)  # drafts 1..m are the argmax
    drafts = []
    for i, m in enumerate(matches.tolist()):
        wrong = [(int(a) + 1 + int(torch.randint(0, vocab - 1, (), generator=gen))) % vocab for a in argmax[i]]
        drafts.append([int(argmax[i, j]) if j < m else wrong[j] for j in range(k)])
    want = [d[:m] + [int(argmax[i, m])] for i, (d, m) in enumerate(zip(drafts, matches.tolist()))]
    draft_probs = torch.rand(num * k, vocab, generator=gen).softmax(-1)
    assert verify_windows(greedy, drafts) == want
    assert verify_windows(greedy, drafts, draft_probs) == want
    assert [verify_window(greedy[i * (k + 1):(i + 1) * (k + 1)], drafts[i], None, None)
            for i in range(5)] == want[:5]


def test_bad_inputs_raise():
    p = torch.full((3, 8), 1 / 8)
    q = torch.full((2, 8), 1 / 8)
    for bad in (float("nan"), float("inf"), -0.1):
        target = p.clone()
        target[1, 3] = bad
        with pytest.raises(ValueError, match="target_probs rows must be probabilities"):
            verify_window(target, [1, 2], q, None)
        draft = q.clone()
        draft[0, 0] = bad
        with pytest.raises(ValueError, match="draft_probs rows must be probabilities"):
            verify_window(p, [1, 2], draft, None)
    with pytest.raises(ValueError, match="target_probs rows must be probabilities"):
        verify_window(torch.randn(3, 8), [1, 2], None, None)  # logits, not probabilities
    with pytest.raises(ValueError, match=r"target_probs must be \(sum\(k_i \+ 1\), V\) = \(4, V\)"):
        verify_window(p, [1, 2, 3], None, None)
    with pytest.raises(ValueError, match=r"draft_probs must be \(sum\(k_i\), V\) = \(2, 8\)"):
        verify_window(p, [1, 2], q[:1], None)
    with pytest.raises(ValueError, match=r"draft ids must be in \[0, 8\)"):
        verify_window(p, [1, 8], None, None)
    with pytest.raises(ValueError, match="generators has 2 entries for 1 sequences"):
        verify_windows(p, [[1, 2]], None, [None, None])
    assert verify_windows(p[:0], []) == []


def test_same_seed_same_tokens_whatever_the_batch(gen):
    k, vocab = 3, 40
    p = (torch.randn(k + 1, vocab, generator=gen) * 2).softmax(-1)
    q = (torch.randn(k, vocab, generator=gen) * 2).softmax(-1)
    drafts = torch.multinomial(q, 1)[:, 0].tolist()
    seed = int(torch.randint(0, 2**62, (), generator=gen))
    alone = [verify_window(p, drafts, q, make_generator(seed)) for _ in range(3)]
    assert alone[0] == alone[1] == alone[2]
    g = make_generator(seed)
    series = [verify_window(p, drafts, q, g) for _ in range(20)]
    assert series[0] == alone[0] and len({tuple(s) for s in series}) > 1  # the generator advances

    other = (torch.randn(3, vocab, generator=gen) * 2).softmax(-1)
    batch = torch.cat([other[:2], p, other[2:]])
    probs = torch.cat([other[1:2], q])
    torch.manual_seed(int(torch.randint(0, 2**62, (), generator=gen)))  # the default generator's state does not matter
    out = verify_windows(batch, [[5], drafts, []], probs, [None, make_generator(seed), make_generator(seed + 1)])
    assert out[1] == alone[0] and len(out[0]) in (1, 2) and len(out[2]) == 1
