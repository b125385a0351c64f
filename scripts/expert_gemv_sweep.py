"""Launch sweep of the per-pair expert GEMV at DeepSeek-V2-Lite shapes (GPU machine).

For each (pairs, product) the expert weights are bf16 stacks of 64 experts (740 MB / 370 MB, far
beyond L2); 8 launches, each over fresh distinct experts, are captured in one CUDA graph, so the
timing is the kernels' alone (a decode step replays them from a graph too, not from Python).
Prints the median [min-max] over 10 replays of the time per launch in microseconds and the
weight bytes read per second, per launch configuration, with the default configuration marked.
Usage: ``python3 scripts/expert_gemv_sweep.py``.

``--dense``: instead, the dense projections of a decode step at 1 and 2 rows (DeepSeek-V2-Lite and
Llama-3.1-8B shapes, each weight in 8 distinct copies so none is served from L2): ``F.linear``
(cuBLAS) against ``dense_gemv`` at the launch sweep's best configurations, to set the
``SEGKV_GEMV_ROWS`` policy (layers/projection.py).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from functools import partial

import torch
import torch.nn.functional as F

from segkv.kernels.expert_gemv import BLOCK_I, BLOCK_O, NUM_WARPS, dense_gemv, expert_gemv
from segkv.kernels.grouped_expert_gemm import grouped_expert_gemm

SHAPES = {"gate_up": (2816, 2048), "down": (2048, 1408)}  # (Out, In) per expert
# (Out, In) of the dense projections of one decode step
DENSE_SHAPES = {
    "deepseek-v2-lite q+kv_a": (3072 + 576, 2048), "deepseek-v2-lite o": (2048, 2048),
    "deepseek-v2-lite shared gate+up": (5632, 2048), "deepseek-v2-lite shared down": (2048, 2816),
    "llama-3.1-8b qkv": (6144, 4096), "llama-3.1-8b o": (4096, 4096),
    "llama-3.1-8b gate+up": (28672, 4096), "llama-3.1-8b down": (4096, 14336),
}


def time_us(launches, reps: int = 10) -> list[float]:
    """Microseconds per launch: ``launches`` (callables) captured in one graph, replayed ``reps`` times."""
    for launch in launches:  # compile and warm up outside the capture
        launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            launch()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(launches))
    return times


def dense() -> None:
    """cuBLAS against the Triton GEMV on the dense projections, 1 and 2 rows."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"device {torch.cuda.get_device_name()}; bf16; median [min-max] of 10 graph replays of 8 distinct "
          "weights, per launch")
    for name, (out_dim, in_dim) in DENSE_SHAPES.items():
        weights = [torch.randn(out_dim, in_dim, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(8)]
        nbytes = out_dim * in_dim * 2
        for rows in (1, 2):
            x = torch.randn(rows, in_dim, device=dev, dtype=torch.bfloat16, generator=gen)
            ids = torch.zeros(rows, dtype=torch.int32, device=dev)
            variants = {"F.linear": lambda w: F.linear(x, w), "dense_gemv": lambda w: dense_gemv(x, w)}
            for block_o, warps in ((32, 4), (64, 4), (16, 8)):
                variants[f"gemv {block_o}x{BLOCK_I} w{warps}"] = (
                    lambda w, b=block_o, nw=warps: expert_gemv(x, 1, ids, w.unsqueeze(0), block_o=b, num_warps=nw))
            for label, fn in variants.items():
                t = time_us([partial(fn, w) for w in weights])
                med = statistics.median(t)
                print(f"{name:34s} rows {rows} {label:22s}: {med:7.1f} us [{min(t):.1f}-{max(t):.1f}] "
                      f"{nbytes / med / 1e3:7.0f} GB/s")


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"device {torch.cuda.get_device_name()}; bf16; 64 experts; median [min-max] of 10 graph replays, per launch")
    for name, (out_dim, in_dim) in SHAPES.items():
        weight = torch.randn(64, out_dim, in_dim, device=dev, dtype=torch.bfloat16, generator=gen)
        for pairs in (6, 48):
            x = torch.randn(pairs, in_dim, device=dev, dtype=torch.bfloat16, generator=gen)
            rows = torch.arange(pairs, device=dev)
            draws = [torch.randperm(64, device=dev, generator=gen)[:pairs] for _ in range(8)]
            nbytes = pairs * out_dim * in_dim * 2
            for block_o, block_i, warps in itertools.product((16, 32, 64), (128, 256), (2, 4)):
                launches = [partial(expert_gemv, x, rows, experts, weight, block_o=block_o, block_i=block_i,
                                    num_warps=warps) for experts in draws]
                t = time_us(launches)
                med = statistics.median(t)
                mark = " <- default" if (block_o, block_i, warps) == (BLOCK_O, BLOCK_I, NUM_WARPS) else ""
                print(f"{name:8s} pairs {pairs:3d} block_o {block_o:3d} block_i {block_i:3d} warps {warps}: "
                      f"{med:7.1f} us [{min(t):.1f}-{max(t):.1f}] {nbytes / med / 1e3:7.0f} GB/s{mark}")
            t = time_us([partial(grouped_expert_gemm, x, rows, experts, weight) for experts in draws])
            med = statistics.median(t)
            print(f"{name:8s} pairs {pairs:3d} grouped GEMM (its default launch): {med:7.1f} us "
                  f"[{min(t):.1f}-{max(t):.1f}] {nbytes / med / 1e3:7.0f} GB/s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dense", action="store_true", help="dense projections: cuBLAS against the GEMV")
    dense() if parser.parse_args().dense else main()
