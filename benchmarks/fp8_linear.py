"""FP8 weight-only products (``layers.fp8.Fp8Linear``) against bf16 ``F.linear`` at Llama-3.1-8B
projection shapes: time per call, the weight bytes read per second, and the error against the
float64 product of the dequantized weight. CUDA only.

    python -m benchmarks.fp8_linear [--rows 1 16 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json

import torch
import torch.nn.functional as F

from segkv.layers.fp8 import Fp8Linear, quantize_per_channel

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


# bytes of distinct weights a timed graph cycles through, so that no call finds its weight in L2
COLD_BYTES = 256 << 20


def copies_for(nbytes: int) -> int:
    """Weight copies a timing cycles through so that together they pass :data:`COLD_BYTES`."""
    return max(1, -(-COLD_BYTES // nbytes))


def _time(fns, iters: int = 50, calls: int = 24) -> float:
    """Median seconds per call: at least ``calls`` calls cycling through ``fns`` (one per weight
    copy) captured in one CUDA graph (the host's launch cost out of the figure, as in a decode
    step's graph), replayed ``iters`` times, each replay timed with CUDA events (after warm-up)."""
    fns = list(fns) if isinstance(fns, (list, tuple)) else [fns]
    calls = max(calls, len(fns))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # compile and pick algorithms outside the graph
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(times)[len(times) // 2]


def quantized(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w (n, k)`` as FP8 values and float32 scales: per channel (``block`` None), or per
    ``block`` tile (128 x 128 as DeepSeek-V3 stores them; the tiles divide ``w``)."""
    if block is None:
        return quantize_per_channel(w)
    (n, k), (b0, b1) = w.shape, block
    tiles = w.float().view(n // b0, b0, k // b1, b1)
    s = tiles.abs().amax(dim=(1, 3)) / 448.0
    return (tiles / s[:, None, :, None]).view(n, k).to(torch.float8_e4m3fn), s


def run(rows_list: list[int], block: tuple[int, int] | None) -> list[dict]:
    out = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
        layer = Fp8Linear(k, n, block=block, device="cuda", model_dtype=torch.bfloat16)
        q, s = quantized(w, block)
        layer.weight.data.copy_(q)
        layer.weight_scale.data.copy_(s)
        deq = layer.dequantized(torch.float64)
        fp8_layers = [layer] + [copy.deepcopy(layer) for _ in range(copies_for(n * k) - 1)]
        bf16_weights = [w] + [w.clone() for _ in range(copies_for(2 * n * k) - 1)]
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
            y = layer(x)
            err = ((y.double() - x.double() @ deq.T).abs().max() / (x.double() @ deq.T).abs().max()).item()
            t_fp8 = _time([lambda m=m: m(x) for m in fp8_layers])
            t_bf16 = _time([lambda v=v: F.linear(x, v) for v in bf16_weights])
            row = {"shape": name, "n": n, "k": k, "rows": rows, "fp8_us": t_fp8 * 1e6, "bf16_us": t_bf16 * 1e6,
                   "speedup": t_bf16 / t_fp8, "fp8_weight_GBps": n * k / t_fp8 / 1e9,
                   "bf16_weight_GBps": 2 * n * k / t_bf16 / 1e9, "max_rel_err": err,
                   "scales": "per-channel" if block is None else f"{block[0]}x{block[1]}"}
            out.append(row)
            print(f"{name:8s} {n:6d}x{k:<6d} rows {rows:4d} [{row['scales']}]: fp8 {row['fp8_us']:8.1f} us "
                  f"({row['fp8_weight_GBps']:6.0f} GB/s)  bf16 {row['bf16_us']:8.1f} us "
                  f"({row['bf16_weight_GBps']:6.0f} GB/s)  x{row['speedup']:.2f}  err {err:.1e}", flush=True)
    return out


def sweep(rows: int, n: int, k: int, configs) -> list[dict]:
    """Time the kernel's launch ``configs`` (``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)``)
    for one per-channel product of ``rows`` rows: the data ``launch_for`` is tuned from."""
    from segkv.kernels.quant.fp8_gemm import fp8_linear_kernel
    from segkv.kernels.triton_import import triton

    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
    q, s = quantize_per_channel(torch.randn(n, k, device="cuda") / k**0.5)
    y = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    out = []
    for bm, bn, bk, warps, stages in configs:
        def launch():
            fp8_linear_kernel[(triton.cdiv(rows, bm), triton.cdiv(n, bn))](
                x, q.view(torch.uint8), s, s, y, rows, n, k, x.stride(0), k, n, 1, 1, k, HAS_BIAS=False,
                SCALE_PER_TILE=True, EXACT_FP32=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                num_stages=stages)
        try:
            t = _time(launch, iters=20)
        except Exception as exc:  # a launch that does not fit (shared memory)
            print(f"rows {rows} {n}x{k} {(bm, bn, bk, warps, stages)}: {type(exc).__name__}", flush=True)
            continue
        out.append({"rows": rows, "n": n, "k": k, "config": [bm, bn, bk, warps, stages], "us": t * 1e6,
                    "weight_GBps": n * k / t / 1e9})
        print(f"rows {rows} {n}x{k} {(bm, bn, bk, warps, stages)}: {t * 1e6:7.1f} us "
              f"{n * k / t / 1e9:6.0f} GB/s", flush=True)
    return out


def sweep_gemv(rows: int, n: int, k: int, launches, block: tuple[int, int] | None = None) -> list[dict]:
    """Time the decode GEMV's ``launches`` (``GemvLaunch``) for one product of ``rows`` rows with
    per-channel scales (``block`` None) or ``block`` tiles: the data ``GEMV_LAUNCH`` is chosen from."""
    from segkv.kernels.quant.fp8_gemm import launch_gemv

    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
    q, s = quantized(torch.randn(n, k, device="cuda") / k**0.5, block)
    scales = (1, k) if block is None else block
    weights = [q] + [q.clone() for _ in range(copies_for(n * k) - 1)]
    y = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    out = []
    for launch in launches:
        try:
            t = _time([lambda w=w: launch_gemv(x, w, s, scales, None, y, launch) for w in weights], iters=30)
        except Exception as exc:  # a launch that does not compile or fit
            print(f"rows {rows} {n}x{k} {launch}: {type(exc).__name__}", flush=True)
            continue
        out.append({"rows": rows, "n": n, "k": k, "scales": list(scales), "launch": dataclasses.asdict(launch),
                    "us": t * 1e6, "weight_GBps": n * k / t / 1e9})
        print(f"rows {rows} {n}x{k} {scales} {launch}: {t * 1e6:7.1f} us {n * k / t / 1e9:6.0f} GB/s", flush=True)
    return out


def gemv_launches():
    """The GEMV launches ``--sweep gemv`` times: weight rows per program, accumulator size, chunk
    width, warps and stages around the default."""
    from segkv.kernels.quant.fp8_gemm import GemvLaunch

    grid = [GemvLaunch(block_n=bn, acc_elements=acc, max_block_k=2048, num_warps=w, num_stages=st)
            for bn in (2, 4, 8, 16) for acc in (4096, 8192) for w in (4, 8) for st in (3,)]
    return [launch for launch in grid if launch.acc_elements // (32 * launch.num_warps) <= 64]


def gemv_or_tiles(rows: int, n: int, k: int) -> list[dict]:
    """Time the decode GEMV and the tile kernel (``launch_for``'s tiles) on one per-channel product
    of ``rows`` rows: where ``GEMV_MAX_ROWS`` should stand."""
    from segkv.kernels.quant.fp8_gemm import launch_gemv, launch_tiles

    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
    q, s = quantized(torch.randn(n, k, device="cuda") / k**0.5, None)
    weights = [q] + [q.clone() for _ in range(copies_for(n * k) - 1)]
    y = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    out = []
    for name, launch in (("gemv", launch_gemv), ("tiles", launch_tiles)):
        t = _time([lambda w=w: launch(x, w, s, (1, k), None, y) for w in weights], iters=30)
        out.append({"rows": rows, "n": n, "k": k, "kernel": name, "us": t * 1e6, "weight_GBps": n * k / t / 1e9})
        print(f"rows {rows} {n}x{k} {name:5s}: {t * 1e6:7.1f} us {n * k / t / 1e9:6.0f} GB/s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--json", default=None)
    parser.add_argument("--sweep", choices=("gemm", "gemv", "gemv-or-tiles"), default=None,
                        help="time launch configurations instead: the tile kernel's, the decode GEMV's, or the "
                             "GEMV against the tile kernel at each --rows")
    parser.add_argument("--block", type=int, nargs=2, default=None, metavar=("BN", "BK"),
                        help="--sweep gemv with block scales of this size (e.g. 128 128) instead of per channel")
    args = parser.parse_args()
    if args.sweep == "gemv-or-tiles":
        results = [r for rows in args.rows for n, k in SHAPES.values() for r in gemv_or_tiles(rows, n, k)]
    elif args.sweep == "gemv":
        block = tuple(args.block) if args.block else None
        launches = gemv_launches()
        results = [r for rows in args.rows for n, k in ((6144, 4096), (4096, 14336), (28672, 4096))
                   for r in sweep_gemv(rows, n, k, launches, block)]
    elif args.sweep == "gemm":
        few = [(16, bn, bk, w, st) for bn in (32, 64, 128) for bk in (256, 512) for w in (4, 8) for st in (3, 4)]
        many = [(bm, bn, 128, w, 3) for bm in (64, 128) for bn in (64, 128) for w in (4, 8)]
        results = sweep(1, 6144, 4096, few) + sweep(1, 4096, 14336, few) + sweep(256, 6144, 4096, many)
    else:
        results = run(args.rows, None) + run(args.rows, (128, 128))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
