"""Routed experts of a prefill step: one MoE layer (router and experts) through each dispatch
path, in ms per call, on random bf16 weights of a published shape.

Paths: ``looped`` (unpacked experts, one GEMM per chosen expert from the host: FP8 experts, and
the CPU) and ``triton`` (packed, ``kernels.moe.grouped_expert_gemm``: wherever fused ops run). Each
path is checked against the float32 products of the same bf16 operands. Medians of
``--trials`` CUDA-event timings after a warm-up, with min and max.

Run on a CUDA device: ``python -m benchmarks.moe_prefill --help``.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from segkv.layers.moe import MixtureOfExperts, RouterSpec

# name -> (experts, top-k, hidden, expert width)
SHAPES = {"deepseek-v2-lite": (64, 6, 2048, 1408), "qwen3-30b-a3b": (128, 8, 2048, 768)}


def time_ms(fn, trials: int) -> dict:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def reference(layer: MixtureOfExperts, x: torch.Tensor) -> torch.Tensor:
    """float32 layer output ``(T, H)`` of the same bf16 operands: the router's choice, each chosen
    expert's float32 product, weighted and summed."""
    weights, ids = layer.gate(x)
    out = torch.zeros(x.shape, device=x.device)
    rows = x.float()
    for e, expert in enumerate(layer.experts):
        token, slot = (ids == e).nonzero(as_tuple=True)
        gate, up, down = (m.weight.float() for m in (expert.gate_proj, expert.up_proj, expert.down_proj))
        y = (F.silu(rows[token] @ gate.T) * (rows[token] @ up.T)) @ down.T
        out.index_add_(0, token, y * weights[token, slot, None].float())
    return out


@torch.inference_mode()
def bench(shape: str, tokens: int, trials: int, check: bool) -> dict:
    experts, k, hidden, width = SHAPES[shape]
    torch.manual_seed(tokens)
    layer = MixtureOfExperts(hidden, width, RouterSpec(num_experts=experts, top_k=k)).cuda().to(torch.bfloat16)
    for p in layer.parameters():
        p.data.normal_(0, hidden ** -0.5)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    row = {"shape": shape, "tokens": tokens, "pairs": tokens * k, "paths": {}}
    ref = reference(layer, x) if check else None
    for name in ("looped", "triton"):
        if name == "triton":
            layer.pack_experts()
        if ref is not None:
            err = (layer(x).float() - ref).abs().max().item() / ref.abs().max().item()
            row["paths"].setdefault(name, {})["max_rel_err"] = err
        row["paths"].setdefault(name, {}).update(time_ms(lambda: layer(x), trials))
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="deepseek-v2-lite,qwen3-30b-a3b")
    p.add_argument("--tokens", default="64,256,512,2048,8192")
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = []
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for shape in args.shapes.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            row = bench(shape, tokens, args.trials, not args.no_check)
            rows.append(row)
            base = row["paths"]["looped"]["median_ms"]
            for name, r in row["paths"].items():
                err = f" err {r['max_rel_err']:.1e}" if "max_rel_err" in r else ""
                print(f"{shape} tokens {tokens:>6} pairs {row['pairs']:>6} {name:<8} {r['median_ms']:8.3f} ms "
                      f"[{r['min_ms']:.3f}-{r['max_ms']:.3f}] x{base / r['median_ms']:.2f} of looped{err}", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
