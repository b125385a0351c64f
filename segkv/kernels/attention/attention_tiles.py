"""Triton building blocks of the stage-1 attention programs (GQA and latent): page indices and
tile rows, the plan's share of a program, a tree window's key masks, the online-softmax step in
float32, and the store of a program's partials. Inlined by the kernels of ``paged_attention`` and
``mla_attention``."""

from __future__ import annotations

from segkv.kernels.triton_import import tl, triton

from segkv.kernels.quant.fp8_gemm import e4m3_bits_to_float
from segkv.settings import SETTINGS

# ``ex2.approx.ftz.f32`` on the GPU: Triton's ``exp2`` emits ``ex2.approx.f32``, which ptxas wraps
# in a subnormal fix-up (a compare and two predicated multiplies per element, a sizeable share of
# the tile loop's instructions). Flushing results below 2^-126 to 0
# changes nothing a float32 softmax can see: such a weight is under 2^-126 of the row's largest,
# which is 1. The interpreter runs Triton's ``exp2``.
FAST_EXP2: tl.constexpr = tl.constexpr(not SETTINGS.triton_interpret)
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def exp2_ftz(x):
    """``2 ** x`` in float32, results below 2^-126 flushed to 0 (``exp2_ftz(-inf) == 0``)."""
    if FAST_EXP2:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return tl.exp2(x)


@triton.jit
def page_index(page_table, page_rows, page_key_start, pidx, pg1, WIDE: tl.constexpr):
    """Page ids, valid rows and first-row positions of pages ``pidx`` (0 past ``pg1``). The ids are
    int64 when ``WIDE`` (:func:`paged_attention.wide_offsets`: a cache whose element offsets pass
    int32), else int32: a page's offset is then one 32-bit multiply instead of a sign extension and a
    64-bit product per tile row (fewer instructions in the tile loop)."""
    in_range = pidx < pg1
    page = tl.load(page_table + pidx, mask=in_range, other=0)
    if WIDE:
        page = page.to(tl.int64)
    rows = tl.load(page_rows + pidx, mask=in_range, other=0)
    key_start = tl.load(page_key_start + pidx, mask=in_range, other=0)
    return page, rows, key_start


# A tile of one or two whole pages (four in the GQA stage 1: ``tile_pages``'s ``FOUR``) reads each
# page's index once and gives it to the tile's rows, instead of one load per row and field that
# every thread repeats for the rows it holds: fewer instructions in the tile loop and fewer
# registers, and the GQA and latent stage 1 measured faster (docs/performance-notes.md).
#
# A tile whose rows all hold keys that every pair of the program sees skips the score mask (the
# GQA stage 1's ``SKIP``, where :func:`full_tiles_known`): a branch on scalars every thread already
# holds (the tile's page scalars and, once per program, its work item's last key against its
# pairs' smallest causal offset), no vote between warps in the loop (lazy rescaling's per-tile vote
# cost more than it saved). Decode rows see all their keys, and a prefill chunk's history tiles
# too, so the common tile spends no key positions, compare and select per score: fewer
# instructions in the tile loop; the cascade measured faster, the other kernels level or faster
# (docs/performance-notes.md).


def full_tiles_known(page_size: int, block_n: int, four: bool = False) -> bool:
    """Whether :func:`tile_pages`'s ``full`` tells a full tile: tiles of one page that the tiles
    divide (a 100-row page in 64-row tiles leaves the second tile's last rows empty however full
    the page), or of exactly two pages (or four, with ``four``: the GQA stage 1's four page scalars)."""
    return page_size % block_n == 0 or block_n == 2 * page_size or (four and block_n == 4 * page_size)


@triton.jit
def _by_slot(slot, a, b, c, d, PAGES: tl.constexpr):
    """Per tile row, the value of its page ``slot``: ``a``/``b`` for two pages, ``a``-``d`` for four."""
    if PAGES == 2:
        return tl.where(slot > 0, b, a)
    return tl.where(slot < 2, tl.where(slot == 0, a, b), tl.where(slot == 2, c, d))


