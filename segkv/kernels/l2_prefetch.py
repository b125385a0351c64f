"""Triton building block: ask the GPU's L2 cache for bytes a program will read later.

One bulk prefetch per row (``cp.async.bulk.prefetch.L2``, sm_90): no register or shared memory
holds the data and nothing waits for it. A hint: results never change (the L2 cache is where the
GPU's writes meet, so a row written after its prefetch is read as written). Launchers turn it on
only for Hopper or later GPUs, outside Triton's interpreter (which runs no PTX), for 16-byte
aligned rows of a multiple of 16 bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def prefetch_rows_l2(ptrs, ok, nbytes):
    """Prefetch ``nbytes`` (a constant or a scalar) at each of ``ptrs`` where ``ok``."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [ptrs.to(tl.pointer_type(tl.int8)), tl.zeros_like(ok.to(tl.int32)) + nbytes, ok.to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)
