"""Program timelines of a launch: where each program's time goes, read on the GPU (diagnostics).

A kernel given a ``STAMPS`` int64 tensor writes, per program, :data:`FIELDS` values at fixed
points (``record``); ``None`` (every launch's default) compiles the stamps away. CUDA only.
"""

from __future__ import annotations

from segkv.kernels.triton_import import tl, triton

# per program: globaltimer (ns) at its start, after its PDL wait, at its end; clock64 at the same
# three points (cycles, this SM's counter); the SM it ran on
FIELDS = 7


@triton.jit
def global_ns():
    """The GPU's global timer (ns, shared by all SMs)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def sm_cycles():
    """This SM's cycle counter."""
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def sm_id():
    """The SM running this program."""
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def program_index():
    """The program's index in its launch's grid, x fastest."""
    return (tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2)))


@triton.jit
def record(STAMPS, t0, c0, t1, c1):
    """Store a program's stamps in its row of ``STAMPS`` (:data:`FIELDS` int64 values a program):
    start (``t0``, ``c0``), after its wait (``t1``, ``c1``), now, and its SM."""
    base = STAMPS + program_index().to(tl.int64) * 7  # FIELDS
    t2 = global_ns()
    c2 = sm_cycles()
    tl.store(base, t0)
    tl.store(base + 1, t1)
    tl.store(base + 2, t2)
    tl.store(base + 3, c0)
    tl.store(base + 4, c1)
    tl.store(base + 5, c2)
    tl.store(base + 6, sm_id().to(tl.int64))
