"""Triton building blocks of launches whose programs take work items in order.

A launch of several kinds of work, where some items need others' results (the experts' down
products their activation, their gate/up products the router's normed row and ids), gives each
program its item from an atomic dispenser instead of its program id: items then start in order
whatever order the GPU starts programs in, so an item that waits for earlier ones
(:func:`wait_full`) knows each of them is held by a running program, and its wait ends at any
occupancy. Producers count themselves in (:func:`count_done`, release); waiters spin on an
acquire load. The launch's last waiter sets the counters back to 0 for the next launch.
"""

from __future__ import annotations

from segkv.kernels.triton_import import tl, triton


@triton.jit
def count_done(COUNTER):
    """Count one finished item in: every thread's stores come first (released by it)."""
    tl.debug_barrier()
    tl.atomic_add(COUNTER, 1, sem="release", scope="gpu")


@triton.jit
def wait_full(COUNTER, need):
    """Spin until ``COUNTER`` reaches ``need`` (acquire: the counted stores are visible after)."""
    seen = tl.atomic_add(COUNTER, 0, sem="acquire", scope="gpu")
    while seen < need:
        seen = tl.atomic_add(COUNTER, 0, sem="acquire", scope="gpu")


@triton.jit
def claim_item(COUNTERS, USE_PDL: tl.constexpr):
    """The program's work item, from the dispenser, after the PDL wait (the launch before may be
    this kernel on the same counters)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    return tl.atomic_add(COUNTERS, 1, sem="relaxed", scope="gpu")


@triton.jit
def leave_zero_if_last(PASSED, waiters, COUNTERS, size, BLOCK: tl.constexpr):
    """Count one waiter past its wait in ``PASSED``; the last of ``waiters`` sets ``COUNTERS[0:size]``
    (the dispenser and ``PASSED`` among them) back to 0 for the next launch: by then every item was
    taken and every count it waited for is complete."""
    passed = tl.atomic_add(PASSED, 1, sem="relaxed", scope="gpu")
    if passed == waiters - 1:
        offs = tl.arange(0, BLOCK)
        for i0 in range(0, size, BLOCK):
            tl.store(COUNTERS + i0 + offs, tl.zeros_like(offs), mask=i0 + offs < size)
