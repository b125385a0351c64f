"""Triton kernel: a plan's stage 1 and its merge in one launch (grouped-query attention).

The merge launch of ``paged_attention`` starts when every stage-1 program has finished and its
writes are flushed. Here the merge's (row, head, column block) programs are work items of the
stage-1 launch, taken in order after every stage-1 item (``kernels.work_items``): a stage-1 item
counts each partial it stores (unless it is its row's only one) in ``COUNTERS[row, head]``; a merge
item waits until its row's count is its number of partials, then merges them through L2. Stage-1
items and merge items compute exactly what the two launches compute (``stage1_program``,
``merge_program``). The last merge item past its wait sets the counters back to 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

from segkv.kernels.paged_attention import merge_program, stage1_program
from segkv.kernels.work_items import claim_item, leave_zero_if_last, wait_full


@triton.jit
def _attention_one_launch_kernel(
    Q, K, V, OUT, LSE, FINAL, FINAL_LSE,
    page_table, page_rows, page_key_start, work_pages, work_partial_start, partial_row,
    partial_offset, partial_direct, reduce_ptr, reduce_partials, COUNTERS,
    stride_qr, stride_qh, stride_kp, stride_kn, stride_kh, stride_vp, stride_vn, stride_vh,
    stride_op, stride_oh, stride_lp, stride_fr, stride_fh, stride_flr, stride_c,
    scale, num_rows, num_work, num_heads,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, EXACT_FP32: tl.constexpr, HEADS_FASTEST: tl.constexpr, MERGE: tl.constexpr,
    USE_PDL: tl.constexpr = False, TRANSPOSED: tl.constexpr = False, PLAN_EARLY: tl.constexpr = False,
    MERGE_LANES: tl.constexpr = 1, MERGE_CHUNKED: tl.constexpr = False, NUM_KV: tl.constexpr = 1,
    PAIR_BLOCKS: tl.constexpr = 1, MERGE_DV: tl.constexpr = 64, MERGE_P: tl.constexpr = 64,
):
    """Items ``< num_work x NUM_KV x PAIR_BLOCKS``: stage-1 programs in the stage-1 launch's order;
    then merge items ``(row, head, MERGE_DV columns)``. ``COUNTERS``: ``num_rows x num_heads``
    (row stride ``stride_c``) int32 zeros, then the dispenser and the merge items' count."""
    tail = COUNTERS + num_rows * stride_c
    item = claim_item(tail, USE_PDL)
    stage1_items = num_work * NUM_KV * PAIR_BLOCKS
    if item < stage1_items:
        first = item % (NUM_KV if HEADS_FASTEST else num_work)
        second = (item // (NUM_KV if HEADS_FASTEST else num_work)) % (num_work if HEADS_FASTEST else NUM_KV)
        mb = item // (num_work * NUM_KV)
        w = second if HEADS_FASTEST else first
        kvh = first if HEADS_FASTEST else second
        stage1_program(
            Q, K, V, OUT, LSE, FINAL, FINAL_LSE,
            page_table, page_rows, page_key_start, work_pages, work_partial_start, partial_row,
            partial_offset, partial_direct, reduce_ptr, reduce_partials, COUNTERS,
            stride_qr, stride_qh, stride_kp, stride_kn, stride_kh, stride_vp, stride_vn, stride_vh,
            stride_op, stride_oh, stride_lp, stride_fr, stride_fh, stride_flr, stride_c,
            scale, num_rows, w, kvh, mb,
            GROUP, DK, DV, BLOCK_M, BLOCK_DK, BLOCK_DV, PAGE_SIZE, BLOCK_N, EXACT_FP32, 0, False, TRANSPOSED,
            PLAN_EARLY, MERGE_LANES, MERGE_CHUNKED, True)
    else:
        COLUMN_BLOCKS: tl.constexpr = (DV + MERGE_DV - 1) // MERGE_DV
        m = item - stage1_items
        row = m // (num_heads * COLUMN_BLOCKS)
        head = (m // COLUMN_BLOCKS) % num_heads
        count = tl.load(reduce_ptr + row + 1) - tl.load(reduce_ptr + row)
        if count > 1:
            wait_full(COUNTERS + row * stride_c + head, count)
        merge_program(OUT, LSE, FINAL, FINAL_LSE, reduce_ptr, reduce_partials, stride_op, stride_oh, stride_lp,
                      stride_fr, stride_fh, stride_flr, row, head, m % COLUMN_BLOCKS, DV, MERGE_DV, MERGE_P, False,
                      False, 1, True)
        leave_zero_if_last(tail + 1, num_rows * num_heads * COLUMN_BLOCKS, COUNTERS, num_rows * stride_c + 2, 1024)