@triton.jit
def tile_pages(page_table, page_rows, page_key_start, first, slot, pg1, WIDE: tl.constexpr, PAGES: tl.constexpr,
               BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, FOUR: tl.constexpr = False):
    """:func:`page_index` of a tile's ``BLOCK_N`` rows: ``first`` the tile's first page entry,
    ``slot (BLOCK_N,)`` each row's page within the tile. In a tile of one or two pages (or four,
    with ``FOUR``: the GQA stage 1), each page's entry is loaded once (a scalar) and given to its
    rows. Also
    ``full``, a scalar: whether the tile's pages all hold ``PAGE_SIZE`` rows (meaningful only where
    :func:`full_tiles_known`; unused, it compiles to nothing)."""
    ONE: tl.constexpr = PAGES == 1
    SEVERAL: tl.constexpr = PAGES == 2 or (PAGES == 4 and FOUR)
    if ONE:
        page, rows, key_start = page_index(page_table, page_rows, page_key_start, first, pg1, WIDE)
        zero = tl.zeros([BLOCK_N], tl.int32)
        return page + zero.to(page.dtype), rows + zero, key_start + zero, rows == PAGE_SIZE
    elif SEVERAL:
        page0, rows0, start0 = page_index(page_table, page_rows, page_key_start, first, pg1, WIDE)
        page1, rows1, start1 = page_index(page_table, page_rows, page_key_start, first + 1, pg1, WIDE)
        full = (rows0 == PAGE_SIZE) & (rows1 == PAGE_SIZE)
        page2, rows2, start2 = page0, rows0, start0
        page3, rows3, start3 = page1, rows1, start1
        if PAGES == 4:
            page2, rows2, start2 = page_index(page_table, page_rows, page_key_start, first + 2, pg1, WIDE)
            page3, rows3, start3 = page_index(page_table, page_rows, page_key_start, first + 3, pg1, WIDE)
            full = full & (rows2 == PAGE_SIZE) & (rows3 == PAGE_SIZE)
        return (_by_slot(slot, page0, page1, page2, page3, PAGES),
                _by_slot(slot, rows0, rows1, rows2, rows3, PAGES),
                _by_slot(slot, start0, start1, start2, start3, PAGES), full)
    else:
        page, rows, key_start = page_index(page_table, page_rows, page_key_start, first + slot, pg1, WIDE)
        return page, rows, key_start, pg1 < 0


@triton.jit
def tile_rows_in_page(offs_n, PAGE_SIZE: tl.constexpr, PAGES: tl.constexpr, BLOCK_N: tl.constexpr):
    """Each tile row's row within its page. A tile covers ``PAGES`` whole pages; when the page
    size does not divide the tile (a page of 20 or 48 rows in a 64-row tile) the rows past those
    pages get ``PAGE_SIZE``, which no page's row count exceeds, so they load and count nothing
    (the next step covers them)."""
    row_in_page = offs_n % PAGE_SIZE
    if PAGES * PAGE_SIZE < BLOCK_N:
        row_in_page = tl.where(offs_n < PAGES * PAGE_SIZE, row_in_page, PAGE_SIZE)
    return row_in_page


@triton.jit
def tile_range(pg0, pg1, SUB: tl.constexpr):
    """The loop bounds over a work item's tiles: its page entries ``[pg0, pg1)``, or with pages
    of ``SUB`` tiles each (a page longer than the tile) ``SUB`` steps per entry."""
    if SUB > 1:
        return pg0 * SUB, pg1 * SUB
    return pg0, pg1


@triton.jit
def next_tile_first(t, PAGES: tl.constexpr, SUB: tl.constexpr):
    """The first page entry of the tile after tile ``t`` (its rows add their ``slot``, the row's page
    within a tile of whole pages; 0 when a page spans tiles: :func:`tile_pages`)."""
    if SUB > 1:
        return (t + 1) // SUB
    return t + PAGES


@triton.jit
def load_kv(k_base, v_base, page, stride_kp, stride_vp, in_page, dk_ok, dv_ok):
    """The K and V tiles ``(BLOCK_N, D)`` of one block of pages (0 outside valid rows)."""
    k = tl.load(k_base + (page * stride_kp)[:, None], mask=in_page[:, None] & dk_ok[None, :], other=0.0)
    v = tl.load(v_base + (page * stride_vp)[:, None], mask=in_page[:, None] & dv_ok[None, :], other=0.0)
    return k, v


@triton.jit
def fp8_values(tile, dtype: tl.constexpr):
    """A tile of an FP8 cache's e4m3 bytes (loaded as uint8) -> its unscaled values in ``dtype``,
    exactly: every e4m3 value is a float32, bfloat16 and float16 value. Callers apply the scales
    in float32 (keys' folded into the softmax scale, values' on the accumulator), so the products
    equal those of the dequantized values within float32 rounding."""
    return e4m3_bits_to_float(tile.to(tl.int32)).to(dtype)


