"""The synchronous generation loop: prefill, then batched decode steps until every sequence ends."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from segkv.cache.chain import KVChain
from segkv.cache.page_pool import OutOfPagesError
from segkv.engine.drafting import SpecStats, make_proposer
from segkv.engine.step_ahead import StepAhead
from segkv.engine.tree_windows import Drafts, emitted_rows, greedy_walk, kept_rows, row_prefixes, window_size
from segkv.layers.sampler import Sampler, make_generator, score_tokens
from segkv.layers.transfer import HostCopy, select_rows, to_device
from segkv.outputs import CompletionOutput, TokenLogprob
from segkv.runner.model_runner import ModelRunner, StepInput
from segkv.sampling_params import SamplingParams
from segkv.spec.config import SpeculativeConfig
from segkv.spec.rejection import TreeVerdict, verify_trees, verify_windows
from segkv.spec.tree import DraftTree
from segkv.structured.grammar import GrammarCache
from segkv.structured.matcher import GrammarState, fill_bitmask, new_bitmask
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
    draft_state: object | None = None  # a proposer's own state for this sequence (its n-gram index)
    grammar: GrammarState | None = None  # where a constrained sequence stands in its grammar
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the prompt's scores so far (prompt_logprobs)

    @property
    def num_pending(self) -> int:
        """Tokens that still need KV rows (the scheduler's view)."""
        return len(self.pending)

    @property
    def scoring(self) -> bool:
        """Whether prompt tokens still need their logprobs (``params.prompt_logprobs``)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.history)

    def all_token_ids(self) -> list[int]:
        """Prompt and generated tokens, in order."""
        return self.history + self.output_ids

    def token_ids_from(self, start: int) -> list[int]:
        """``all_token_ids()[start:]`` without building the whole list."""
        h = len(self.history)
        return self.history[start:] + self.output_ids if start < h else self.output_ids[start - h:]

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

    ``speculative`` (a :class:`~segkv.spec.config.SpeculativeConfig`, None: off): decode steps
    become verify windows. A proposer drafts up to ``k`` tokens per decoding sequence; one forward
    over each window (its pending token and the drafts) gives the target's logits of every row;
    exact rejection sampling (:func:`~segkv.spec.rejection.verify_windows`) keeps the drafts the
    target's distribution allows and draws one more token; the rows of rejected drafts are
    trimmed from the chain (no copy). Sequences without drafts decode as usual in the same
    forward. Steps are not launched ahead while speculation is on.

    Constrained sequences (``params.structured``) each follow their grammar (``grammar``, a
    :class:`~segkv.structured.matcher.GrammarState`; compiled grammars are shared through
    :attr:`grammars`): the sampler masks the tokens it does not allow, the sampled token advances
    it, and the sequence ends (``"stop"``) when the grammar terminates. Its steps run ahead like any
    decode: a step launched ahead is a forward only, and its mask is filled once the host has
    advanced the grammar over the token before, while that forward runs. A
    constrained sequence's drafts are walked through its grammar before the forward: the window
    stops at the first draft it rejects, and each window row is masked by the grammar as it stands
    after the drafts before it, so verification keeps exactly the tokens plain decoding allows.

    A request with ``prompt_logprobs`` scores its prompt while prefilling it: its chunks run in a
    forward of their own that keeps every row's logits (:meth:`_score_chunk`); a cached prefix is
    recomputed, since cached rows have no logits. With ``max_tokens`` 0 it then ends (``"length"``)
    without sampling. Steps holding either run without verify windows.
    """

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, *, max_model_len: int,
                 lookahead: bool | None = None, speculative: SpeculativeConfig | None = None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.sampler = Sampler()
        self.max_model_len = max_model_len
        self.speculative = speculative
        self.proposer = make_proposer(speculative, runner, tokenizer)
        self.lookahead = default_lookahead(runner.device) if lookahead is None else bool(lookahead)
        if self.proposer is not None:
            self.lookahead = False  # a window's length is known only after its verification
        self._ahead: StepAhead | None = None
        self.steps_ahead_used = 0  # decode steps served by a step launched ahead
        self.steps_ahead_cancelled = 0
        self.spec_stats = SpecStats(speculative.num_speculative_tokens if speculative else 0)
        # the most rows one step may compute, drafts included (the scheduler's token budget; None: no limit)
        self.max_step_rows: int | None = None
        # the most draft rows a decode's verify window adds (the scheduler keeps them in its budget)
        self.draft_rows = speculative.window_rows - 1 if speculative else 0
        self.vocab_size = runner.model.cfg.vocab_size  # the logits' width
        self.grammars = GrammarCache(tokenizer, self.vocab_size)

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
        params.check_vocab(self.vocab_size)  # logit_bias ids: a ValueError here, not an index error later
        seed = None if params.seed is None else params.seed + index
        generator = make_generator(seed, self.runner.device) if seed is not None else None
        detok = IncrementalDetokenizer(self.tokenizer, stop=params.stop, prompt_ids=history)
        grammar = None
        if params.structured is not None:
            budget = min(params.max_tokens, self.max_model_len - len(history) - len(new_ids))
            grammar = GrammarState(self.grammars, params.structured, budget=budget)
        scores = [None] if params.prompt_logprobs is not None and index == 0 else None
        return Sequence(index, chain, list(history), list(new_ids), params, detok, generator, grammar=grammar,
                        prompt_logprobs=scores)

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
        # prompt scoring keeps every row's logits, and a max_tokens 0 request samples nothing: no windows
        plain = any(s.scoring or s.params.max_tokens == 0 for s, _ in work)
        drafts, masks = ({}, {}) if plain else self._propose(work)
        if drafts:
            try:
                return self._verify_step(work, drafts, masks)
            except OutOfPagesError:  # the chains are as they were: this step runs without drafts
                pass
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
        if any(s.params.max_tokens == 0 for s in ready):  # prompt scoring only: nothing is sampled
            scored = [row for row, s in enumerate(ready) if s.params.max_tokens == 0]
            for s, _ in self._spawn_siblings([ready[row] for row in scored], select_rows(logits, scored)):
                s.prompt_logprobs = None
            for s in [x for row in scored for x in (ready[row], *ready[row].siblings)]:
                s.finish_reason = "length"
                s.detok.finish()
            keep = [row for row, s in enumerate(ready) if s.params.max_tokens > 0]
            self._sample_rows([ready[row] for row in keep], select_rows(logits, keep), work, ahead_ok=False)
            return ready
        self._sample_rows(ready, logits, work, ahead_ok=ahead_ok)
        return ready

    def _sample_rows(self, ready: list[Sequence], logits: torch.Tensor, work: list[tuple[Sequence, int]],
                     *, ahead_ok: bool) -> None:
        """Sample the next token of ``ready`` from their ``logits``, forking ``n > 1`` samples first."""
        if not ready:
            return
        spawned = self._spawn_siblings(ready, logits)
        # the next decode step may start before the host reads this one's tokens: only for plain
        # decodes (every sequence of the step sampled one token, none new), else it could not serve.
        # Constrained ones too: the step ahead is a forward only, and its tokens are sampled once
        # the host has advanced the grammars over this step's (the mask is filled meanwhile)
        decodes = not spawned and len(ready) == len(work) and all(k == 1 for _, k in work)
        self._sample(ready + [s for s, _ in spawned],
                     torch.cat([logits] + [row for _, row in spawned]) if spawned else logits,
                     launch_ahead=self.lookahead and ahead_ok and decodes)

    def _propose(self, work: list[tuple[Sequence, int]]
                 ) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
        """Drafts for the decoding sequences of ``work`` (position -> token ids), each capped so
        that its window stays inside the model's length and the request's ``max_tokens``, and the
        grammar masks of the constrained ones' windows (position -> ``(drafts + 1, words)`` int32):
        a constrained sequence's drafts stop before the first its grammar rejects."""
        if self.proposer is None:
            return {}, {}
        limit = self.speculative.disable_by_batch_size
        if limit is not None and len(work) > limit:
            return {}, {}
        where, seqs, rooms = [], [], []
        for i, (s, k) in enumerate(work):
            if k != 1 or len(s.pending) != 1 or not s.output_ids or not s.params.speculative:
                continue  # prefill chunks and first tokens (siblings fork after them) decode plainly
            room = min(self.speculative.num_speculative_tokens,
                       s.params.max_tokens - len(s.output_ids) - 1,  # each accepted draft is a token
                       self.max_model_len - s.chain.num_rows - 2)  # every window row has a position
            if room >= 1:
                where.append(i)
                seqs.append(s)
                rooms.append(room)
        if not seqs:
            return {}, {}
        proposals = self.proposer.propose(seqs, rooms)
        drafts = {}
        for i, proposal, room in zip(where, proposals, rooms):
            if isinstance(proposal, DraftTree):
                # a constrained sequence's grammar walks one path; a chain-shaped tree is a chain
                if work[i][0].grammar is not None:
                    proposal = proposal.first_branch()
                else:
                    proposal = proposal.truncated(room)
                    if proposal.is_chain:
                        proposal = list(proposal.tokens)
            if len(proposal):
                drafts[i] = proposal if isinstance(proposal, DraftTree) else list(proposal[:room])
        self._fit_budget(work, drafts)
        masks = {}
        for i, proposal in list(drafts.items()):
            state = work[i][0].grammar
            if state is None:
                continue
            bitmask = new_bitmask(len(proposal) + 1, self.vocab_size)
            taken = state.draft_masks(proposal, bitmask, 0)
            if taken:
                drafts[i] = proposal[:taken]
                masks[i] = bitmask[: taken + 1]
            else:
                del drafts[i]
        return drafts, masks

    def _fit_budget(self, work: list[tuple[Sequence, int]], drafts: dict[int, Drafts]) -> None:
        """Cut ``drafts`` (in place) so the step's rows, the scheduled tokens and every draft, stay
        within :attr:`max_step_rows`: windows in work order keep what the budget still allows (a
        tree its first nodes, which form a tree: parents come first)."""
        if self.max_step_rows is None:
            return
        left = self.max_step_rows - sum(k for _, k in work)
        for i in sorted(drafts):
            d = drafts[i]
            take = max(0, min(len(d), left))
            left -= take
            if take == len(d):
                continue
            if take == 0:
                del drafts[i]
            elif isinstance(d, DraftTree):
                drafts[i] = DraftTree(d.tokens[:take], d.parents[:take])
            else:
                drafts[i] = d[:take]

    def _verify_step(self, work: list[tuple[Sequence, int]], drafts: dict[int, list[int]],
                     masks: dict[int, torch.Tensor]) -> list[Sequence]:
        """One forward over ``work`` where the items in ``drafts`` carry their drafts after their
        pending token (a verify window); each window is verified (constrained ones under their
        ``masks``), the rest sample as usual."""
        counts = [1 + len(drafts.get(i, ())) for i in range(len(work))]
        inputs = []
        for i, (s, k) in enumerate(work):
            d = drafts.get(i, [])
            if isinstance(d, DraftTree):
                inputs.append(StepInput(s.chain, s.pending[:k] + list(d.tokens), d.window_parents()))
            else:
                inputs.append(StepInput(s.chain, s.pending[:k] + d))
        logits = self.runner.forward(inputs, logit_rows=counts)
        ready, plain, plain_rows, windows = [], [], [], []
        end = 0
        for i, (s, k) in enumerate(work):
            end += counts[i]
            s.pending = s.pending[k:]
            if s.pending:
                continue
            ready.append(s)
            if i in drafts:
                windows.append((s, drafts[i], logits[end - counts[i] : end], masks.get(i)))
            else:
                plain.append(s)
                plain_rows.append(end - 1)
        if plain:
            rows = select_rows(logits, plain_rows)
            spawned = self._spawn_siblings(plain, rows)
            self._sample(plain + [x for x, _ in spawned],
                         torch.cat([rows] + [row for _, row in spawned]) if spawned else rows)
        if windows:
            self._verify(windows)
        return ready

    def _verify(self, windows: list[tuple[Sequence, Drafts, torch.Tensor, torch.Tensor | None]]) -> None:
        """Verify the step's windows together: each ``(sequence, drafts, rows, bitmask)`` has its
        ``rows (k + 1, vocab)`` float32 logits of its pending token and its ``k`` drafts, a chain or a
        :class:`DraftTree` (``bitmask``: ``(k + 1, words)`` int32, a constrained sequence's grammar
        mask of each row, or None; chains only). Each emits its accepted drafts and one more token
        (up to a stop or a length limit) and drops the rows of the drafts not kept (a tree's kept
        path is moved into place first). The whole batch reads its results with one device-to-host
        copy (two with logprobs, or with sampled chains and trees both); greedy windows only compare
        the drafts with the rows' argmax."""
        seqs = [w[0] for w in windows]
        proposals = [w[1] for w in windows]
        params = [s.params for s, p in zip(seqs, proposals) for _ in range(len(p) + 1)]
        prompts = [s.history for s, p in zip(seqs, proposals) for _ in range(len(p) + 1)]
        # the output so far plus the drafts before each row, which only penalties read: not copied
        # for the rest (a copy per row of a long output, every step)
        outputs = [s.output_ids + prefix if s.params.has_penalties else ()
                   for s, p in zip(seqs, proposals)
                   for prefix in (row_prefixes(p) if s.params.has_penalties else [()] * window_size(p))]
        logits = torch.cat([w[2] for w in windows]) if len(windows) > 1 else windows[0][2]
        bitmask = None
        if any(w[3] is not None for w in windows):
            bitmask = torch.cat([new_bitmask(len(p) + 1, self.vocab_size) if m is None else m
                                 for _, p, _, m in windows])
        scores = dict(prompt_token_ids=prompts, output_token_ids=outputs, token_bitmask=bitmask)
        starts = _starts(proposals)
        if all(p.greedy for p in params):  # one-hot targets: a draft is kept iff it is the argmax
            best = self.sampler.greedy_tokens(logits, params, **scores).tolist()
            verdicts = []
            for proposal, start in zip(proposals, starts):
                row = best[start : start + len(proposal) + 1]
                if isinstance(proposal, DraftTree):
                    verdicts.append(greedy_walk(proposal, row))
                    continue
                kept = next((j for j, (d, t) in enumerate(zip(proposal, row)) if d != t), len(proposal))
                verdicts.append(TreeVerdict(proposal[:kept] + [row[kept]], list(range(kept))))
        else:
            verdicts = self._sample_windows(self.sampler.distribution(logits, params, **scores), seqs, proposals,
                                            starts)
        emitted = [v.tokens for v in verdicts]
        chosen = None
        if any(s.params.logprobs is not None for s in seqs):
            # the logprobs of the emitted tokens: each drawn from its window row's logits
            rows = [start + r for start, v in zip(starts, verdicts) for r in emitted_rows(v)]
            chosen = self.sampler.logprobs_of(
                logits[rows], [t for e in emitted for t in e], [params[r] for r in rows],
                prompt_token_ids=[prompts[r] for r in rows], output_token_ids=[outputs[r] for r in rows],
                token_bitmask=None if bitmask is None else bitmask[rows])
            values = chosen.logprobs.tolist()
        row = 0
        for s, proposal, verdict in zip(seqs, proposals, verdicts):
            tokens, window = verdict.tokens, window_size(proposal)
            self.spec_stats.record(len(proposal), len(tokens) - 1)
            taken = 0
            for j, token in enumerate(tokens):
                s.output_ids.append(token)
                taken += 1
                if chosen is not None and s.params.logprobs is not None:
                    s.logprobs.append(TokenLogprob(token, values[row + j], chosen.top_logprobs[row + j]))
                # the chain holds rows for the window's tokens after this one: not in the length check
                self._check_finish(s, token, rows_ahead=window - taken)
                if s.finish_reason is not None:
                    break
            row += len(tokens)
            # rows kept: the pending token's and the accepted drafts' before the last token taken
            if isinstance(proposal, DraftTree):
                keep = kept_rows(verdict, taken)
                s.chain.keep_last_rows(window, keep)
                on_kept = getattr(self.proposer, "keep_tree_rows", None)
                if on_kept is not None:  # a drafter holding per-row states moves them the same way
                    on_kept(s.chain, window, keep)
            else:
                s.chain.trim(window - taken)
            if s.finish_reason is None:
                s.pending = [tokens[taken - 1]]

    def _sample_windows(self, probs: torch.Tensor, seqs: list[Sequence], proposals: list[Drafts],
                        starts: list[int]) -> list[TreeVerdict]:
        """Exact rejection sampling of sampled windows from their rows' target distributions
        ``probs (rows, vocab)`` float32: chains by :func:`verify_windows`, trees by
        :func:`verify_trees` (each a batch of its own)."""
        verdicts: list[TreeVerdict | None] = [None] * len(proposals)
        for is_tree in (False, True):
            picked = [n for n, p in enumerate(proposals) if isinstance(p, DraftTree) == is_tree]
            if not picked:
                continue
            rows = [starts[n] + r for n in picked for r in range(window_size(proposals[n]))]
            part = probs if len(rows) == probs.shape[0] else probs[to_device(rows, torch.long, probs.device)]
            gens = [seqs[n].generator for n in picked]
            if is_tree:
                found = verify_trees(part, [proposals[n].parents for n in picked],
                                     [proposals[n].tokens for n in picked], gens)
            else:
                found = [TreeVerdict(e, list(range(len(e) - 1)))
                         for e in verify_windows(part, [proposals[n] for n in picked], None, gens)]
            for n, verdict in zip(picked, found):
                verdicts[n] = verdict
        return verdicts

    def _forward(self, work: list[tuple[Sequence, int]]) -> torch.Tensor:
        """``(len(work), vocab)`` logits of the step: the decode rows a step launched ahead holds
        are taken from it, the rest (prefills, new sequences) run a forward of their own."""
        served, ahead_logits = self._take_ahead(work)
        if len(served) == len(work):
            return ahead_logits
        taken = set(served)
        rest = [i for i in range(len(work)) if i not in taken]
        try:
            rest_logits = self._forward_rest([work[i] for i in rest])
        except BaseException:  # the step did not happen: the rows taken from the step ahead go too
            for i in served:
                work[i][0].chain.trim(1)
            raise
        if not served:
            return rest_logits
        where = {i: n for n, i in enumerate(served)} | {i: len(served) + n for n, i in enumerate(rest)}
        return select_rows(torch.cat([ahead_logits, rest_logits]), [where[i] for i in range(len(work))])

    def _forward_rest(self, items: list[tuple[Sequence, int]]) -> torch.Tensor:
        """``(len(items), vocab)`` logits of one forward over ``items``; a sequence still scoring
        its prompt runs a forward of its own that keeps every row's logits (:meth:`_score_chunk`)."""
        scoring = [i for i, (s, _) in enumerate(items) if s.scoring]
        if not scoring:
            return self.runner.forward([StepInput(s.chain, s.pending[:k]) for s, k in items])
        plain = [i for i in range(len(items)) if i not in set(scoring)]
        parts = [self.runner.forward([StepInput(items[i][0].chain, items[i][0].pending[:items[i][1]])
                                      for i in plain])] if plain else []
        parts += [self._score_chunk(*items[i]) for i in scoring]
        where = {i: n for n, i in enumerate(plain + scoring)}
        return select_rows(torch.cat(parts), [where[i] for i in range(len(items))])

    def _score_chunk(self, s: Sequence, k: int) -> torch.Tensor:
        """Process ``s``'s next ``k`` prompt tokens keeping every row's logits, record the prompt
        logprobs they give, and return the last row's ``(1, vocab)`` logits.

        Rows the prefix cache gave (a cached prefix skips its forward) have no logits: the chain is
        first trimmed back to the last scored row, so a scoring request recomputes the cached part
        of its prompt instead of reusing it."""
        scored = len(s.prompt_logprobs)
        if s.chain.num_rows > scored - 1:
            extra = s.chain.num_rows - (scored - 1)
            s.chain.trim(extra)
            s.pending = s.token_ids_from(scored - 1)[: extra + len(s.pending)]
        start = s.chain.num_rows
        rows: list[torch.Tensor] = []
        last = self.runner.forward([StepInput(s.chain, s.pending[:k])], collect=rows)
        logits = torch.cat(rows)
        # row j predicts the token at position start + j + 1
        positions = range(max(scored, start + 1), min(start + k + 1, len(s.history)))
        targets = [s.history[p] for p in positions]
        s.prompt_logprobs += score_tokens(logits[[p - start - 1 for p in positions]], targets,
                                          s.params.prompt_logprobs)
        return last

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
            token_bitmask=fill_bitmask([s.grammar for s in seqs], self.vocab_size),
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
        if s.grammar is not None:
            # a token outside the grammar (every allowed token had no probability): the output
            # ends there, as at an end-of-sequence token, rather than failing the step
            if not s.grammar.accept(token) or s.grammar.terminated:  # complete, its EOS taken
                s.finish_reason, s.stop_reason = "stop", None
                s.detok.finish()
                return
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


def _starts(groups: list[list[int]]) -> list[int]:
    """Where each verify window's rows start in the step's window rows (``len(g) + 1`` each)."""
    out, total = [], 0
    for g in groups:
        out.append(total)
        total += len(g) + 1
    return out
