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
    python3 scripts/kernel_resources.py --kernel mla --sass   # machine instructions per program and tile
"""

from __future__ import annotations

import argparse
import itertools

import triton

from segkv.kernels.offline_compile import stage1_report
from segkv.kernels.paged_attention import LaunchConfig

H200_REGISTERS = 65536  # per multiprocessor
H200_SHARED = 228 * 1024  # bytes per multiprocessor (227 KB usable per block + 1 KB reserved)


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
    p.add_argument("--sass", action="store_true", help="also the machine instructions: per program and per tile loop")
    args = p.parse_args()
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    print(f"triton {triton.__version__}, target sm_90a, {args.dtype}; resident programs per SM from registers "
          "and shared memory (64K registers, 228 KB)")
    group = 4 if args.kernel == "gqa" else 16  # (row x head) pairs per query row: Llama-3-8B, DeepSeek
    for block_n, block_m, warps, stages, cap in itertools.product(
            ints(args.block_n), ints(args.block_m), ints(args.warps), ints(args.stages), ints(args.maxnreg)):
        label = f"{args.kernel} BLOCK_N {block_n:3d} BLOCK_M {block_m:3d} warps {warps} stages {stages} maxnreg {cap or '-'}"
        launch = LaunchConfig(max(block_n, args.page_size), warps, stages, block_m=block_m, tall_warps=warps,
                              maxnreg=cap or None)
        case = {"kernel": "gqa" if args.kernel == "gqa" else "latent", "dtype": args.dtype, "head_dim": 128,
                "page_size": args.page_size, "rows": max(1, block_m // group), "assemble": True, "sass": args.sass}
        try:
            r = stage1_report(case, launch)
        except Exception as e:  # noqa: BLE001 - report the configuration that failed and go on
            print(f"{label}: failed: {str(e).splitlines()[-1][:200] if str(e) else type(e).__name__}")
            continue
        resident = min(H200_REGISTERS // (r["registers"] * 32 * r["num_warps"]), H200_SHARED // (r["shared"] + 1024), 32)
        print(f"{label}: {r['registers']} registers, {r['spill_bytes']} bytes spilled, {r['shared']} B shared, "
              f"{resident} per SM, {r['mma']}, {r['num_stages']} stages launched, {r['buffers']} tile buffers, "
              f"waits {r['waits']}")
        counts = r["sass"]
        if counts:
            print(f"    SASS: {counts['total']} instructions; loops " + "; ".join(
                f"{lp['instructions']} ({lp['mma']} MMA, {lp['ldmatrix']} ldmatrix, {lp['barriers']} barriers)"
                for lp in counts["loops"] if lp["instructions"] > 1))


if __name__ == "__main__":
    main()
