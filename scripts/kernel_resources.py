"""Registers, spills, shared memory, pipeline buffers and resident programs per SM of the stage-1
attention kernels, compiled for Hopper (sm_90a) on any machine: no GPU needed.

Each configuration is compiled exactly as the launcher would launch it (``stage1_launch`` /
``mla_stage1_launch``, so pipeline stages shrink where the buffers would not fit) with the
installed Triton and its bundled ``ptxas -v`` (``segkv.kernels.offline_compile``). This answers
"how many programs fit on a multiprocessor" (the planner's wave), "does this launch spill" and
"does the pipeliner keep the next tile in flight" before spending device time. The GPU machine's
Triton may be older than this one, so its code can differ slightly; check one configuration there
with ``ncu --section LaunchStats --section Occupancy`` when a decision depends on it.

    python3 scripts/kernel_resources.py --kernel mla --block-n 16,32 --warps 4,8
    python3 scripts/kernel_resources.py --kernel gqa --block-m 16,64 --maxnreg 0,128 --stages 2,3
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from segkv.kernels import mla_attention, paged_attention
from segkv.kernels.offline_compile import compile_offline
from segkv.kernels.paged_attention import LaunchConfig

H200_REGISTERS = 65536  # per multiprocessor
H200_SHARED = 228 * 1024  # bytes per multiprocessor (227 KB usable per block + 1 KB reserved)


def configuration(kind: str, *, block_n: int, block_m: int, warps: int, stages: int, maxnreg: int | None,
                  page_size: int, dtype: torch.dtype) -> tuple:
    """The jit function, its pointer types and its launch constants for a real model shape:
    Llama-3-8B (group 4, head_dim 128) or DeepSeek (rank 512 + rope 64), one decode row per
    sequence (``block_m`` pairs: that many rows x heads per work item)."""
    launch = LaunchConfig(block_n, warps, stages, block_m=block_m, tall_warps=warps, heads_fastest=True,
                          maxnreg=maxnreg)
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    element = torch.empty((), dtype=dtype).element_size()
    if kind == "gqa":
        meta = paged_attention.stage1_launch(dtype=dtype, dk=128, dv=128, group=4, page_size=page_size,
                                             max_work_rows=max(1, block_m // 4), element_size=element, launch=launch)
        return paged_attention._stage1_kernel, {"Q": f"*{name}", "K": f"*{name}", "V": f"*{name}",
                                                "OUT": "*fp32", "LSE": "*fp32", "FINAL": f"*{name}",
                                                "FINAL_LSE": "*fp32"}, meta
    meta = mla_attention.mla_stage1_launch(dtype=dtype, rank=512, rope=64, num_heads=16, page_size=page_size,
                                           max_work_rows=max(1, block_m // 16), element_size=element, launch=launch)
    return mla_attention._mla_stage1_kernel, {"Q": f"*{name}", "LAT": f"*{name}", "OUT": "*fp32", "LSE": "*fp32",
                                              "FINAL": f"*{name}", "FINAL_LSE": "*fp32"}, meta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", choices=("gqa", "mla"), default="mla")
    p.add_argument("--block-n", default="32", help="keys per tile (comma list)")
    p.add_argument("--block-m", default="16", help="(row x head) pairs per program (comma list)")
    p.add_argument("--warps", default="4")
    p.add_argument("--stages", default="3")
    p.add_argument("--maxnreg", default="0", help="register caps, 0 for none (comma list)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = p.parse_args()
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    dtype = getattr(torch, args.dtype)
    print(f"triton {triton.__version__}, target sm_90a, {args.dtype}; resident programs per SM from registers "
          "and shared memory (64K registers, 228 KB)")
    for block_n, block_m, warps, stages, cap in itertools.product(
            ints(args.block_n), ints(args.block_m), ints(args.warps), ints(args.stages), ints(args.maxnreg)):
        label = f"{args.kernel} BLOCK_N {block_n:3d} BLOCK_M {block_m:3d} warps {warps} stages {stages} maxnreg {cap or '-'}"
        fn, pointers, meta = configuration(args.kernel, block_n=max(block_n, args.page_size), block_m=block_m,
                                           warps=warps, stages=stages, maxnreg=cap or None,
                                           page_size=args.page_size, dtype=dtype)
        try:
            k = compile_offline(fn, meta, pointers=pointers)
        except Exception as e:  # noqa: BLE001 - report the configuration that failed and go on
            print(f"{label}: failed: {str(e).splitlines()[-1][:200] if str(e) else type(e).__name__}")
            continue
        threads = 32 * warps
        resident = min(H200_REGISTERS // (k.registers * threads), H200_SHARED // (k.shared + 1024), 32)
        mma = "wgmma" if "wgmma" in k.ptx else "mma.sync" if "mma.sync" in k.ptx else "none"
        cols = 512 if args.kernel == "mla" else 128
        print(f"{label}: {k.registers} registers, {k.spill_bytes} bytes spilled, {k.shared} B shared, "
              f"{resident} per SM, {mma}, {meta['num_stages']} stages launched, "
              f"{k.pipeline_buffers(meta['BLOCK_N'], cols)} tile buffers, waits {k.loop_waits()}")


if __name__ == "__main__":
    main()
