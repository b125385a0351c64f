"""Prefill attention benchmark: a chunk of query rows over a long paged history, segkv's prefill
programs against torch's stock SDPA backends, in TFLOP/s.

For each (history, chunk) one sequence holds ``history + chunk`` rows in a paged cache (random
K/V); its last ``chunk`` rows are the query, causal among themselves and seeing the whole history.
segkv runs the planner's plan for that query (what the engine runs for a prefill chunk) in each
precision mode (``exact``, ``fast``) and each launch of ``--launches`` (prefill programs' pairs x
warps x key rows per tile). Stock SDPA attends contiguous copies (K/V repeated to the query heads):
flash and memory-efficient with the causal mask aligned to the last key (``causal_lower_right``),
cuDNN without a mask over every key (it takes no such mask), each counted for the work it does.
FLOPs count the causal work once: ``4 x heads x dim x (chunk x history + chunk (chunk + 1) / 2)``.
A history of 0 is a whole first turn attended in one chunk (every backend then runs causal).

Every variant is captured in a CUDA graph; trials run the variants in shuffled order; each figure
is the median per call over the trials with min and max.

Run on a CUDA device: ``python -m benchmarks.prefill_attention --help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch
import torch.nn.functional as F

from benchmarks.decode_attention import SHAPES, Timer, fill_random, run_trials
from segkv.attention import AttentionShape, DeviceSpec, SequenceQuery, plan_attention
from segkv.attention.triton_backend import TritonBackend
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, KVLayout
from segkv.kernels.attention.paged_attention import default_launch_config

SDPA_BACKENDS = ("flash", "cudnn", "efficient")


def causal_flops(heads: int, dim: int, chunk: int, history: int) -> float:
    """FLOPs of a causal chunk over a history, each visible (row, key) pair counted once (QK and PV)."""
    return 4.0 * heads * dim * (chunk * history + chunk * (chunk + 1) / 2)


def parse_launch(text: str):
    """``PAIRSxWARPSxKEYS[xSTAGES]`` (e.g. ``128x8x64`` or ``128x8x128x2``) -> the default launch
    with those prefill fields (and that many pipeline stages)."""
    pairs, warps, keys, *stages = (int(x) for x in text.split("x"))
    launch = dataclasses.replace(default_launch_config(head_dim=128), prefill_block_m=pairs, prefill_warps=warps,
                                 prefill_block_n=keys)
    return dataclasses.replace(launch, num_stages=stages[0]) if stages else launch


def _sdpa(backend: str, q, k, v, chunk: int, keys: int):
    """A stock SDPA call on ``backend`` and the FLOPs it does (cuDNN: unmasked, every key)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
    heads, dim = q.shape[1], q.shape[3]
    if chunk == keys:  # a whole first turn: plain causal
        kwargs, flops = {"is_causal": True}, causal_flops(heads, dim, chunk, 0)
    elif backend == "cudnn":
        kwargs, flops = {}, 4.0 * heads * dim * chunk * keys
    else:
        kwargs, flops = {"attn_mask": causal_lower_right(chunk, keys)}, causal_flops(heads, dim, chunk, keys - chunk)

    def call():
        with sdpa_kernel([chosen]):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return call, flops


def bench_case(*, shape_name: str, history: int, chunk: int, page_size: int, dtype, trials: int, launches: list[str],
               precisions: list[str], sdpa=SDPA_BACKENDS, seed: int = 0) -> dict:
    device = "cuda"
    q_heads, kv_heads, dim = SHAPES[shape_name]
    total = history + chunk
    gen = torch.Generator(device=device).manual_seed(seed)
    layout = KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=dim, dtype=dtype)
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=-(-total // page_size) + 1),
                         device=device, compaction=CompactionPolicy(enabled=False))
    fill_random(cache, gen)
    chain = cache.new_chain()
    chain.append(total)
    shape = AttentionShape(q_heads, kv_heads, dim, dim)
    spec = DeviceSpec.cuda()
    q = torch.randn(chunk, q_heads, dim, device=device, dtype=dtype, generator=gen)
    kc, vc = cache.storage.key_cache(0), cache.storage.value_cache(0)
    scale = dim ** -0.5
    flops = causal_flops(q_heads, dim, chunk, history)
    fns, work, plans = {}, {}, {}
    query = SequenceQuery.from_chain(chain, chunk)
    for precision in precisions:
        plan = plan_attention([query], shape, spec, page_size=page_size, precision=precision)
        plans[precision] = plan.describe()
        for text in launches:
            backend = TritonBackend(page_size=page_size, device=device, launch=parse_launch(text))
            prepared = backend.prepare(plan)
            name = f"segkv_{precision}_{text}"
            fns[name] = lambda b=backend, p=prepared: b.run(p, q, kc, vc, scale=scale)
            work[name] = flops
    pages = torch.tensor([p for s in chain.spans() for p in s.page_ids], device=device)
    k, v = (t[pages].flatten(0, 1)[:total].transpose(0, 1).repeat_interleave(q_heads // kv_heads, 0)[None]
            for t in (kc, vc))
    qd = q.transpose(0, 1)[None]
    for name in sdpa:
        fns[f"sdpa_{name}"], work[f"sdpa_{name}"] = _sdpa(name, qd, k, v, chunk, total)
    timers, errors = {}, {}
    for name, fn in fns.items():
        try:
            timers[name] = Timer.capture([fn])
        except Exception as exc:  # a stock backend that does not run this shape
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    samples = run_trials(timers, trials)
    variants = {}
    for name, times in samples.items():
        med = statistics.median(times)
        variants[name] = {"median_ms": med, "min_ms": min(times), "max_ms": max(times),
                          "tflops": work[name] / (med / 1e3) / 1e12}
    chain.release()
    del timers, fns, k, v
    torch.cuda.empty_cache()
    return {"shape": shape_name, "history": history, "chunk": chunk, "page_size": page_size,
            "dtype": str(dtype).replace("torch.", ""), "plans": plans, "errors": errors, "variants": variants}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--histories", default="16384,32768,65536,131072")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--prompts", default="8192,32768", help="whole first turns attended in one chunk (history 0)")
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--launches", default="256x8x64", help="comma-separated PAIRSxWARPSxKEYS[xSTAGES] prefill launches")
    p.add_argument("--precisions", default="exact,fast")
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    props = torch.cuda.get_device_properties(0)
    cases = [(h, args.chunk) for h in _ints(args.histories)] + [(0, n) for n in _ints(args.prompts)]
    report = {"device": props.name, "torch": torch.__version__, "cases": []}
    for history, chunk in cases:
        row = bench_case(shape_name=args.shape, history=history, chunk=chunk, page_size=args.page_size,
                         dtype=torch.bfloat16, trials=args.trials, launches=args.launches.split(","),
                         precisions=args.precisions.split(","))
        report["cases"].append(row)
        best_sdpa = max((v["tflops"] for n, v in row["variants"].items() if n.startswith("sdpa")), default=0.0)
        for name, v in sorted(row["variants"].items()):
            ratio = v["tflops"] / best_sdpa if best_sdpa else float("nan")
            print(f"history {history:>6} chunk {chunk:>5} {name:<28} {v['median_ms']:8.3f} ms "
                  f"[{v['min_ms']:.3f}-{v['max_ms']:.3f}] {v['tflops']:6.1f} TFLOP/s  x{ratio:.2f} of best SDPA",
                  flush=True)
        for name, err in row["errors"].items():
            print(f"history {history:>6} chunk {chunk:>5} {name}: {err}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
