"""What the statistical tests of sampling through verify windows share (chains in
``engine/test_speculative_sampling.py``, trees in ``engine/test_tree_speculative.py``): a
24-word random model whose exact distribution over its first three generated tokens is computable,
drawing samples through the engine, and chi-square tests against plain samples and the exact
distribution."""

from __future__ import annotations

import json
import math
from collections import Counter

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from model_helpers import COMMON, gqa_families
from segkv.engine.core import EngineCore
from segkv.engine.llm import LLM
from segkv.layers.sampler import Sampler
from segkv.sampling_params import SamplingParams
from segkv.scheduler import SchedulerConfig

VOCAB = 24
# Three tokens are compared; a fourth makes room for windows of two drafts (positions 2 and 3):
# a window never drafts past max_tokens, so with 3 the windows would hold one draft only
MAX_TOKENS = 4
SETTINGS = {"temperature-1": dict(temperature=1.0), "top-p-0.9": dict(temperature=1.0, top_p=0.9)}
# Every vocabulary token once, then a repeat: whatever the first sampled token, the n-gram
# proposer finds it in the prompt and drafts what followed it; 30 tokens (at least the draft
# model's 16 to fork its cached prompt instead of computing it per request)
PROMPT = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1)).tolist()
PROMPT = PROMPT + PROMPT[:6]


# -- a model of a small vocabulary ---------------------------------------------------
def build_word_model(directory, *, seed: int, scale: float = 0.2):
    """A one-layer random Qwen3 over a 24-word word-level tokenizer (eos ``<|im_end|>`` = 0); its
    weights scaled so that next-token distributions are spread (top token ~0.3, entropy ~2.3
    nats of ln 24 = 3.2): neither one-hot nor uniform. Returns the HF model."""
    directory.mkdir(parents=True, exist_ok=True)
    words = ["<|im_end|>", "<|pad|>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|pad|>",
        "bos_token": None, "add_bos_token": False}))
    config_cls, model_cls, extra = gqa_families()["qwen3"]
    config = config_cls(vocab_size=VOCAB, **{**COMMON, **extra, "num_hidden_layers": 1})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, scale)
    model.save_pretrained(directory)
    return model

def big_batches(llm: LLM) -> LLM:
    """Let ``generate`` run up to 1024 sequences per step (fewer, larger forwards)."""
    llm.core = EngineCore(llm.cache, llm.generator,
                          SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=8192, max_waiting=1024))
    return llm


def params_of(setting: str) -> SamplingParams:
    return SamplingParams(**SETTINGS[setting], max_tokens=MAX_TOKENS, ignore_eos=True)


def draw(llm: LLM, setting: str, count: int, *, seed: int,
         chunk: int | None = None) -> list[tuple[int, int, int]]:
    """``count`` samples of the first three tokens of ``PROMPT``: identical unseeded requests in
    ``generate`` calls of ``chunk`` prompts (default: one call; their draws come from the default
    generator, seeded here)."""
    torch.manual_seed(seed)
    chunk = chunk or count
    samples = []
    for start in range(0, count, chunk):
        outputs = llm.generate([PROMPT] * min(chunk, count - start), params_of(setting))
        samples += [tuple(r.outputs[0].token_ids[:3]) for r in outputs]
    assert len(samples) == count and all(len(s) == 3 for s in samples)
    assert llm.cache.stats()["pages_in_use"] == 0  # every request's pages went back
    return samples



