"""Turn one step's next-token logits into chosen token ids and their log-probabilities.

Order of operations per row (vLLM semantics, filters in Hugging Face's order):
``logit_bias`` added to the raw logits (OpenAI's semantics) -> the grammar's token mask (a
constrained row: tokens it does not allow become -inf) -> penalties (repetition over prompt +
output tokens, then frequency and presence over output tokens) -> greedy rows take the
argmax here -> temperature -> top-k -> top-p (over the top-k survivors, renormalised) ->
min-p (relative to the most likely token, so it keeps the same set in any order) -> one
draw from the filtered softmax. All in float32.

A draw is an exponential race, ``argmax(probs / q)`` with ``q ~ Exp(1)`` per vocabulary
entry, which picks token ``i`` with probability ``probs[i]``. A row with a generator draws
its ``q`` from that generator alone, always ``V`` values per step, so a seeded request
gives the same tokens whatever else is in the batch; other rows share torch's default
generator of the device.

A verify window (speculative decoding) needs the same rows without a draw:
``Sampler.distribution`` gives each row's probabilities (one-hot for greedy rows) for exact
rejection sampling, and ``Sampler.logprobs_of`` the log-probabilities of the tokens it kept.
Both reuse the penalties and filters above, so they describe exactly what ``forward`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from segkv.layers.transfer import to_device
from segkv.outputs import TokenLogprob
from segkv.sampling_params import SamplingParams

LOGPROBS_MODES = ("raw", "processed")


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of ``(B, V)`` float32: on CUDA two short Triton launches
    (``kernels.fused.sampling_ops.row_argmax``), since torch reduces a 128K-entry row in one block, which
    measured slow between two decode steps (docs/performance-notes.md)."""
    if x.is_cuda:
        from segkv.kernels.fused.sampling_ops import row_argmax

        return row_argmax(x)
    return x.argmax(dim=-1)


@dataclass(slots=True)
class SampleOutput:
    """What one step chose for each of its ``B`` rows.

    ``token_ids``: ``(B,)`` int64. ``logprobs``: ``(B,)`` float32, the log-probability of
    each chosen token (which distribution: see ``Sampler``), or None when no row asked for
    log-probabilities (a step then runs no reduction over the vocabulary beyond its argmax).
    ``top_logprobs``: ``B`` entries, ``None`` where the row's ``params.logprobs`` is None, else a
    list of ``params.logprobs`` ``(token_id, logprob)`` pairs, most likely first.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_logprobs: list[list[tuple[int, float]] | None]


def score_tokens(logits: torch.Tensor, token_ids: Sequence[int], top: int) -> list[TokenLogprob]:
    """Each of ``token_ids``' log-probability under its row of ``logits`` ``(n, V)`` (the model's
    own: ``log_softmax`` in float32) and the ``top`` most likely alternatives (prompt logprobs)."""
    if logits.shape[0] != len(token_ids):
        raise ValueError(f"{len(token_ids)} token ids for {logits.shape[0]} rows of logits")
    if not token_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = to_device(list(token_ids), torch.int64, logits.device)
    chosen = logprobs.gather(1, ids[:, None]).squeeze(1).tolist()
    alternatives = [[] for _ in token_ids]
    if top:
        values, where = logprobs.topk(min(top, logprobs.shape[1]), dim=-1)
        alternatives = [list(zip(i, v)) for i, v in zip(where.tolist(), values.tolist())]
    return [TokenLogprob(t, c, a) for t, c, a in zip(token_ids, chosen, alternatives)]


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one seeded request; the engine keeps it across the request's steps."""
    return torch.Generator(device=device).manual_seed(seed)


