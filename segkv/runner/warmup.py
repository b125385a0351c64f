"""Warming a runner before it serves: the step shapes a server runs, compiled and captured up front.

Triton compiles a kernel the first time it meets a new specialisation (block sizes chosen from a
step's rows, integer arguments equal to 1 or divisible by 16), and a CUDA graph is captured the
first time a decode batch lands in its bucket. Done lazily, all of it falls on the first requests:
a burst of 32 on a fresh server waited seconds for its first tokens (docs/benchmarks.md, "Serving").

:func:`warm_up` runs those shapes on throwaway chains of the cache: every variant of every decode
graph bucket up to the server's batch (captured directly), one-sequence prefills of a geometric
range of chunk lengths (a full chunk and one continued over history among them), the largest
forward the scheduler makes (full chunks of several sequences), batched prefills and decode steps
at every bucket size (host token ids, then device ones as a step launched ahead has them), a step
mixing decode rows with a prefill chunk, forks of a shared prefix (cascade plans, wide graphs), and
the sampler's greedy and filtered paths. Afterwards the cache is as it was (every page back, the
free list in its order, the pool's counters restored), the runner's route counts, last plan and
graph counters too, and the random generators' states, so sampling continues as if nothing had
run. Nothing is written to a prefix index.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from tqdm import tqdm

from segkv.cache.chain import KVChain
from segkv.cache.page_pool import OutOfPagesError
from segkv.layers.transfer import HostCopy
from segkv.runner.cuda_graphs import DEFAULT_BUCKETS
from segkv.runner.model_runner import ModelRunner, StepInput
from segkv.sampling_params import SamplingParams

# On a device without compilation or graphs, a warm-up only exercises the step: decode batches
# up to this size, one-token prompts.
LIGHT_MAX_BATCH = 4
# Sampler settings the warm-up draws with: greedy, plain sampling, and every filter and penalty.
SAMPLING = (
    SamplingParams(temperature=0.0),
    SamplingParams(),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                   presence_penalty=0.5, frequency_penalty=0.5, logprobs=2),
    SamplingParams(temperature=0.8, top_p=0.95),
)


@dataclass(slots=True, frozen=True)
class WarmUpShapes:
    """What a warm-up runs.

    ``graph_sizes``: decode graph buckets whose every variant is captured (and the verify-window
    buckets of as many sequences, when the runner's graphs have window sizes). ``decode_sizes``: batch
    sizes that prefill together and decode (a step from host ids, one from device ids).
    ``prefill_lengths``: one-sequence prompts, a forward each (longer ones chunked). ``batched``:
    the prompt lengths of the largest forward, full chunks of several sequences. ``shared_prefix``:
    rows forks of one prompt share (cascade plans; 0: none). ``thorough``: also the filtered
    sampler paths and a step mixing decode rows with a prefill chunk.
    """

    graph_sizes: tuple[int, ...]
    decode_sizes: tuple[int, ...]
    prefill_lengths: tuple[int, ...]
    batched: tuple[int, ...]
    shared_prefix: int
    thorough: bool

    def __post_init__(self) -> None:
        if any(n < 1 for n in (*self.graph_sizes, *self.decode_sizes, *self.prefill_lengths, *self.batched)):
            raise ValueError("warm-up batch sizes and prompt lengths must be >= 1")


def warm_up_shapes(runner: ModelRunner, *, max_batch: int, max_num_batched_tokens: int, max_model_len: int,
                   thorough: bool) -> WarmUpShapes:
    """The shapes a server with batches of up to ``max_batch`` sequences and forwards of up to
    ``max_num_batched_tokens`` tokens runs; ``thorough`` (CUDA) covers every kernel
    specialisation, otherwise one-token prompts and batches up to :data:`LIGHT_MAX_BATCH`."""
    if max_batch < 1 or max_num_batched_tokens < 1:
        raise ValueError(f"max_batch and max_num_batched_tokens must be >= 1, got {max_batch} and "
                         f"{max_num_batched_tokens}")
    graphs = runner.graphs
    buckets = graphs.buckets if graphs is not None else DEFAULT_BUCKETS
    cover = next((b for b in buckets if b >= max_batch), buckets[-1])
    graph_sizes = tuple(b for b in buckets if b <= cover) if graphs is not None else ()
    longest = max_model_len - 2  # room for the decode rows after the prompt
    if not thorough:
        sizes = tuple(b for b in buckets if b <= min(cover, LIGHT_MAX_BATCH))
        return WarmUpShapes(graph_sizes, sizes, (), (), 0, thorough=False)
    sizes = tuple(b for b in buckets if b <= cover) + ((max_batch,) if max_batch > buckets[-1] else ())
    chunk = runner.prefill_chunk
    # one row, then each doubling of the rows (block sizes follow the next power of two), a full
    # chunk, and a prompt whose second chunk attends the first one's rows
    lengths = {1, chunk, chunk + 7} | {2**k + 1 for k in range(int(math.log2(chunk)) + 1) if 2**k + 1 < chunk}
    lengths = tuple(sorted(n for n in lengths if n <= longest))
    page = runner.cache.page_size
    chunk = max(1, min(chunk, longest))
    batched = tuple(min(chunk, max_num_batched_tokens - start) for start in range(0, max_num_batched_tokens, chunk))
    shared = min(2 * page + 3, longest - 4) if longest > page + 4 else 0  # a page and more: a cascade
    return WarmUpShapes(graph_sizes, sizes, lengths, batched, shared, thorough=True)


def warm_up(runner: ModelRunner, sampler: Callable, shapes: WarmUpShapes, *, vocab_size: int,
            progress: bool = False) -> dict:
    """Run ``shapes`` on ``runner`` (its cache and graphs) and leave no trace but compiled kernels and
    captured graphs (see the module docstring). ``sampler``: the engine's
    :class:`~segkv.layers.sampler.Sampler`. Returns ``{"buckets": decode batch sizes, "graphs":
    graph variants captured now, "forwards": steps run, "skipped": shapes the cache had no room
    for}``. Not thread-safe: call it while nothing else runs on the runner."""
    warm = _Warm(runner, sampler, vocab_size)
    tasks: list[tuple[str, Callable[[], None]]] = []
    if runner.graphs is not None:
        tasks += [(f"graphs of {b} rows", lambda b=b: warm.graphs(b)) for b in shapes.graph_sizes]
    tasks += [(f"prefill of {n} tokens", lambda n=n: warm.prefill(n)) for n in shapes.prefill_lengths]
    if shapes.batched:
        tasks.append((f"forward of {sum(shapes.batched)} tokens", lambda: warm.batched(shapes.batched)))
    last = shapes.decode_sizes[-1] if shapes.decode_sizes else 0
    tasks += [(f"decode of {b} sequences", lambda b=b: warm.decode(b, mixed=shapes.thorough and b == last,
                                                                    thorough=shapes.thorough))
              for b in shapes.decode_sizes]
    if shapes.shared_prefix and last >= 2:
        tasks.append((f"{last} forks", lambda: warm.forks(last, shapes.shared_prefix)))
    skipped = []
    with _state_kept(runner):
        for label, task in tqdm(tasks, desc="warming up", unit="shape", disable=not progress):
            try:
                task()
            except OutOfPagesError:  # a small cache: this shape cannot run now, nor can a request's
                skipped.append(label)
    return {"buckets": list(shapes.decode_sizes), "graphs": warm.captured, "forwards": warm.forwards,
            "skipped": skipped}


class _Warm:
    """The warm-up's steps; every chain made is released before a step returns."""

    def __init__(self, runner: ModelRunner, sampler: Callable, vocab_size: int) -> None:
        self.runner, self.sampler, self.vocab = runner, sampler, vocab_size
        self.captured: list[list] = []
        self.forwards = 0

    def ids(self, n: int, salt: int = 0) -> list[int]:
        return [(7919 * (i + 1) + 104729 * salt) % self.vocab for i in range(n)]

    @torch.inference_mode()
    def graphs(self, size: int) -> None:
        runner = self.runner
        keys = runner.warm_graphs(size)
        self.captured += [list(k) for k in keys]
        windows = runner.graphs.warm_windows(size, lambda window: runner.mla_mode_of([[0] * window]))
        self.captured += [[s, wide, False, window] for s, window, wide in windows]

    def forward(self, inputs: list[StepInput]) -> torch.Tensor:
        self.forwards += 1
        return self.runner.forward(inputs)

    def prefill(self, n: int) -> None:
        with _chains(self.runner, 1) as (chain,):
            self.forward([StepInput(chain, self.ids(n))])

    def batched(self, lengths: tuple[int, ...]) -> None:
        with _chains(self.runner, len(lengths)) as chains:
            self.forward([StepInput(c, self.ids(n, i)) for i, (c, n) in enumerate(zip(chains, lengths))])

    def decode(self, size: int, *, mixed: bool, thorough: bool) -> None:
        """``size`` prompts prefilled together, a decode step from host token ids, and (thorough) one
        from device ids and, with ``mixed``, one with a new prompt's chunk beside the decode rows."""
        prompts = [self.ids(1 + (i % 3 if thorough else 0), i) for i in range(size)]
        with _chains(self.runner, size + 1) as chains:
            seqs, extra = chains[:size], chains[size]
            logits = self.forward([StepInput(c, p) for c, p in zip(seqs, prompts)])
            tokens = self.sample(logits, prompts, thorough)
            logits = self.forward([StepInput(c, [t]) for c, t in zip(seqs, tokens.tolist())])
            if not thorough:
                return
            tokens = self.sample(logits, prompts, thorough)
            self.forwards += 1
            logits = self.runner.decode_from_device(seqs, tokens)  # as a step launched ahead runs
            tokens = self.sample(logits, prompts, thorough)
            if mixed:
                self.forward([StepInput(c, [t]) for c, t in zip(seqs, tokens.tolist())]
                             + [StepInput(extra, self.ids(9, size))])

    def forks(self, size: int, shared: int) -> None:
        """Forks of one prompt: their prefill chunks and decode rows attend the shared prefix once."""
        with _chains(self.runner, 1) as (base,):
            self.forward([StepInput(base, self.ids(shared))])
            forks = [base.fork() for _ in range(size)]
            try:
                self.forward([StepInput(c, self.ids(3, i)) for i, c in enumerate(forks)])
                self.forward([StepInput(c, self.ids(1, i)) for i, c in enumerate(forks)])
            finally:
                for chain in forks:
                    chain.release()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, prompts: list[list[int]], thorough: bool) -> torch.Tensor:
        """``(B,)`` int64 token ids on the device: greedy rows, and (thorough, B > 1) every setting."""
        rows = logits.shape[0]
        params = [SAMPLING[i % len(SAMPLING)] if thorough and rows > 1 else SAMPLING[0] for i in range(rows)]
        out = self.sampler(logits, params, prompt_token_ids=prompts, output_token_ids=[p[:1] for p in prompts])
        HostCopy(out.token_ids).tolist()  # as the engine reads them: pinned host blocks of this size
        return out.token_ids


