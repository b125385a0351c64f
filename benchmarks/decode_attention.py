"""Decode attention benchmark: segkv's Triton routes against torch's stock SDPA backends.

For each (shape, batch, context, page size) the same K/V data is attended by: stock
``scaled_dot_product_attention`` on a contiguous copy (flash, cuDNN and memory-efficient
backends, each where it runs), segkv ``single``, the planner's automatic plan (``split``),
and ``segments`` with the same pages viewed as 2, 8 and 30 page-aligned segments (and the
planner's own plan over the 8 segments, ``auto_segments8``: what the engine runs). A separate
case times ``cascade``: 16 forks of one shared prefix, each with its own suffix, against the
same batch planned without sharing.

Every variant is captured in a CUDA graph (no launch overhead in the figures; plans are
prepared before timing). When a case's data is smaller than ``4 x L2``, the graph walks
through enough copies of it that L2 is cold for each call. Trials run the variants in
shuffled order; each figure is the median per call over the trials, with min and max; GB/s
counts the unique KV bytes a step must read, and the fraction is of the copy bandwidth
measured in the same run.

Run on a CUDA device: ``python -m benchmarks.decode_attention --help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from segkv.attention import AttentionShape, DeviceSpec, SequenceQuery, plan_attention
from segkv.attention.triton_backend import TritonBackend
from segkv.cache import PagedKVCache
from segkv.cache.segment import ChainSpan
from segkv.config import CacheConfig, CompactionPolicy, KVLayout

SHAPES = {"llama3-8b": (32, 8, 128), "llama3-70b": (64, 8, 128), "llama3-405b": (128, 8, 128)}
SDPA_BACKENDS = ("flash", "cudnn", "efficient")
MAX_L2_COPIES = 16


def l2_copies(nbytes: int, l2_bytes: int, cap: int = MAX_L2_COPIES) -> int:
    """Copies of ``nbytes`` of data a graph walks through so that each call finds L2 cold."""
    return max(1, min(cap, math.ceil(4 * l2_bytes / max(nbytes, 1))))


def measured_read_bandwidth(device: str = "cuda") -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read and written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    rates = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        rates.append(2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3))
    del src, dst
    return statistics.median(rates)


# Calls per timing graph at least (``--calls-per-graph``): the variant's calls (one per data copy,
# cycled) repeated until the graph holds this many. 0 (the default): one pass over the data copies.
# Each graph replay starts with a launch gap that a longer graph spreads over more calls (batch 1 /
# 32K, two data copies: 0.0376 -> 0.0363 ms at 16 calls), but with attention PDL on the calls then
# chain, each call's programs launching into the slots the one before frees (8B shape, pages of
# 16, batch 16: 0.25 -> 0.33 ms, likely some SMs crowded). docs/benchmarks.md,
# "The timing harness: calls per graph and PDL between calls".
CALLS_PER_GRAPH = 0


@dataclass
class Timer:
    """Times a variant's calls (one per data copy); ``ms()`` is the time per call.

    ``capture`` records them in a CUDA graph (no launch overhead); ``eager`` launches them from
    Python between two events, the fallback for a variant a graph cannot hold.
    """

    replay: Callable[[], None]
    calls: int
    reps: int = 1
    keep: tuple = ()  # the graph and the captured calls, and through them every tensor it reads

    @classmethod
    def capture(cls, fns: list) -> Timer:
        """``fns`` recorded in one graph, cycled until it holds at least :data:`CALLS_PER_GRAPH`
        calls (0: each once)."""
        calls = [fns[i % len(fns)] for i in range(max(len(fns), CALLS_PER_GRAPH))]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for fn in fns:  # warm up (compiles kernels, picks SDPA algorithms) outside the graph
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
        torch.cuda.synchronize()
        return cls(graph.replay, len(calls), keep=(graph, *fns))._sized()

    @classmethod
    def eager(cls, fns: list) -> Timer:
        fns = tuple(fns)
        for fn in fns:  # warm up
            fn()
        torch.cuda.synchronize()
        return cls(lambda: [fn() for fn in fns], len(fns), keep=fns)._sized()

    def _sized(self) -> Timer:
        """Repetitions so that one measurement lasts about 2 ms."""
        once = self.ms()
        self.reps = max(1, min(200, round(2.0 / max(once, 1e-3) / self.calls)))
        return self

    def ms(self) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.reps):
            self.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / (self.reps * self.calls)


def regroup(query: SequenceQuery, num_segments: int, page_size: int, id_base: int) -> SequenceQuery:
    """The same pages seen as ``num_segments`` page-aligned sealed segments (the spans a chain
    sealed ``num_segments - 1`` times at page boundaries would have)."""
    pages = [p for span in query.spans for p in span.page_ids]
    total = query.num_kv_rows
    bounds = [round(i * len(pages) / num_segments) for i in range(num_segments + 1)]
    spans = []
    for i in range(num_segments):
        ids = tuple(pages[bounds[i]:bounds[i + 1]])
        start = bounds[i] * page_size
        rows = min(total, bounds[i + 1] * page_size) - start
        if rows > 0:
            spans.append(ChainSpan(id_base + i, ids, rows, start, sealed=True))
    return SequenceQuery(tuple(spans), query.num_query_rows)


def random_cache(shape_name: str, *, batch: int, context: int, read_rows: int, page_size: int, dtype,
                 generator: torch.Generator) -> tuple[PagedKVCache, int, int]:
    """A one-layer CUDA cache of random K/V with room for ``batch`` sequences of ``context`` rows
    in each of enough copies to keep L2 cold when a step reads ``read_rows`` rows a sequence
    (:func:`l2_copies`): ``(cache, copies, bytes a step reads)``."""
    _, kv_heads, head_dim = SHAPES[shape_name]
    kv_bytes = 2 * batch * read_rows * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    copies = l2_copies(kv_bytes, torch.cuda.get_device_properties(0).L2_cache_size)
    layout = KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    num_pages = copies * batch * -(-context // page_size) + 1
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=num_pages), device="cuda",
                         compaction=CompactionPolicy(enabled=False))
    fill_random(cache, generator)
    return cache, copies, kv_bytes


def fill_random(cache: PagedKVCache, generator: torch.Generator) -> None:
    """Fill layer 0's whole K and V pools of ``cache`` (``(num_pages, page_size, num_kv_heads,
    dim)`` views, in the cache's dtype) with standard-normal values drawn from ``generator``
    (on the cache's device), 4096 pages at a time."""
    for tensor in (cache.storage.key_cache(0), cache.storage.value_cache(0)):
        for start in range(0, tensor.shape[0], 4096):
            chunk = tensor[start:start + 4096]
            chunk.copy_(torch.randn(chunk.shape, device=chunk.device, generator=generator))


def _contiguous(cache: PagedKVCache, chains, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, kv_heads, context, dim) copies of the chains' K and V, for stock SDPA."""
    out = []
    for tensor in (cache.storage.key_cache(0), cache.storage.value_cache(0)):
        rows = [tensor[torch.tensor([p for s in c.spans() for p in s.page_ids], device=tensor.device)]
                .flatten(0, 1)[:context] for c in chains]
        out.append(torch.stack(rows).transpose(1, 2).contiguous())
    return out[0], out[1]


def _sdpa_call(backend: str, q, k, v):
    """Stock SDPA for GQA decode: each KV head's query heads are the query rows (no mask)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]

    def call():
        with sdpa_kernel([chosen]):
            return F.scaled_dot_product_attention(q, k, v)
    return call


def time_summary(times: list[float], kv_bytes: int, bandwidth: float) -> dict:
    """One variant's row: median / min / max of ``times`` (ms per call), and the rate of
    ``kv_bytes`` read per call at the median, in GB/s and as a fraction of ``bandwidth`` (bytes/s)."""
    med = statistics.median(times)
    return {"median_ms": med, "min_ms": min(times), "max_ms": max(times), "gbps": kv_bytes / (med / 1e3) / 1e9,
            "fraction_of_bandwidth": kv_bytes / (med / 1e3) / bandwidth}


def run_trials(timers: dict[str, Timer], trials: int) -> dict[str, list[float]]:
    """``trials`` rounds over ``timers``, each round in a fresh random order (so no variant always
    runs first or after the same one); returns each timer's ms per call, one entry per round."""
    samples = {name: [] for name in timers}
    for _ in range(trials):
        order = list(timers)
        random.shuffle(order)
        for name in order:
            samples[name].append(timers[name].ms())
    return samples


def bench_case(*, shape_name: str, batch: int, context: int, page_size: int, dtype, trials: int, bandwidth: float,
               segment_counts=(2, 8, 30), sdpa=SDPA_BACKENDS, seed: int = 0, head_major: bool = False) -> dict:
    """One (shape, batch, context, page size) case; returns its row of the table. ``head_major``:
    also the planner's plan over a head-major copy of the pages (``(page, head, row, dim)``
    memory, viewed with the kernels' strides: one contiguous block per page and KV head)."""
    device = "cuda"
    q_heads, kv_heads, head_dim = SHAPES[shape_name]
    gen = torch.Generator(device=device).manual_seed(seed)
    cache, copies, kv_bytes = random_cache(shape_name, batch=batch, context=context, read_rows=context,
                                           page_size=page_size, dtype=dtype, generator=gen)
    shape = AttentionShape(q_heads, kv_heads, head_dim, head_dim)
    spec = DeviceSpec.cuda()
    backend = TritonBackend(page_size=page_size, device=device)
    kc, vc = cache.storage.key_cache(0), cache.storage.value_cache(0)
    if head_major:
        kc_hm, vc_hm = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (kc, vc))
    scale = head_dim**-0.5
    fns: dict[str, list] = {}
    plans: dict[str, dict] = {}
    chains_all = []
    for copy in range(copies):
        chains = [cache.new_chain() for _ in range(batch)]
        for chain in chains:
            chain.append(context)
        chains_all.extend(chains)
        queries = [SequenceQuery.from_chain(c, 1) for c in chains]
        q = torch.randn(batch, q_heads, head_dim, device=device, dtype=dtype, generator=gen)
        variants = {
            "single": plan_attention(queries, shape, spec, page_size=page_size, route="single"),
            "auto": plan_attention(queries, shape, spec, page_size=page_size),
        }
        for n in segment_counts:
            grouped = [regroup(qr, n, page_size, 1000 * i) for i, qr in enumerate(queries)]
            variants[f"segments{n}"] = plan_attention(grouped, shape, spec, page_size=page_size, route="segments")
            if n == 8:  # what the engine runs over such a history: the planner's own plan
                variants["auto_segments8"] = plan_attention(grouped, shape, spec, page_size=page_size)
        for name, plan in variants.items():
            prepared = backend.prepare(plan)
            fns.setdefault(name, []).append(lambda p=prepared, q=q: backend.run(p, q, kc, vc, scale=scale))
            plans.setdefault(name, plan.describe())
            if head_major and name == "auto":
                fns.setdefault("auto_head_major", []).append(
                    lambda p=prepared, q=q: backend.run(p, q, kc_hm, vc_hm, scale=scale))
        k, v = _contiguous(cache, chains, context)
        qd = q.view(batch, kv_heads, q_heads // kv_heads, head_dim)
        for name in sdpa:
            fns.setdefault(f"sdpa_{name}", []).append(_sdpa_call(name, qd, k, v))
    timers, errors = {}, {}
    for name, calls in fns.items():
        try:
            timers[name] = Timer.capture(calls)
        except Exception as exc:  # a stock backend that does not run this shape
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    samples = run_trials(timers, trials)
    result = {"shape": shape_name, "batch": batch, "context": context, "page_size": page_size,
              "dtype": str(dtype).replace("torch.", ""), "l2_copies": copies, "plans": plans, "errors": errors,
              "variants": {name: time_summary(t, kv_bytes, bandwidth) for name, t in samples.items()}}
    del timers, fns
    for chain in chains_all:
        chain.release()
    return result


def forked_prefix(*, kv_heads: int, head_dim: int, dtype, forks: int, prefix: int, suffix: int, page_size: int,
                  generator: torch.Generator, device: str = "cuda") -> tuple[PagedKVCache, object, list]:
    """A cache of random rows holding a sealed ``prefix``-row history forked ``forks`` times, each
    fork with ``suffix`` rows of its own: ``(cache, root chain, forks' chains)``."""
    layout = KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    pages = (prefix + forks * (suffix + page_size)) // page_size + 8
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=pages), device=device,
                         compaction=CompactionPolicy(enabled=False))
    fill_random(cache, generator)
    root = cache.new_chain()
    root.append(prefix)
    root.seal()
    chains = [root.fork() for _ in range(forks)]
    for chain in chains:
        if suffix:
            chain.append(suffix)
    return cache, root, chains


