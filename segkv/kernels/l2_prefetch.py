"""Triton kernel: bring a weight into the GPU's L2 cache while memory is otherwise idle.

At batch 1 and short context a decoder layer's attention reads a few MB in ~10 us of mostly
latency, while the output projection after it (32 MB for Llama-3.1-8B) then streams from memory.
``l2_prefetch`` launched between the q/k/v launch and attention asks the L2 for the next
product's weight with bulk prefetches (``cp.async.bulk.prefetch.L2``: one instruction per
chunk, no registers or shared memory held, nothing waits for the data), so that product finds
it there. It is a hint: results never change. With programmatic dependent launch it is
scheduled while the kernel before it finishes, prefetches at once, then waits for that kernel
(so a PDL kernel after it that waits for it also waits for the one before).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from segkv.kernels.pdl import _INTERPRET, capability_major, pdl_options

CHUNK_BYTES = 4096  # per thread and prefetch instruction (a multiple of 16)
THREADS = 128  # one program of 4 warps, one chunk per thread


@triton.jit
def _l2_prefetch_kernel(W, nbytes, CHUNK: tl.constexpr, THREADS: tl.constexpr, USE_PDL: tl.constexpr):
    """Program ``p``: thread ``t`` prefetches bytes ``[(p THREADS + t) CHUNK, ... + CHUNK)`` of
    ``W`` (clipped to ``nbytes``, a multiple of 16)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    start = (tl.program_id(0) * THREADS + tl.arange(0, THREADS)).to(tl.int64) * CHUNK
    ok = start < nbytes
    size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)
    base = W.to(tl.pointer_type(tl.int8))
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [base + start, size, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


def supported(t: torch.Tensor) -> bool:
    """Whether ``l2_prefetch`` launches for ``t``: a CUDA tensor on a Hopper or later GPU (bulk
    prefetch is sm_90), outside Triton's interpreter (which runs no PTX)."""
    return t.is_cuda and not _INTERPRET and capability_major(t.device.index or 0) >= 9


def l2_prefetch(weight: torch.Tensor, max_bytes: int | None = None) -> int:
    """Prefetch the first ``max_bytes`` (default all) of contiguous ``weight`` into L2; returns the
    bytes asked for (0 where :func:`supported` says no: a hint, nothing to do)."""
    if not weight.is_contiguous():
        raise ValueError(f"l2_prefetch: a contiguous tensor expected, got strides {weight.stride()}")
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"l2_prefetch: max_bytes must be >= 0, got {max_bytes}")
    nbytes = weight.numel() * weight.element_size()
    nbytes = (min(nbytes, max_bytes) if max_bytes is not None else nbytes) // 16 * 16
    if nbytes == 0 or not supported(weight) or weight.data_ptr() % 16:
        return 0
    _l2_prefetch_kernel[(triton.cdiv(nbytes, CHUNK_BYTES * THREADS),)](
        weight, nbytes, CHUNK=CHUNK_BYTES, THREADS=THREADS, num_warps=THREADS // 32, **pdl_options(weight))
    return nbytes
