"""Triton kernels for sampling: the argmax of each row of logits.

``torch.argmax`` over one row of a 128K-entry vocabulary runs as a single-block reduction, which
measured slow between two decode steps' graph replays (docs/performance-notes.md).
:func:`row_argmax` splits each row into chunks reduced side by side, then reduces the chunks'
winners: two short launches.
"""

from __future__ import annotations

import torch
from segkv.kernels.triton_import import tl, triton


@triton.jit
def _chunk_argmax_kernel(X, VALUES, INDICES, stride_x, vocab, chunks, CHUNK: tl.constexpr):
    """Program (row, chunk): the chunk's winner. A NaN wins over any number (the first NaN);
    otherwise the largest value, the first of equal ones (as ``torch.argmax``)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = offs < vocab
    x = tl.load(X + row * stride_x + offs, mask=ok, other=float("-inf")).to(tl.float32)
    nan = ok & (x != x)
    first_nan = tl.min(tl.where(nan, offs, vocab), axis=0)
    numbers = tl.where(nan, float("-inf"), x)
    has_nan = first_nan < vocab
    index = tl.where(has_nan, first_nan, chunk * CHUNK + tl.argmax(numbers, axis=0, tie_break_left=True))
    value = tl.where(has_nan, float("nan"), tl.max(numbers, axis=0))
    tl.store(VALUES + row * chunks + chunk, value)
    tl.store(INDICES + row * chunks + chunk, index)


@triton.jit
def _final_argmax_kernel(VALUES, INDICES, OUT, chunks, BLOCK: tl.constexpr):
    """Program ``row``: the winner among the row's chunk winners (chunks in index order)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < chunks
    value = tl.load(VALUES + row * chunks + offs, mask=ok, other=float("-inf"))
    index = tl.load(INDICES + row * chunks + offs, mask=ok, other=0)
    nan = ok & (value != value)
    first_nan = tl.min(tl.where(nan, offs, BLOCK), axis=0)
    best = tl.argmax(tl.where(nan, float("-inf"), value), axis=0, tie_break_left=True)
    pick = tl.where(first_nan < BLOCK, first_nan, best)
    tl.store(OUT + row, tl.sum(tl.where(offs == pick, index, 0), axis=0).to(tl.int64))


_CHUNK = 4096  # vocabulary entries per program: 32 programs for a 128K vocabulary


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x (B, V)`` (any float dtype, unit last stride) -> ``(B,)`` int64: each row's index of its
    largest value, the first of equal ones, and the first NaN if the row has any (what
    ``x.argmax(dim=-1)`` returns)."""
    if x.dim() != 2 or x.shape[1] == 0 or x.stride(-1) != 1 or not x.is_floating_point():
        raise ValueError(f"row_argmax needs (B, V) floats with V > 0 and a unit last stride, got "
                         f"{tuple(x.shape)} {x.dtype}")
    batch, vocab = x.shape
    chunks = triton.cdiv(vocab, _CHUNK)
    chunk = min(_CHUNK, triton.next_power_of_2(vocab))
    values = torch.empty(batch, chunks, dtype=torch.float32, device=x.device)
    indices = torch.empty(batch, chunks, dtype=torch.int32, device=x.device)
    out = torch.empty(batch, dtype=torch.int64, device=x.device)
    if batch:
        _chunk_argmax_kernel[(batch, chunks)](x, values, indices, x.stride(0), vocab, chunks, CHUNK=chunk,
                                              num_warps=4)
        _final_argmax_kernel[(batch,)](values, indices, out, chunks, BLOCK=max(2, triton.next_power_of_2(chunks)),
                                       num_warps=1)
    return out
