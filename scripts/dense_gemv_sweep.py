"""Launch sweep of the split-K batch-1 GEMV (``kernels.dense_gemv``) against cuBLAS (``F.linear``)
at the dense projection shapes of DeepSeek-V2-Lite and Llama-3.1-8B (GPU machine).

Each case captures 8 products over 8 distinct bf16 weight copies in one CUDA graph (the weights
stream from memory, as in a decode step) and prints the median [min-max] of 10 replays per
product, the weight bytes per second, and the result's largest difference from cuBLAS's.
``--layers``: the chain of a Llama-3.1-8B layer at one row without its attention (residual add
and RMSNorm, q/k/v, o, residual add and RMSNorm, gate/up, SiLU-and-mul, down) over 8 layers'
weights: the separate kernels with cuBLAS against the fused split-K GEMVs (``layers.linear``).
``--layers --all-tiles`` compares the tile shapes; ``--layers --whole-rows``
programs of whole weight rows (one split: no partial sums, no tickets; the engine's launch for
products of up to 4096 inputs) against split-K blocks.
Usage: ``python3 scripts/dense_gemv_sweep.py [--chain-only | --layers [--all-tiles | --whole-rows]]``.
"""

from __future__ import annotations

import statistics
import sys
from functools import partial

import torch
import torch.nn.functional as F
import triton

from expert_gemv_sweep import time_us  # scripts/ beside this one: the same graph timing

from segkv.kernels.dense_gemv import gated_splitk_gemv, norm_splitk_gemv, splitk_gemv, workspace_size
from segkv.kernels.fused_ops import rms_norm, silu_and_mul
from segkv.layers.linear import launch_for

SHAPES = {"deepseek q+kv_a": (3648, 2048), "deepseek o": (2048, 2048), "llama qkv": (6144, 4096),
          "llama o": (4096, 4096), "llama down": (4096, 14336), "llama gate+up": (28672, 4096)}
LAUNCHES = [(16, 512, 4), (32, 256, 4), (32, 512, 4), (64, 256, 4), (32, 1024, 4), (64, 512, 8), (128, 256, 8)]


def weight_copies(dev, gen, out_dim: int, in_dim: int, copies: int = 8):
    """``copies`` distinct bf16 weights ``(out_dim, in_dim)`` scaled by ``in_dim ** -0.5`` (so a product
    streams from memory, not L2), one bf16 row ``x (1, in_dim)``, the bytes of one weight, and
    cuBLAS's float32 product of ``x`` and the first weight (the reference)."""
    weights = [torch.randn(out_dim, in_dim, device=dev, dtype=torch.bfloat16, generator=gen) / in_dim**0.5
               for _ in range(copies)]
    x = torch.randn(1, in_dim, device=dev, dtype=torch.bfloat16, generator=gen)
    return weights, x, out_dim * in_dim * 2, F.linear(x, weights[0]).float()


def chain(dev, gen) -> None:
    """16 dependent products (each one's output the next one's input, as a decode step's layers),
    square weights: cuBLAS, the split-K GEMV, and the split-K GEMV with programmatic dependent
    launch (weights loaded before waiting for the previous product)."""
    for dim in (2048, 4096):
        weights = [torch.randn(dim, dim, device=dev, dtype=torch.bfloat16, generator=gen) / dim**0.5 for _ in range(16)]
        x = torch.randn(1, dim, device=dev, dtype=torch.bfloat16, generator=gen)
        block_k = 256 if dim == 2048 else 512
        floats, tickets = workspace_size(dim, dim, 32, block_k)
        ws = [(torch.empty(floats, dtype=torch.float32, device=dev), torch.zeros(tickets, dtype=torch.int32, device=dev))
              for _ in weights]

        def run(kind):
            h = x
            for w, s in zip(weights, ws):
                h = F.linear(h, w) if kind == "cublas" else splitk_gemv(h, w, block_n=32, block_k=block_k, workspace=s,
                                                                      pdl=kind == "pdl")
            return h

        ref = run("cublas").float()
        for kind in ("cublas", "splitk", "pdl", "cublas", "splitk", "pdl"):
            times = time_us([partial(run, kind)])
            err = (run(kind).float() - ref).abs().max()
            print(f"chain of 16 x {dim}^2 {kind:6s}: {statistics.median(times) / 16:6.2f} us per product "
                  f"[{min(times) / 16:.2f}-{max(times) / 16:.2f}], max diff from cuBLAS {err:.2e}", flush=True)


