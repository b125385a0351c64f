"""Where a decode step's time goes: host work, graph replay and each kernel, for one model shape.

Builds a model at a real shape with random weights (``benchmarks.decode_e2e.model_config``), fills a
cache of ``--context`` random rows per sequence and times greedy decode steps through the runner
(CUDA graphs on), then splits the step:

* wall time per step (runner.forward + argmax to the host, as the engine does);
* graph replay alone (inputs already staged), synchronised;
* the host's ``replay()`` call alone, and 8 replays back to back (each launch overlapping the
  replay before it): whether launching the graph delays the GPU;
* host planning and preparation alone (plan_attention + backend.prepare);
* a ``torch.profiler`` table of an eager step's kernels (self CUDA time), to find the slow ones.

``--timeline``: instead, the GPU's own clock over plain decode steps (CUDA events recorded on
the stream just before each replay, after the runner returns and after the argmax), so the
step splits into the replay, the work queued behind it and the time before the next replay.

Usage (GPU machine): ``python3 scripts/profile_decode.py --model llama-3.1-8b --batch 1 --context 1024``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time

import torch

from segkv.attention.planner import plan_attention
from segkv.attention.plan import SequenceQuery
from benchmarks.decode_e2e import build_runner, build_segkv, case_pages, decode_steps, model_config, trim_to
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, default_page_size
from segkv.layers.sampler import argmax_rows


def median_ms(fn, repeats: int, *, wait: bool = True) -> tuple[float, float, float]:
    """``fn``'s wall time in ms, the device idle before each call: median, min, max. ``wait``:
    synchronised after each call too (the whole GPU work); otherwise the host's call alone."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if wait:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times), min(times), max(times)


