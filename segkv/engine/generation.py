"""The synchronous generation loop: prefill, then batched decode steps until every sequence ends."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from segkv.cache.chain import KVChain
from segkv.engine.detokenizer import IncrementalDetokenizer
from segkv.engine.tokenizer import Tokenizer
from segkv.layers.sampler import Sampler, make_generator
from segkv.outputs import CompletionOutput, TokenLogprob
from segkv.runner.model_runner import ModelRunner, StepInput
from segkv.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)  # identity semantics: sequences are tracked in lists
class Sequence:
    """One continuation being generated on its own chain.

    ``pending`` holds token ids whose KV rows are not yet in the chain (the prompt's new
    tokens before prefill, then the last sampled token). ``history`` are all prompt ids.
    """

    index: int
    chain: KVChain
    history: list[int]
    pending: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    siblings: list[Sequence] = field(default_factory=list)  # samples 1..n-1 forked after prefill

    @property
    def num_pending(self) -> int:
        """Tokens that still need KV rows (the scheduler's view)."""
        return len(self.pending)

    def all_token_ids(self) -> list[int]:
        """Prompt and generated tokens, in order."""
        return self.history + self.output_ids

    def result(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detok.output_text,
            token_ids=list(self.output_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
        )


class Generator:
    """Drives sequences to completion with the runner, the sampler and detokenizers."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, *, max_model_len: int) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.sampler = Sampler()
        self.max_model_len = max_model_len

    def new_sequence(self, index: int, chain: KVChain, history: list[int], new_ids: list[int],
                     params: SamplingParams) -> Sequence:
        seed = None if params.seed is None else params.seed + index
        generator = make_generator(seed, self.runner.device) if seed is not None else None
        detok = IncrementalDetokenizer(self.tokenizer, stop=params.stop, prompt_ids=history)
        return Sequence(index, chain, list(history), list(new_ids), params, detok, generator)

    def run(self, seqs: list[Sequence]) -> None:
        """Generate until every sequence has a finish reason (EOS, stops, lengths)."""
        active = [s for s in seqs if s.finish_reason is None]
        while active:
            ready = self.step([(s, len(s.pending)) for s in active])
            active = [s for s in active + [x for r in ready for x in r.siblings if x not in active]
                      if s.finish_reason is None]

    def step(self, work: list[tuple[Sequence, int]]) -> list[Sequence]:
        """One forward over ``(sequence, tokens to process)`` pairs; sample where ready.

        A sequence is ready when all its pending tokens have rows: it samples its next
        token. A ready sequence whose params ask for ``n > 1`` samples first gets ``n - 1``
        siblings: forks of its chain that sample from the same logits, so the prompt is
        computed and stored once. Returns the sequences that sampled (siblings excluded).
        """
        logits = self.runner.forward([StepInput(s.chain, s.pending[:k]) for s, k in work])
        ready, rows = [], []
        for row, (s, k) in enumerate(work):
            s.pending = s.pending[k:]
            if not s.pending:
                ready.append(s)
                rows.append(row)
        if not ready:
            return []
        logits = logits[rows]
        spawned = self._spawn_siblings(ready, logits)
        self._sample(ready + [s for s, _ in spawned],
                     torch.cat([logits] + [row for _, row in spawned]) if spawned else logits)
        return ready

    def _spawn_siblings(self, seqs: list[Sequence], logits: torch.Tensor) -> list[tuple[Sequence, torch.Tensor]]:
        out = []
        for row, s in enumerate(seqs):
            if s.index == 0 and s.params.n > 1 and not s.siblings and not s.output_ids:
                for index in range(1, s.params.n):
                    sib = self.new_sequence(index, s.chain.fork(), s.history, [], s.params)
                    s.siblings.append(sib)
                    out.append((sib, logits[row : row + 1]))
        return out

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        out = self.sampler(
            logits,
            [s.params for s in seqs],
            prompt_token_ids=[s.history for s in seqs],
            output_token_ids=[s.output_ids for s in seqs],
            generators=[s.generator for s in seqs],
        )
        tokens = out.token_ids.tolist()  # one transfer for the batch, not one per row
        chosen = out.logprobs.tolist() if any(s.params.logprobs is not None for s in seqs) else None
        for row, s in enumerate(seqs):
            token = tokens[row]
            s.output_ids.append(token)
            if chosen is not None and s.params.logprobs is not None:
                s.logprobs.append(TokenLogprob(token, chosen[row], out.top_logprobs[row]))
            self._check_finish(s, token)
            if s.finish_reason is None:
                s.pending = [token]

    def _check_finish(self, s: Sequence, token: int) -> None:
        p = s.params
        is_eos = token in self.tokenizer.eos_token_ids and not p.ignore_eos
        if is_eos or token in p.stop_token_ids:
            s.finish_reason = "stop"
            s.stop_reason = None if is_eos and token not in p.stop_token_ids else token
            s.detok.finish()
            return
        s.detok.add(token)
        if s.detok.stopped:
            s.finish_reason, s.stop_reason = "stop", s.detok.stop_string
            return
        # the sampled token still needs a row: stop when the model length is reached
        if len(s.output_ids) >= p.max_tokens or s.chain.num_rows + 1 >= self.max_model_len:
            s.finish_reason = "length"
            s.detok.finish()
