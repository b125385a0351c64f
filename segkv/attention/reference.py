"""The PyTorch reference backend: executes any attention plan on any device (the oracle).

Per work item it gathers the piece's K/V rows through the page table, attends in
float32 with the causal offsets (or a tree window's key masks), keeps each partial's LSE, then merges all partials
exactly (``merge.merge_partials``, attention sinks as one more LSE term there) and rounds once to
the output dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from segkv.attention.backend import BackendCapabilities, KVScales, KVTransform, check_sinks
from segkv.attention.merge import LSE_API, merge_partials
from segkv.attention.plan import AttentionPlan, Piece
from segkv.cache.storage import dequantize_fp8


@dataclass(slots=True)
class PreparedPlan:
    """Index tensors of a plan, built once per step and reused by every layer.

    ``piece_slots[k]``: ``(n_k,)`` int64 flat storage slots of piece ``k``'s rows.
    ``work_rows[w]``: ``(r_w,)`` int64 query rows of work item ``w``; ``work_visible[w]``:
    ``(r_w,)`` int64, how many of the piece's rows each sees, or for a work item with key
    masks or key lows (a sliding window) ``(r_w, n_k)`` bool, which. ``partial_rows``: ``(P,)`` int64.
    """

    plan: AttentionPlan
    piece_slots: list[torch.Tensor]
    work_rows: list[torch.Tensor]
    work_visible: list[torch.Tensor]
    partial_rows: torch.Tensor


def piece_slots(piece: Piece, page_size: int, device: torch.device) -> torch.Tensor:
    """Flat slots ``page_id * page_size + offset`` of a piece's valid rows, in order."""
    if not piece.page_ids:
        return torch.empty(0, dtype=torch.long, device=device)
    pages = torch.tensor(piece.page_ids, dtype=torch.long, device=device)
    rows = torch.tensor(piece.page_rows, dtype=torch.long, device=device)
    offsets = torch.arange(page_size, device=device)
    slots = pages.unsqueeze(1) * page_size + offsets
    return slots[offsets.unsqueeze(0) < rows.unsqueeze(1)]


def key_mask_tensor(key_masks: tuple[int, ...], num_keys: int, device: torch.device) -> torch.Tensor:
    """``(len(key_masks), num_keys)`` bool: entry ``[i, j]`` is bit ``j`` of ``key_masks[i]``."""
    bits = [[bool(mask >> j & 1) for j in range(num_keys)] for mask in key_masks]
    return torch.tensor(bits, dtype=torch.bool, device=device).reshape(len(key_masks), num_keys)


