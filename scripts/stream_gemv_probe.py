"""Probe: a persistent, software-pipelined one-row GEMV against the split-K GEMV of the engine
(``kernels.dense_gemv``) and cuBLAS, at Llama-3.1-8B's product shapes (GPU machine).

The split-K GEMV gives each program one 16 x 512 weight block, held in registers from before its
PDL wait: at batch 1 its products stream 2.7-3.9 TB/s against a 4.2-4.3 TB/s copy rate. Here each
program owns ``blocks`` consecutive row blocks with the whole input dim, and walks their weight
blocks through a ``STAGES``-deep asynchronous-copy pipeline in shared memory (Triton's pipeliner),
so a multiprocessor keeps up to ``(STAGES - 1) x 16 KB`` per program in flight without a program
ending and starting between blocks. No split over the input dim: no partial sums, no tickets.

Cases (all bf16, weights rotated so L2 is cold, every figure a median [min-max] of graph replays):
- ``isolated``: 8 products over 8 weight copies in one graph, per shape;
- ``chain``: a Llama-3.1-8B layer's four plain products in dependence (q/k/v -> o -> gate/up ->
  down, each reading the first ``In`` of the one before), over 8 layers' weights, PDL on.
Usage: ``python3 scripts/stream_gemv_probe.py [--quick]``.
"""

from __future__ import annotations

import statistics
import sys
from functools import partial

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dense_gemv_sweep import weight_copies  # scripts/ beside this one: the same weights
from expert_gemv_sweep import time_us  # and the same graph timing

from benchmarks.decode_attention import measured_read_bandwidth
from segkv.kernels.dense_gemv import splitk_gemv, workspace_size
from segkv.layers.linear import launch_for


