"""The synchronous generation loop: prefill, then batched decode steps until every sequence ends."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from segkv.cache.chain import KVChain
from segkv.cache.page_pool import OutOfPagesError
from segkv.engine.detokenizer import IncrementalDetokenizer
from segkv.engine.tokenizer import Tokenizer
from segkv.layers.sampler import Sampler, make_generator
from segkv.outputs import CompletionOutput, TokenLogprob
from segkv.runner.model_runner import PLACEHOLDER_ID, ModelRunner, StepInput
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


@dataclass(slots=True, eq=False)
class _AheadRow:
    """One sequence's row in a run-ahead step: its chain, the chain's length with the row, and
    the row of the step's logits."""

    seq: Sequence
    chain: KVChain
    num_rows: int
    row: int


@dataclass(slots=True)
class _RunAhead:
    """A decode step launched right after sampling, before the host read the sampled tokens."""

    logits: torch.Tensor  # (n, vocab) float32, computed after the tokens on the device's stream
    rows: dict[int, _AheadRow]  # by id(sequence)


class Generator:
    """Drives sequences to completion with the runner, the sampler and detokenizers.

    **Run-ahead** (``run_ahead``, default: on when the runner replays CUDA graphs): after
    sampling a decode step, the next decode step of the same sequences is launched with the
    sampled tokens still on the device, and only then does the host read them. The host's work
    between two steps (reading tokens, stop checks, detokenising, planning and launching) then
    overlaps the GPU's step instead of leaving the GPU idle. The next :meth:`step` takes that
    step's logits when its work is those sequences' one pending token each; otherwise, and for a
    sequence that finished meanwhile, the row computed ahead is trimmed from its chain (the
    device's work on it is wasted, nothing else changes). Outputs equal those without run-ahead.
    """

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, *, max_model_len: int,
                 run_ahead: bool | None = None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.sampler = Sampler()
        self.max_model_len = max_model_len
        self.run_ahead = getattr(runner, "graphs", None) is not None if run_ahead is None else bool(run_ahead)
        self._ahead: _RunAhead | None = None
        self.steps_taken_ahead = 0  # steps whose logits came from a run-ahead launch
        self.rows_cancelled = 0  # rows computed ahead and trimmed (finished or rescheduled sequences)

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

    def step(self, work: list[tuple[Sequence, int]], *, run_ahead: bool = True) -> list[Sequence]:
        """One forward over ``(sequence, tokens to process)`` pairs; sample where ready.

        A sequence is ready when all its pending tokens have rows: it samples its next
        token. A ready sequence whose params ask for ``n > 1`` samples first gets ``n - 1``
        siblings: forks of its chain that sample from the same logits, so the prompt is
        computed and stored once. Returns the sequences that sampled (siblings excluded).
        ``run_ahead=False``: launch no step ahead after this one (the caller will change the
        batch, e.g. admit waiting requests); the generator's ``run_ahead`` decides otherwise.
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
        if len(rows) != len(work):
            logits = logits[rows]
        spawned = self._spawn_siblings(ready, logits)
        ahead = self.run_ahead and run_ahead and not spawned and len(ready) == len(work)
        self._sample(ready + [s for s, _ in spawned],
                     torch.cat([logits] + [row for _, row in spawned]) if spawned else logits, ahead=ahead)
        return ready

    def cancel_ahead(self) -> None:
        """Trim every row computed ahead (before the engine changes chains: preemption, abort)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self._trim(ahead.rows.values())

    def _forward(self, work: list[tuple[Sequence, int]]) -> torch.Tensor:
        """``(len(work), vocab)`` logits: from the run-ahead step for sequences it computed (one
        pending token, on the chain it extended), from a forward of the others; the run-ahead
        rows not used are trimmed. On failure the chains are as they were."""
        ahead, self._ahead = self._ahead, None
        matched: dict[int, _AheadRow] = {}
        if ahead is not None:
            for i, (s, k) in enumerate(work):
                entry = ahead.rows.get(id(s))
                if entry is not None and k == 1 and len(s.pending) == 1 and entry.chain is s.chain \
                        and s.chain.num_rows == entry.num_rows:
                    matched[i] = entry
            used = {id(e.seq) for e in matched.values()}
            self._trim([e for key, e in ahead.rows.items() if key not in used])
        if not matched:
            return self.runner.forward([StepInput(s.chain, s.pending[:k]) for s, k in work])
        self.steps_taken_ahead += 1
        rows = [matched[i].row for i in range(len(work)) if i in matched]
        taken = ahead.logits if rows == list(range(len(ahead.logits))) else ahead.logits[rows]
        rest = [i for i in range(len(work)) if i not in matched]
        if not rest:
            return taken
        try:
            others = self.runner.forward([StepInput(work[i][0].chain, work[i][0].pending[:work[i][1]]) for i in rest])
        except BaseException:
            self._trim(matched.values())
            raise
        order = [i for i in range(len(work)) if i in matched] + rest  # rows of cat(taken, others)
        where = torch.empty(len(work), dtype=torch.long)
        where[torch.tensor(order)] = torch.arange(len(work))
        return torch.cat([taken, others])[where.to(taken.device)]

    def _trim(self, entries) -> None:
        """Drop rows computed ahead from chains that still end with them."""
        for e in entries:
            if e.seq.chain is e.chain and e.chain.num_rows == e.num_rows:
                e.chain.trim(1)
                self.rows_cancelled += 1

    def _launch_ahead(self, seqs: list[Sequence], token_ids: torch.Tensor) -> None:
        """Launch the next decode step of ``seqs`` over the just-sampled ``token_ids (B,)`` (still
        on the device). Sequences sure to stop for length are left out; without free pages (or
        with nothing to run) nothing is launched."""
        keep = [i for i, s in enumerate(seqs)
                if len(s.output_ids) + 1 < s.params.max_tokens and s.chain.num_rows + 2 < self.max_model_len]
        if not keep:
            return
        ids = token_ids if len(keep) == len(seqs) else token_ids[torch.tensor(keep, device=token_ids.device)]
        chains = [seqs[i].chain for i in keep]
        try:
            logits = self.runner.forward([StepInput(c, [PLACEHOLDER_ID]) for c in chains], device_ids=ids)
        except OutOfPagesError:
            return
        self._ahead = _RunAhead(logits, {id(seqs[i]): _AheadRow(seqs[i], seqs[i].chain, seqs[i].chain.num_rows, row)
                                         for row, i in enumerate(keep)})

    def _spawn_siblings(self, seqs: list[Sequence], logits: torch.Tensor) -> list[tuple[Sequence, torch.Tensor]]:
        out = []
        for row, s in enumerate(seqs):
            if s.index == 0 and s.params.n > 1 and not s.siblings and not s.output_ids:
                for index in range(1, s.params.n):
                    sib = self.new_sequence(index, s.chain.fork(), s.history, [], s.params)
                    s.siblings.append(sib)
                    out.append((sib, logits[row : row + 1]))
        return out

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, *, ahead: bool = False) -> None:
        out = self.sampler(
            logits,
            [s.params for s in seqs],
            prompt_token_ids=[s.history for s in seqs],
            output_token_ids=[s.output_ids for s in seqs],
            generators=[s.generator for s in seqs],
        )
        if ahead:  # before the host reads the tokens: the device runs the next step meanwhile
            self._launch_ahead(seqs, out.token_ids)
        tokens = out.token_ids.tolist()  # one transfer for the batch, not one per row
        chosen = out.logprobs.tolist() if any(s.params.logprobs is not None for s in seqs) else None
        for row, s in enumerate(seqs):
            token = tokens[row]
            s.output_ids.append(token)
            if chosen is not None and s.params.logprobs is not None:
                s.logprobs.append(TokenLogprob(token, chosen[row], out.top_logprobs[row]))
            self._check_finish(s, token)
            entry = self._ahead.rows.get(id(s)) if self._ahead is not None else None
            if entry is not None and s.finish_reason is not None:  # its row computed ahead is not needed
                self._trim([entry])
                del self._ahead.rows[id(s)]
            elif entry is not None:
                s.chain.fill_token_ids([token])
            if s.finish_reason is None:
                s.pending = [token]
        if self._ahead is not None and not self._ahead.rows:
            self._ahead = None

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