def attend_piece(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor,
    *,
    scale: float,
    fast: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 attention of query rows over one piece, with per-row visibility.

    Args:
        query: ``(R, Hq, Dk)``; key: ``(n, Hkv, Dk)``; value: ``(n, Hkv, Dv)`` (any float
            dtype, upcast to float32); ``Hq`` a multiple of ``Hkv``.
        visible: ``(R,)`` int64, row ``r`` sees piece rows ``0 .. visible[r]-1``; or ``(R, n)``
            bool, row ``r`` sees piece row ``j`` where ``visible[r, j]`` (a tree window's mask).
        scale: softmax scale applied to the scores.
        fast: the contract's ``fast`` mode: each weight ``exp(s - max)`` (the row's largest is 1)
            is rounded to ``query``'s dtype before P.V; the sums, the normalisation by the
            unrounded weights' sum and the LSE stay float32 (``exact``: nothing is rounded; a
            float32 query rounds nothing either, so the modes are one computation).

    Returns:
        ``(out, lse)``: ``(R, Hq, Dv)`` and ``(R, Hq)`` float32; a row that sees nothing
        is 0 with LSE ``-inf``.
    """
    num_rows, num_q_heads, key_dim = query.shape
    n, num_kv_heads, value_dim = value.shape
    group = num_q_heads // num_kv_heads
    q = query.float().reshape(num_rows, num_kv_heads, group, key_dim)
    scores = torch.einsum("rhgd,nhd->rhgn", q, key.float()) * scale
    if visible.dim() == 2:
        mask = visible
    else:
        mask = torch.arange(n, device=query.device).unsqueeze(0) < visible.unsqueeze(1)  # (R, n)
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (R, Hkv, G); -inf where nothing is visible
    if fast and query.dtype != torch.float32:  # weights relative to the row's largest, rounded as a kernel's P tile is
        top = scores.amax(dim=-1, keepdim=True)
        weights = torch.exp(scores - torch.where(torch.isneginf(top), 0.0, top))
        total = weights.sum(dim=-1, keepdim=True)
        probs = weights.to(query.dtype).float() / torch.where(total == 0, 1.0, total)
    else:
        probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("rhgn,nhd->rhgd", probs, value.float())
    return out.reshape(num_rows, num_q_heads, value_dim), lse.reshape(num_rows, num_q_heads)


class TorchReferenceBackend:
    """Runs attention plans with PyTorch: the CPU backend and the oracle for kernels.

    An :class:`~segkv.attention.backend.AttentionBackend` (its docstring shows the lifecycle):
    any device, both cache layouts, ``kv_transform``; no CUDA graphs (``prepare`` allocates
    index tensors sized by the plan, and ``run`` gathers pieces of plan-dependent sizes).
    """

    name = "torch"
    lse_api = LSE_API
    capabilities = BackendCapabilities(devices=("cpu", "cuda"), kv_layouts=("mha", "mla"), kv_transform=True,
                                       cuda_graphs=False, precision_modes=("exact", "fast"), key_masks=True,
                                       sinks=True)

    def __init__(self, *, page_size: int, device: str | torch.device = "cpu") -> None:
        self.page_size = page_size
        self.device = torch.device(device)

    def prepare(self, plan: AttentionPlan) -> PreparedPlan:
        """Turn the plan's lists into index tensors (once per forward step)."""
        dev = self.device
        slots = [piece_slots(piece, self.page_size, dev) for piece in plan.pieces]
        work_rows, work_visible = [], []
        for item in plan.work:
            n = plan.pieces[item.piece].num_rows
            offsets = torch.tensor(item.causal_offsets, dtype=torch.long, device=dev)
            work_rows.append(torch.tensor(item.query_rows, dtype=torch.long, device=dev))
            if item.key_lows is not None:  # a sliding window: rows see [low, offset] of the piece
                keys = torch.arange(n, device=dev)
                lows = torch.tensor(item.key_lows, dtype=torch.long, device=dev)
                work_visible.append((keys[None, :] >= lows[:, None]) & (keys[None, :] <= offsets[:, None]))
            elif item.key_masks is None:
                work_visible.append((offsets + 1).clamp(min=0, max=n))
            else:  # the masks never set a bit past the causal offset (WorkItem checks it)
                work_visible.append(key_mask_tensor(item.key_masks, n, dev))
        partial_rows = torch.tensor(plan.partial_rows, dtype=torch.long, device=dev)
        return PreparedPlan(plan, slots, work_rows, work_visible, partial_rows)

    def run(
        self,
        prepared: PreparedPlan,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        *,
        scale: float,
        out_dtype: torch.dtype | None = None,
        kv_transform: KVTransform | None = None,
        kv_scales: KVScales | None = None,
        sinks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of one layer.

        Args:
            query: ``(R, Hq, Dk)`` query rows in plan row order.
            key_cache: ``(num_pages, page_size, Hkv, Dk)`` (for MLA the latent rows).
            value_cache: ``(num_pages, page_size, Hkv, Dv)`` (for MLA a view of the first
                ``kv_lora_rank`` latent columns).
            scale: softmax scale (explicit; MLA's differs from ``Dk ** -0.5``).
            out_dtype: dtype of the result (default ``query.dtype``); rounded once.
            kv_transform: maps each piece's gathered ``(key, value)`` rows to the per-head
                K/V that are attended, e.g. MLA's naive path decompresses latent rows
                ``(n, 1, r + rope)`` into ``(n, H, Dk)`` keys and ``(n, H, Dv)`` values.
            kv_scales: an FP8 cache's ``(k_scale, v_scale)``, ``(Hkv,)`` float32 each: the
                gathered ``float8_e4m3fn`` rows are dequantized to float32 (times the scale of
                their KV head) before anything else, ``kv_transform`` included.
            sinks: ``(Hq,)`` float32 attention sinks (``AttentionBackend``): merged as one more
                state per row (LSE ``sinks[h]``, output 0) in float32, before the rounding; a row
                that sees no key is 0 with LSE ``sinks[h]``. Any layout, ``kv_transform`` too.

        Returns:
            ``(out, lse)``: ``(R, Hq, Dv)`` in ``out_dtype`` and ``(R, Hq)`` float32.
        """
        plan = prepared.plan
        if query.shape[0] != plan.num_query_rows:
            raise ValueError(f"query has {query.shape[0]} rows, the plan {plan.num_query_rows}")
        check_sinks(self.name, self.capabilities, sinks, query)
        partial_out, partial_lse = self.partials(prepared, query, key_cache, value_cache, scale=scale,
                                                 kv_transform=kv_transform, kv_scales=kv_scales)
        out, lse = merge_partials(partial_out, partial_lse, prepared.partial_rows, plan.num_query_rows, sinks=sinks)
        return out.to(out_dtype or query.dtype), lse

    def partials(
        self,
        prepared: PreparedPlan,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        *,
        scale: float,
        kv_transform: KVTransform | None = None,
        kv_scales: KVScales | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 1 alone: every work item's partial states, unmerged (arguments as :meth:`run`;
        ``query`` may hold more rows than the plan's work reads).

        Returns:
            ``(partial_out, partial_lse)``: ``(P, Hq, Dv)`` and ``(P, Hq)`` float32, partial
            ``p`` belonging to query row ``prepared.partial_rows[p]``.
        """
        plan = prepared.plan
        if kv_transform is None and query.shape[1] % key_cache.shape[2]:
            raise ValueError(f"{query.shape[1]} query heads for {key_cache.shape[2]} KV heads")
        keys = key_cache.flatten(0, 1)
        values = value_cache.flatten(0, 1)
        gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def piece_kv(index: int) -> tuple[torch.Tensor, torch.Tensor]:
            if index not in gathered:
                slots = prepared.piece_slots[index]
                key, value = keys[slots], values[slots]
                if kv_scales is not None:  # FP8 bytes -> float32 values, per KV head
                    key, value = dequantize_fp8(key, kv_scales[0]), dequantize_fp8(value, kv_scales[1])
                gathered[index] = kv_transform(key, value) if kv_transform else (key, value)
            return gathered[index]

        num_heads = query.shape[1]
        fast = plan.precision == "fast"
        value_dim = piece_kv(plan.work[0].piece)[1].shape[-1] if plan.work else values.shape[-1]
        partial_out = torch.empty(plan.num_partials, num_heads, value_dim, device=query.device)
        partial_lse = torch.empty(plan.num_partials, num_heads, device=query.device)
        start = 0
        for item, rows, visible in zip(plan.work, prepared.work_rows, prepared.work_visible):
            key, value = piece_kv(item.piece)
            out, lse = attend_piece(query[rows], key, value, visible, scale=scale, fast=fast)
            end = start + rows.numel()
            partial_out[start:end] = out
            partial_lse[start:end] = lse
            start = end
        return partial_out, partial_lse
