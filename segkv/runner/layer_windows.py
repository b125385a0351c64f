"""The sliding windows a model's layers attend, as the runner and its CUDA graphs plan them."""

from __future__ import annotations

from torch import nn


def layer_windows(model: nn.Module) -> tuple[int, ...]:
    """The distinct sliding windows of a model whose layers differ (``model.layer_windows``: one
    entry per layer, None for full attention): each is planned on its own every step
    (``AttentionMetadata.windowed``). () for the others, whose one plan bounds every layer alike
    (``model.sliding_window``)."""
    return tuple(sorted({w for w in getattr(model, "layer_windows", None) or () if w is not None}))


def history_window(model: nn.Module) -> int | None:
    """The window past which no layer of ``model`` looks back: the model's sliding window, or
    the widest of its per-layer windows; None when some layer attends the whole history. Rows
    further back than it from every future query can be given back
    (``KVChain.release_rows_before``)."""
    if getattr(model, "sliding_window", None):
        return int(model.sliding_window)
    windows = getattr(model, "layer_windows", None)
    if windows and all(w is not None for w in windows):
        return max(windows)
    return None
