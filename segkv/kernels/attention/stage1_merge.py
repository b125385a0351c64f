"""Triton building blocks of the merge inside stage 1: the last program to finish a (query row,
head) pair merges its partials (an atomic ticket per pair), and the first work item's programs
zero the rows without partials, so a decode plan of few partials per row needs no merge launch.
Results follow the merge kernel's contract (float32, rounded once). ``SINKS`` (attention sinks,
``(Hq,)`` float32 natural-log logits per query head; None compiles them away): each merged row's
state starts as its head's sink (max ``sink``, weight sum 1, a zero value), exactly as the merge
kernel's, so the sink is one more LSE term folded before the rounding; a row without partials gets
0 with LSE ``sink``."""

from __future__ import annotations

from segkv.kernels.triton_import import tl, triton


@triton.jit
def zero_empty_rows(reduce_ptr, num_rows, kvh, FINAL, FINAL_LSE, stride_fr, stride_fh, stride_flr,
                    GROUP: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, SINKS=None):
    """Rows without partials (no visible key, a graph bucket's padding rows): 0 with LSE -inf (with
    ``SINKS``: the head's sink) in KV head ``kvh``'s query heads (what the merge kernel writes for
    them)."""
    PAIRS: tl.constexpr = 16
    offs_d = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < DV
    for p0 in range(0, num_rows * GROUP, PAIRS):
        pair = p0 + tl.arange(0, PAIRS)
        row = (pair // GROUP).to(tl.int64)
        ok = row < num_rows
        count = tl.load(reduce_ptr + row + 1, mask=ok, other=0) - tl.load(reduce_ptr + row, mask=ok, other=0)
        empty = ok & (count == 0)
        head = kvh * GROUP + pair % GROUP
        tl.store(FINAL + row[:, None] * stride_fr + head[:, None] * stride_fh + offs_d[None, :],
                 tl.zeros([PAIRS, BLOCK_DV], FINAL.dtype.element_ty), mask=empty[:, None] & d_ok[None, :])
        if SINKS is not None:
            empty_lse = tl.load(SINKS + head, mask=empty, other=float("-inf"))
        else:
            empty_lse = tl.full([PAIRS], float("-inf"), tl.float32)
        tl.store(FINAL_LSE + row * stride_flr + head, empty_lse, mask=empty)


@triton.jit
def merge_if_last(partial, head, valid, qrow, partial_direct, reduce_ptr, reduce_partials, COUNTERS, stride_c,
                  OUT, LSE, FINAL, FINAL_LSE, offs_d, d_ok, stride_op, stride_oh, stride_lp, stride_fr, stride_fh,
                  stride_flr, MAX_PARTIALS: tl.constexpr, SINKS=None):
    """After a program stored its partials: for each of its (row, head) pairs with several
    partials (at most ``MAX_PARTIALS``), count this one in (an atomic ticket per pair). The
    program holding a pair's last ticket merges that pair's partials by the contract's formula
    (all of them in one load: no chain of dependent loads), rounds once into FINAL/FINAL_LSE and
    resets the ticket to 0 for the next launch. Saves the merge launch of a decode step."""
    direct = tl.load(partial_direct + partial, mask=valid, other=0)
    shared = valid & (direct < 0)
    start = tl.load(reduce_ptr + qrow, mask=shared, other=0)
    count = tl.load(reduce_ptr + qrow + 1, mask=shared, other=0) - start
    tl.debug_barrier()  # every thread's partial stores come before the ticket (released by it)
    ticket = tl.atomic_add(COUNTERS + qrow * stride_c + head, 1, mask=shared, sem="acq_rel", scope="gpu")
    last = shared & (ticket == count - 1)
    if tl.max(last.to(tl.int32), 0) > 0:
        j = tl.arange(0, MAX_PARTIALS)
        ok = last[:, None] & (j[None, :] < count[:, None])
        p = tl.load(reduce_partials + start[:, None] + j[None, :], mask=ok, other=0).to(tl.int64)
        # other programs' partials: read through L2 (".cg"), not a stale L1
        lse = tl.load(LSE + p * stride_lp + head[:, None], mask=ok, other=float("-inf"), cache_modifier=".cg")
        live = lse != float("-inf")
        o = tl.load(OUT + p[:, :, None] * stride_op + head[:, None, None] * stride_oh + offs_d[None, None, :],
                    mask=live[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=".cg")
        m = tl.max(lse, 1)
        if SINKS is not None:  # the sink: one more LSE term, with a zero value
            sink = tl.load(SINKS + head, mask=last, other=float("-inf"))
            m = tl.maximum(m, sink)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        wgt = tl.where(live, tl.exp(lse - m_safe[:, None]), 0.0)
        total = tl.sum(wgt, 1)
        if SINKS is not None:
            total = total + tl.exp(sink - m_safe)
        acc = tl.sum(wgt[:, :, None] * o, 1)
        empty = total == 0.0
        out = acc / tl.where(empty, 1.0, total)[:, None]
        tl.store(FINAL + qrow[:, None] * stride_fr + head[:, None] * stride_fh + offs_d[None, :],
                 out.to(FINAL.dtype.element_ty, fp_downcast_rounding="rtne"), mask=last[:, None] & d_ok[None, :])
        tl.store(FINAL_LSE + qrow * stride_flr + head,
                 tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, total))), mask=last)
        tl.store(COUNTERS + qrow * stride_c + head, tl.zeros_like(ticket), mask=last)


