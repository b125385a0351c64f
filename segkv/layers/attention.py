"""Paged attention layers: write the step's new K/V rows, then attend the plan's pieces."""

from __future__ import annotations

import torch
from torch import nn

from segkv.attention.metadata import AttentionMetadata


class PagedAttention(nn.Module):
    """GQA/MQA/MHA attention of one layer over the paged cache (no parameters).

    ``q``: ``(T, Hq, D)``; ``k``, ``v``: ``(T, Hkv, D)`` for the step's ``T`` new rows,
    already position-encoded. Returns ``(T, Hq, D)`` in ``q.dtype``. ``window``: this layer's own
    sliding window in a model whose layers differ (``layer_windows``): it attends the step's plan
    bounded by that window (``AttentionMetadata.windowed``); None: the step's plan.
    """

    def __init__(self, layer_index: int, *, scale: float) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.scale = scale
        self.window: int | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        storage, layer = meta.storage, self.layer_index
        storage.write(layer, meta.slots, k, v, trusted_slots=meta.trusted_slots)
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of ``q (T, Hq, D)`` over the cache, the step's rows already written."""
        storage, layer = meta.storage, self.layer_index
        out, _ = meta.backend.run(
            meta.prepared_for(self.window), q, storage.key_cache(layer), storage.value_cache(layer), scale=self.scale,
            kv_scales=storage.kv_scales(layer),
        )
        return out
