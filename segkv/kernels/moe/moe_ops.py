"""Triton kernels around a mixture-of-experts layer's expert products (decode on the GPU).

* :func:`router_logits`: a few tokens' router logits in float32 from half-precision inputs and
  weights, one kernel instead of two conversions and cuBLAS's float32 GEMV and its reduction.
* :func:`route_topk`: a router's scores, top-k choice and weights from its float32 logits, one
  kernel instead of softmax/sigmoid, top-k, gather, normalisation and scaling (about six).
* :func:`norm_route_topk`: a pre-norm block's residual add and RMSNorm, then the router's logits
  and top-k of the normed rows, one kernel for a few tokens (the last program of each token,
  found by an atomic ticket, takes the top-k) instead of three.
* :func:`combine_experts`: the weighted sum of each token's expert outputs in float32, rounded
  once, plus the shared experts' output, one kernel instead of about five;
  :func:`combine_add_rms_norm` does it inside the next block's residual add and RMSNorm.

A decode step of a model with many small MoE layers (DeepSeek-V2-Lite: 26) is made of
launches of a few microseconds each, so fewer launches is most of what there is to gain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from segkv.kernels.triton_import import tl, triton

from segkv.kernels.fused.fused_ops import kind_of, round_to_kind
from segkv.kernels.pdl import pdl_options, wait_then_release
from segkv.kernels.moe.work_items import count_done


@triton.jit
def _router_logits_kernel(X, W, OUT, stride_x, stride_w, stride_o, hidden, num_experts,
                          BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (token, block of experts): ``BLOCK_E`` logits of one token, float32 products of
    the exactly widened inputs summed in float32."""
    t = tl.program_id(0).to(tl.int64)
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = experts < num_experts
    cols = tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_E, BLOCK_H], tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        ok = h0 + cols < hidden
        x = tl.load(X + t * stride_x + h0 + cols, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(W + experts[:, None].to(tl.int64) * stride_w + (h0 + cols)[None, :],
                    mask=e_ok[:, None] & ok[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    tl.store(OUT + t * stride_o + experts, tl.sum(acc, axis=1), mask=e_ok)


_ROUTER_BLOCK_E = 4  # 16 programs per token for 64 experts: the weight read spreads over SMs


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x (T, hidden)`` and the router's ``weight (E, hidden)`` (any float dtypes) -> float32
    ``logits (T, E)``: ``x.float() @ weight.float().T`` with float32 sums (their order differs
    from cuBLAS's by float32 rounding). For decode: one launch where the float32 conversions and
    GEMV took four; every token's programs read the whole weight, so many tokens belong on cuBLAS."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router_logits: x {tuple(x.shape)} against weight {tuple(weight.shape)}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("router_logits needs a unit stride on the hidden dim")
    tokens, hidden = x.shape
    experts = weight.shape[0]
    out = torch.empty(tokens, experts, dtype=torch.float32, device=x.device)
    if tokens and experts:
        _router_logits_kernel[(tokens, triton.cdiv(experts, _ROUTER_BLOCK_E))](
            x, weight, out, x.stride(0), weight.stride(0), out.stride(0), hidden, experts,
            # one step over the hidden dim up to 2048 (DeepSeek-V2-Lite): one round of loads
            BLOCK_E=_ROUTER_BLOCK_E, BLOCK_H=min(2048, triton.next_power_of_2(hidden)), num_warps=4,
        )
    return out


@triton.jit
def _scores(logits, ok, SOFTMAX: tl.constexpr):
    """A token's expert scores from its float32 ``logits`` (valid where ``ok``): softmax or sigmoid."""
    if SOFTMAX:
        e = tl.where(ok, tl.exp(logits - tl.max(logits, axis=0)), 0.0)
        scores = e / tl.sum(e, axis=0)
    else:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    return scores


@triton.jit
def _topk_of_logits(logits, offs, ok, scale, K: tl.constexpr, BLOCK_K: tl.constexpr, SOFTMAX: tl.constexpr,
                    NORM: tl.constexpr):
    """The top ``K`` of one token's float32 ``logits (BLOCK_E,)`` (-inf past the experts): their
    ids (int32) and weights (float32, normalised when ``NORM``, times ``scale``), ``(BLOCK_K,)``.
    Softmax and sigmoid are increasing, so the experts are the top-k by logit."""
    scores = _scores(logits, ok, SOFTMAX)
    slot = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    choice = tl.where(logits != logits, float("inf"), logits)  # NaN first, as torch.topk: never a padding id
    for j in tl.static_range(K):
        best = tl.argmax(choice, axis=0)  # the first of equal maxima: the lower expert id
        weights = tl.where(slot == j, tl.sum(tl.where(offs == best, scores, 0.0), axis=0), weights)
        ids = tl.where(slot == j, best, ids)
        choice = tl.where(offs == best, float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    return ids, weights * scale


@triton.jit
def _route_topk_kernel(LOGITS, WEIGHTS, IDS, stride_l, num_experts, scale,
                       K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                       SOFTMAX: tl.constexpr, NORM: tl.constexpr):
    """Program ``t``: the top ``K`` experts of token ``t`` by logit, weighted by their scores."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < num_experts
    logits = tl.load(LOGITS + t * stride_l + offs, mask=ok, other=float("-inf"))
    ids, weights = _topk_of_logits(logits, offs, ok, scale, K, BLOCK_K, SOFTMAX, NORM)
    slot = tl.arange(0, BLOCK_K)
    keep = slot < K
    tl.store(WEIGHTS + t * K + slot, weights, mask=keep)
    tl.store(IDS + t * K + slot, ids.to(tl.int64), mask=keep)


def _check_route(experts: int, top_k: int, scoring: str) -> None:
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in 1..{experts}, got {top_k}")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")


def route_topk(logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", norm_topk_prob: bool = False,
               scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits (T, E)`` float32 -> ``weights (T, k)`` float32 and ``ids (T, k)`` int64: each
    token's ``top_k`` experts in decreasing order, their ``softmax`` or ``sigmoid`` scores,
    normalised to sum 1 when ``norm_topk_prob``, times ``scaling``. The experts are the top-k
    of the scores (ties to the lower id); weights equal the torch ops' to float32 rounding."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"route_topk needs (T, E) float32 logits with a unit last stride, got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    tokens, experts = logits.shape
    _check_route(experts, top_k, scoring)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        _route_topk_kernel[(tokens,)](
            logits, weights, ids, logits.stride(0), experts, float(scaling),
            K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(experts),
            SOFTMAX=scoring == "softmax", NORM=norm_topk_prob, num_warps=1,
        )
    return weights, ids


@triton.jit
def _store_topk_by_rank(logits, offs, ok, scale, WEIGHTS, IDS, t, K: tl.constexpr, SOFTMAX: tl.constexpr,
                        NORM: tl.constexpr):
    """:func:`_topk_of_logits` stored straight into ``WEIGHTS``/``IDS`` row ``t``, by rank: an
    expert's slot is the number of experts ahead of it (a larger logit, or an equal one and a
    lower id), so the choice takes one reduction over all pairs of experts instead of ``K``
    rounds of argmax (each a reduction across the program's warps)."""
    # NaN ranks first, as torch.topk ranks it; the keys are then totally ordered, so the valid
    # experts' ranks are 0, 1, 2, ... and every slot gets exactly one expert
    key = tl.where(logits != logits, float("inf"), logits)
    ahead = (key[None, :] > key[:, None]) | ((key[None, :] == key[:, None]) & (offs[None, :] < offs[:, None]))
    rank = tl.sum(ahead.to(tl.int32), axis=1)
    chosen = ok & (rank < K)
    scores = _scores(logits, ok, SOFTMAX)
    weights = tl.where(chosen, scores, 0.0)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    slot = t * K + tl.where(chosen, rank, 0)
    tl.store(WEIGHTS + slot, weights * scale, mask=chosen)
    tl.store(IDS + slot, offs.to(tl.int64), mask=chosen)


@triton.jit
def _residual_sum(X, RES, t, stride_x, stride_r, cols, ok, X_KIND: tl.constexpr):
    """Columns ``cols`` of row ``t`` of ``X + RES``, rounded to ``X_KIND`` as a torch add rounds."""
    return round_to_kind(tl.load(X + t * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
                         + tl.load(RES + t * stride_r + cols, mask=ok, other=0.0).to(tl.float32), X_KIND)


@triton.jit
def _norm_and_store(s, w, inv_rms, store, RES_OUT, H_OUT, t, stride_ro, stride_h, cols, ok,
                    X_KIND: tl.constexpr, H_KIND: tl.constexpr):
    """``w * round(s * inv_rms)`` rounded as ``rms_norm`` rounds it; with ``store`` the sum ``s``
    and the normed columns go to ``RES_OUT`` / ``H_OUT`` row ``t``. Returns the normed columns."""
    h = round_to_kind(w * round_to_kind(s * inv_rms, X_KIND), H_KIND)
    if store:
        tl.store(RES_OUT + t * stride_ro + cols, s, mask=ok)
        tl.store(H_OUT + t * stride_h + cols, h, mask=ok)
    return h


@triton.jit
def _norm_route_kernel(
    X, RES, NORM_W, RES_OUT, H_OUT, ROUTER_W, LOGITS, WEIGHTS, IDS, TICKETS,
    stride_x, stride_r, stride_ro, stride_h, stride_w, stride_l,
    hidden, num_experts, eps, scale,
    X_KIND: tl.constexpr, H_KIND: tl.constexpr, BLOCK_H: tl.constexpr, ONE_STEP: tl.constexpr,
    BLOCK_E: tl.constexpr, ALL_E: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr, SOFTMAX: tl.constexpr,
    NORM: tl.constexpr, BY_RANK: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (token, block of experts): :func:`norm_route_program`."""
    norm_route_program(X, RES, NORM_W, RES_OUT, H_OUT, ROUTER_W, LOGITS, WEIGHTS, IDS, TICKETS,
                       stride_x, stride_r, stride_ro, stride_h, stride_w, stride_l, hidden, num_experts, eps, scale,
                       tl.program_id(0).to(tl.int64), tl.program_id(1), tl.num_programs(1), TICKETS, TICKETS,
                       X_KIND, H_KIND, BLOCK_H, ONE_STEP, BLOCK_E, ALL_E, K, BLOCK_K, SOFTMAX, NORM, BY_RANK, USE_PDL,
                       False)


@triton.jit
def norm_route_program(
    X, RES, NORM_W, RES_OUT, H_OUT, ROUTER_W, LOGITS, WEIGHTS, IDS, TICKETS,
    stride_x, stride_r, stride_ro, stride_h, stride_w, stride_l, hidden, num_experts, eps, scale,
    t, eb, blocks, NORM_READY, IDS_READY,
    X_KIND: tl.constexpr, H_KIND: tl.constexpr, BLOCK_H: tl.constexpr, ONE_STEP: tl.constexpr,
    BLOCK_E: tl.constexpr, ALL_E: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr, SOFTMAX: tl.constexpr,
    NORM: tl.constexpr, BY_RANK: tl.constexpr, USE_PDL: tl.constexpr, SIGNAL: tl.constexpr,
):
    """Token ``t``'s router block ``eb`` of ``blocks``: the residual sum and its RMSNorm (every
    program computes them alike; block 0's program stores them), ``BLOCK_E`` router logits of the
    normed row, then an atomic ticket per token: the token's last program reads all its logits
    back and writes the top-k ids and weights, and resets the ticket to 0 for the next launch.
    ``ONE_STEP`` (rows of at most ``BLOCK_H``): every load is issued before any arithmetic, so the
    router weight's latency hides behind the norm's; with ``USE_PDL`` the weights load before the
    wait for the previous kernel (``kernels.pdl``). ``SIGNAL`` (a launch whose other programs wait
    for these results): block 0's program adds 1 to ``NORM_READY`` once the normed row is stored,
    the last program 1 to ``IDS_READY`` once the ids and weights are (release)."""
    cols = tl.arange(0, BLOCK_H)
    experts = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = experts < num_experts
    w_rows = ROUTER_W + experts[:, None].to(tl.int64) * stride_w
    if ONE_STEP:
        ok = cols < hidden
        w = tl.load(NORM_W + cols, mask=ok, other=0.0).to(tl.float32)
        wr = tl.load(w_rows + cols[None, :], mask=e_ok[:, None] & ok[None, :], other=0.0).to(tl.float32)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        s = _residual_sum(X, RES, t, stride_x, stride_r, cols, ok, X_KIND)
        inv_rms = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / hidden + eps)
        h = _norm_and_store(s, w, inv_rms, eb == 0, RES_OUT, H_OUT, t, stride_ro, stride_h, cols, ok, X_KIND, H_KIND)
        if SIGNAL:
            if eb == 0:
                count_done(NORM_READY)
        logits = tl.sum(wr * h[None, :], axis=1)
    else:
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        sq = tl.zeros([BLOCK_H], tl.float32)
        for h0 in range(0, hidden, BLOCK_H):  # the mean square
            ok = h0 + cols < hidden
            s = _residual_sum(X, RES, t, stride_x, stride_r, h0 + cols, ok, X_KIND)
            sq += s * s
        inv_rms = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / hidden + eps)
        acc = tl.zeros([BLOCK_E, BLOCK_H], tl.float32)
        for h0 in range(0, hidden, BLOCK_H):
            ok = h0 + cols < hidden
            s = _residual_sum(X, RES, t, stride_x, stride_r, h0 + cols, ok, X_KIND)
            w = tl.load(NORM_W + h0 + cols, mask=ok, other=0.0).to(tl.float32)
            h = _norm_and_store(s, w, inv_rms, eb == 0, RES_OUT, H_OUT, t, stride_ro, stride_h, h0 + cols, ok,
                                X_KIND, H_KIND)
            wr = tl.load(w_rows + (h0 + cols)[None, :], mask=e_ok[:, None] & ok[None, :], other=0.0).to(tl.float32)
            acc += wr * h[None, :]
        if SIGNAL:
            if eb == 0:
                count_done(NORM_READY)
        logits = tl.sum(acc, axis=1)
    tl.store(LOGITS + t * stride_l + experts, logits, mask=e_ok)
    tl.debug_barrier()  # every thread's logits are stored before the ticket (released by it)
    ticket = tl.atomic_add(TICKETS + t, 1, sem="acq_rel", scope="gpu")
    if ticket == blocks - 1:
        offs = tl.arange(0, ALL_E)
        all_ok = offs < num_experts
        # the other programs' logits: read through L2 (".cg"), not a stale L1
        all_logits = tl.load(LOGITS + t * stride_l + offs, mask=all_ok, other=float("-inf"), cache_modifier=".cg")
        if BY_RANK:
            _store_topk_by_rank(all_logits, offs, all_ok, scale, WEIGHTS, IDS, t, K, SOFTMAX, NORM)
        else:
            ids, weights = _topk_of_logits(all_logits, offs, all_ok, scale, K, BLOCK_K, SOFTMAX, NORM)
            slot = tl.arange(0, BLOCK_K)
            keep = slot < K
            tl.store(WEIGHTS + t * K + slot, weights, mask=keep)
            tl.store(IDS + t * K + slot, ids.to(tl.int64), mask=keep)
        tl.store(TICKETS + t, 0)
        if SIGNAL:
            count_done(IDS_READY)


def norm_route_topk(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    router_weight: torch.Tensor, top_k: int, tickets: torch.Tensor, *, scoring: str = "softmax",
                    norm_topk_prob: bool = False, scaling: float = 1.0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pre-norm block's residual add and RMSNorm, the router's float32 logits of the normed rows
    and their top-k, in one launch (decode: four launches before).

    ``x``, ``residual`` ``(T, hidden)`` of one dtype, ``norm_weight (hidden,)``, ``router_weight
    (E, hidden)``, ``tickets`` int32 zeros of at least ``T`` entries (left zero). Returns ``h (T,
    hidden)`` (``rms_norm(x, norm_weight, eps, residual)[0]``), the sum ``x + residual`` and
    ``route_topk``'s ``weights (T, k)`` float32 and ``ids (T, k)`` int64 of
    ``router_logits(h, router_weight)``; every value as those functions round it, up to the
    order of float32 sums. Every token's programs read the whole router weight: for few tokens."""
    route = prepare_norm_route(x, residual, norm_weight, router_weight, top_k, tickets, scoring=scoring,
                               norm_topk_prob=norm_topk_prob, name="norm_route_topk")
    tokens = x.shape[0]
    if tokens:
        _norm_route_kernel[(tokens, route.blocks)](
            x, residual, norm_weight, route.total, route.h, router_weight, route.logits, route.weights, route.ids,
            tickets, *route.strides(x, residual, router_weight), x.shape[1], router_weight.shape[0], float(eps),
            float(scaling), **route.meta, num_warps=4, **pdl_options(x),
        )
    return route.h, route.total, route.weights, route.ids


@dataclass
class NormRoute:
    """Outputs and launch constants of :func:`norm_route_program` for ``T`` tokens: ``h (T,
    hidden)``, ``total (T, hidden)``, float32 ``logits (T, E)``, ``weights (T, k)`` float32, ``ids
    (T, k)`` int64; ``blocks`` programs per token; ``meta`` its constexprs."""

    h: torch.Tensor
    total: torch.Tensor
    logits: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    blocks: int
    meta: dict

    def strides(self, x: torch.Tensor, residual: torch.Tensor, router_weight: torch.Tensor) -> tuple[int, ...]:
        """The program's ``stride_x, stride_r, stride_ro, stride_h, stride_w, stride_l``."""
        return (x.stride(0), residual.stride(0), self.total.stride(0), self.h.stride(0), router_weight.stride(0),
                self.logits.stride(0))


def prepare_norm_route(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                       router_weight: torch.Tensor, top_k: int, tickets: torch.Tensor, *, scoring: str,
                       norm_topk_prob: bool, name: str) -> NormRoute:
    """Checks of a norm-route launch's inputs (a clear error naming ``name``) and its outputs."""
    if (x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype or norm_weight.shape != (x.shape[1],)
            or router_weight.dim() != 2 or router_weight.shape[1] != x.shape[1]):
        raise ValueError(f"{name}: x {tuple(x.shape)} {x.dtype}, residual {tuple(residual.shape)} "
                         f"{residual.dtype}, norm weight {tuple(norm_weight.shape)}, router weight "
                         f"{tuple(router_weight.shape)}")
    for what, t in (("x", x), ("residual", residual), ("norm weight", norm_weight),
                    ("router weight", router_weight)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit stride on the hidden dim ({what})")
    tokens, hidden = x.shape
    experts = router_weight.shape[0]
    _check_route(experts, top_k, scoring)
    if tickets.dtype != torch.int32 or tickets.numel() < tokens:
        raise ValueError(f"{name} needs int32 tickets for {tokens} tokens, got {tickets.numel()} {tickets.dtype}")
    h = torch.empty(tokens, hidden, dtype=torch.result_type(norm_weight, x), device=x.device)
    block_h, all_e = min(2048, triton.next_power_of_2(hidden)), triton.next_power_of_2(experts)
    # up to 128 experts the top-k goes by rank (a 128 x 128 comparison at most)
    meta = dict(X_KIND=kind_of(x.dtype), H_KIND=kind_of(h.dtype), BLOCK_H=block_h, ONE_STEP=hidden <= block_h,
                BLOCK_E=_ROUTER_BLOCK_E, ALL_E=all_e, K=top_k, BLOCK_K=triton.next_power_of_2(top_k),
                SOFTMAX=scoring == "softmax", NORM=norm_topk_prob, BY_RANK=all_e <= 128)
    return NormRoute(h, torch.empty_like(x), torch.empty(tokens, experts, dtype=torch.float32, device=x.device),
                     torch.empty(tokens, top_k, dtype=torch.float32, device=x.device),
                     torch.empty(tokens, top_k, dtype=torch.int64, device=x.device),
                     triton.cdiv(experts, _ROUTER_BLOCK_E), meta)


@triton.jit
def combine_row(Y, WEIGHTS, SHARED, t, cols, ok, stride_y, stride_s, K: tl.constexpr, HAS_SHARED: tl.constexpr,
              KIND: tl.constexpr, BLOCK: tl.constexpr):
    """Columns ``cols`` of token ``t``'s combined expert outputs (float32 holding ``KIND``
    values): the weighted sum in slot order, each product rounded before the add (as torch; the
    launch disables FMA fusion), rounded once, then the shared experts' output added and rounded."""
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K):
        w = tl.load(WEIGHTS + t * K + j)
        acc = acc + tl.load(Y + (t * K + j) * stride_y + cols, mask=ok, other=0.0).to(tl.float32) * w
    out = round_to_kind(acc, KIND)
    if HAS_SHARED:
        out = round_to_kind(out + tl.load(SHARED + t * stride_s + cols, mask=ok, other=0.0).to(tl.float32), KIND)
    return out


@triton.jit
def _combine_kernel(Y, WEIGHTS, SHARED, OUT, stride_y, stride_s, stride_o, hidden,
                    K: tl.constexpr, HAS_SHARED: tl.constexpr, KIND: tl.constexpr, BLOCK: tl.constexpr):
    """Program (token, block): ``BLOCK`` outputs of one token."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    out = combine_row(Y, WEIGHTS, SHARED, t, cols, ok, stride_y, stride_s, K, HAS_SHARED, KIND, BLOCK)
    tl.store(OUT + t * stride_o + cols, out, mask=ok)


def _described(t: torch.Tensor | None):
    return None if t is None else (tuple(t.shape), t.dtype)


def check_combine(fn: str, y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None,
                   residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None) -> None:
    """The inputs of :func:`combine_experts` (and of :func:`combine_add_rms_norm`, with the
    residual and the norm's weight): shapes, dtypes, unit last strides; errors name ``fn``."""
    tokens, k = weights.shape
    row = (tokens, y.shape[-1])
    if (y.dim() != 2 or y.shape[0] != tokens * k or weights.dtype != torch.float32
            or (shared is not None and (shared.shape != row or shared.dtype != y.dtype))
            or (residual is not None and (residual.shape != row or residual.dtype != y.dtype))
            or (norm_weight is not None and norm_weight.shape != (y.shape[-1],))):
        raise ValueError(f"{fn}: y {_described(y)}, weights {_described(weights)}, shared {_described(shared)}"
                         + (f", residual {_described(residual)}, norm weight {_described(norm_weight)}"
                            if residual is not None else ""))
    for name, x in (("y", y), ("shared", shared), ("residual", residual), ("norm weight", norm_weight)):
        if x is not None and x.stride(-1) != 1:
            raise ValueError(f"{fn}: {name} needs a unit stride on its last dim")


def combine_experts(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
    """``y (T k, H)`` expert outputs (pair ``t k + j`` is token ``t``'s ``j``-th expert),
    ``weights (T, k)`` float32, optional ``shared (T, H)`` -> ``(T, H)`` in ``y``'s dtype:
    ``sum_j y[t k + j] w[t, j]`` in float32 rounded once, then ``+ shared`` rounded as a torch
    add of two ``y``-dtype tensors rounds."""
    tokens, k = weights.shape
    check_combine("combine_experts", y, weights, shared)
    hidden = y.shape[1]
    weights = weights.contiguous()
    out = torch.empty(tokens, hidden, dtype=y.dtype, device=y.device)
    if tokens:
        block = min(1024, triton.next_power_of_2(hidden))
        _combine_kernel[(tokens, triton.cdiv(hidden, block))](
            y, weights, shared if shared is not None else y, out, y.stride(0),
            shared.stride(0) if shared is not None else 0, out.stride(0), hidden,
            K=k, HAS_SHARED=shared is not None, KIND=kind_of(y.dtype), BLOCK=block, num_warps=4,
            enable_fp_fusion=False,  # y*w + acc as an FMA would round once; torch rounds the product
        )
    return out


@triton.jit
def _combine_add_norm_kernel(Y, WEIGHTS, SHARED, RES, NORM_W, RES_OUT, H_OUT, stride_y, stride_s, stride_r,
                             stride_ro, stride_h, hidden, eps, K: tl.constexpr, HAS_SHARED: tl.constexpr,
                             KIND: tl.constexpr, H_KIND: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Program ``t``: token ``t``'s expert outputs combined as :func:`combine_experts` combines
    them, the residual added and the sum normed as ``rms_norm`` norms it (one row of ``BLOCK``).
    With ``USE_PDL`` the norm's weight loads before the wait for the previous kernel."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    norm_w = tl.load(NORM_W + cols, mask=ok, other=0.0).to(tl.float32)
    wait_then_release(USE_PDL)
    out = combine_row(Y, WEIGHTS, SHARED, t, cols, ok, stride_y, stride_s, K, HAS_SHARED, KIND, BLOCK)
    s = round_to_kind(out + tl.load(RES + t * stride_r + cols, mask=ok, other=0.0).to(tl.float32), KIND)
    inv_rms = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / hidden + eps)
    _norm_and_store(s, norm_w, inv_rms, True, RES_OUT, H_OUT, t, stride_ro, stride_h, cols, ok, KIND, H_KIND)


def combine_add_rms_norm(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None, residual: torch.Tensor,
                         norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The next pre-norm block's residual add and RMSNorm of a MoE layer's combined output, in one
    launch with the combine: ``c = combine_experts(y, weights, shared)``, then ``rms_norm(c,
    norm_weight, eps, residual)``, returning ``(h, c + residual)`` as that pair rounds them (up to
    the order of float32 sums). ``residual (T, H)`` of ``y``'s dtype."""
    tokens, k = weights.shape
    check_combine("combine_add_rms_norm", y, weights, shared, residual, norm_weight)
    hidden = y.shape[1]
    weights = weights.contiguous()
    total = torch.empty(tokens, hidden, dtype=y.dtype, device=y.device)
    h = torch.empty(tokens, hidden, dtype=torch.result_type(norm_weight, y), device=y.device)
    if tokens:
        _combine_add_norm_kernel[(tokens,)](
            y, weights, shared if shared is not None else y, residual, norm_weight, total, h, y.stride(0),
            shared.stride(0) if shared is not None else 0, residual.stride(0), total.stride(0), h.stride(0),
            hidden, float(eps), K=k, HAS_SHARED=shared is not None, KIND=kind_of(y.dtype), H_KIND=kind_of(h.dtype),
            # one program per token: 8 warps halve each thread's share of the ~9 rows it reads
            BLOCK=triton.next_power_of_2(hidden), num_warps=8 if hidden <= 8192 else 16,
            enable_fp_fusion=False,  # y*w + acc as an FMA would round once; torch rounds the product
            **pdl_options(y),
        )
    return h, total