@triton.jit
def _split_p(p, dtype: tl.constexpr):
    """Float32 weights ``p`` as two parts of the half-precision ``dtype`` whose sum is ``p`` to about
    16 bits: the high part rounded, the low part the rounded rest."""
    p_hi = p.to(dtype)
    return p_hi, (p - p_hi.to(tl.float32)).to(dtype)


@triton.jit
def _rounded_weights(p, dtype: tl.constexpr):
    """Float32 weights ``p >= 0`` rounded to nearest (even) in ``dtype``, returned as float32: the
    fast mode's P in float32 products. bfloat16 by the bits (the interpreter's casts to bfloat16
    truncate); other dtypes by a cast."""
    if dtype == tl.bfloat16:
        bits = p.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    return p.to(dtype).to(tl.float32)


@triton.jit
def _key_positions(kpos, in_page):
    """The keys' positions for the causal mask, past every query (int32 max) where the tile row
    holds no key: one compare per score then masks both. Invalid query rows need no term of their
    own: :func:`pair_reads` gives them offset -1, below every key position."""
    return tl.where(in_page, kpos, 2147483647)


# Tree verify windows (``WorkItem.key_masks``): a masked work item's rows each carry a bitmask over
# the piece's rows, packed into 32-bit words (``triton_backend.flatten_plan``: ``work_key_masks``
# and ``key_mask_words``). Only masked items read them: a scalar branch per tile on the item's flag,
# so unmasked items load nothing more.


@triton.jit
def work_key_masks_of(work_key_masks, w, partial, p0):
    """A work item's key masks: whether it has any (a scalar) and each pair's first mask word
    ``(M,)`` in ``key_mask_words`` (``work_key_masks[2 w]`` the item's first row's first word, -1
    when unmasked; ``work_key_masks[2 w + 1]`` the words per row; ``partial - p0`` the pair's row
    within the item)."""
    start = tl.load(work_key_masks + 2 * w)
    words = tl.load(work_key_masks + 2 * w + 1)
    return start >= 0, tl.maximum(start, 0) + (partial - p0) * words


@triton.jit
def key_mask_scores(s, key_mask_words, word_base, kpos, offset, in_page):
    """Scores ``s (M, N)`` with -inf wherever the pair's row does not see the key: bit ``kpos`` of the
    row's mask (word ``kpos // 32`` from ``word_base (M,)``, shifted by ``kpos % 32``), and only keys
    ``in_page`` at most the row's causal ``offset`` (every set bit is; the words past it are not
    read). Arithmetic shifts of int32 words: ``& 1`` keeps the wanted bit, bit 31 included."""
    see = in_page[None, :] & (kpos[None, :] <= offset[:, None])
    word = tl.load(key_mask_words + word_base[:, None] + (kpos >> 5)[None, :], mask=see, other=0)
    bit = (word >> (kpos & 31)[None, :]) & 1
    return tl.where(see & (bit != 0), s, float("-inf"))


