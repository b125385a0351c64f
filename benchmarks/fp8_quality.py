"""Held-out perplexity of the built-in models with FP8 weights (``quantization="fp8"``) against
their bf16 weights: the quality half of FP8 serving.

Both sides run the engine's own forward (``ModelRunner.prompt_logits``) over the same windows of
the held-out files (``benchmarks.spec_decode.heldout_prompts``: the default models' test split),
each window on a fresh chain; perplexity = exp(mean next-token cross-entropy in nats).

    python -m benchmarks.fp8_quality                                  # both models, the CPU or the GPU
    python -m benchmarks.fp8_quality --models default --windows 8 --tokens 512 --json build/fp8/quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from benchmarks.spec_decode import heldout_prompts
from segkv.engine.llm import LLM


def perplexity(llm: LLM, windows: list[list[int]]) -> dict:
    """Mean next-token loss (nats) and perplexity of ``llm`` over ``windows``."""
    total, count = 0.0, 0
    for ids in windows:
        chain = llm.cache.new_chain()
        try:
            logits = llm.runner.prompt_logits(chain, ids)  # (n, vocab) float32
        finally:
            chain.release()
        target = torch.tensor(ids[1:], device=logits.device)
        total += float(F.cross_entropy(logits[:-1].float(), target, reduction="sum"))
        count += len(ids) - 1
    return {"loss": total / count, "perplexity": math.exp(total / count), "tokens": count}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fp8_quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="default,default-mla")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--windows", type=int, default=16, help="held-out windows per model")
    p.add_argument("--tokens", type=int, default=512, help="tokens per window")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "windows": args.windows, "tokens": args.tokens, "models": {}}
    for name in args.models.split(","):
        row = {}
        for label, quantization in (("bf16", None), ("fp8", "fp8")):
            start = time.perf_counter()
            llm = LLM(name, dtype="bfloat16", device=args.device, quantization=quantization)
            windows, _ = heldout_prompts(llm.tokenizer, args.windows, args.tokens)
            row[label] = perplexity(llm, windows) | {"seconds": time.perf_counter() - start}
            del llm
        row["fp8_over_bf16"] = row["fp8"]["perplexity"] / row["bf16"]["perplexity"]
        report["models"][name] = row
        print(f"{name}: bf16 perplexity {row['bf16']['perplexity']:.4f}, fp8 {row['fp8']['perplexity']:.4f} "
              f"({100 * (row['fp8_over_bf16'] - 1):+.2f}%) over {row['bf16']['tokens']} tokens "
              f"({args.windows} windows of {args.tokens}); {report['device']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