def cascade_speedup_bound(no_sharing_ms: float, unique_bytes: int, bandwidth: float) -> float:
    """The most a cascade can gain over the unshared batch (``no_sharing_ms``) if it reads its
    ``unique_bytes`` of distinct K/V once at ``bandwidth`` (bytes/s, the copy rate of the same run)
    and nothing else costs time. The unshared batch reads the same pages, which L2 serves in part,
    so on a card whose memory is slow beside its L2 this bound can fall below a target ratio."""
    if unique_bytes <= 0 or bandwidth <= 0:
        raise ValueError(f"unique_bytes and bandwidth must be positive, got {unique_bytes} and {bandwidth}")
    return no_sharing_ms * 1e-3 * bandwidth / unique_bytes


def bench_cascade(*, shape_name: str, forks: int, prefix: int, suffix: int, page_size: int, dtype, trials: int,
                  bandwidth: float, seed: int = 0, partition_caps: tuple[int, ...] = ()) -> dict:
    """``forks`` sequences sharing a ``prefix``-row history, each with ``suffix`` rows of its own:
    the planner's cascade plan against the same batch planned without sharing (split; the forks
    still read the same pages, so L2 serves some of the repeated reads), against ``forks``
    sequences that each hold their own copy of the history (``own_copies``, split: what a cache
    without shared pages reads), and the cascade plan of the prefix seen as 30 sealed segments
    (``cascade_segments30``).
    ``partition_caps``: also the cascade planned with at most that many partitions per run
    (variants ``cascade_max<N>``), to see how the prefix's split pays."""
    device = "cuda"
    q_heads, kv_heads, head_dim = SHAPES[shape_name]
    gen = torch.Generator(device=device).manual_seed(seed)
    cache, root, chains = forked_prefix(kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, forks=forks, prefix=prefix,
                                        suffix=suffix, page_size=page_size, generator=gen, device=device)
    queries = [SequenceQuery.from_chain(c, 1) for c in chains]
    shape = AttentionShape(q_heads, kv_heads, head_dim, head_dim)
    spec = DeviceSpec.cuda()
    backend = TritonBackend(page_size=page_size, device=device)
    kc, vc = cache.storage.key_cache(0), cache.storage.value_cache(0)
    q = torch.randn(forks, q_heads, head_dim, device=device, dtype=dtype, generator=gen)
    # the same shared prefix as a history sealed in 30 segments (turn by turn), then forked
    prefix_spans = regroup(SequenceQuery.from_chain(root, 1), 30, page_size, 10_000).spans
    sealed_turns = [SequenceQuery(prefix_spans + q.spans[1:], 1) for q in queries]
    plans = {"cascade": plan_attention(queries, shape, spec, page_size=page_size),
             "no_sharing": plan_attention(queries, shape, spec, page_size=page_size, route="split"),
             "cascade_segments30": plan_attention(sealed_turns, shape, spec, page_size=page_size)}
    for cap in partition_caps:
        plans[f"cascade_max{cap}"] = plan_attention(queries, shape, dataclasses.replace(spec, max_partitions=cap),
                                                    page_size=page_size)
    prepared = {name: backend.prepare(plan) for name, plan in plans.items()}
    timers = {name: Timer.capture([lambda p=p: backend.run(p, q, kc, vc, scale=head_dim**-0.5)])
              for name, p in prepared.items()}
    # the same batch where every sequence holds its own copy of the history
    own_pages = forks * -(-(prefix + suffix) // page_size) + 8
    copies = PagedKVCache(cache.layout, CacheConfig(page_size=page_size, num_pages=own_pages), device=device,
                          compaction=CompactionPolicy(enabled=False))
    fill_random(copies, gen)
    own = [copies.new_chain() for _ in range(forks)]
    for chain in own:
        chain.append(prefix + suffix)
    own_plan = plan_attention([SequenceQuery.from_chain(c, 1) for c in own], shape, spec, page_size=page_size,
                              route="split")
    plans["own_copies"] = own_plan
    own_prepared = backend.prepare(own_plan)
    ck, cv = copies.storage.key_cache(0), copies.storage.value_cache(0)
    timers["own_copies"] = Timer.capture([lambda: backend.run(own_prepared, q, ck, cv, scale=head_dim**-0.5)])
    samples = run_trials(timers, trials)
    element = torch.empty((), dtype=dtype).element_size()
    unique = 2 * (prefix + forks * suffix) * kv_heads * head_dim * element
    # GB/s of the unique K/V, except own_copies: what it reads (every fork's whole history)
    read = {"own_copies": 2 * forks * (prefix + suffix) * kv_heads * head_dim * element}
    result = {"shape": shape_name, "forks": forks, "prefix": prefix, "suffix": suffix, "page_size": page_size,
              "dtype": str(dtype).replace("torch.", ""), "plans": {n: p.describe() for n, p in plans.items()},
              "variants": {name: time_summary(t, read.get(name, unique), bandwidth) for name, t in samples.items()}}
    result["speedup"] = result["variants"]["no_sharing"]["median_ms"] / result["variants"]["cascade"]["median_ms"]
    result["speedup_vs_own_copies"] = (result["variants"]["own_copies"]["median_ms"]
                                       / result["variants"]["cascade"]["median_ms"])
    result["unique_bytes"] = unique
    result["speedup_bound"] = cascade_speedup_bound(result["variants"]["no_sharing"]["median_ms"], unique, bandwidth)
    for chain in (*chains, root, *own):
        chain.release()
    return result


def tune(*, dtype, trials: int, bandwidth: float, cases: list[tuple[int, int]], launch, page_size: int = 16,
         shape_name: str = "llama3-8b") -> list[dict]:
    """Partition-count sweep of the split route at one launch configuration (one model shape;
    ``launch`` None: the kernels' defaults), in the cache's token-major page layout and a
    head-major one (``(page, head, row, dim)``). One configuration per process: a faulting
    configuration cannot spoil the others."""
    from segkv.kernels.attention.paged_attention import default_launch_config

    device = "cuda"
    q_heads, kv_heads, head_dim = SHAPES[shape_name]
    launch = launch or default_launch_config(head_dim=head_dim)
    shape = AttentionShape(q_heads, kv_heads, head_dim, head_dim)
    spec = DeviceSpec.cuda()
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for batch, context in cases:
        pages_per_seq = -(-context // page_size)
        layout = KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
        cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=batch * pages_per_seq + 1),
                             device=device, compaction=CompactionPolicy(enabled=False))
        fill_random(cache, gen)
        chains = [cache.new_chain() for _ in range(batch)]
        for chain in chains:
            chain.append(context)
        queries = [SequenceQuery.from_chain(c, 1) for c in chains]
        q = torch.randn(batch, q_heads, head_dim, device=device, dtype=dtype, generator=gen)
        token_major = (cache.storage.key_cache(0), cache.storage.value_cache(0))
        head_major = tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in token_major)
        kv_bytes = 2 * batch * context * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        auto = plan_attention(queries, shape, spec, page_size=page_size)
        backend = TritonBackend(page_size=page_size, device=device, launch=launch)
        timers = {}
        for parts in sorted({1, 2, 4, 8, 12, 16, 24, 32, 33, 48, 66, 132, 264, 528, 1056, auto.num_partitions}):
            if parts * page_size * 4 > context:
                continue
            plan = plan_attention(queries, shape, spec, page_size=page_size, route="split", num_partitions=parts)
            prepared = backend.prepare(plan)
            for layout_name, (kc, vc) in (("token", token_major), ("head", head_major)):
                key = f"p{parts}_{layout_name}"
                timers[key] = Timer.capture([lambda p=prepared, kc=kc, vc=vc: backend.run(p, q, kc, vc, scale=0.088)])
        samples = run_trials(timers, trials)
        results = {k: time_summary(t, kv_bytes, bandwidth) for k, t in samples.items()}
        rows.append({"batch": batch, "context": context, "launch": [launch.block_n, launch.num_warps,
                     launch.num_stages], "auto_partitions": auto.num_partitions, "results": results})
        print(f"tune {shape_name} n{launch.block_n}_w{launch.num_warps}_s{launch.num_stages} B={batch} ctx={context} "
              f"auto x{auto.num_partitions}: "
              + " ".join(f"{k}={v['median_ms']:.4f}({v['fraction_of_bandwidth']:.0%})" for k, v in results.items()),
              flush=True)
        del timers, token_major, head_major
        for chain in chains:
            chain.release()
        del cache
        torch.cuda.empty_cache()
    return rows


