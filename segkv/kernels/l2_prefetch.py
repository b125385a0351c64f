"""Triton building block: ask the GPU's L2 cache for bytes a program will read later.

One bulk prefetch per row (``cp.async.bulk.prefetch.L2``, sm_90): no register or shared memory
holds the data and nothing waits for it. A hint: results never change (the L2 cache is where the
GPU's writes meet, so a row written after its prefetch is read as written). Launchers turn it on
only for Hopper or later GPUs, outside Triton's interpreter (which runs no PTX), for 16-byte
aligned rows of a multiple of 16 bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from segkv.kernels.pdl import _INTERPRET, capability_major


@triton.jit
def prefetch_rows_l2(ptrs, ok, nbytes):
    """Prefetch ``nbytes`` (a constant or a scalar) at each of ``ptrs`` where ``ok``."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [ptrs.to(tl.pointer_type(tl.int8)), tl.zeros_like(ok.to(tl.int32)) + nbytes, ok.to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)


def rows_prefetchable(tensors: tuple[torch.Tensor, ...], row_elements: tuple[int, ...]) -> bool:
    """Whether bulk prefetches can ask for rows of ``tensors``: CUDA tensors on a Hopper or later
    GPU, outside the interpreter, of 16-bit values with unit column stride, 16-byte aligned starts
    and other strides, and rows of ``row_elements`` (each a multiple of 8 elements, 16 bytes)."""
    return (not _INTERPRET and all(t.is_cuda for t in tensors)
            and all(capability_major(t.device.index or 0) >= 9 for t in tensors)
            and all(t.element_size() == 2 and t.stride(-1) == 1 and t.data_ptr() % 16 == 0
                    and all(s % 8 == 0 for s in t.stride()[:-1]) for t in tensors)
            and all(n % 8 == 0 for n in row_elements))
