"""Decode attention under a sliding window: a window of ``--window`` keys over a long history must
cost what a context of the window's length costs, since the plan leaves the pages before the
window out and the kernels start their scan at the window's page.

For each batch, three cases on the same kind of data (llama3-8b attention shape, bf16, the
planner's automatic plan, each captured in a CUDA graph, L2 cold as in
``benchmarks.decode_attention``):

- ``window``: ``--window`` keys over a ``--context``-key history (``plan_attention(window=)``);
- ``short``: a plain context of ``--window`` keys (the target: ``window`` / ``short`` about 1);
- ``whole``: the whole ``--context`` keys without a window (what a window saves).

Run on a CUDA device: ``python -m benchmarks.window_decode --help``.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.decode_attention import SHAPES, Timer, measured_read_bandwidth, random_cache, run_trials, time_summary
from segkv.attention import AttentionShape, DeviceSpec, SequenceQuery, plan_attention
from segkv.attention.triton_backend import TritonBackend


def case(*, shape_name: str, batch: int, context: int, window: int | None, read_rows: int, page_size: int,
         dtype, trials: int, bandwidth: float, seed: int = 0) -> dict:
    """Decode attention of ``batch`` sequences of ``context`` keys under ``window`` (None: no
    window), timed; ``read_rows`` keys per sequence are what the step must read (the bytes of
    the GB/s figure)."""
    device = "cuda"
    q_heads, kv_heads, head_dim = SHAPES[shape_name]
    gen = torch.Generator(device=device).manual_seed(seed)
    cache, copies, kv_bytes = random_cache(shape_name, batch=batch, context=context, read_rows=read_rows,
                                           page_size=page_size, dtype=dtype, generator=gen)
    shape, spec = AttentionShape(q_heads, kv_heads, head_dim, head_dim), DeviceSpec.cuda()
    backend = TritonBackend(page_size=page_size, device=device)
    kc, vc = cache.storage.key_cache(0), cache.storage.value_cache(0)
    calls, plan = [], None
    for _ in range(copies):
        chains = [cache.new_chain() for _ in range(batch)]
        for chain in chains:
            chain.append(context)
        queries = [SequenceQuery.from_chain(c, 1) for c in chains]
        plan = plan_attention(queries, shape, spec, page_size=page_size, window=window)
        prepared = backend.prepare(plan)
        q = torch.randn(batch, q_heads, head_dim, device=device, dtype=dtype, generator=gen)
        calls.append(lambda p=prepared, q=q: backend.run(p, q, kc, vc, scale=head_dim**-0.5))
    times = run_trials({"t": Timer.capture(calls)}, trials)["t"]
    return {"batch": batch, "context": context, "window": window, "l2_copies": copies, "plan": plan.describe(),
            **time_summary(times, kv_bytes, bandwidth)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--batches", default="1,16")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("window_decode times CUDA kernels: run it on a CUDA device")
    dtype, bandwidth = torch.bfloat16, measured_read_bandwidth()
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; shape {args.shape}, "
          f"bf16, page {args.page_size}")
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        common = dict(shape_name=args.shape, batch=batch, page_size=args.page_size, dtype=dtype, trials=args.trials,
                      bandwidth=bandwidth)
        cases = {"window": case(context=args.context, window=args.window, read_rows=args.window, **common),
                 "short": case(context=args.window, window=None, read_rows=args.window, **common),
                 "whole": case(context=args.context, window=None, read_rows=args.context, **common)}
        for name, r in cases.items():
            print(f"B={batch:3d} {name:6s} context {r['context']:7d} window {r['window']}: {r['median_ms']:.4f} ms "
                  f"[{r['min_ms']:.4f}-{r['max_ms']:.4f}] {r['gbps']:.0f} GB/s  plan {r['plan']['route']} "
                  f"x{r['plan']['max_partitions']}")
        ratio = cases["window"]["median_ms"] / cases["short"]["median_ms"]
        saved = cases["whole"]["median_ms"] / cases["window"]["median_ms"]
        print(f"B={batch:3d} window/short = {ratio:.2f}x (target about 1); whole/window = {saved:.1f}x")
        rows.append({"batch": batch, "cases": cases, "window_over_short": ratio, "whole_over_window": saved})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": args.shape, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