@triton.jit
def merge_group_if_last(partial, head, valid, qrow, partial_direct, reduce_ptr, reduce_partials, COUNTERS, stride_c,
                        OUT, LSE, FINAL, FINAL_LSE, offs_d, d_ok, stride_op, stride_oh, stride_lp, stride_fr,
                        stride_fh, stride_flr, kvh, mb, MAX_PARTIALS: tl.constexpr, GROUP: tl.constexpr,
                        LANES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, SINKS=None):
    """:func:`merge_if_last` for rows of many partials (16 to 64): a decode program's pairs are
    heads of one query row, in its first ``LANES`` lanes (``GROUP`` rounded up to a power of 2, at
    most ``BLOCK_M``), so the program holding the last tickets merges those heads only, ``CHUNK``
    partials at a time with a running maximum (a ``(LANES, CHUNK, BLOCK_DV)`` float32 block, about
    64 registers a thread at 4 warps) instead of ``(BLOCK_M, MAX_PARTIALS, BLOCK_DV)`` at once."""
    CHUNK: tl.constexpr = min(MAX_PARTIALS, max(4, 64 // LANES))
    direct = tl.load(partial_direct + partial, mask=valid, other=0)
    shared = valid & (direct < 0)
    count_pair = (tl.load(reduce_ptr + qrow + 1, mask=shared, other=0)
                  - tl.load(reduce_ptr + qrow, mask=shared, other=0))
    tl.debug_barrier()  # every thread's partial stores come before the ticket (released by it)
    ticket = tl.atomic_add(COUNTERS + qrow * stride_c + head, 1, mask=shared, sem="acq_rel", scope="gpu")
    last = shared & (ticket == count_pair - 1)
    if tl.max(last.to(tl.int32), 0) > 0:
        g = tl.arange(0, LANES)
        lane = tl.arange(0, BLOCK_M)
        last_g = tl.max(tl.where((lane[None, :] == g[:, None]) & last[None, :], 1, 0), 1) > 0  # (LANES,)
        row = tl.max(tl.where(valid, qrow, 0), 0)  # the program's one query row
        start = tl.load(reduce_ptr + row)
        count = tl.load(reduce_ptr + row + 1) - start
        head_g = kvh * GROUP + (mb * BLOCK_M + g) % GROUP  # as the pairs' heads
        j = tl.arange(0, CHUNK)
        m = tl.full([LANES], float("-inf"), tl.float32)
        total = tl.zeros([LANES], tl.float32)
        if SINKS is not None:  # the running state starts as the sink's: max sink, weight 1, value 0
            m = tl.load(SINKS + head_g, mask=last_g, other=float("-inf"))
            total = tl.where(m == float("-inf"), 0.0, 1.0)
        acc = tl.zeros([LANES, BLOCK_DV], tl.float32)
        for i0 in range(0, count, CHUNK):
            in_row = i0 + j < count
            p = tl.load(reduce_partials + start + i0 + j, mask=in_row, other=0).to(tl.int64)
            ok = last_g[:, None] & in_row[None, :]
            # other programs' partials: read through L2 (".cg"), not a stale L1
            lse = tl.load(LSE + p[None, :] * stride_lp + head_g[:, None], mask=ok, other=float("-inf"),
                          cache_modifier=".cg")
            live = lse != float("-inf")
            o = tl.load(OUT + p[None, :, None] * stride_op + head_g[:, None, None] * stride_oh + offs_d[None, None, :],
                        mask=live[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m, tl.max(lse, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)  # rescales earlier chunks; 0 while nothing was live
            wgt = tl.where(live, tl.exp(lse - m_safe[:, None]), 0.0)
            acc = acc * alpha[:, None] + tl.sum(wgt[:, :, None] * o, 1)
            total = total * alpha + tl.sum(wgt, 1)
            m = m_new
        empty = total == 0.0
        out = acc / tl.where(empty, 1.0, total)[:, None]
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        tl.store(FINAL + row * stride_fr + head_g[:, None] * stride_fh + offs_d[None, :],
                 out.to(FINAL.dtype.element_ty, fp_downcast_rounding="rtne"), mask=last_g[:, None] & d_ok[None, :])
        tl.store(FINAL_LSE + row * stride_flr + head_g,
                 tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, total))), mask=last_g)
        tl.store(COUNTERS + row * stride_c + head_g, tl.zeros([LANES], tl.int32), mask=last_g)