@triton.jit
def online_softmax_step(s, scale, kpos, offset, in_page, v, m_i, l_i, acc, EXACT_FP32: tl.constexpr,
                        needs_mask=True, FAST_PV: tl.constexpr = False, low=None):
    """One block of the online softmax: raw scores ``s (M, N)`` float32 of the keys at positions
    ``kpos (N,)``, masked causally against ``offset (M,)`` (a program's padding rows have offset
    -1, :func:`pair_reads`) and to the keys ``in_page``; ``v (N, D)`` the block's values. Returns
    the updated running max, sum and float32 accumulator ``(M, D)``. The running max ``m_i`` is in base-2 units (``max(s) * scale * log2(e)``): each weight is then
    one fused multiply-add and one ``exp2`` (:func:`store_partials` turns it back into a natural
    LSE). A fully masked row keeps max -inf and adds nothing (no NaN). ``needs_mask`` False (a
    scalar, the GQA stage 1's ``SKIP``): every pair sees every key of the tile, no mask.
    ``FAST_PV`` (the contract's ``fast`` mode): P is rounded once to the values' dtype before P.V,
    one half-precision product with float32 sums, as FlashAttention does (``l_i`` sums the unrounded
    weights); otherwise (``exact``) P is split into two half-precision parts. In float32
    (``EXACT_FP32``: float32 inputs, or the interpreter) the fast product rounds P to the dtype the
    values arrived in and multiplies in IEEE float32, which is what the GPU's product computes.
    ``low (M,)`` (sliding windows, with ``needs_mask``): keys before position ``low`` are masked too."""
    scale2 = scale * LOG2E
    if needs_mask:
        s = tl.where(_key_positions(kpos, in_page)[None, :] <= offset[:, None], s, float("-inf"))
        if low is not None:  # a sliding window: keys before the pair's window's first position are masked too
            s = tl.where(kpos[None, :] >= low[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale2)  # scale2 > 0: the max of the scaled scores
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = exp2_ftz(s * scale2 - m_safe[:, None])
    alpha = exp2_ftz(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    # the products accumulate into acc itself: a separate (M, D) float32 result per dot would
    # triple the accumulator registers (and spill at 64 x 128 and 16 x 512 tiles)
    if FAST_PV:
        if EXACT_FP32:
            acc = tl.dot(_rounded_weights(p, v.dtype), v.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
    elif EXACT_FP32:
        acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    else:  # P split exactly into two half-precision parts: about 16 bits of P, float32 sums
        p_hi, p_lo = _split_p(p, v.dtype)
        acc = tl.dot(p_lo, v, tl.dot(p_hi, v, acc))
    return m_new, l_i, acc


@triton.jit
def fold_sink(m_i, l_i, acc, sink2):
    """An attention sink folded into a running softmax state in float32: ``sink2 (M,)`` the pairs'
    sink logits in base-2 units (``sink * log2(e)``; -inf: none) join the maximum ``m_i`` (base 2)
    and add ``2 ** (sink2 - m)`` to the weight sum ``l_i``, with a zero value (``acc`` is only
    rescaled). A pair without a sink keeps its state (a rescale by ``2 ** 0``); an empty pair with a
    sink gets max ``sink2`` and sum 1, so it normalises to 0 with LSE ``sink``."""
    m_new = tl.maximum(m_i, sink2)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = exp2_ftz(m_i - m_safe)
    l_i = l_i * alpha + exp2_ftz(sink2 - m_safe)
    return m_new, l_i, acc * alpha[:, None]


@triton.jit
def store_partials(acc, m_i, l_i, partial, head, valid, offs_d, d_ok, partial_direct, OUT, LSE, FINAL, FINAL_LSE,
                   stride_op, stride_oh, stride_lp, stride_fr, stride_fh, stride_flr, lse_valid, SINKS=None):
    """Normalise a program's (row, head) results and store them: a partial that is its row's
    only one (``partial_direct >= 0``) is rounded once into FINAL/FINAL_LSE, the others go to
    OUT/LSE in float32 for the merge. Empty rows are 0 with LSE -inf. ``m_i`` is the running max
    in base-2 units (:func:`online_softmax_step`); the stored LSE is natural. The LSEs of the pairs
    in ``lse_valid`` only (``valid``, or none where another program of the same pairs stores them).
    ``SINKS``: attention sinks, ``(Hq,)`` float32 natural-log logits per query head (None compiles
    them away): a row's only partial takes its head's sink term (:func:`fold_sink`) before its one
    rounding (an empty one: 0 with LSE ``sink``); partials for the merge stay without it (the merge
    adds it once per row)."""
    if SINKS is not None:  # the rows' only partials (direct >= 0) take their heads' sinks
        alone = valid & (tl.load(partial_direct + partial, mask=valid, other=-1) >= 0)
        sink = tl.load(SINKS + head, mask=alone, other=float("-inf"))
        m_i, l_i, acc = fold_sink(m_i, l_i, acc, sink * LOG2E)
    empty = l_i == 0.0
    # one reciprocal per row and a product per value, not a division per value (a division costs
    # more instructions; fewer instructions and spills in the stage-1 programs): float32 within
    # 2 ulp, rounded once after
    out = acc * (1.0 / tl.where(empty, 1.0, l_i))[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    direct = tl.load(partial_direct + partial, mask=valid, other=-1)
    to_merge = valid & (direct < 0)
    to_final = valid & (direct >= 0)
    frow = tl.where(to_final, direct, 0).to(tl.int64)
    tl.store(OUT + partial[:, None] * stride_op + head[:, None] * stride_oh + offs_d[None, :], out,
             mask=to_merge[:, None] & d_ok[None, :])
    tl.store(LSE + partial * stride_lp + head, lse, mask=to_merge & lse_valid)
    tl.store(FINAL + frow[:, None] * stride_fr + head[:, None] * stride_fh + offs_d[None, :],
             out.to(FINAL.dtype.element_ty, fp_downcast_rounding="rtne"), mask=to_final[:, None] & d_ok[None, :])
    tl.store(FINAL_LSE + frow * stride_flr + head, lse, mask=to_final & lse_valid)


@triton.jit
def pair_reads(p0, n_rows, mb, first_head, group, partial_row, partial_offset, BLOCK_M: tl.constexpr):
    """A stage-1 program's pairs (GQA: ``group`` heads from ``first_head``, its KV head's; latent:
    all the heads from 0): their validity, heads, partials, query rows and causal offsets."""
    pair = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    r = pair // group
    valid = r < n_rows
    head = first_head + pair % group
    partial = p0 + tl.where(valid, r, 0)
    qrow = tl.load(partial_row + partial, mask=valid, other=0).to(tl.int64)
    offset = tl.load(partial_offset + partial, mask=valid, other=-1)
    return valid, head, partial, qrow, offset


@triton.jit
def plan_reads(p0, n_rows, mb, w, first_head, group, partial_row, partial_offset, work_pages, page_table,
               page_rows, page_key_start, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
               WIDE: tl.constexpr, FOUR: tl.constexpr = False):
    """A stage-1 program's whole share of the plan: :func:`pair_reads`, its work item's page range,
    and the first block's page indices and fullness (:func:`tile_pages`; one block ahead,
    loop-carried: the K/V loads then depend on no load of their own iteration, so with 3 pipeline
    stages the next tile stays in flight during this one's products)."""
    valid, head, partial, qrow, offset = pair_reads(p0, n_rows, mb, first_head, group, partial_row, partial_offset,
                                                    BLOCK_M)
    pg0 = tl.load(work_pages + 2 * w)  # the work item's pages: no piece table in between
    pg1 = tl.load(work_pages + 2 * w + 1)
    slot = tl.arange(0, BLOCK_N) // PAGE_SIZE
    page, rows, kst, full = tile_pages(page_table, page_rows, page_key_start, pg0, slot, pg1, WIDE,
                                       max(BLOCK_N // PAGE_SIZE, 1), BLOCK_N, PAGE_SIZE, FOUR)
    return valid, head, partial, qrow, offset, pg0, pg1, page, rows, kst, full


@triton.jit
def work_item_visible(page_rows, page_key_start, pg0, pg1, offset, valid):
    """Whether every valid pair (causal ``offset``) sees every key of its work item's pages
    ``[pg0, pg1)``: the item's last key position against the pairs' smallest offset (a scalar)."""
    has = pg1 > pg0
    last = tl.where(has, pg1 - 1, pg0)
    last_key = (tl.load(page_key_start + last, mask=has, other=0)
                + tl.load(page_rows + last, mask=has, other=0) - 1)
    return last_key <= tl.min(tl.where(valid, offset, 2147483647), 0)


# Prefill programs (``CAUSAL_END`` in the GQA stage 1): a chunk's query rows see its own keys only up
# to their positions, so a program of the chunk's first rows stops where its last pair's causal
# offset ends instead of scanning (and masking) the rest of the chunk; and a tile every pair sees
# whole skips the score mask, so only the tiles on the diagonal pay for it.


@triton.jit
def causal_page_end(page_key_start, pg0, pg1, valid, offset):
    """The end of the page entries a program's pairs see: the first entry of ``[pg0, pg1)`` whose
    first key lies past every valid pair's causal ``offset`` (``pg1`` when none does), by binary
    search over the piece's increasing key starts (a few scalar loads per program)."""
    last = tl.max(tl.where(valid, offset, -1), 0)
    lo = pg0
    hi = pg1
    while lo < hi:
        mid = (lo + hi) // 2
        right = tl.load(page_key_start + mid) <= last
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def tile_seen_whole(page_key_start, t, full, min_offset, BLOCK_N: tl.constexpr, SUB: tl.constexpr):
    """Whether every pair of a program sees every key of tile ``t`` (a scalar): the tile is full
    (``full``, where :func:`full_tiles_known`) and its last key is at most ``min_offset``, the
    pairs' smallest causal offset."""
    if SUB > 1:
        first = tl.load(page_key_start + t // SUB) + (t % SUB) * BLOCK_N
    else:
        first = tl.load(page_key_start + t)
    return full & (first + BLOCK_N - 1 <= min_offset)


@triton.jit
def window_page_start(page_key_start, pg0, pg1, valid, low):
    """The first page entry of ``[pg0, pg1)`` a program's pairs see under a sliding window: the last
    one whose first key is at most the pairs' smallest window start ``low`` (``pg0`` when none is),
    by binary search; the entries before it hold only keys before every pair's window."""
    first = tl.min(tl.where(valid, low, 2147483647), 0)
    lo = pg0
    hi = pg1
    while lo < hi:  # the first entry whose first key lies past ``first``
        mid = (lo + hi) // 2
        right = tl.load(page_key_start + mid) <= first
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    return tl.maximum(lo - 1, pg0)