def _profile_table(runner, chains, first: list[int], steps: int, context: int, sort_by: str, rows: int,
                   trace: str | None = None) -> str:
    """``torch.profiler`` table of ``steps`` decode steps (CPU and CUDA activity), chains trimmed
    back after; with ``trace``, the timeline is also written there (Chrome trace JSON)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode_steps(runner, chains, first, steps)
        torch.cuda.synchronize()
    trim_to(chains, context)
    if trace:
        prof.export_chrome_trace(trace)
    return prof.key_averages().table(sort_by=sort_by, row_limit=rows)


class _TimedGraph:
    """A captured graph whose every replay is preceded by a CUDA event on the stream."""

    def __init__(self, graph) -> None:
        self.graph, self.events, self.ends = graph, [], []

    def replay(self) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)
        self.graph.replay()
        self.ends.append(torch.cuda.Event(enable_timing=True))
        self.ends[-1].record()


@contextlib.contextmanager
def timed_graphs(runner):
    """Each captured bucket's graph wrapped in a :class:`_TimedGraph` while inside; yields them by
    bucket key, and gives every bucket its own graph back on leaving, however the block ends."""
    timed = {}
    for key, bucket in runner.graphs.captured.items():
        timed[key] = bucket.graph = _TimedGraph(bucket.graph)
    try:
        yield timed
    finally:
        for key, t in timed.items():
            runner.graphs.captured[key].graph = t.graph


def timeline(runner, chains, first: list[int], steps: int) -> None:
    """Median GPU-clock intervals of ``steps`` plain decode steps (see the module docstring)."""
    from segkv.runner.model_runner import StepInput

    with timed_graphs(runner) as timed:
        after_forward, after_argmax, tokens = [], [], first
        for _ in range(steps):
            logits = runner.forward([StepInput(c, [t]) for c, t in zip(chains, tokens)])
            after_forward.append(torch.cuda.Event(enable_timing=True))
            after_forward[-1].record()
            ids = argmax_rows(logits)  # the engine's greedy argmax (sampler), not torch's one-block reduction
            after_argmax.append(torch.cuda.Event(enable_timing=True))
            after_argmax[-1].record()
            tokens = ids.tolist()
        torch.cuda.synchronize()
        before = [e for t in timed.values() for e in t.events][-steps:]
        if len(before) != steps:
            print(f"  timeline: {len(before)} replays for {steps} steps (some ran eagerly)")
            return
        med = lambda xs: statistics.median(xs)  # noqa: E731
        period = med([a.elapsed_time(b) for a, b in zip(after_forward, after_forward[1:])])
        replay = med([b.elapsed_time(a) for b, a in zip(before, after_forward)])
        argmax = med([f.elapsed_time(a) for f, a in zip(after_forward, after_argmax)])
        between = med([a.elapsed_time(b) for a, b in zip(after_argmax, before[1:])])
        print(f"  GPU clock per step: {period:.3f} ms = replay to runner's return {replay:.3f} (graph, "
              f"logits copy, next step's index copies) + argmax {argmax:.3f} + argmax to next replay "
              f"{between:.3f} (host's turn, input copies)")


def generator_timeline(runner, chains, first: list[int], steps: int, context: int, runs: int = 3,
                       trace: str | None = None) -> None:
    """The engine's loop (``Generator``, steps launched ahead) on the GPU's clock: per step, the
    graph replay (an event before and after it) and the time from one replay's end to the next
    one's start (sampling, copies, and any wait for the host), median / 90th percentile / largest
    over ``runs`` runs of ``steps`` steps, the first 3 steps of each run left out."""
    from benchmarks.decode_e2e import generate_steps

    replays, gaps, collections = [], [], []
    started = {}

    def on_gc(phase, info) -> None:  # the cyclic collector's runs during the loop, with their time
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            collections.append((info["generation"], (time.perf_counter() - started["t"]) * 1e3))

    def run() -> None:
        generate_steps(runner, chains, first, steps, lookahead=True, max_model_len=context + steps + 8)
        torch.cuda.synchronize()
        trim_to(chains, context)

    gc.callbacks.append(on_gc)
    try:
        with timed_graphs(runner) as timed:
            for _ in range(runs):
                for t in timed.values():
                    t.events.clear()
                    t.ends.clear()
                run()
                pairs = [(b, e) for t in timed.values() for b, e in zip(t.events, t.ends)]
                ref = pairs[0][0]
                pairs = sorted(pairs, key=lambda be: ref.elapsed_time(be[0]))[3:]  # launch order, buckets merged
                replays += [b.elapsed_time(e) for b, e in pairs]
                gaps += [e.elapsed_time(b2) for (_, e), (b2, _) in zip(pairs, pairs[1:])]
        if trace:  # one more run under the profiler: what runs on the GPU between two replays
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run()
            prof.export_chrome_trace(trace)
    finally:
        gc.callbacks.remove(on_gc)
    print(f"  generator loop, cyclic collections (generation, ms): {[(g, round(ms, 2)) for g, ms in collections]}")
    for name, xs in (("graph replay", replays), ("replay end to next replay", gaps)):
        xs = sorted(xs)
        print(f"  generator loop, {name}: median {statistics.median(xs):.3f} ms, 90th {xs[int(0.9 * len(xs))]:.3f}, "
              f"max {xs[-1]:.3f}, mean {statistics.fmean(xs):.3f} ({len(xs)} steps)")


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rows", type=int, default=30, help="rows of each profiler table")
    p.add_argument("--timeline", action="store_true", help="only the GPU-clock split of plain graph steps")
    p.add_argument("--generator", action="store_true",
                   help="only the engine loop's (steps ahead) graph replays and the gaps between them, GPU clock")
    p.add_argument("--gc-freeze", action="store_true", help="with --generator: gc.freeze() first, as the engine")
    p.add_argument("--trace", default=None, help="write the graph steps' timeline here (Chrome trace JSON): "
                   "what the host does between two replays")
    args = p.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    cfg = model_config(args.model)
    with torch.no_grad():
        model, _ = build_segkv(cfg, device=device, dtype=dtype)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    print(f"{args.model}: {weight_bytes / 1e9:.2f} GB of weights; dtypes "
          f"{sorted({str(t.dtype) for t in model.parameters()})}")
    layout = model.kv_layout(dtype)
    page_size = default_page_size(device.type)
    pages = case_pages(args.batch, args.context, steps=args.steps, warmup=8, page_size=page_size)
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=pages), device=device,
                         compaction=CompactionPolicy(enabled=False))
    chains = [cache.new_chain() for _ in range(args.batch)]
    for chain in chains:
        chain.append(args.context)
    first = list(range(1, args.batch + 1))
    for graphs in ("auto", "off"):
        runner, on = build_runner(model, cache, device, graphs=graphs)
        decode_steps(runner, chains, first, 8)
        trim_to(chains, args.context)

        def steps() -> None:
            decode_steps(runner, chains, first, args.steps)
            trim_to(chains, args.context)

        if args.timeline or args.generator:
            if on and args.timeline:
                timeline(runner, chains, first, args.steps)
                trim_to(chains, args.context)
            if on and args.generator:
                if args.gc_freeze:  # as the engine does once set up
                    gc.collect()
                    gc.freeze()
                generator_timeline(runner, chains, first, args.steps, args.context, trace=args.trace)
                gc.unfreeze()
            continue
        med = median_ms(steps, 3)
        per = [m / args.steps for m in med]
        print(f"graphs={graphs} (on: {on}): {per[0]:.3f} ms/step [{per[1]:.3f}-{per[2]:.3f}] "
              f"-> {args.batch * 1e3 / per[0]:.1f} tok/s; plan {runner.last_plan.describe()}")
        bucket = next(iter(runner.graphs.captured.values()), None) if on else None
        if on and bucket is None:
            print("  no graph was captured (every step ran eagerly)")
        if bucket is not None:
            rep = median_ms(bucket.graph.replay, 20)
            print(f"  graph replay alone: {rep[0]:.3f} ms [{rep[1]:.3f}-{rep[2]:.3f}] "
                  f"= {weight_bytes / (rep[0] / 1e3) / 1e9:.0f} GB/s of all weights (a MoE step reads only its experts)")
            launch = median_ms(bucket.graph.replay, 20, wait=False)
            print(f"  replay() call on the host (no sync): {launch[0]:.3f} ms [{launch[1]:.3f}-{launch[2]:.3f}]")
            back = median_ms(lambda: [bucket.graph.replay() for _ in range(8)], 5)
            print(f"  8 replays back to back: {back[0] / 8:.3f} ms each [{back[1] / 8:.3f}-{back[2] / 8:.3f}] "
                  f"(launches overlapping the GPU: the GPU's share of a step)")
            shape = model.attention_shape("absorbed")
            queries = [SequenceQuery.from_chain(c, 1) for c in chains]

            def host_plan() -> None:
                plan = plan_attention(queries, shape, runner.device_spec, page_size=page_size)
                bucket.backend.prepare(plan)

            host = median_ms(host_plan, 20)
            print(f"  host plan + prepare: {host[0]:.3f} ms [{host[1]:.3f}-{host[2]:.3f}]")
            print("  graph steps, by CPU time:")
            print(_profile_table(runner, chains, first, 4, args.context, "self_cpu_time_total", args.rows,
                                 trace=args.trace))
        else:
            print("  eager steps, by CUDA time:")
            print(_profile_table(runner, chains, first, 2, args.context, "self_cuda_time_total", args.rows))

if __name__ == "__main__":
    main()
