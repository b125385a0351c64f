"""AttentionMetadata: what every attention layer of one forward step needs, as an argument."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from segkv.attention.backend import AttentionBackend, PreparedAttention
from segkv.cache.storage import PagedKVStorage


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step attention inputs shared by all layers.

    ``slots``: ``(T,)`` int64 storage slots where the step's ``T`` new rows are written
    (row ``t`` of the step is query row ``t`` of the plan). ``prepared``: the plan's index
    tensors. ``storage``: the paged KV tensors of every layer. ``mla_mode``: ``"absorbed"``
    (attend over the latent cache) or ``"naive"`` (decompress per-head K/V per piece).
    ``trusted_slots``: the runner checked the slots against the chains, so cache writes skip
    their device-side range check (a host synchronisation CUDA graphs cannot capture).
    ``windowed``: for models whose layers attend different sliding windows (``layer_windows``),
    the step's plan bounded by each window, by window; layers without one attend ``prepared``.
    """

    backend: AttentionBackend
    prepared: PreparedAttention  # backend.prepare(plan)
    storage: PagedKVStorage
    slots: torch.Tensor
    mla_mode: str = "absorbed"
    trusted_slots: bool = False  # slots checked on the host: cache writes skip the device check
    windowed: dict[int, PreparedAttention] = field(default_factory=dict)

    def prepared_for(self, window: int | None) -> PreparedAttention:
        """The prepared plan a layer attending ``window`` (None: the step's plan) runs."""
        if window is None:
            return self.prepared
        if window not in self.windowed:
            raise ValueError(f"no attention plan for a sliding window of {window} in this step "
                             f"(plans for {sorted(self.windowed)}): the model's layer_windows were not planned")
        return self.windowed[window]

    @property
    def num_tokens(self) -> int:
        return int(self.slots.numel())
