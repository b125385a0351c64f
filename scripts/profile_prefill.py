"""Where a prefill chunk's time goes: one chunk of new tokens over a long history (GPU machine).

A Qwen3-8B-shape model cut to ``--layers`` layers (random bf16 weights), a chain holding
``--history`` rows, then ``--chunk`` new tokens through ``ModelRunner.forward`` (eager, as a
prefill runs): wall time per chunk (median [min-max] of 5), the attention FLOPs per second that
implies next to torch SDPA on contiguous tensors of the same shape in the same run, and a
``torch.profiler`` table of one chunk's kernels by CUDA time.
Usage: ``python3 scripts/profile_prefill.py --history 16384 --chunk 512,2048 --precisions exact,fast``
(``--chunk`` sizes and ``--precisions`` modes each timed in one process; the profile is of the last).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn.functional as F

from benchmarks.decode_e2e import build_runner, build_segkv, model_config
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy
from segkv.runner.model_runner import StepInput
import segkv.settings as settings

from profile_decode import median_ms  # scripts/ is on the path when a script runs


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--history", type=int, default=16384)
    p.add_argument("--chunk", default="512", help="comma-separated chunk sizes (the runner's prefill_chunk)")
    p.add_argument("--precisions", default="auto", help="comma-separated attention precision modes (auto, exact, fast)")
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--rows", type=int, default=20, help="rows of the profiler table (0: no profile)")
    args = p.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    cfg = {**model_config(args.model), "num_hidden_layers": args.layers}
    model, _ = build_segkv(cfg, device=device, dtype=dtype)
    page = args.page_size
    sizes = [int(c) for c in args.chunk.split(",")]
    cache = PagedKVCache(model.kv_layout(dtype), CacheConfig(page_size=page, num_pages=(args.history + max(sizes)) // page + 4),
                         device=device, compaction=CompactionPolicy(enabled=False))
    chain = cache.new_chain()
    chain.append(args.history)
    runner, _ = build_runner(model, cache, device, graphs="off")
    heads, dim = cfg["num_attention_heads"], cfg.get("head_dim", 128)
    for size in sizes:
        runner.prefill_chunk = size  # one forward per chunk
        tokens = torch.randint(0, cfg["vocab_size"], (size,)).tolist()

        def chunk() -> None:
            runner.forward([StepInput(chain, tokens)])
            chain.trim(size)

        for precision in args.precisions.split(","):
            settings.SETTINGS = dataclasses.replace(settings.SETTINGS, attention_precision=precision)
            chunk()
            med, lo, hi = median_ms(chunk, 5)
            flops = 4 * size * (args.history + size / 2) * heads * dim * args.layers  # causal chunk
            print(f"{args.model} x {args.layers} layers, history {args.history}, chunk {size}, precision {precision}, "
                  f"plan {runner.last_plan.describe()}")
            print(f"chunk {size} {precision}: {med:.2f} ms [{lo:.2f}-{hi:.2f}] = {med / size * 1000:.1f} ms per 1K tokens; "
                  f"attention at most {flops / med / 1e9:.1f} TFLOP/s (if it took the whole chunk)", flush=True)
    size = sizes[-1]
    q = torch.randn(1, heads, size, dim, device=device, dtype=dtype)
    k = torch.randn(1, heads, args.history + size, dim, device=device, dtype=dtype)
    sdpa = median_ms(lambda: [F.scaled_dot_product_attention(q, k, k) for _ in range(args.layers)], 5)
    sdpa_flops = 4 * size * (args.history + size) * heads * dim * args.layers  # no mask: all rows
    print(f"torch SDPA, chunk {size}'s shapes, no mask: {sdpa[0]:.2f} ms = {sdpa_flops / sdpa[0] / 1e9:.1f} TFLOP/s")
    if args.rows <= 0:
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        chunk()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