def graph_calls_text(calls_per_graph: int) -> str:
    """How a timing graph is filled, in words (0: one pass over the data copies)."""
    if calls_per_graph:
        return f"at least {calls_per_graph} calls per timing graph"
    return "one pass over the data copies per timing graph"


def markdown_tables(report: dict) -> str:
    """The report as markdown: one row per case (planner's plan, segkv and best stock SDPA times,
    their ratio, fraction of bandwidth, segments variants), then the cascade comparison."""
    lines = [f"Device: {report['device']}; copy bandwidth {report['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; "
             f"{report['dtype']}; {report['trials']} trials; "
             f"{graph_calls_text(report.get('calls_per_graph', 0))}, "
             f"attention PDL {'on' if report.get('attention_pdl', True) else 'off'}; times are "
             "medians in ms [min-max].", "",
             "| shape | page | batch | context | plan | segkv auto | % bw | best SDPA | SDPA/segkv | "
             "segments 2 / 8 / 30 ÷ auto | auto over 8 segments ÷ auto | single |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.get("rows", []):
        v = r["variants"]
        stock_name, stock = min(((n, x) for n, x in v.items() if n.startswith("sdpa_")),
                                key=lambda item: item[1]["median_ms"])
        auto = v["auto"]
        plan = r["plans"]["auto"]
        segs = " / ".join(f"{v[f'segments{n}']['median_ms'] / auto['median_ms']:.3f}" for n in (2, 8, 30)
                          if f"segments{n}" in v)
        auto8 = (f"{v['auto_segments8']['median_ms'] / auto['median_ms']:.3f}" if "auto_segments8" in v
                 else "-")
        lines.append(
            f"| {r['shape']} | {r['page_size']} | {r['batch']} | {r['context'] // 1024}K | "
            f"{plan['route']} ×{plan['max_partitions']} | {auto['median_ms']:.4f} "
            f"[{auto['min_ms']:.4f}-{auto['max_ms']:.4f}] | {auto['fraction_of_bandwidth']:.0%} | "
            f"{stock['median_ms']:.4f} ({stock_name[5:]}) | {stock['median_ms'] / auto['median_ms']:.2f} | {segs} | "
            f"{auto8} | {v['single']['median_ms']:.4f} |")
    cascade = report.get("cascade")
    if cascade:
        v = cascade["variants"]
        lines += ["", f"Cascade: {cascade['forks']} forks of a {cascade['prefix'] // 1024}K prefix, "
                  f"{cascade['suffix']} own rows each ({cascade['shape']}, page {cascade['page_size']}): "
                  f"cascade {v['cascade']['median_ms']:.4f} ms ({cascade['plans']['cascade']['max_partitions']} "
                  f"partitions of the prefix), no sharing {v['no_sharing']['median_ms']:.4f} ms, "
                  f"**{cascade['speedup']:.1f}×**; every fork with its own copy of the history "
                  f"{v['own_copies']['median_ms']:.4f} ms, {cascade['speedup_vs_own_copies']:.1f}×."]
        if "speedup_bound" in cascade:  # reports from before the bound was recorded have none
            lines[-1] += (f" Reading its {cascade['unique_bytes'] / 1e6:.1f} MB of distinct K/V once at the copy rate "
                          f"bounds the cascade to {cascade['speedup_bound']:.1f}× the unshared batch; it runs at "
                          f"{v['cascade']['fraction_of_bandwidth']:.0%} of the copy rate.")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    global CALLS_PER_GRAPH  # --calls-per-graph sets the timers' default
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama3-8b,llama3-70b")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--contexts", default="4096,16384,32768,65536,131072")
    parser.add_argument("--page-sizes", default="16,32")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--max-kv-gib", type=float, default=33.0)
    parser.add_argument("--no-cascade", action="store_true")
    parser.add_argument("--head-major", action="store_true", help="also the planner's plan over head-major pages")
    parser.add_argument("--cascade-caps", default="", help="also the cascade with at most N partitions per run, "
                        "e.g. 8,17,33")
    parser.add_argument("--cascade-only", action="store_true", help="only the cascade comparison")
    parser.add_argument("--cascade-shape", default="llama3-8b", choices=sorted(SHAPES),
                        help="the cascade's model shape (default %(default)s)")
    parser.add_argument("--cascade-page-size", type=int, default=16, help="the cascade's page size (default 16)")
    parser.add_argument("--tune", default="", help="instead: sweep partition counts on BxCTX cases, e.g. 1x131072 "
                        "(the first of --shapes)")
    parser.add_argument("--launch", default="", help="with --tune: BLOCK_N,WARPS,STAGES (default: the kernels' "
                        "defaults); the page size is the first of --page-sizes")
    parser.add_argument("--calls-per-graph", type=int, default=CALLS_PER_GRAPH,
                        help="each timing graph holds at least this many calls (default %(default)s: one pass "
                        "over the data copies)")
    parser.add_argument("--pdl", type=int, choices=(0, 1), default=None,
                        help="attention PDL on or off for the timed calls (default: on where the device has it); "
                        "in a graph of several calls PDL chains them")
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None, metavar="REPORT_JSON",
                        help="print the tables of an earlier --json report and exit (no GPU needed)")
    args = parser.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown_tables(json.load(f)))
        return 0
    if args.calls_per_graph < 0:
        parser.error("--calls-per-graph must be 0 or more")
    CALLS_PER_GRAPH = args.calls_per_graph
    from segkv.kernels.attention import paged_attention

    if args.pdl is not None:
        paged_attention.ATTENTION_PDL = bool(args.pdl)  # read at each launch (attention_pdl_options)
    dtype = getattr(torch, args.dtype)
    random.seed(0)
    bandwidth = measured_read_bandwidth()
    device_name = torch.cuda.get_device_name()
    print(f"device {device_name}; measured copy bandwidth {bandwidth / 1e12:.2f} TB/s (bytes read + written); "
          f"fractions below are of this rate; {graph_calls_text(CALLS_PER_GRAPH)}, attention PDL "
          f"{'on' if paged_attention.ATTENTION_PDL else 'off'}", flush=True)
    report = {"device": device_name, "bandwidth_bytes_per_s": bandwidth, "torch": torch.__version__,
              "dtype": args.dtype, "trials": args.trials, "calls_per_graph": CALLS_PER_GRAPH,
              "attention_pdl": paged_attention.ATTENTION_PDL}
    if args.tune:
        cases = [tuple(int(x) for x in c.split("x")) for c in args.tune.split(",")]
        from segkv.kernels.attention.paged_attention import LaunchConfig

        launch = LaunchConfig(*_ints(args.launch)) if args.launch else None
        report["tune"] = tune(dtype=dtype, trials=args.trials, bandwidth=bandwidth, cases=cases, launch=launch,
                              page_size=_ints(args.page_sizes)[0], shape_name=args.shapes.split(",")[0])
    else:
        rows = []
        started = time.time()
        for shape_name in ([] if args.cascade_only else args.shapes.split(",")):
            for page_size in _ints(args.page_sizes):
                for batch in _ints(args.batches):
                    for context in _ints(args.contexts):
                        q_heads, kv_heads, head_dim = SHAPES[shape_name]
                        if 2 * batch * context * kv_heads * head_dim * 2 / 2**30 > args.max_kv_gib:
                            continue
                        r = bench_case(shape_name=shape_name, batch=batch, context=context, page_size=page_size,
                                       dtype=dtype, trials=args.trials, bandwidth=bandwidth,
                                       head_major=args.head_major)
                        rows.append(r)
                        _print_row(r, time.time() - started)
                        torch.cuda.empty_cache()
        report["rows"] = rows
        if not args.no_cascade:
            cascade = bench_cascade(shape_name=args.cascade_shape, forks=16, prefix=32768, suffix=512,
                                    page_size=args.cascade_page_size,
                                    partition_caps=tuple(_ints(args.cascade_caps)) if args.cascade_caps else (),
                                    dtype=dtype, trials=args.trials, bandwidth=bandwidth)
            report["cascade"] = cascade
            v = cascade["variants"]
            print(f"cascade {args.cascade_shape} p{args.cascade_page_size} 16 forks x 32K prefix + 512: "
                  f"cascade {v['cascade']['median_ms']:.3f} ms, "
                  f"no sharing {v['no_sharing']['median_ms']:.3f} ms, speedup {cascade['speedup']:.1f}x; "
                  f"own copies {v['own_copies']['median_ms']:.3f} ms, {cascade['speedup_vs_own_copies']:.1f}x; "
                  f"bound from its bytes at the copy rate {cascade['speedup_bound']:.1f}x "
                  f"(the cascade at {v['cascade']['fraction_of_bandwidth']:.0%} of it)", flush=True)
            for name, plan in cascade["plans"].items():
                print(f"  {name}: {v[name]['median_ms']:.4f} ms, {plan['reason']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _print_row(r: dict, elapsed: float) -> None:
    v = r["variants"]
    stock = min((x["median_ms"] for n, x in v.items() if n.startswith("sdpa_")), default=float("nan"))
    auto = r["plans"]["auto"]
    print(f"[{elapsed:5.0f}s] {r['shape']} p{r['page_size']} B={r['batch']:2d} ctx={r['context']:6d} "
          f"plan={auto['route']}x{auto['max_partitions']} best_sdpa={stock:.4f}ms "
          + " ".join(f"{n}={x['median_ms']:.4f}({x['fraction_of_bandwidth']:.0%})" for n, x in v.items())
          + (f" errors={list(r['errors'])}" if r["errors"] else ""), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
