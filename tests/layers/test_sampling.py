"""SamplingParams validation and the Sampler: penalties, filters, seeded draws, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from segkv.layers.sampler import Sampler, apply_filters, apply_penalties, make_generator
from segkv.sampling_params import SamplingParams

SAMPLER = Sampler()
PROCESSED = Sampler(logprobs_mode="processed")


def _seed(gen: torch.Generator) -> int:
    return int(torch.randint(0, 2**62, (), generator=gen))


def _frequencies(row: torch.Tensor, params: SamplingParams, gen, num: int = 20000) -> torch.Tensor:
    """Sample ``row`` (V,) ``num`` times through one seeded generator; (V,) float64 frequencies."""
    g = make_generator(_seed(gen))
    out = SAMPLER(row.expand(num, -1), [params] * num, generators=[g] * num)
    return torch.bincount(out.token_ids, minlength=row.numel()).double() / num


def _assert_frequencies(freq: torch.Tensor, probs: torch.Tensor, num: int = 20000) -> None:
    """Within 5 standard errors (+0.002) everywhere; tokens of probability 0 never drawn."""
    probs = probs.double()
    tol = 5 * (probs * (1 - probs) / num).sqrt() + 2e-3
    assert torch.all((freq - probs).abs() <= tol), f"frequencies {freq} vs probabilities {probs}"
    assert torch.all(freq[probs == 0] == 0)


# ---------------------------------------------------------------- SamplingParams


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.max_tokens, p.n) == (1.0, 0, 1.0, 0.0, 16, 1)
    assert (p.seed, p.logprobs, p.stop, p.stop_token_ids, p.ignore_eos) == (None, None, (), (), False)
    assert not p.greedy and not p.has_penalties
    q = SamplingParams(temperature=0, top_k=-1, stop=["a", "bc"], stop_token_ids=[3, 7], presence_penalty=1)
    assert q.greedy and q.has_penalties and q.top_k == 0
    assert q.stop == ("a", "bc") and q.stop_token_ids == (3, 7)
    assert isinstance(q.temperature, float) and isinstance(q.presence_penalty, float)
    assert SamplingParams(stop="END").stop == ("END",) and SamplingParams(stop=None).stop == ()
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=0.01).greedy
    assert SamplingParams(repetition_penalty=1.2).has_penalties
    same = SamplingParams(temperature=0.0, stop=("a", "bc"), stop_token_ids=(3, 7), presence_penalty=1.0)
    assert same == q and hash(same) == hash(q)
    with pytest.raises(AttributeError):
        p.temperature = 0.5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": "1"}, "temperature must be a finite number"),
        ({"top_k": -2}, "top_k must be -1 or 0"),
        ({"top_k": 2.0}, "top_k must be -1 or 0"),
        ({"top_k": True}, "top_k must be -1 or 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.01}, r"top_p must be in \(0, 1\]"),
        ({"min_p": -0.01}, r"min_p must be in \[0, 1\]"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"presence_penalty": -2.01}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"seed": 1.5}, "seed must be None or an integer"),
        ({"seed": 2**64}, "seed must be None or an integer"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"max_tokens": None}, "max_tokens must be an integer >= 1"),
        ({"stop": ["ok", ""]}, "every stop string must be a non-empty str"),
        ({"stop": ["ok", 3]}, "every stop string must be a non-empty str"),
        ({"stop": 5}, "stop must be a string or a list of strings"),
        ({"stop_token_ids": [1, -1]}, "every stop token id must be an integer >= 0"),
        ({"stop_token_ids": "12"}, "stop_token_ids must be a list of integers"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool"),
        ({"logprobs": -1}, r"logprobs must be None or an integer in \[0, 20\]"),
        ({"logprobs": 21}, r"logprobs must be None or an integer in \[0, 20\]"),
        ({"n": 0}, "n must be an integer >= 1"),
    ],
)
def test_every_bad_field_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_boundary_values_are_accepted_and_replace_validates():
    p = SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2, logprobs=20, seed=-5)
    assert p.logprobs == 20 and p.seed == -5
    q = p.replace(temperature=0.0, top_k=5)
    assert q.greedy and q.top_k == 5 and q.min_p == 1.0 and p.temperature == 1.0
    with pytest.raises(ValueError, match="top_p"):
        p.replace(top_p=0)


# ---------------------------------------------------------------- penalties and greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_equals_argmax(gen, dtype):
    logits = (torch.randn(7, 300, generator=gen) * 3).to(dtype)
    params = [SamplingParams(temperature=0, top_k=3, seed=i) for i in range(7)]
    out = SAMPLER(logits, params)
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (7,)
    assert torch.equal(out.token_ids, logits.float().argmax(dim=-1))
    assert torch.equal(SAMPLER(logits, params).token_ids, out.token_ids)


def test_penalties_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0, 4.0, -0.5]])
    params = [SamplingParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2)]
    got = apply_penalties(logits, params, [[0, 1]], [[1, 2, 2, 5]])
    # token 0: prompt only -> 2 / 1.5; token 1: -1 * 1.5 - 0.2 - 0.3; token 2: 0.5 / 1.5 - 2 * 0.2 - 0.3;
    # token 5: 0 * 1.5 - 0.2 - 0.3; tokens 3, 4, 6, 7 unseen.
    want = torch.tensor([[2 / 1.5, -2.0, 0.5 / 1.5 - 0.7, -3.0, 1.0, -0.5, 4.0, -0.5]])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # presence and frequency look at the output only: prompt tokens alone change nothing
    output_only = [SamplingParams(presence_penalty=2, frequency_penalty=2)]
    only_prompt = apply_penalties(logits, output_only, [[0, 1, 6]], [[]])
    assert torch.equal(only_prompt, logits)


def test_penalties_match_a_per_token_loop(gen):
    batch, vocab = 5, 40
    logits = torch.randn(batch, vocab, generator=gen) * 2
    params, prompts, outputs = [], [], []
    for i in range(batch):
        rep, pres, freq = (float(v) for v in torch.rand(3, generator=gen))
        penalties = {"presence_penalty": 4 * pres - 2, "frequency_penalty": 4 * freq - 2}
        params.append(SamplingParams(repetition_penalty=0.5 + 2 * rep, **penalties))
        for history in (prompts, outputs):
            length = int(torch.randint(0, 30, (), generator=gen))
            history.append(torch.randint(0, vocab, (length,), generator=gen).tolist())
    params[0] = SamplingParams()  # a row without penalties stays untouched
    got = apply_penalties(logits, params, prompts, outputs)
    want = logits.clone()
    for i, p in enumerate(params):
        for t in range(vocab):
            count = outputs[i].count(t)
            if p.has_penalties and (count or t in prompts[i]):
                v = want[i, t]
                want[i, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
            if p.has_penalties:
                want[i, t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[0], logits[0])


def test_greedy_uses_the_penalised_logits():
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0], [0.0, 3.0, 2.5, 1.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=2.0), SamplingParams(temperature=0)]
    out = SAMPLER(logits, params, prompt_token_ids=[[1], [1]], output_token_ids=[[], []])
    assert out.token_ids.tolist() == [2, 1]  # 3 / 2 = 1.5 < 2.5 in the penalised row only


# ---------------------------------------------------------------- filters and temperature


def test_top_k_keeps_exactly_k(gen):
    vocab, k = 50, 5
    row = torch.randn(vocab, generator=gen)
    freq = _frequencies(row, SamplingParams(top_k=k), gen)
    top = row.topk(k).indices
    assert set(freq.nonzero().flatten().tolist()) == set(top.tolist())
    probs = torch.zeros(vocab)
    probs[top] = row[top].softmax(-1)
    _assert_frequencies(freq, probs)
    # k >= V keeps everything
    assert torch.equal(apply_filters(row[None], top_k=torch.tensor([vocab + 3])), row[None])


def _top_p_reference(row: torch.Tensor, p: float) -> set[int]:
    """Smallest most-likely-first prefix whose probability reaches p (float64)."""
    probs = row.double().softmax(-1)
    order = probs.argsort(descending=True)
    cumulative = probs[order].cumsum(0)
    size = int((cumulative < p).sum()) + 1
    return set(order[:size].tolist())


def test_top_p_keeps_the_smallest_prefix_reaching_p(gen):
    batch, vocab = 6, 60
    logits = torch.randn(batch, vocab, generator=gen) * 1.5
    top_p = torch.rand(batch, generator=gen) * 0.8 + 0.1
    top_p[0] = 1.0  # off
    got = apply_filters(logits, top_p=top_p)
    for i in range(batch):
        kept = set(got[i].isfinite().nonzero().flatten().tolist())
        want = set(range(vocab)) if i == 0 else _top_p_reference(logits[i], float(top_p[i]))
        assert kept == want
        assert torch.equal(got[i][got[i].isfinite()], logits[i][got[i].isfinite()])
    # the sampler draws from the renormalised survivors
    row, p = logits[1], float(top_p[1])
    probs = apply_filters(row[None], top_p=torch.tensor([p])).softmax(-1)[0]
    _assert_frequencies(_frequencies(row, SamplingParams(top_p=p), gen), probs)


def test_top_p_applies_to_the_top_k_survivors(gen):
    vocab = 40
    row = torch.randn(vocab, generator=gen)
    top = row.topk(8).indices
    want = {int(top[i]) for i in _top_p_reference(row[top], 0.6)}
    got = apply_filters(row[None], top_k=torch.tensor([8]), top_p=torch.tensor([0.6]))[0]
    assert set(got.isfinite().nonzero().flatten().tolist()) == want


def test_min_p_drops_tokens_below_a_fraction_of_the_max(gen):
    vocab, temperature, min_p = 60, 0.7, 0.1
    row = torch.randn(vocab, generator=gen) * 2
    probs = (row.double() / temperature).softmax(-1)  # min-p acts after temperature
    want = set((probs >= min_p * probs.max()).nonzero().flatten().tolist())
    got = apply_filters(row[None] / temperature, min_p=torch.tensor([min_p]))[0]
    assert set(got.isfinite().nonzero().flatten().tolist()) == want
    params = SamplingParams(temperature=temperature, min_p=min_p)
    expected = torch.zeros(vocab, dtype=torch.float64)
    idx = torch.tensor(sorted(want))
    expected[idx] = probs[idx] / probs[idx].sum()
    _assert_frequencies(_frequencies(row, params, gen), expected)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_follow_softmax_over_temperature(gen, temperature):
    vocab = 12
    row = torch.linspace(-2, 2, vocab)[torch.randperm(vocab, generator=gen)]
    row = row + 0.3 * torch.randn(vocab, generator=gen)
    probs = (row.double() / temperature).softmax(-1)
    if temperature != 1.0:  # the test can tell the temperature apart
        assert (probs - row.double().softmax(-1)).abs().max() > 0.05
    _assert_frequencies(_frequencies(row, SamplingParams(temperature=temperature), gen), probs)


# ---------------------------------------------------------------- seeds


def _run_steps(logits_per_step, params, generators, histories, row):
    tokens = []
    for logits in logits_per_step:
        out = SAMPLER(logits, params, output_token_ids=histories, generators=generators)
        for i, t in enumerate(out.token_ids.tolist()):
            histories[i].append(t)
        tokens.append(int(out.token_ids[row]))
    return tokens


def test_seeded_request_ignores_batch_position_and_neighbours(gen):
    vocab, steps, seed = 64, 10, _seed(gen)
    mine = SamplingParams(seed=seed, top_p=0.95, presence_penalty=0.5)
    row_logits = [torch.randn(vocab, generator=gen) for _ in range(steps)]
    alone = _run_steps([r[None] for r in row_logits], [mine], [make_generator(seed)], [[]], 0)

    neighbours = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(seed=seed + 1, top_k=4)]
    params = neighbours[:2] + [mine] + neighbours[2:]
    batched = []
    for r in row_logits:
        rows = torch.randn(3, vocab, generator=gen)
        batched.append(torch.cat([rows[:2], r[None], rows[2:]]))
    gens = [None, None, make_generator(seed), make_generator(seed + 1)]
    torch.manual_seed(_seed(gen))  # the default generator's state does not matter
    in_batch = _run_steps(batched, params, gens, [[] for _ in params], 2)
    assert in_batch == alone

    # two rows with the same seed in one batch draw the same tokens; another seed differs
    flat = SamplingParams(seed=seed)
    flat_logits = torch.zeros(3, 1000)
    gens = [make_generator(seed), make_generator(seed), make_generator(seed + 7)]
    many = torch.stack([SAMPLER(flat_logits, [flat] * 3, generators=gens).token_ids for _ in range(8)])
    assert torch.equal(many[:, 0], many[:, 1]) and not torch.equal(many[:, 0], many[:, 2])


# ---------------------------------------------------------------- logprobs


def test_raw_logprobs_and_top_alternatives(gen):
    batch, vocab = 5, 100
    logits = torch.randn(batch, vocab, generator=gen) * 2
    params = [
        SamplingParams(logprobs=5, temperature=0.7, repetition_penalty=1.3),
        SamplingParams(logprobs=0),
        SamplingParams(),
        SamplingParams(logprobs=20, temperature=0, top_k=2),
        SamplingParams(logprobs=1, top_p=0.5),
    ]
    out = SAMPLER(logits, params, prompt_token_ids=[list(range(10))] * batch)
    reference = logits.log_softmax(-1)
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == (batch,)
    chosen = reference.gather(1, out.token_ids[:, None])[:, 0]
    torch.testing.assert_close(out.logprobs, chosen, rtol=0, atol=1e-6)
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] is None
    for i in (0, 3, 4):
        pairs = out.top_logprobs[i]
        assert len(pairs) == params[i].logprobs
        values = [v for _, v in pairs]
        assert values == sorted(values, reverse=True)
        want = reference[i].topk(len(pairs))
        assert [t for t, _ in pairs] == want.indices.tolist()
        torch.testing.assert_close(torch.tensor(values), want.values, rtol=0, atol=1e-6)


def test_no_logprobs_asked_no_logprobs_computed(gen):
    """Rows that ask for no log-probabilities get the same tokens, and the step computes none
    (no log-softmax over the vocabulary on a decode step's path)."""
    logits = torch.randn(3, 50, generator=gen) * 2
    plain = [SamplingParams(seed=7), SamplingParams(temperature=0, repetition_penalty=1.5), SamplingParams(top_k=1)]
    asked = [SamplingParams(seed=7, logprobs=0), *plain[1:]]
    out, ref = (SAMPLER(logits, params, prompt_token_ids=[[1, 2, 3]] * 3, generators=[make_generator(7), None, None])
                for params in (plain, asked))
    assert out.logprobs is None and out.top_logprobs == [None, None, None]
    assert torch.equal(out.token_ids, ref.token_ids) and ref.logprobs is not None


def test_processed_logprobs_describe_the_sampled_distribution(gen):
    vocab = 30
    logits = torch.randn(2, vocab, generator=gen) * 2
    params = [
        SamplingParams(temperature=0, frequency_penalty=1.0, logprobs=3),
        SamplingParams(temperature=0.5, top_k=4, logprobs=6),
    ]
    out = PROCESSED(logits, params, output_token_ids=[[0, 0, 5], []], generators=None)
    greedy_ref = apply_penalties(logits[:1], params[:1], [[]], [[0, 0, 5]]).log_softmax(-1)[0]
    torch.testing.assert_close(out.logprobs[0], greedy_ref[out.token_ids[0]], rtol=0, atol=1e-6)
    filtered = apply_filters(logits[1:] / 0.5, top_k=torch.tensor([4])).log_softmax(-1)[0]
    torch.testing.assert_close(out.logprobs[1], filtered[out.token_ids[1]], rtol=0, atol=1e-6)
    top = out.top_logprobs[1]
    assert [t for t, _ in top[:4]] == (logits[1]).topk(4).indices.tolist()
    assert all(v == -math.inf for _, v in top[4:]) and all(math.isfinite(v) for _, v in top[:4])
    assert math.isclose(sum(math.exp(v) for _, v in top), 1.0, rel_tol=1e-5)


# ---------------------------------------------------------------- robustness


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_no_nan_at_extremes(gen, dtype):
    batch, vocab = 8, 256
    logits = torch.randn(batch, vocab, generator=gen) * 1000
    logits[:, vocab - 40 :] = -math.inf  # padded vocabulary
    logits = logits.to(dtype)
    params = [
        SamplingParams(temperature=1e-4, logprobs=20),
        SamplingParams(temperature=50.0, logprobs=3),
        SamplingParams(min_p=1.0),
        SamplingParams(top_p=1e-6, logprobs=2),
        SamplingParams(top_k=1, repetition_penalty=3.0, presence_penalty=-2),
        SamplingParams(temperature=0, frequency_penalty=2),
        SamplingParams(top_k=1000, top_p=0.999, min_p=0.5),
        SamplingParams(seed=3, temperature=2.0),
    ]
    gens = [None] * 7 + [make_generator(3)]
    history = [list(range(30))] * batch
    for sampler in (SAMPLER, PROCESSED):
        out = sampler(logits, params, prompt_token_ids=history, output_token_ids=history, generators=gens)
        assert not out.logprobs.isnan().any() and out.logprobs.isfinite().all()
        assert (out.token_ids < vocab - 40).all()
        assert not any(math.isnan(v) for row in out.top_logprobs if row for _, v in row)


def test_random_settings_sample_only_kept_tokens(gen):
    batch, vocab = 64, 80
    logits = torch.randn(batch, vocab, generator=gen) * 3
    r = torch.rand(batch, 4, generator=gen)
    params = [
        SamplingParams(
            temperature=float(2 * r[i, 0]), top_k=int(r[i, 1] * 12), top_p=float(0.05 + 0.95 * r[i, 2]),
            min_p=float(r[i, 3] * 0.5), logprobs=int(r[i, 1] * 5),
        )
        for i in range(batch)
    ]
    out = PROCESSED(logits, params, generators=[make_generator(i) for i in range(batch)])
    assert out.logprobs.isfinite().all()  # the chosen token always survives every filter
    for i, p in enumerate(params):
        if not p.greedy:
            kept = apply_filters(
                logits[i : i + 1] / p.temperature,
                top_k=torch.tensor([p.top_k]), top_p=torch.tensor([p.top_p]), min_p=torch.tensor([p.min_p]),
            )[0]
            assert kept[out.token_ids[i]].isfinite()


def test_sampler_rejects_bad_arguments():
    logits = torch.zeros(2, 10)
    two = [SamplingParams(), SamplingParams()]
    with pytest.raises(ValueError, match="params has 1 entries for 2 rows"):
        SAMPLER(logits, two[:1])
    with pytest.raises(ValueError, match="output_token_ids has 3 entries"):
        SAMPLER(logits, two, output_token_ids=[[], [], []])
    with pytest.raises(ValueError, match="generators has 1 entries"):
        SAMPLER(logits, two, generators=[None])
    with pytest.raises(ValueError, match="row 1 has seed 4 but no generator"):
        SAMPLER(logits, [SamplingParams(), SamplingParams(seed=4)])
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 10\)"):
        SAMPLER(logits, [SamplingParams(presence_penalty=1)] * 2, output_token_ids=[[1], [10]])
    with pytest.raises(ValueError, match=r"logits must be \(B, V\)"):
        SAMPLER(torch.zeros(10), two[:1])
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler(logprobs_mode="sampled")