def token_counts(rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``(B, vocab_size)`` int32: how often each token id occurs in each row's list."""
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.int32, device=device)
    width = max((len(r) for r in rows), default=0)
    if width == 0:
        return counts
    ids = torch.tensor([list(r) + [0] * (width - len(r)) for r in rows], dtype=torch.int64)
    real = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    if ids.min() < 0 or ids.max() >= vocab_size:
        low, high = ids.min().item(), ids.max().item()
        raise ValueError(f"token ids must be in [0, {vocab_size}), got ids from {low} to {high}")
    return counts.scatter_add_(1, to_device(ids, torch.int64, device), to_device(real, torch.int32, device))


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Penalised copy of ``logits`` ``(B, V)`` float32 (the input is returned if no row has any).

    Repetition penalty ``r`` on tokens in the prompt or the output: ``l / r`` if ``l > 0``
    else ``l * r``. Then ``l -= frequency * count + presence * (count > 0)`` with ``count``
    the token's occurrences in the output only.
    """
    rows = [p.has_penalties for p in params]
    if not any(rows):
        return logits
    device, vocab = logits.device, logits.shape[1]
    outputs = token_counts([o if use else () for o, use in zip(output_token_ids, rows)], vocab, device)
    seen = outputs > 0
    if any(p.repetition_penalty != 1.0 for p in params):
        penalty = to_device([p.repetition_penalty for p in params], torch.float32, device)[:, None]
        prompts = [t if p.repetition_penalty != 1.0 else () for t, p in zip(prompt_token_ids, params)]
        repeated = seen | (token_counts(prompts, vocab, device) > 0)
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(repeated, scaled, logits)
    frequency = to_device([p.frequency_penalty for p in params], torch.float32, device)[:, None]
    presence = to_device([p.presence_penalty for p in params], torch.float32, device)[:, None]
    return logits - frequency * outputs - presence * seen


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits`` ``(B, V)`` float32 plus each row's ``params.logit_bias`` (the input itself if no
    row has one). Token ids were checked against the vocabulary when the request was added."""
    rows, cols, values = [], [], []
    for i, p in enumerate(params):
        for token, value in (p.logit_bias or {}).items():
            rows.append(i)
            cols.append(token)
            values.append(value)
    if not rows:
        return logits
    device = logits.device
    index = (to_device(rows, torch.int64, device), to_device(cols, torch.int64, device))
    return logits.index_put(index, to_device(values, torch.float32, device), accumulate=True)


