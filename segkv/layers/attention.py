"""Paged attention layers: write the step's new K/V rows, then attend the plan's pieces."""

from __future__ import annotations

import torch
from torch import nn

from segkv.attention.metadata import AttentionMetadata
from segkv.kernels.partials_merge import PendingMerge


class PagedAttention(nn.Module):
    """GQA/MQA/MHA attention of one layer over the paged cache (no parameters).

    ``q``: ``(T, Hq, D)``; ``k``, ``v``: ``(T, Hkv, D)`` for the step's ``T`` new rows,
    already position-encoded. Returns ``(T, Hq, D)`` in ``q.dtype``.
    """

    def __init__(self, layer_index: int, *, scale: float) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        storage, layer = meta.storage, self.layer_index
        storage.write(layer, meta.slots, k, v, trusted_slots=meta.trusted_slots)
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, *, defer_merge: bool = False
               ) -> torch.Tensor | PendingMerge:
        """Attention of ``q (T, Hq, D)`` over the cache, the step's rows already written.
        ``defer_merge``: where the backend can, one row whose merge would launch comes back as a
        :class:`PendingMerge` for the output projection to merge (``kernels.merge_gemv``)."""
        storage, layer = meta.storage, self.layer_index
        defer = {"defer_merge": True} if defer_merge and getattr(meta.backend, "defers_merge", False) else {}
        out, _ = meta.backend.run(
            meta.prepared, q, storage.key_cache(layer), storage.value_cache(layer), scale=self.scale, **defer
        )
        return out
