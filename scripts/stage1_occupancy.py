"""Resident stage-1 programs per SM as the CUDA driver places them, for the GQA decode launches of
the kernel benchmark's shapes (run on a CUDA device).

For each (shape, page size) a batch-64 decode step in one piece per sequence is planned and run
once; every stage-1 program it compiled is then reported with its registers, spills, shared memory
and warps (Triton's loaded kernel) and ``cuOccupancyMaxActiveBlocksPerMultiprocessor`` (the
driver's answer, where a register count alone can mislead). The planner's wave assumes 2 programs
per SM (``DeviceSpec.blocks_per_multiprocessor``).

    python3 scripts/stage1_occupancy.py --shapes llama3-8b,llama3-70b --page-sizes 16,32
"""

from __future__ import annotations

import argparse
import ctypes

import torch

from segkv.attention import AttentionShape, DeviceSpec, SequenceQuery, plan_attention
from segkv.attention.triton_backend import TritonBackend
from benchmarks.decode_attention import SHAPES
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, KVLayout
from segkv.kernels import paged_attention


def driver_occupancy(function: int, threads: int, shared: int) -> int | str:
    """``cuOccupancyMaxActiveBlocksPerMultiprocessor`` for a loaded kernel (``CUfunction``), or
    why it could not be asked."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"no libcuda: {exc}"
    blocks = ctypes.c_int(0)
    status = cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(blocks), ctypes.c_void_p(function),
                                                             ctypes.c_int(threads), ctypes.c_size_t(shared))
    return blocks.value if status == 0 else f"CUresult {status}"


def compiled_stage1() -> dict[int, object]:
    """The stage-1 kernels Triton has compiled so far, by id (the per-device caches' first entry
    is the kernel cache in Triton 3.x)."""
    kernels = {}
    for entry in paged_attention._stage1_kernel.device_caches.values():
        for kernel in entry[0].values():
            kernels[id(kernel)] = kernel
    return kernels


def run_case(shape_name: str, page_size: int, batch: int, context: int) -> None:
    q_heads, kv_heads, head_dim = SHAPES[shape_name]
    layout = KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, dtype=torch.bfloat16)
    pages = batch * -(-context // page_size) + 1
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=pages), device="cuda",
                         compaction=CompactionPolicy(enabled=False))
    chains = [cache.new_chain() for _ in range(batch)]
    for chain in chains:
        chain.append(context)
    shape = AttentionShape(q_heads, kv_heads, head_dim, head_dim)
    plan = plan_attention([SequenceQuery.from_chain(c, 1) for c in chains], shape, DeviceSpec.cuda(),
                          page_size=page_size)
    backend = TritonBackend(page_size=page_size, device="cuda")
    q = torch.randn(batch, q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    before = compiled_stage1()
    backend.run(backend.prepare(plan), q, cache.storage.key_cache(0), cache.storage.value_cache(0),
                scale=head_dim**-0.5)
    torch.cuda.synchronize()
    new = [k for i, k in compiled_stage1().items() if i not in before] or list(before.values())[-1:]
    for kernel in new:
        kernel._init_handles()
        meta = kernel.metadata
        threads = meta.num_warps * 32
        print(f"{shape_name} pages of {page_size}, batch {batch} / {context} ({plan.route.value} x{plan.num_partitions}):"
              f" {kernel.n_regs} registers, {kernel.n_spills} spilled, {meta.shared} B shared, {meta.num_warps} warps,"
              f" {meta.num_stages} stages; driver: {driver_occupancy(kernel.function, threads, meta.shared)} per SM",
              flush=True)
    for chain in chains:
        chain.release()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama3-8b,llama3-70b")
    p.add_argument("--page-sizes", default="16,32")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("stage1_occupancy needs a CUDA device")
    for shape_name in args.shapes.split(","):
        for page_size in (int(v) for v in args.page_sizes.split(",")):
            run_case(shape_name, page_size, args.batch, args.context)


if __name__ == "__main__":
    main()