def apply_token_bitmask(logits: torch.Tensor, token_bitmask: torch.Tensor | None) -> torch.Tensor:
    """Copy of ``logits`` ``(B, V)`` float32 with the tokens ``token_bitmask`` does not allow set
    to -inf (the input itself when it is None). ``token_bitmask``: ``(B, ceil(V / 32))`` int32,
    any device, xgrammar's layout (bit ``j % 32`` of word ``j // 32`` set: token ``j`` allowed).
    On the CPU xgrammar's C++ kernel applies it (unpacking the bits with torch operations measured
    several times slower there); on other devices the bits are unpacked by torch operations, which
    need no kernel built at run time and queue without a host synchronisation."""
    if token_bitmask is None:
        return logits
    batch, vocab = logits.shape
    if token_bitmask.dim() != 2 or token_bitmask.shape != (batch, (vocab + 31) // 32):
        raise ValueError(f"token_bitmask must be ({batch}, {(vocab + 31) // 32}) for logits of shape "
                         f"{tuple(logits.shape)}, got {tuple(token_bitmask.shape)}")
    same = token_bitmask.device == logits.device
    words = token_bitmask.to(torch.int32) if same else to_device(token_bitmask, torch.int32, logits.device)
    if logits.device.type == "cpu":
        import xgrammar  # only constrained requests get here

        out = logits.clone()
        xgrammar.apply_token_bitmask_inplace(out, words, vocab_size=vocab)
        return out
    return mask_by_bits(logits, words)


def mask_by_bits(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """``apply_token_bitmask`` with torch operations (any device): ``words (B, ceil(V / 32))``
    int32 on ``logits``' device. Three launches, since the steps it runs in are bound by host work."""
    batch, vocab = logits.shape
    allowed = (words[:, :, None] & _bit_values(logits.device)).ne(0).reshape(batch, -1)[:, :vocab]
    return torch.where(allowed, logits, float("-inf"))


_BIT_VALUES: dict[torch.device, torch.Tensor] = {}


def _bit_values(device: torch.device) -> torch.Tensor:
    """``(32,)`` int32 ``1 << j`` on ``device`` (bit 31 is the sign bit), made once per device."""
    values = _BIT_VALUES.get(device)
    if values is None:
        values = _BIT_VALUES[device] = torch.tensor([1 << j for j in range(31)] + [-(1 << 31)], dtype=torch.int32,
                                                    device=device)
    return values


def apply_filters(
    logits: torch.Tensor,
    *,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy of ``logits`` ``(B, V)`` float32 with the tokens each filter drops set to -inf.

    ``top_k`` ``(B,)`` int64 (0 = off) keeps exactly the ``k`` largest (ties broken by
    index). ``top_p`` ``(B,)`` float32 (>= 1 = off) keeps the smallest most-likely-first
    prefix of the top-k survivors whose renormalised probability sums to at least ``p``.
    ``min_p`` ``(B,)`` float32 (0 = off) drops tokens less likely than ``min_p`` times the
    most likely one. ``None`` skips a filter for every row. The most likely token is
    always kept, so a row never loses all its candidates.
    """
    vocab = logits.shape[1]
    out = logits
    if top_k is not None or top_p is not None:
        ordered, order = logits.sort(dim=-1, descending=True, stable=True)
        drop = torch.zeros_like(ordered, dtype=torch.bool)
        if top_k is not None:
            k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
            drop = torch.arange(vocab, device=logits.device)[None, :] >= k[:, None]
        if top_p is not None:
            probs = ordered.masked_fill(drop, float("-inf")).softmax(dim=-1)
            before = torch.cat([torch.zeros_like(probs[:, :1]), probs.cumsum(dim=-1)[:, :-1]], dim=1)
            p = torch.where(top_p < 1, top_p, torch.inf)[:, None]  # off: no rounding may drop a token
            drop = drop | (before >= p)
        out = out.masked_fill(torch.empty_like(drop).scatter_(1, order, drop), float("-inf"))
    if min_p is not None:
        threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
        out = out.masked_fill(logits < threshold, float("-inf"))
    return out


def _biased(logits: torch.Tensor, params: Sequence[SamplingParams], token_bitmask: torch.Tensor | None
            ) -> torch.Tensor:
    """The logits the penalties start from: ``logit_bias`` added, then the grammar's mask."""
    return apply_token_bitmask(apply_logit_bias(logits, params), token_bitmask)


def _penalised(logits: torch.Tensor, params: Sequence[SamplingParams],
               prompt_token_ids: Sequence[Sequence[int]] | None, output_token_ids: Sequence[Sequence[int]] | None,
               token_bitmask: torch.Tensor | None) -> torch.Tensor:
    """``(B, V)`` float32: ``logits`` with ``logit_bias``, the grammar's mask and the penalties applied,
    what greedy rows take the argmax of and sampled rows start from."""
    prompts, outputs = _histories(logits, params, prompt_token_ids, output_token_ids)
    return apply_penalties(_biased(logits.float(), params, token_bitmask), params, prompts, outputs)


def _histories(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]] | None,
    output_token_ids: Sequence[Sequence[int]] | None,
) -> tuple[Sequence[Sequence[int]], Sequence[Sequence[int]]]:
    """Check one call's shapes and lengths; the prompt and output histories (None: all empty)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be (B, V), got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    empty = [()] * batch
    prompts = empty if prompt_token_ids is None else prompt_token_ids
    outputs = empty if output_token_ids is None else output_token_ids
    for name, items in {"params": params, "prompt_token_ids": prompts, "output_token_ids": outputs}.items():
        if len(items) != batch:
            raise ValueError(f"{name} has {len(items)} entries for {batch} rows of logits")
    return prompts, outputs


class Sampler(torch.nn.Module):
    """Chooses the next token of every row of a batch (see the module docstring).

    ``logprobs_mode="raw"`` (the default, as OpenAI and vLLM report) gives the model's own
    log-probabilities, ``log_softmax(logits)``, before penalties, temperature and filters.
    ``"processed"`` gives the log-probabilities of the distribution actually sampled from:
    after penalties, temperature and filters (filtered tokens are -inf); for greedy rows,
    after penalties only.
    """

    def __init__(self, *, logprobs_mode: str = "raw") -> None:
        super().__init__()
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode

    def forward(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
        token_bitmask: torch.Tensor | None = None,
    ) -> SampleOutput:
        """Sample one token per row.

        ``logits``: ``(B, V)``, any float dtype. ``params``: ``B`` SamplingParams.
        ``prompt_token_ids`` / ``output_token_ids``: ``B`` lists of token ids each (``None``:
        all empty), the histories the penalties look at. ``generators``: ``B`` entries, a
        ``torch.Generator`` on ``logits.device`` for each seeded row (``None``: the
        device's default generator); a row with a seed must have one. ``token_bitmask``:
        ``(B, words)`` int32, the grammar's allowed tokens per row (see ``apply_token_bitmask``;
        None: every token allowed).
        """
        prompts, outputs = _histories(logits, params, prompt_token_ids, output_token_ids)
        gens = [None] * logits.shape[0] if generators is None else list(generators)
        if len(gens) != logits.shape[0]:
            raise ValueError(f"generators has {len(gens)} entries for {logits.shape[0]} rows of logits")
        for i, p in enumerate(params):
            if p.seed is not None and not p.greedy and gens[i] is None:
                raise ValueError(f"row {i} has seed {p.seed} but no generator (use make_generator)")

        raw = logits.float()
        penalised = apply_penalties(_biased(raw, params, token_bitmask), params, prompts, outputs)
        token_ids = argmax_rows(penalised)
        final = penalised
        greedy = [p.greedy for p in params]
        if not all(greedy):
            final = self._sample_distribution(penalised, params, greedy)
            sampled = argmax_rows(final.softmax(dim=-1).div_(self._race_noise(final, gens, greedy)))
            token_ids = torch.where(to_device(greedy, torch.bool, logits.device), token_ids, sampled)
        if all(p.logprobs is None for p in params):  # a log-softmax over the vocabulary nobody reads
            return SampleOutput(token_ids=token_ids, logprobs=None, top_logprobs=[None] * len(params))
        return self._logprobs(raw if self.logprobs_mode == "raw" else final, token_ids, params)

    def greedy_tokens(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        token_bitmask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(B,)`` int64 on ``logits.device``: each row's penalised argmax, the token ``forward``
        takes for a greedy row (the one-hot of :meth:`distribution`, without building it).
        Arguments as for ``forward``."""
        return argmax_rows(_penalised(logits, params, prompt_token_ids, output_token_ids, token_bitmask))

    def distribution(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        token_bitmask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(B, V)`` float32 probabilities that ``forward`` draws each row from.

        A sampled row: the softmax after penalties, temperature and filters (exactly the row
        ``forward`` races over; filtered tokens are 0). A greedy row: a one-hot of the
        penalised argmax, the token ``forward`` takes. Arguments as for ``forward``; the rows
        of a verify window come as separate rows, each with the output so far plus the drafts
        before its position in ``output_token_ids``, so penalties see them.
        """
        penalised = _penalised(logits, params, prompt_token_ids, output_token_ids, token_bitmask)
        one_hot = torch.zeros_like(penalised).scatter_(1, argmax_rows(penalised)[:, None], 1.0)
        greedy = [p.greedy for p in params]
        if all(greedy):
            return one_hot
        probs = self._sample_distribution(penalised, params, greedy).softmax(dim=-1)
        return torch.where(to_device(greedy, torch.bool, logits.device)[:, None], one_hot, probs)

    def logprobs_of(
        self,
        logits: torch.Tensor,
        token_ids: torch.Tensor | Sequence[int],
        params: Sequence[SamplingParams],
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        token_bitmask: torch.Tensor | None = None,
    ) -> SampleOutput:
        """Log-probabilities of given tokens, as ``forward`` reports them had it chosen them.

        ``token_ids``: ``B`` ids (a list, or a ``(B,)`` integer tensor); other arguments as
        for ``forward``. The result's ``token_ids`` are these, ``(B,)`` int64 on
        ``logits.device``; ``logprobs`` and ``top_logprobs`` follow ``logprobs_mode`` and
        each row's ``params.logprobs`` exactly as in ``forward`` (``logprobs`` is None when
        no row asks for any).
        """
        prompts, outputs = _histories(logits, params, prompt_token_ids, output_token_ids)
        batch, vocab = logits.shape
        if isinstance(token_ids, torch.Tensor):
            ids = token_ids.to(device=logits.device, dtype=torch.int64).reshape(-1)
        else:
            ids = [int(t) for t in token_ids]
            if any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"token ids must be in [0, {vocab}), got {ids}")
            ids = to_device(ids, torch.int64, logits.device)
        if ids.shape[0] != batch:
            raise ValueError(f"token_ids has {ids.shape[0]} entries for {batch} rows of logits")
        if all(p.logprobs is None for p in params):
            return SampleOutput(token_ids=ids, logprobs=None, top_logprobs=[None] * batch)
        raw = logits.float()
        if self.logprobs_mode == "raw":
            return self._logprobs(raw, ids, params)
        penalised = apply_penalties(_biased(raw, params, token_bitmask), params, prompts, outputs)
        greedy = [p.greedy for p in params]
        final = penalised if all(greedy) else self._sample_distribution(penalised, params, greedy)
        return self._logprobs(final, ids, params)

    @staticmethod
    def _sample_distribution(
        penalised: torch.Tensor, params: Sequence[SamplingParams], greedy: list[bool]
    ) -> torch.Tensor:
        """``(B, V)`` float32: temperature and filters applied; greedy rows left as they are."""
        device = penalised.device
        active = [p for p, g in zip(params, greedy) if not g]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        scaled = penalised / to_device(temperature, torch.float32, device)[:, None]

        def column(name, off, dtype):
            if all(getattr(p, name) == off for p in active):
                return None
            values = [off if g else getattr(p, name) for p, g in zip(params, greedy)]
            return to_device(values, dtype, device)

        scaled = apply_filters(
            scaled,
            top_k=column("top_k", 0, torch.int64),
            top_p=column("top_p", 1.0, torch.float32),
            min_p=column("min_p", 0.0, torch.float32),
        )
        keep_greedy = to_device(greedy, torch.bool, device)[:, None]
        return torch.where(keep_greedy, penalised, scaled)

    @staticmethod
    def _race_noise(
        like: torch.Tensor, gens: list[torch.Generator | None], greedy: list[bool]
    ) -> torch.Tensor:
        """``(B, V)`` float32 Exp(1) noise, each seeded row's drawn from its own generator."""
        noise = torch.ones_like(like)
        if any(g is None and not greedy[i] for i, g in enumerate(gens)):
            noise.exponential_()
        for i, g in enumerate(gens):
            if g is not None and not greedy[i]:
                noise[i].exponential_(generator=g)
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)  # q = 0 would give inf or NaN

    @staticmethod
    def _logprobs(
        source: torch.Tensor, token_ids: torch.Tensor, params: Sequence[SamplingParams]
    ) -> SampleOutput:
        """Log-probabilities of the chosen tokens and the requested alternatives, per row."""
        lse = torch.logsumexp(source, dim=-1)
        chosen = source.gather(1, token_ids[:, None]).squeeze(1) - lse
        top: list[list[tuple[int, float]] | None] = [None] * len(params)
        most = max((p.logprobs for p in params if p.logprobs), default=0)
        if most:
            values, ids = source.topk(min(most, source.shape[1]), dim=-1)
            values, ids = (values - lse[:, None]).tolist(), ids.tolist()
        for i, p in enumerate(params):
            if p.logprobs is not None:
                top[i] = list(zip(ids[i][: p.logprobs], values[i][: p.logprobs])) if p.logprobs else []
        return SampleOutput(token_ids=token_ids, logprobs=chosen, top_logprobs=top)
