"""The synchronous generation loop: prefill, then batched decode steps until every sequence ends."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from segkv.cache.chain import KVChain
from segkv.cache.page_pool import OutOfPagesError
from segkv.engine.step_ahead import StepAhead
from segkv.layers.sampler import Sampler, make_generator
from segkv.layers.transfer import HostCopy, select_rows
from segkv.outputs import CompletionOutput, TokenLogprob
from segkv.runner.model_runner import ModelRunner, StepInput
from segkv.sampling_params import SamplingParams
from segkv.tokenizer.detokenizer import IncrementalDetokenizer
from segkv.tokenizer.tokenizer import Tokenizer
import segkv.settings as settings


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


def default_lookahead(device: torch.device) -> bool:
    """Whether decode steps are launched ahead by default on ``device``: on CUDA (on the CPU a
    step launched is a step computed, so nothing overlaps); ``SEGKV_LOOKAHEAD=0/1`` overrides it."""
    return bool(settings.or_default(settings.SETTINGS.lookahead, int(torch.device(device).type == "cuda")))


class Generator:
    """Drives sequences to completion with the runner, the sampler and detokenizers.

    ``lookahead`` (default: on CUDA; ``SEGKV_LOOKAHEAD=0/1`` overrides it): after a decode step's
    samples are drawn on the device and before the host reads them, the next decode step of the
    same sequences is launched with those samples as its input tokens, so the host's work between
    steps (reading the tokens, stop checks, detokenising, scheduling) overlaps the GPU instead of
    idling it (:class:`~segkv.engine.step_ahead.StepAhead`). A sequence that ends on the token just
    read gives its extra row back (trimmed). The next step takes the decode rows it holds; what
    else that step has (a new request's prefill) runs a forward of its own, and rows no work item
    takes (aborted or preempted sequences) are given back. Outputs are the same either way.
    """

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, *, max_model_len: int,
                 lookahead: bool | None = None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.sampler = Sampler()
        self.max_model_len = max_model_len
        self.lookahead = default_lookahead(runner.device) if lookahead is None else bool(lookahead)
        self._ahead: StepAhead | None = None
        self.steps_ahead_used = 0  # decode steps served by a step launched ahead
        self.steps_ahead_cancelled = 0

    def check_prompt_length(self, num_tokens: int) -> None:
        """Raise a clear ValueError if a prompt leaves no room for one generated token."""
        if num_tokens >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {num_tokens} tokens in the prompt, which leaves no room for output."
            )

    def rows_ahead(self, seq: Sequence) -> int:
        """Rows ``seq``'s chain already holds for its pending tokens (1 when the decode step that
        consumes them was launched ahead, else 0): the scheduler's page count leaves them out."""
        return int(self._ahead is not None and self._ahead.live(seq))

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

    def step(self, work: list[tuple[Sequence, int]], *, ahead_ok: bool = True) -> list[Sequence]:
        """One forward over ``(sequence, tokens to process)`` pairs; sample where ready.

        A sequence is ready when all its pending tokens have rows: it samples its next
        token. A ready sequence whose params ask for ``n > 1`` samples first gets ``n - 1``
        siblings: forks of its chain that sample from the same logits, so the prompt is
        computed and stored once. Returns the sequences that sampled (siblings excluded).
        """
        logits = self._forward(work)
        ready, rows = [], []
        for row, (s, k) in enumerate(work):
            s.pending = s.pending[k:]
            if not s.pending:
                ready.append(s)
                rows.append(row)
        if not ready:
            return []
        logits = select_rows(logits, rows)  # no stream synchronisation: the step may still be running
        spawned = self._spawn_siblings(ready, logits)
        # the next decode step may start before the host reads this one's tokens: only for plain
        # decodes (every sequence of the step sampled one token, none new), else it could not serve
        decodes = not spawned and len(ready) == len(work) and all(k == 1 for _, k in work)
        self._sample(ready + [s for s, _ in spawned],
                     torch.cat([logits] + [row for _, row in spawned]) if spawned else logits,
                     launch_ahead=self.lookahead and ahead_ok and decodes)
        return ready

    def _forward(self, work: list[tuple[Sequence, int]]) -> torch.Tensor:
        """``(len(work), vocab)`` logits of the step: the decode rows a step launched ahead holds
        are taken from it, the rest (prefills, new sequences) run a forward of their own."""
        served, ahead_logits = self._take_ahead(work)
        if len(served) == len(work):
            return ahead_logits
        taken = set(served)
        rest = [i for i in range(len(work)) if i not in taken]
        try:
            rest_logits = self.runner.forward([StepInput(work[i][0].chain, work[i][0].pending[:work[i][1]])
                                               for i in rest])
        except BaseException:  # the step did not happen: the rows taken from the step ahead go too
            for i in served:
                work[i][0].chain.trim(1)
            raise
        if not served:
            return rest_logits
        where = {i: n for n, i in enumerate(served)} | {i: len(served) + n for n, i in enumerate(rest)}
        return select_rows(torch.cat([ahead_logits, rest_logits]), [where[i] for i in range(len(work))])

    def _take_ahead(self, work: list[tuple[Sequence, int]]) -> tuple[list[int], torch.Tensor | None]:
        """The positions of ``work`` whose decode row the step launched ahead holds, and their
        logits in that order. Rows of that step no work item takes (the sequence was aborted,
        preempted or left out) are given back."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return [], None
        served, logits = ahead.take(work)
        if served:
            self.steps_ahead_used += 1
        else:
            self.steps_ahead_cancelled += 1
        return served, logits

    def _launch_ahead(self, seqs: list[Sequence], token_ids: torch.Tensor) -> None:
        """Launch the next decode step of ``seqs`` from their samples ``token_ids`` (device)."""
        if any(s.chain.num_rows + 2 >= self.max_model_len for s in seqs):
            return  # a sequence may end by length on this token: nothing to gain near the limit
        if all(len(s.output_ids) + 1 >= s.params.max_tokens for s in seqs):
            return  # this token ends every sequence: the step would only be given back
        chains = [s.chain for s in seqs]
        try:
            logits = self.runner.decode_from_device(chains, token_ids)
        except OutOfPagesError:  # the chains are unchanged; the next step schedules as usual
            return
        self._ahead = StepAhead(list(seqs), chains, logits)

    def _spawn_siblings(self, seqs: list[Sequence], logits: torch.Tensor) -> list[tuple[Sequence, torch.Tensor]]:
        out = []
        for row, s in enumerate(seqs):
            if s.index == 0 and s.params.n > 1 and not s.siblings and not s.output_ids:
                for index in range(1, s.params.n):
                    sib = self.new_sequence(index, s.chain.fork(), s.history, [], s.params)
                    s.siblings.append(sib)
                    out.append((sib, logits[row : row + 1]))
        return out

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, *, launch_ahead: bool = False) -> None:
        out = self.sampler(
            logits,
            [s.params for s in seqs],
            prompt_token_ids=[s.history for s in seqs],
            output_token_ids=[s.output_ids for s in seqs],
            generators=[s.generator for s in seqs],
        )
        # one transfer for the batch, queued before the step launched ahead so reading it waits
        # for this step's samples only
        token_copy = HostCopy(out.token_ids)
        logprob_copy = HostCopy(out.logprobs) if any(s.params.logprobs is not None for s in seqs) else None
        if launch_ahead:
            self._launch_ahead(seqs, out.token_ids)
        tokens = token_copy.tolist()
        ahead = self._ahead
        chosen = logprob_copy.tolist() if logprob_copy is not None else None
        for row, s in enumerate(seqs):
            token = tokens[row]
            s.output_ids.append(token)
            if chosen is not None and s.params.logprobs is not None:
                s.logprobs.append(TokenLogprob(token, chosen[row], out.top_logprobs[row]))
            held = ahead is not None and ahead.live(s)
            self._check_finish(s, token, rows_ahead=int(held))
            if s.finish_reason is None:
                s.pending = [token]
                if held:  # the row launched ahead holds this token
                    s.chain.set_last_token_id(token)
            elif held:  # the sequence ended: its row ahead is not needed
                ahead.give_back(s)
        if ahead is not None and ahead.empty:
            self._ahead = None  # every sequence of the batch ended

    def _check_finish(self, s: Sequence, token: int, *, rows_ahead: int = 0) -> None:
        """Set ``s``'s finish reason if ``token`` ends it; ``rows_ahead``: rows its chain already
        holds for tokens after the history (a step launched ahead), left out of the length check."""
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
        if len(s.output_ids) >= p.max_tokens or s.chain.num_rows - rows_ahead + 1 >= self.max_model_len:
            s.finish_reason = "length"
            s.detok.finish()
