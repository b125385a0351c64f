"""Whole-model prefill: first-turn time to first token, and prefill tokens/s of concurrent prompts,
segkv against Hugging Face ``transformers`` (sdpa attention), both on one set of random weights.

For each model (published shapes, ``benchmarks.decode_e2e.MODELS``; bf16) the transformers model
is built with its own random initialisation and segkv's model views the same tensors (no second
copy). Then:

- **First turn**: a prompt of ``L`` random token ids for each ``--lengths`` entry. segkv: one
  ``ModelRunner.forward`` on a new chain (chunks of ``--prefill-chunk`` rows, the planner's plans,
  its automatic precision unless ``SEGKV_ATTENTION_PRECISION`` forces one), until the last row's
  logits are on the host. transformers: one forward of the whole prompt with a ``DynamicCache``
  and the last position's logits only (``logits_to_keep=1``), until its logits are on the host.
  Each figure is the median of ``--runs`` after a warm-up run, with min and max.
- **Concurrent prompts**: ``--batch`` prompts of ``--batch-len`` tokens each. segkv: one forward of
  all of them (each chunked as above); transformers: one batched forward (same lengths, no
  padding). Prefill tokens/s at the median.

A case that runs out of memory on one side is reported as such; the other side's figure stays.
Run on a CUDA device: ``python -m benchmarks.prefill_e2e --help``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.decode_e2e import build_runner, build_segkv, model_config
from benchmarks.hf_baseline import build_hf
from benchmarks.runs import release, sync
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy
from segkv.runner.model_runner import StepInput


def timed_runs(fn, runs: int, device) -> dict:
    """``fn`` once to warm up, then ``runs`` times: median / min / max seconds."""
    fn()
    times = []
    for _ in range(runs):
        sync(device)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def guarded(fn) -> dict:
    """``fn()``'s result, or ``{"error": ...}`` when it ran out of memory."""
    try:
        return fn()
    except torch.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        return {"error": f"out of memory: {str(exc).splitlines()[0][:120]}"}


def segkv_prefill(runner, cache: PagedKVCache, prompts: list[list[int]]) -> None:
    """One forward of ``prompts`` on new chains, the last rows' logits read by the host."""
    chains = [cache.new_chain() for _ in prompts]
    try:
        logits = runner.forward([StepInput(c, p) for c, p in zip(chains, prompts)])
        logits.argmax(-1).tolist()
    finally:
        for chain in chains:
            chain.release()


@torch.inference_mode()
def hf_prefill(hf, prompts: list[list[int]], device) -> None:
    """One batched forward of equal-length ``prompts`` filling a new cache (the model's default,
    a dynamic cache), the last position's logits read."""
    ids = torch.tensor(prompts, device=device)
    out = hf(ids, use_cache=True, logits_to_keep=1)
    out.logits[:, -1].argmax(-1).tolist()


def run_model(name: str, args, device) -> dict:
    cfg = model_config(name, args.preset)
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], max(args.lengths) + 64)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf = build_hf(cfg, device=device, dtype=dtype)
    model, _ = build_segkv(cfg, device=device, dtype=dtype, hf_state=hf.state_dict(keep_vars=True))
    page = 32
    rows = max(max(args.lengths), args.batch * args.batch_len)
    cache = PagedKVCache(model.kv_layout(dtype), CacheConfig(page_size=page, num_pages=rows // page + args.batch + 8),
                         device=device, compaction=CompactionPolicy(enabled=False))
    runner, _ = build_runner(model, cache, device, graphs="off")
    runner.prefill_chunk = args.prefill_chunk
    gen = torch.Generator().manual_seed(args.seed)
    result = {"model": name, "prefill_chunk": args.prefill_chunk, "first_turn": [], "concurrent": None}
    for length in args.lengths:
        prompt = torch.randint(0, cfg["vocab_size"], (length,), generator=gen).tolist()
        ours = guarded(lambda: timed_runs(lambda: segkv_prefill(runner, cache, [prompt]), args.runs, device))
        plan = runner.last_plan.describe() if runner.last_plan is not None else None
        theirs = (guarded(lambda: timed_runs(lambda: hf_prefill(hf, [prompt], device), args.runs, device))
                  if not args.skip_hf else {"error": "skipped"})
        row = {"length": length, "segkv": ours, "transformers": theirs, "plan": plan}
        if "median_s" in ours and "median_s" in theirs:
            row["ratio"] = ours["median_s"] / theirs["median_s"]
        result["first_turn"].append(row)
        print(f"{name} first turn {length:>6}: segkv {_ms(ours)}  transformers {_ms(theirs)}  "
              f"ratio {row.get('ratio', float('nan')):.2f}  plan {plan}", flush=True)
    if args.batch:
        prompts = [torch.randint(0, cfg["vocab_size"], (args.batch_len,), generator=gen).tolist()
                   for _ in range(args.batch)]
        tokens = args.batch * args.batch_len
        ours = guarded(lambda: timed_runs(lambda: segkv_prefill(runner, cache, prompts), args.runs, device))
        theirs = (guarded(lambda: timed_runs(lambda: hf_prefill(hf, prompts, device), args.runs, device))
                  if not args.skip_hf else {"error": "skipped"})
        for side in (ours, theirs):
            if "median_s" in side:
                side["tokens_per_s"] = tokens / side["median_s"]
        result["concurrent"] = {"batch": args.batch, "length": args.batch_len, "segkv": ours, "transformers": theirs}
        print(f"{name} {args.batch} x {args.batch_len}: segkv {ours.get('tokens_per_s', 0):.0f} tok/s  "
              f"transformers {theirs.get('tokens_per_s', 0):.0f} tok/s", flush=True)
    return result


def _ms(side: dict) -> str:
    if "median_s" not in side:
        return side.get("error", "?")
    return f"{side['median_s'] * 1e3:.0f} ms [{side['min_s'] * 1e3:.0f}-{side['max_s'] * 1e3:.0f}]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen3-8b,llama-3.1-8b,deepseek-v2-lite")
    p.add_argument("--lengths", default="4096,20000,50000", help="first-turn prompt lengths")
    p.add_argument("--batch", type=int, default=16, help="concurrent prompts (0: skip)")
    p.add_argument("--batch-len", type=int, default=2048)
    p.add_argument("--prefill-chunk", type=int, default=2048, help="the runner's prefill chunk")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", choices=("real", "tiny"), default="real", help="tiny: the families' small shapes (CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    report = {"device": name, "torch": torch.__version__, "models": []}
    for name in args.models.split(","):
        report["models"].append(run_model(name, args, device))
        release(device)  # the model's weights and cache, dropped with run_model's frame
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
