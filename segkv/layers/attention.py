"""Paged attention layers: write the step's new K/V rows, then attend the plan's pieces."""

from __future__ import annotations

import torch
from torch import nn

from segkv.attention.metadata import AttentionMetadata


class PagedAttention(nn.Module):
    """GQA/MQA/MHA attention of one layer over the paged cache.

    ``q``: ``(T, Hq, D)``; ``k``, ``v``: ``(T, Hkv, D)`` for the step's ``T`` new rows,
    already position-encoded. Returns ``(T, Hq, D)`` in ``q.dtype``. ``window``: this layer's own
    sliding window in a model whose layers differ (``layer_windows``): it attends the step's plan
    bounded by that window (``AttentionMetadata.windowed``); None: the step's plan.

    ``num_sinks``: 0 (no parameters), or the number of query heads ``Hq`` for attention sinks
    (gpt-oss): a learned logit per head, ``sinks (Hq,)``, in the units of the scaled scores
    ``scale * q.k``. Each sink is one more softmax-denominator term with a zero value: it takes
    attention weight away from every key of the row, and a row may attend mostly to nothing. The
    backend folds it in float32 (``AttentionBackend.run``'s ``sinks``).
    """

    def __init__(self, layer_index: int, *, scale: float, num_sinks: int = 0) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.scale = scale
        self.window: int | None = None
        self.sinks: nn.Parameter | None = nn.Parameter(torch.zeros(num_sinks)) if num_sinks else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        storage, layer = meta.storage, self.layer_index
        storage.write(layer, meta.slots, k, v, trusted_slots=meta.trusted_slots)
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of ``q (T, Hq, D)`` over the cache, the step's rows already written."""
        storage, layer = meta.storage, self.layer_index
        # the backends take the sink logits as float32 (a no-op for a float32 model); a layer without
        # sinks calls run exactly as before
        sinks = {} if self.sinks is None else {"sinks": self.sinks.float()}
        out, _ = meta.backend.run(
            meta.prepared_for(self.window), q, storage.key_cache(layer), storage.value_cache(layer), scale=self.scale,
            kv_scales=storage.kv_scales(layer), **sinks,
        )
        return out
