"""Registers, spills, shared memory and resident programs per SM of the stage-1 attention kernels,
compiled for Hopper (sm_90a) on any machine: no GPU needed.

The installed Triton compiles the kernel to PTX for a CUDA target and its bundled ``ptxas``
assembles it with ``-v``. This answers "how many programs fit on a multiprocessor" (the planner's
wave) and "does this launch spill" before spending device time. The GPU machine's Triton may be
older than this one, so its code can differ slightly; check one configuration there with
``ncu --section LaunchStats --section Occupancy`` when a decision depends on it.

    python3 scripts/kernel_resources.py --kernel mla --block-n 16,32 --warps 4,8
    python3 scripts/kernel_resources.py --kernel gqa --block-m 16,64 --maxnreg 0,128
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from segkv.kernels import mla_attention, paged_attention

H200_REGISTERS = 65536  # per multiprocessor
H200_SHARED = 228 * 1024  # bytes per multiprocessor (227 KB usable per block + 1 KB reserved)
INDEX_ARGS = {"page_table", "page_rows", "page_key_start", "piece_page_start", "work_piece",
              "work_partial_start", "partial_row", "partial_offset", "partial_direct"}


def kernel_and_constants(kind: str, block_n: int, block_m: int, page_size: int) -> tuple:
    """The jit function, its float pointer types and its constexpr values for a real model shape:
    Llama-3-8B (group 4, head_dim 128) or DeepSeek (rank 512 + rope 64), bf16."""
    if kind == "gqa":
        return paged_attention._stage1_kernel, {"Q": "*bf16", "K": "*bf16", "V": "*bf16"}, dict(
            GROUP=4, DK=128, DV=128, BLOCK_M=block_m, BLOCK_DK=128, BLOCK_DV=128, PAGE_SIZE=page_size,
            BLOCK_N=block_n, EXACT_FP32=False, HEADS_FASTEST=True)
    return mla_attention._mla_stage1_kernel, {"Q": "*bf16", "LAT": "*bf16"}, dict(
        RANK=512, ROPE=64, BLOCK_R=512, BLOCK_ROPE=64, BLOCK_M=block_m, PAGE_SIZE=page_size, BLOCK_N=block_n,
        EXACT_FP32=False)


def compile_for_sm90(fn, pointers: dict, constants: dict, *, warps: int, stages: int, maxnreg: int | None) -> dict:
    """Compile with the JIT's usual assumptions (16-byte aligned pointers and strides) and assemble."""
    names = list(inspect.signature(fn.fn).parameters)
    signature = {}
    for name in names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        elif name in ("OUT", "LSE", "FINAL_LSE"):
            signature[name] = "*fp32"
        elif name == "FINAL":
            signature[name] = "*bf16"
        elif name in INDEX_ARGS:
            signature[name] = "*i32"
        elif name == "scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
               if signature[name].startswith("*") or name.startswith("stride") or name == "num_heads"}
    options = dict(num_warps=warps, num_stages=stages)
    if maxnreg:
        options["maxnreg"] = maxnreg
    compiled = triton.compile(ASTSource(fn, signature, constants, aligned), target=GPUTarget("cuda", 90, 32),
                              options=options)
    ptx = compiled.asm["ptx"]
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = next((os.path.join(bin_dir, n) for n in ("ptxas-blackwell", "ptxas")
                  if os.path.exists(os.path.join(bin_dir, n))), "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", path, "-o", path + ".o"],
                             capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr.strip()[-400:])
    info = out.stderr
    registers = int(info.split("Used ")[1].split(" registers")[0])
    spills = sum(int(part.split(" bytes spill")[0].split()[-1]) for part in info.split(",") if "bytes spill" in part)
    shared = compiled.metadata.shared
    threads = 32 * warps
    resident = min(H200_REGISTERS // (registers * threads), H200_SHARED // (shared + 1024), 32)
    mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
    return dict(registers=registers, spill_bytes=spills, shared=shared, resident=resident, mma=mma)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", choices=("gqa", "mla"), default="mla")
    p.add_argument("--block-n", default="32", help="keys per tile (comma list)")
    p.add_argument("--block-m", default="16", help="(row x head) pairs per program (comma list)")
    p.add_argument("--warps", default="4")
    p.add_argument("--stages", default="2")
    p.add_argument("--maxnreg", default="0", help="register caps, 0 for none (comma list)")
    p.add_argument("--page-size", type=int, default=16)
    args = p.parse_args()
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    print(f"triton {triton.__version__}, target sm_90a; resident programs per SM from registers and shared "
          "memory (64K registers, 228 KB)")
    for block_n, block_m, warps, stages, cap in itertools.product(
            ints(args.block_n), ints(args.block_m), ints(args.warps), ints(args.stages), ints(args.maxnreg)):
        fn, pointers, constants = kernel_and_constants(args.kernel, max(block_n, args.page_size), block_m,
                                                       args.page_size)
        label = f"{args.kernel} BLOCK_N {block_n:3d} BLOCK_M {block_m:3d} warps {warps} stages {stages} maxnreg {cap or '-'}"
        try:
            r = compile_for_sm90(fn, pointers, constants, warps=warps, stages=stages, maxnreg=cap or None)
        except Exception as e:  # noqa: BLE001 - report the configuration that failed and go on
            print(f"{label}: failed: {str(e).splitlines()[-1][:200] if str(e) else type(e).__name__}")
            continue
        print(f"{label}: {r['registers']} registers, {r['spill_bytes']} bytes spilled, {r['shared']} B shared, "
              f"{r['resident']} per SM, {r['mma']}")


if __name__ == "__main__":
    main()