def layers(dev, gen, hidden: int = 4096, inner: int = 14336, kv: int = 1024, count: int = 8) -> None:
    """A Llama-3.1-8B layer's products at one row, attention left out (its output is the first
    ``hidden`` of q/k/v), over ``count`` layers' weights: separate kernels and cuBLAS against the
    fused split-K GEMVs, with launches from ``launch_for`` and the alternatives below."""
    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=gen) / shape[-1] ** 0.5

    weights = [(rand(hidden + 2 * kv, hidden), rand(hidden, hidden), rand(2 * inner, hidden), rand(hidden, inner),
                1 + 0.1 * rand(hidden), 1 + 0.1 * rand(hidden)) for _ in range(count)]
    x0 = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
    r0 = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
    nbytes = sum(w.numel() * 2 for w in weights[0][:4])

    def cublas():
        x, res = x0, r0
        for qkv_w, o_w, gu_w, d_w, g1, g2 in weights:
            h, res = rms_norm(x, g1, 1e-5, residual=res)
            o = F.linear(F.linear(h, qkv_w)[:, :hidden], o_w)
            h, res = rms_norm(o, g2, 1e-5, residual=res)
            x = F.linear(silu_and_mul(F.linear(h, gu_w)), d_w)
        return x

    def fused(launch):
        """``launch(out_dim, in_dim)`` -> (BLOCK_N, BLOCK_K, warps, evict_first) per product."""
        spaces = {}

        def kw(w):
            bn, bk, warps, evict = launch(*w.shape)
            key = (w.shape, bn, bk)
            if key not in spaces:
                floats, tickets = workspace_size(*w.shape, bn, bk)
                spaces[key] = (torch.empty(floats, dtype=torch.float32, device=dev),
                               torch.zeros(tickets, dtype=torch.int32, device=dev))
            return {"block_n": bn, "block_k": bk, "num_warps": warps, "evict_first": evict, "workspace": spaces[key]}

        def run():
            x, res = x0, r0
            for qkv_w, o_w, gu_w, d_w, g1, g2 in weights:
                qkv, res = norm_splitk_gemv(x, res, g1, 1e-5, qkv_w, **kw(qkv_w))
                o = splitk_gemv(qkv[:, :hidden], o_w, **kw(o_w))
                gu, res = norm_splitk_gemv(o, res, g2, 1e-5, gu_w, **kw(gu_w))
                x = gated_splitk_gemv(gu, d_w, **kw(d_w))
            return x
        return run

    def every(bn, bk, warps=4, evict=False):
        return lambda o, i: (bn, bk, warps, evict)

    def small_big(small, big):  # q/k/v and o, then gate/up and down
        return lambda o, i: small if o * i <= (hidden + 2 * kv) * hidden else big

    if "--all-tiles" in sys.argv:  # the tile sweep of earlier runs (docs/benchmarks.md)
        variants = {"cuBLAS + kernels": cublas, "fused, launch_for": fused(lambda o, i: (*launch_for(i), 4, False)),
                    "fused, 16 x 512, evict first": fused(every(16, 512, 4, True)),
                    "fused, 16 x 512, 2 warps": fused(every(16, 512, 2)),
                    "fused, 16 x 512, 8 warps": fused(every(16, 512, 8)),
                    "fused, 16 x 256": fused(every(16, 256)),
                    "fused, 8 x 512, 2 warps": fused(every(8, 512, 2)),
                    "fused, 32 x 256": fused(every(32, 256)),
                    "fused, small 32 x 256, big 16 x 512": fused(small_big((32, 256, 4, False), (16, 512, 4, False))),
                    "fused, small 8 x 512, big 16 x 512": fused(small_big((8, 512, 4, False), (16, 512, 4, False)))}
    elif "--whole-rows" in sys.argv:  # programs of whole weight rows: no split over the input, no tickets
        def whole(rows, warps, down=(16, 512, 4)):
            return lambda o, i: (rows, triton.next_power_of_2(i), warps, True) if i <= 4096 else (*down, True)

        variants = {"split-K 16 x 512 (before)": fused(every(16, 512, 4, True)),
                    "launch_for (4 whole rows up to 4096 inputs)": fused(lambda o, i: (*launch_for(i, whole_rows=True), 4,
                                                                                      True)),
                    "whole rows 8 x 4096, 8 warps": fused(whole(8, 8)),
                    "whole rows 4 x 4096, down 8 x 1024": fused(whole(4, 4, (8, 1024, 4))),
                    "whole rows 4 x 4096, down 4 x 4096": fused(whole(4, 4, (4, 4096, 4)))}
        # earlier (H200): 1 x 4096 0.77x, 2 x 4096 1.00x, 2 x 4096 with 8 warps 0.91x, 4 x 4096
        # with 8 warps 1.04x; down in whole rows 1 x 16384 (8 warps) 0.74x, 2 x 8192 0.86x; down
        # 8 x 2048 / 4 x 2048 1.06-1.07x (4 x 4096 elsewhere: 1.09x)
    else:  # the engine's launches against cuBLAS
        variants = {"cuBLAS + kernels": cublas,
                    "fused, launch_for": fused(lambda o, i: (*launch_for(i, whole_rows=True), 4, True))}
    ref = cublas().float()
    base = None
    for _ in range(2):
        for name, run in variants.items():
            per_layer = [t / count for t in time_us([run])]  # one callable: the whole chain
            med = statistics.median(per_layer)
            base = base or med
            err = (run().float() - ref).abs().max() / ref.abs().max()
            print(f"layer chain {name:36s}: {med:6.1f} us per layer [{min(per_layer):.1f}-{max(per_layer):.1f}] "
                  f"{nbytes / med / 1e3:5.0f} GB/s, {base / med:4.2f}x the first, max diff {err:.1e} of the largest",
                  flush=True)


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"device {torch.cuda.get_device_name()}; bf16; one row; median [min-max] of 10 graph replays, per product")
    if "--layers" in sys.argv:
        return layers(dev, gen)
    chain(dev, gen)
    if "--chain-only" in sys.argv:
        return
    for name, (out_dim, in_dim) in SHAPES.items():
        weights, x, nbytes, ref = weight_copies(dev, gen, out_dim, in_dim)
        base = statistics.median(time_us([partial(F.linear, x, w) for w in weights]))
        print(f"{name:16s} cuBLAS: {base:6.1f} us {nbytes / base / 1e3:5.0f} GB/s", flush=True)
        for block_n, block_k, warps in LAUNCHES:
            split = -(-in_dim // block_k)
            ws = [(torch.empty(split * out_dim, dtype=torch.float32, device=dev),
                   torch.zeros(-(-out_dim // block_n), dtype=torch.int32, device=dev)) for _ in weights]
            launches = [partial(splitk_gemv, x, w, block_n=block_n, block_k=block_k, num_warps=warps, workspace=s)
                        for w, s in zip(weights, ws)]
            times = time_us(launches)
            med = statistics.median(times)
            err = (splitk_gemv(x, weights[0], block_n=block_n, block_k=block_k, num_warps=warps).float() - ref).abs().max()
            print(f"{name:16s} {block_n:3d} x {block_k:4d}, {warps} warps ({split} splits): {med:6.1f} us "
                  f"[{min(times):.1f}-{max(times):.1f}] {nbytes / med / 1e3:5.0f} GB/s, {base / med:4.2f}x cuBLAS, "
                  f"max diff {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