# ---------------------------------------------------------------- distribution, logprobs_of


def test_distribution_is_what_forward_draws_from(gen):
    vocab = 12
    row = torch.randn(vocab, generator=gen) * 2
    history = [3, 3, 7]
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.9, presence_penalty=0.7, repetition_penalty=1.2)
    probs = SAMPLER.distribution(row[None], [params], prompt_token_ids=[[1]], output_token_ids=[history])[0]
    assert probs.dtype == torch.float32 and math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)
    penalised = apply_penalties(row[None], [params], [[1]], [history]) / 0.8
    kept = apply_filters(penalised, top_k=torch.tensor([8]), top_p=torch.tensor([0.9]))[0].isfinite()
    assert torch.equal(probs > 0, kept) and 0 < int(kept.sum()) <= 8
    num = 20000
    g = make_generator(_seed(gen))
    out = SAMPLER(row.expand(num, -1), [params] * num, prompt_token_ids=[[1]] * num,
                  output_token_ids=[history] * num, generators=[g] * num)
    _assert_frequencies(torch.bincount(out.token_ids, minlength=vocab).double() / num, probs, num)


def test_distribution_rows_each_see_their_own_history(gen):
    """Greedy rows are a one-hot of the penalised argmax; every row is penalised by its own
    history (a verify window's rows pass the drafts before them)."""
    vocab = 20
    logits = torch.randn(4, vocab, generator=gen)
    logits[1] = logits[0]
    top = int(logits[0].argmax())
    logits[:2, top] = logits[0].topk(2).values[1] + 0.5  # a penalty of 2 moves the argmax away
    params = [SamplingParams(temperature=0, presence_penalty=2.0)] * 2 + [SamplingParams(frequency_penalty=1.0)] * 2
    histories = [[], [top], [5], [5, 5, 6]]
    probs = SAMPLER.distribution(logits, params, output_token_ids=histories)
    penalised = apply_penalties(logits, params, [[]] * 4, histories)
    assert torch.equal(probs[:2], torch.nn.functional.one_hot(penalised[:2].argmax(-1), vocab).float())
    assert probs[0, top] == 1 and probs[1, top] == 0
    torch.testing.assert_close(probs[2:], penalised[2:].softmax(-1), rtol=0, atol=1e-7)
    out = SAMPLER(logits[:2], params[:2], output_token_ids=histories[:2])
    assert torch.equal(out.token_ids, probs[:2].argmax(-1))


