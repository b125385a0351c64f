"""The fixed cost of a batch-1 decode attention call, split: stage 1 alone, the merge alone, the
whole call, over partition counts and contexts (Llama-3-8B shape: 32 query heads, 8 KV heads,
head_dim 128, bf16). Each variant is a CUDA graph over enough copies of the KV that L2 stays cold
(as in ``benchmarks.decode_attention``); medians of ``--trials`` shuffled trials, in us.

A time that barely grows with the tiles each program scans is fixed cost: the plan's dependent
index loads, the pipeline's first tile, the partial's store, the merge launch. The floor of an
empty Triton launch of the same grid is printed for scale.

    python3 scripts/attention_floor.py --contexts 1024,4096,32768 --partitions 1,2,4,8,11,16,33,66
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
from unittest import mock

import torch
import triton
import triton.language as tl

from segkv.attention import AttentionShape, DeviceSpec, SequenceQuery, plan_attention
from segkv.attention.triton_backend import PlanCapacity, TritonBackend
from benchmarks.decode_attention import Timer, _fill_random
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, KVLayout
from segkv.kernels import paged_attention
import segkv.settings as settings


@triton.jit
def _empty_kernel(X):
    if tl.program_id(0) < 0:  # never: the launch alone
        tl.store(X, 0.0)


def bucket_work_items(spec, kv_heads: int) -> int:
    """Work items of a batch-1 graph bucket (this revision's rule, or the older one)."""
    try:
        from segkv.runner.cuda_graphs import max_graph_work_items
    except ImportError:
        return max(2 * spec.wave_size, 4)
    return max_graph_work_items(spec, 1, kv_heads=kv_heads, latent=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="1024,4096,32768")
    p.add_argument("--partitions", default="1,2,4,8,11,16,33,66")
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--flush-mb", type=int, default=0, help="write this many MB between calls (as a model's "
                   "weights do between two layers' attention): plan indices and queries come from DRAM; the "
                   "flush's own time (measured apart) is subtracted")
    p.add_argument("--capacity-work", default="", help="also each plan in fixed-size buffers of this many work "
                   "items (padding work items launch and exit), or 'bucket': a batch-1 CUDA-graph bucket's")
    p.add_argument("--launches", default="", help="also these stage-1 launches (BLOCK_N,WARPS,STAGES;...), "
                   "e.g. 64,4,4;128,4,3: each partition count's whole call once per launch")
    args = p.parse_args()
    device, dtype, page_size = "cuda", torch.bfloat16, args.page_size
    q_heads, kv_heads, head_dim = 32, 8, 128
    shape = AttentionShape(q_heads, kv_heads, head_dim, head_dim)
    spec = DeviceSpec.cuda()
    gen = torch.Generator(device=device).manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    x = torch.zeros(1, device=device)
    floor = Timer.capture([lambda: _empty_kernel[(264,)](x)] * 16)
    print(f"empty launch of 264 programs, 16 in a graph: {floor.ms() * 1e3:.2f} us each")
    flush = torch.empty(args.flush_mb * 2**20 // 4, device=device)
    flush_us = 0.0
    if args.flush_mb:
        flush_timer = Timer.capture([flush.zero_] * 16)
        flush_us = statistics.median(flush_timer.ms() * 1e3 for _ in range(args.trials))
        print(f"flush of {args.flush_mb} MB between calls: {flush_us:.2f} us, subtracted below")

    def flushed(calls: list) -> list:
        return [c for call in calls for c in (call, flush.zero_)] if args.flush_mb else calls

    for context in [int(c) for c in args.contexts.split(",")]:
        kv_bytes = 2 * context * kv_heads * head_dim * 2
        copies = max(1, min(32, math.ceil(4 * l2 / kv_bytes)))
        pages = -(-context // page_size)
        layout = KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
        cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=copies * pages + 1), device=device,
                             compaction=CompactionPolicy(enabled=False))
        _fill_random(cache, gen)
        kc, vc = cache.storage.key_cache(0), cache.storage.value_cache(0)
        backend = TritonBackend(page_size=page_size, device=device)
        chains = []
        for _ in range(copies):
            chains.append(cache.new_chain())
            chains[-1].append(context)
        queries = [[SequenceQuery.from_chain(c, 1)] for c in chains]
        qs = [torch.randn(1, q_heads, head_dim, device=device, dtype=dtype, generator=gen) for _ in chains]
        auto = plan_attention(queries[0], shape, spec, page_size=page_size)
        work = bucket_work_items(spec, kv_heads) if args.capacity_work == "bucket" else int(args.capacity_work or 0)
        timers, notes = {}, {}
        for parts in sorted({int(n) for n in args.partitions.split(",")} | {auto.num_partitions}):
            if parts > pages:
                continue
            prepared = [backend.prepare(plan_attention(qr, shape, spec, page_size=page_size, route="split",
                                                       num_partitions=parts)) for qr in queries]
            calls = [lambda p=pp, q=q: backend.run(p, q, kc, vc, scale=0.088) for pp, q in zip(prepared, qs)]
            timers[f"p{parts}_call"] = Timer.capture(flushed(calls))
            if args.capacity_work:
                extra = {"max_pieces": work} if "max_pieces" in PlanCapacity.__dataclass_fields__ else {}
                fixed = [TritonBackend(page_size=page_size, device=device, capacity=PlanCapacity(
                    max_pages=pages + 64, max_work=work, max_partials=work + 64, max_rows=1, max_work_rows=1,
                    **extra)) for _ in queries]
                fixed_prepared = [b.prepare(plan_attention(qr, shape, spec, page_size=page_size, route="split",
                                                           num_partitions=parts)) for b, qr in zip(fixed, queries)]
                timers[f"p{parts}_fixed{work}"] = Timer.capture(flushed(
                    [lambda b=b, p=pp, q=q: b.run(p, q, kc, vc, scale=0.088)
                     for b, pp, q in zip(fixed, fixed_prepared, qs)]))
            for launch in filter(None, args.launches.split(";")):
                block_n, warps, stages = launch.split(",")
                # as SEGKV_TRITON_BLOCK_N, _WARPS and _STAGES would (settings are read once, at import)
                with mock.patch.object(settings, "SETTINGS", dataclasses.replace(
                        settings.SETTINGS, triton_block_n=int(block_n), triton_warps=int(warps),
                        triton_stages=int(stages))):
                    timers[f"p{parts}_n{block_n}w{warps}s{stages}"] = Timer.capture(flushed(calls))
            notes[parts] = ("merge in stage 1" if prepared[0].merge_in_stage1 else
                            "merge kernel" if prepared[0].needs_merge else "no merge")
            if notes[parts] == "merge kernel":
                with mock.patch.object(paged_attention, "merge_into", lambda *a, **k: None):
                    timers[f"p{parts}_stage1"] = Timer.capture(flushed(calls))
                n = prepared[0].num_partials
                bufs = [(torch.empty(1, q_heads, head_dim, device=device, dtype=dtype),
                         torch.empty(1, q_heads, device=device),
                         torch.randn(n, q_heads, head_dim, device=device), torch.randn(n, q_heads, device=device))
                        for _ in prepared]
                timers[f"p{parts}_merge"] = Timer.capture(flushed(
                    [lambda b=b, pp=pp: paged_attention.merge_into(*b, pp.reduce_ptr, pp.reduce_partials)
                     for b, pp in zip(bufs, prepared)]))
        samples = {k: [] for k in timers}
        for _ in range(args.trials):
            order = list(timers)
            random.shuffle(order)
            for k in order:
                # a flushed timer's calls alternate with the flush: ms() is per half-pair
                samples[k].append(timers[k].ms() * 1e3 * (2 if args.flush_mb else 1) - flush_us)
        print(f"context {context} ({kv_bytes / 1e6:.1f} MB of KV, {copies} copies; planner: "
              f"{auto.num_partitions} partitions):")
        for parts, note in notes.items():
            row = [f"{key[len(f'p{parts}_'):]} {statistics.median(times):7.2f}" for key, times in samples.items()
                   if key.startswith(f"p{parts}_")]
            call = statistics.median(samples[f"p{parts}_call"])
            print(f"  {parts:4d} partitions ({-(-pages // parts) * page_size:6d} rows each, {note}): "
                  + ", ".join(row) + f" us; {kv_bytes / call / 1e6:.2f} TB/s")
        del timers, samples
        for c in chains:
            c.release()
        del cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