@contextmanager
def _chains(runner: ModelRunner, n: int) -> Iterator[list[KVChain]]:
    chains = [runner.cache.new_chain() for _ in range(n)]
    try:
        yield chains
    finally:
        for chain in chains:
            chain.release()


@contextmanager
def _state_kept(runner: ModelRunner) -> Iterator[None]:
    """Restore what a warm-up's steps change besides compiled kernels and captured graphs: the
    pool's free list (its order decides the pages the next allocations get) and counters, the
    runner's route and precision counts, last plan and plan ahead, the graphs' counters, and the CPU's and the
    device's random generator states (unseeded sampling draws from them)."""
    pool, graphs = runner.cache.pool, runner.graphs
    free = list(pool._free)  # private to the pool, read and put back whole: no page changes hands
    counters = {k: getattr(pool, k) for k in ("peak_pages_in_use", "pages_allocated_total", "bytes_copied",
                                              "rows_copied")}
    routes, last_plan, ahead_used = Counter(runner.route_counts), runner.last_plan, runner.plans_ahead_used
    precisions = Counter(runner.precision_counts)
    graph_counters = {k: getattr(graphs, k) for k in ("replays", "fallbacks", "staged_plans_used")} if graphs else {}
    cuda = runner.device.type == "cuda"
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(runner.device) if cuda else None
    try:
        yield
    finally:
        runner.forget_plan_ahead()
        if graphs is not None:
            graphs.forget_staged()
            for k, v in graph_counters.items():
                setattr(graphs, k, v)
        runner.route_counts.clear()
        runner.route_counts.update(routes)
        runner.precision_counts.clear()
        runner.precision_counts.update(precisions)
        runner.last_plan, runner.plans_ahead_used = last_plan, ahead_used
        assert sorted(pool._free) == sorted(free), "a warm-up chain kept pages"
        pool._free[:] = free
        for k, v in counters.items():
            setattr(pool, k, v)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, runner.device)
