"""Triton building block: ask the GPU's L2 cache for weights a later launch will stream.

At one token, a latent-attention layer's middle (the ``W_uk`` product, stage 1, the merge, ``W_uv``,
``o``) is a chain of small latency-bound launches that leave most of the memory bandwidth idle,
while the MoE block after it streams its weights at the bandwidth limit. A launch early in that
chain may ask L2 for weights the block reads later (the shared experts', whose rows do not depend
on the router), so the block finds them on chip. A bulk prefetch (``cp.async.bulk.prefetch.L2``,
sm_90) holds no register or shared memory and nothing waits for it: a hint that never changes a
result. Each program issues at most one request per thread, of ``CHUNK`` bytes, so a launch of P
programs covers ``P x threads x CHUNK`` bytes; the ranges' chunks are dealt to programs in turn.
Launchers turn it on only on Hopper or later GPUs, outside Triton's interpreter (which runs no
PTX), for 16-byte aligned ranges of a multiple of 16 bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from segkv.kernels.pdl import _INTERPRET, capability_major


@triton.jit
def _bulk_prefetch(ptrs, nbytes, ok, EVICT_LAST: tl.constexpr):
    """One bulk L2 prefetch of ``nbytes`` at each of ``ptrs`` (int8 pointers) where ``ok``."""
    if EVICT_LAST:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 pol; setp.ne.b32 p, $3, 0; "
            "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
            "=r,l,r,r", [ptrs, nbytes, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r,r", [ptrs, nbytes, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _range_chunks(base, nbytes, c, ok, CHUNK: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Chunks ``c`` (where ``ok``) of the ``nbytes`` at ``base``: the last one may be shorter."""
    start = c * CHUNK
    size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)
    _bulk_prefetch(base + start, tl.where(ok, size, 16), ok, EVICT_LAST)


@triton.jit
def prefetch_ranges_l2(R0, bytes0, R1, bytes1, R2, bytes2, pid, programs, LANES: tl.constexpr,
                       CHUNK: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Program ``pid`` of ``programs``: its turns of the chunks of up to three byte ranges ``R0 ..
    R2`` (int8 pointers; a range of 0 bytes is skipped), one chunk per lane of ``LANES`` (the
    launch's threads, so each request is issued once)."""
    lane = tl.arange(0, LANES).to(tl.int64)
    c = pid + lane * programs
    n0 = tl.cdiv(bytes0, CHUNK)
    n1 = tl.cdiv(bytes1, CHUNK)
    n2 = tl.cdiv(bytes2, CHUNK)
    _range_chunks(R0, bytes0, c, c < n0, CHUNK, EVICT_LAST)
    _range_chunks(R1, bytes1, c - n0, (c >= n0) & (c < n0 + n1), CHUNK, EVICT_LAST)
    _range_chunks(R2, bytes2, c - n0 - n1, (c >= n0 + n1) & (c < n0 + n1 + n2), CHUNK, EVICT_LAST)


def prefetch_args(tensors: tuple[torch.Tensor, ...], max_bytes: int) -> tuple | None:
    """Kernel arguments ``(R0, bytes0, R1, bytes1, R2, bytes2)`` for the first ``max_bytes`` of up
    to three contiguous tensors, in order (int8 views; empty ranges point at the first), or None
    where bulk prefetches cannot run: outside a Hopper-or-later GPU, in the interpreter, or for
    unaligned tensors."""
    if not tensors or len(tensors) > 3 or _INTERPRET:
        return None
    if not all(t.is_cuda and t.is_contiguous() and t.data_ptr() % 16 == 0 and t.numel() * t.element_size() % 16 == 0
               for t in tensors):
        return None
    if capability_major(tensors[0].device.index or 0) < 9:
        return None
    args, left = [], max_bytes // 16 * 16
    for t in tensors:
        nbytes = min(left, t.numel() * t.element_size())
        left -= nbytes
        args += [t.view(-1).view(torch.int8), nbytes]
    while len(args) < 6:  # unused ranges: 0 bytes
        args += [args[0], 0]
    return tuple(args)


# bytes per request: 2 MB of weights for every 128 requests
PREFETCH_CHUNK = 16384


def lanes(num_warps: int) -> int:
    """Threads of a launch of ``num_warps`` warps (one prefetch request each)."""
    return 32 * num_warps


def prefetch_capacity(programs: int, num_warps: int) -> int:
    """Bytes a launch of ``programs`` programs can ask for (one chunk per thread)."""
    return programs * lanes(num_warps) * PREFETCH_CHUNK


