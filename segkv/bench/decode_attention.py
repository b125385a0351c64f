"""Decode attention benchmark: segkv's Triton routes (single, split) against torch's stock SDPA.

Same tensors for every variant; shuffled trials; median with min/max; achieved GB/s (KV bytes
read once per step) and the fraction of the measured device-to-device read bandwidth.
Run on a CUDA device: ``python -m segkv.bench.decode_attention``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

import torch
import torch.nn.functional as F

from segkv.attention import AttentionShape, DeviceSpec, SequenceQuery, plan_attention
from segkv.attention.triton_backend import TritonBackend
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, KVLayout


def measured_read_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read and written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3)


def time_call(fn, *, iters: int) -> float:
    """Median milliseconds of ``iters`` calls timed with CUDA events (after warm-up)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_case(*, batch: int, context: int, q_heads: int, kv_heads: int, head_dim: int, dtype, page_size: int,
               trials: int, iters: int, bandwidth: float) -> dict:
    device = "cuda"
    layout = KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    pages = batch * (-(-context // page_size)) + 8
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=pages), device=device)
    chains = []
    for _ in range(batch):
        chain = cache.new_chain()
        slots = torch.tensor(chain.append(context), device=device)
        for start in range(0, context, 16384):
            part = slots[start:start + 16384]
            kv = torch.randn(2, part.numel(), kv_heads, head_dim, device=device, dtype=dtype)
            cache.storage.write(0, part, kv[0], kv[1])
        chains.append(chain)
    queries = [SequenceQuery.from_chain(c, 1) for c in chains]
    shape = AttentionShape(q_heads, kv_heads, head_dim, head_dim)
    spec = DeviceSpec.cuda()
    q = torch.randn(batch, q_heads, head_dim, device=device, dtype=dtype)
    backend = TritonBackend(page_size=page_size, device=device)
    kc, vc = cache.storage.key_cache(0), cache.storage.value_cache(0)
    plans = {
        "auto": plan_attention(queries, shape, spec, page_size=page_size),
        "single": plan_attention(queries, shape, spec, page_size=page_size, route="single"),
    }
    auto = plans["auto"]
    if auto.route.value != "split":  # measure split anyway, at the count the planner would use at batch 1
        plans["split"] = plan_attention(queries, shape, spec, page_size=page_size, route="split",
                                        num_partitions=max(2, spec.wave_size // max(1, batch * kv_heads)))
    prepared = {name: backend.prepare(plan) for name, plan in plans.items()}
    # stock: SDPA over a contiguous copy of the same K/V (batch, heads, context, dim)
    kd = torch.stack([kc.flatten(0, 1)[torch.tensor(c.slots(), device=device)] for c in chains]).transpose(1, 2)
    vd = torch.stack([vc.flatten(0, 1)[torch.tensor(c.slots(), device=device)] for c in chains]).transpose(1, 2)
    qd = q.unsqueeze(2)  # (batch, heads, 1, dim)
    variants = {name: (lambda p=p: backend.run(p, q, kc, vc, scale=head_dim**-0.5)) for name, p in prepared.items()}
    variants["torch_sdpa"] = lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)
    samples = {name: [] for name in variants}
    for _ in range(trials):
        order = list(variants)
        random.shuffle(order)
        for name in order:
            samples[name].append(time_call(variants[name], iters=iters))
    kv_bytes = 2 * batch * context * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    result = {"batch": batch, "context": context, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim,
              "dtype": str(dtype).replace("torch.", ""), "page_size": page_size,
              "planner_route": auto.route.value, "planner_partitions": auto.num_partitions, "variants": {}}
    for name, times in samples.items():
        med = statistics.median(times)
        result["variants"][name] = {"median_ms": med, "min_ms": min(times), "max_ms": max(times),
                                    "gbps": kv_bytes / (med / 1e3) / 1e9,
                                    "fraction_of_bandwidth": kv_bytes / (med / 1e3) / bandwidth}
    for chain in chains:
        chain.release()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="2048,8192,32768,131072")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--max-kv-gib", type=float, default=40.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    bandwidth = measured_read_bandwidth("cuda")
    print(f"device {torch.cuda.get_device_name()}; measured bandwidth {bandwidth / 1e12:.2f} TB/s "
          "(a device-to-device copy, bytes read + written); fractions below are of this rate")
    rows = []
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            kv_gib = 2 * batch * context * args.kv_heads * args.head_dim * 2 / 2**30
            if kv_gib > args.max_kv_gib:
                continue
            r = bench_case(batch=batch, context=context, q_heads=args.q_heads, kv_heads=args.kv_heads,
                           head_dim=args.head_dim, dtype=dtype, page_size=args.page_size, trials=args.trials,
                           iters=args.iters, bandwidth=bandwidth)
            rows.append(r)
            v = r["variants"]
            print(f"B={batch:3d} ctx={context:6d} plan={r['planner_route']}x{r['planner_partitions']:<3d} "
                  + "  ".join(f"{n}={x['median_ms']:.3f}ms({x['fraction_of_bandwidth']:.0%})" for n, x in v.items()),
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "bandwidth_bytes_per_s": bandwidth, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