# -- the exact distribution ---------------------------------------------------------
def next_token_probs(hf, sampler: Sampler, params: SamplingParams
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 sampling distributions of the first three tokens after ``PROMPT``: ``p1 (V,)``,
    ``p2 (V, V)`` (row ``x``: after ``x``) and ``p3 (V, V, V)`` (after ``x, y``), from the HF model's
    logits after the prompt and every one- and two-token continuation, turned into sampling
    distributions by ``sampler`` under ``params`` (temperature, top-p)."""
    contexts = [[]] + [[x] for x in range(VOCAB)] + [[x, y] for x in range(VOCAB) for y in range(VOCAB)]
    with torch.no_grad():
        rows = []
        for length in (0, 1, 2):  # one batch per context length
            batch = torch.tensor([PROMPT + c for c in contexts if len(c) == length])
            rows.append(hf(batch).logits[:, -1].float())
        logits = torch.cat(rows)
    probs = sampler.distribution(
        logits, [params] * len(contexts), prompt_token_ids=[PROMPT] * len(contexts),
        output_token_ids=contexts).double()
    return probs[0], probs[1 : 1 + VOCAB], probs[1 + VOCAB :].reshape(VOCAB, VOCAB, VOCAB)


def exact_joint_of(hf, sampler: Sampler, params: SamplingParams) -> torch.Tensor:
    """``(V, V, V)`` float64: the probability of each first three tokens (:func:`next_token_probs`)."""
    p1, p2, p3 = next_token_probs(hf, sampler, params)
    return p1[:, None, None] * p2[:, :, None] * p3


# -- chi-square tests ---------------------------------------------------------------
def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df)."""
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def two_sample_p(a: Counter, b: Counter, *, min_count: int = 10) -> float:
    """Chi-square test that two samples' counts over the same cells come from one distribution;
    cells with fewer than ``min_count`` pooled counts are merged into one."""
    na, nb = sum(a.values()), sum(b.values())
    cells, sparse = [], [0, 0]
    for key in set(a) | set(b):
        if a[key] + b[key] >= min_count:
            cells.append((a[key], b[key]))
        else:
            sparse[0] += a[key]
            sparse[1] += b[key]
    if sum(sparse):
        cells.append(tuple(sparse))
    ka, kb = math.sqrt(nb / na), math.sqrt(na / nb)
    statistic = sum((x * ka - y * kb) ** 2 / (x + y) for x, y in cells)
    return chi2_sf(statistic, len(cells) - 1)


def goodness_of_fit_p(observed: Counter, expected: dict, *, min_expected: float = 5.0) -> float:
    """Chi-square test of counts against exact cell probabilities (cells expected fewer than
    ``min_expected`` times are merged; an observed cell of probability 0 gives p = 0)."""
    n = sum(observed.values())
    if any(expected.get(key, 0.0) == 0.0 for key in observed):
        return 0.0
    cells, sparse = [], [0, 0.0]
    for key, prob in expected.items():
        if n * prob >= min_expected:
            cells.append((observed[key], n * prob))
        elif prob > 0:
            sparse[0] += observed[key]
            sparse[1] += n * prob
    if sparse[1] > 0:
        cells.append(tuple(sparse))
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    return chi2_sf(statistic, len(cells) - 1)


VIEWS = {  # what is compared: each position's marginal, and the joint of the first two
    "token 1": lambda s: s[0],
    "token 2": lambda s: s[1],
    "token 3": lambda s: s[2],
    "tokens 1-2": lambda s: s[:2],
}


def view_probs(joint: torch.Tensor, view: str) -> dict:
    if view == "tokens 1-2":
        table = joint.sum(2)
        return {(x, y): float(table[x, y]) for x in range(VOCAB) for y in range(VOCAB)}
    marginal = joint.sum(dim=tuple(d for d in range(3) if d != int(view[-1]) - 1))
    return {x: float(marginal[x]) for x in range(VOCAB)}


def p_values(samples, plain, joint) -> dict[str, float]:
    """Each view's p-value against the plain samples and against the exact distribution."""
    out = {}
    for view, key in VIEWS.items():
        counts = Counter(map(key, samples))
        out[f"{view} vs plain"] = two_sample_p(counts, Counter(map(key, plain)))
        out[f"{view} vs exact"] = goodness_of_fit_p(counts, view_probs(joint, view))
    return out


def spec_counts(llm: LLM) -> tuple[int, int, int]:
    s = llm.generator.spec_stats
    return s.drafts, s.accepted_tokens, s.draft_tokens - s.accepted_tokens