@triton.jit
def _l2_prefetch(W, stride_w, rb, kb, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Ask L2 for weight block ``(rb, kb)``: one 128-byte line per thread (bf16)."""
    LINE: tl.constexpr = 64  # bf16 elements per 128-byte line
    LINES: tl.constexpr = BLOCK_N * BLOCK_K // LINE
    i = tl.arange(0, LINES)
    row = rb * BLOCK_N + i // (BLOCK_K // LINE)
    col = kb * BLOCK_K + (i % (BLOCK_K // LINE)) * LINE
    ptr = W + row.to(tl.int64) * stride_w + col
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptr], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _stream_gemv_kernel(X, W, OUT, stride_w, out_dim, blocks_per_prog,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KB: tl.constexpr, STAGES: tl.constexpr,
                        PREFETCH: tl.constexpr, USE_PDL: tl.constexpr):
    """``OUT (out_dim,) = W (out_dim, KB * BLOCK_K) @ X``: program ``p`` owns row blocks
    ``[p * blocks_per_prog, ...)``, walks their ``(row block, input block)`` pairs in order through
    the pipeline, float32 sums rounded once per row block. ``PREFETCH``: L2 prefetch of the
    program's first weight blocks before the PDL wait."""
    pid = tl.program_id(0)
    rb0 = pid * blocks_per_prog
    n_mine = tl.minimum(blocks_per_prog, out_dim // BLOCK_N - rb0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        for j in tl.static_range(PREFETCH):
            if j < n_mine * KB:
                _l2_prefetch(W, stride_w, rb0 + j // KB, j % KB, BLOCK_N, BLOCK_K)
        tl.extra.cuda.gdc_wait()
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for t in tl.range(0, n_mine * KB, num_stages=STAGES):
        rb = rb0 + t // KB
        kb = t % KB
        rows = rb * BLOCK_N + offs_n
        w = tl.load(W + rows[:, None].to(tl.int64) * stride_w + (kb * BLOCK_K + offs_k)[None, :],
                    eviction_policy="evict_first")
        x = tl.load(X + kb * BLOCK_K + offs_k)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
        if kb == KB - 1:
            tl.store(OUT + rows, acc.to(OUT.dtype.element_ty))
            acc = tl.zeros([BLOCK_N], tl.float32)


def stream_gemv(x, weight, *, block_n=16, block_k=512, stages=4, per_sm=1, warps=4, prefetch=0, pdl=True):
    """``x (1, In) @ weight.T`` through :func:`_stream_gemv_kernel` (``In % block_k == 0``,
    ``Out % block_n == 0``)."""
    out_dim, in_dim = weight.shape
    assert in_dim % block_k == 0 and out_dim % block_n == 0
    row_blocks = out_dim // block_n
    programs = torch.cuda.get_device_properties(x.device).multi_processor_count * per_sm
    per_prog = triton.cdiv(row_blocks, programs)
    grid = (triton.cdiv(row_blocks, per_prog),)
    out = torch.empty(1, out_dim, dtype=x.dtype, device=x.device)
    opts = {"launch_pdl": True} if pdl else {}
    _stream_gemv_kernel[grid](x, weight, out, weight.stride(0), out_dim, per_prog, BLOCK_N=block_n, BLOCK_K=block_k,
                              KB=in_dim // block_k, STAGES=stages, PREFETCH=prefetch, USE_PDL=pdl, num_warps=warps,
                              num_stages=stages, **opts)
    return out


def splitk(x, weight, spaces):
    bn, bk = launch_for(weight.shape[1])
    key = tuple(weight.shape)
    if key not in spaces:
        floats, tickets = workspace_size(*weight.shape, bn, bk)
        spaces[key] = (torch.empty(floats, dtype=torch.float32, device=x.device),
                       torch.zeros(tickets, dtype=torch.int32, device=x.device))
    return splitk_gemv(x, weight, block_n=bn, block_k=bk, workspace=spaces[key], pdl=True, evict_first=True)


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate+up": (28672, 4096), "down": (4096, 14336)}
QUICK = "--quick" in sys.argv
VARIANTS = {  # name -> stream_gemv keywords
    "s4 x1": dict(stages=4, per_sm=1), "s6 x1": dict(stages=6, per_sm=1), "s8 x1": dict(stages=8, per_sm=1),
    "s4 x2": dict(stages=4, per_sm=2), "s3 x3": dict(stages=3, per_sm=3), "s4 x2 k256": dict(stages=6, per_sm=2, block_k=256),
    "s6 x1 n32": dict(stages=6, per_sm=1, block_n=32, block_k=256), "s4 x1 8w": dict(stages=4, per_sm=1, warps=8),
    "s4 x2 pf2": dict(stages=4, per_sm=2, prefetch=2), "s6 x1 pf4": dict(stages=6, per_sm=1, prefetch=4),
}
if QUICK:
    VARIANTS = {k: VARIANTS[k] for k in ("s4 x1", "s4 x2", "s4 x2 pf2")}


def isolated(dev, gen, rate):
    for name, (out_dim, in_dim) in SHAPES.items():
        weights, x, nbytes, ref = weight_copies(dev, gen, out_dim, in_dim)
        spaces = {}
        runs = {"cuBLAS": [partial(F.linear, x, w) for w in weights],
                "split-K (engine)": [partial(splitk, x, w, spaces) for w in weights]}
        for vname, kw in VARIANTS.items():
            runs[f"stream {vname}"] = [partial(stream_gemv, x, w, **kw) for w in weights]
        for label, launches in runs.items():
            try:
                times = time_us(launches)
            except Exception as e:  # a variant that does not fit (shared memory): say so, go on
                print(f"{name:8s} {label:22s}: failed: {str(e)[:120]}", flush=True)
                continue
            med = statistics.median(times)
            err = (launches[0]().float() - ref).abs().max() / ref.abs().max()
            print(f"{name:8s} {label:22s}: {med:6.2f} us [{min(times):.2f}-{max(times):.2f}] "
                  f"{nbytes / med / 1e6:5.2f} TB/s ({nbytes / med / 1e6 / rate:4.0%} of copy), rel diff {err:.1e}",
                  flush=True)


def chain(dev, gen, rate, count=8):
    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=gen) / shape[-1] ** 0.5

    layers = [tuple(rand(*SHAPES[n]) for n in ("qkv", "o", "gate+up", "down")) for _ in range(count)]
    x0 = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16, generator=gen)
    nbytes = sum(w.numel() * 2 for w in layers[0])

    def run(product):
        x = x0
        for ws in layers:
            for w in ws:
                x = product(x[:, :w.shape[1]].contiguous() if x.shape[1] != w.shape[1] else x, w)
        return x

    spaces = {}
    variants = {"cuBLAS": F.linear, "split-K (engine)": lambda x, w: splitk(x, w, spaces)}
    for vname, kw in VARIANTS.items():
        variants[f"stream {vname}"] = partial(lambda x, w, kw: stream_gemv(x, w, **kw), kw=kw)
    ref = run(F.linear).float()
    for round_ in range(2):
        for label, product in variants.items():
            try:
                per_layer = [t / count for t in time_us([partial(run, product)])]
            except Exception as e:
                print(f"chain {label:22s}: failed: {str(e)[:120]}", flush=True)
                continue
            med = statistics.median(per_layer)
            err = (run(product).float() - ref).abs().max() / ref.abs().max()
            print(f"chain round {round_} {label:22s}: {med:6.1f} us per layer [{min(per_layer):.1f}-"
                  f"{max(per_layer):.1f}] {nbytes / med / 1e6:5.2f} TB/s ({nbytes / med / 1e6 / rate:4.0%} of copy), "
                  f"rel diff {err:.1e}", flush=True)


def main():
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rate = measured_read_bandwidth() / 1e12
    print(f"device {torch.cuda.get_device_name()}; copy rate {rate:.2f} TB/s; bf16, one row", flush=True)
    isolated(dev, gen, rate)
    chain(dev, gen, rate)


if __name__ == "__main__":
    main()