@pytest.mark.parametrize("sampler", [SAMPLER, PROCESSED], ids=["raw", "processed"])
def test_logprobs_of_the_chosen_tokens_match_forward(gen, sampler):
    batch, vocab = 6, 60
    logits = torch.randn(batch, vocab, generator=gen) * 2
    params = [
        SamplingParams(logprobs=5, temperature=0.7, repetition_penalty=1.3, seed=1),
        SamplingParams(logprobs=0, temperature=0, frequency_penalty=0.5),
        SamplingParams(),
        SamplingParams(logprobs=20, top_k=3, seed=2),
        SamplingParams(logprobs=2, top_p=0.5, min_p=0.1, seed=3),
        SamplingParams(logprobs=1, temperature=1.5, presence_penalty=-1.0, seed=4),
    ]
    histories = {"prompt_token_ids": [[1, 2, 3]] * batch, "output_token_ids": [[4, 4, 9]] * batch}
    gens = [make_generator(_seed(gen)) if p.seed is not None else None for p in params]
    out = sampler(logits, params, generators=gens, **histories)
    again = sampler.logprobs_of(logits, out.token_ids, params, **histories)
    assert torch.equal(again.token_ids, out.token_ids) and torch.equal(again.logprobs, out.logprobs)
    assert again.top_logprobs == out.top_logprobs
    listed = sampler.logprobs_of(logits.half(), out.token_ids.tolist(), params, **histories)
    assert listed.token_ids.dtype == torch.int64 and listed.logprobs.shape == (batch,)

    other = (out.token_ids + 1) % vocab  # any token, chosen or not
    source = logits.log_softmax(-1) if sampler is SAMPLER else None
    theirs = sampler.logprobs_of(logits, other, params, **histories)
    if source is not None:
        torch.testing.assert_close(theirs.logprobs, source.gather(1, other[:, None])[:, 0], rtol=0, atol=1e-6)
    else:
        filtered = apply_filters(logits[3:4], top_k=torch.tensor([3])).log_softmax(-1)[0]
        # -inf outside the top 3 as well; inside, the sampler's fused steps may round one ulp apart
        torch.testing.assert_close(theirs.logprobs[3], filtered[other[3]], rtol=0, atol=1e-6)
    assert theirs.top_logprobs == out.top_logprobs  # the alternatives do not depend on the token
    nobody = [p.replace(logprobs=None) for p in params]
    assert sampler.logprobs_of(logits, other, nobody, **histories).logprobs is None
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 60\)"):
        sampler.logprobs_of(logits, [0] * (batch - 1) + [60], params, **histories)
    with pytest.raises(ValueError, match="token_ids has 2 entries for 6 rows"):
        sampler.logprobs_of(logits, [0, 1], params, **histories)
