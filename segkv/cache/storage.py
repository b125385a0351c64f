"""PagedKVStorage: the torch tensors that hold KV pages (the only torch user in cache/)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from segkv.cache.page_pool import PagePool
from segkv.config import KVLayout


def _as_slots(slots: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(slots, torch.Tensor):
        return slots.to(device=device, dtype=torch.long)
    return torch.tensor(list(slots), dtype=torch.long, device=device)


class PagedKVStorage:
    """K/V (or MLA latent) storage for every layer, addressed by flat slot.

    A slot is ``page_id * page_size + offset``. Per layer the tensors are:

    - ``kind="mha"``: ``k[layer]`` and ``v[layer]`` of shape
      ``(num_pages, page_size, num_kv_heads, head_dim)``;
    - ``kind="mla"``: ``latent[layer]`` of shape
      ``(num_pages, page_size, kv_lora_rank + rope_dim)``.

    All in ``layout.dtype`` on ``device``. Copies are reported to the pool.
    """

    def __init__(self, layout: KVLayout, pool: PagePool, *, device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.pool = pool
        self.page_size = pool.page_size
        self.device = torch.device(device)
        shape_common = (pool.num_pages, pool.page_size)
        kw = {"dtype": layout.dtype, "device": self.device}
        if layout.kind == "mha":
            shape = shape_common + (layout.num_kv_heads, layout.head_dim)
            self.k = [torch.zeros(shape, **kw) for _ in range(layout.num_layers)]
            self.v = [torch.zeros(shape, **kw) for _ in range(layout.num_layers)]
            self.latent: list[torch.Tensor] = []
        else:
            shape = shape_common + (layout.key_dim,)
            self.latent = [torch.zeros(shape, **kw) for _ in range(layout.num_layers)]
            self.k, self.v = [], []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *self.latent))

    # -- attention views --------------------------------------------------------------
    def key_cache(self, layer: int) -> torch.Tensor:
        """``(num_pages, page_size, num_kv_heads, key_dim)`` view of one layer's keys."""
        if self.layout.kind == "mha":
            return self.k[layer]
        return self.latent[layer].unsqueeze(2)

    def value_cache(self, layer: int) -> torch.Tensor:
        """``(num_pages, page_size, num_kv_heads, value_dim)`` view of one layer's values.

        For MLA this is the first ``kv_lora_rank`` columns of the latent rows (no copy).
        """
        if self.layout.kind == "mha":
            return self.v[layer]
        return self.latent[layer][..., : self.layout.kv_lora_rank].unsqueeze(2)

    # -- rows -------------------------------------------------------------------------
    def write(
        self,
        layer: int,
        slots: Sequence[int] | torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor | None = None,
        *,
        trusted_slots: bool = False,
    ) -> None:
        """Write rows at ``slots`` (n,) of one layer.

        MHA: ``key`` and ``value`` are ``(n, num_kv_heads, head_dim)``. MLA: ``key`` is the
        latent ``(n, kv_lora_rank + rope_dim)`` and ``value`` must be None.
        ``trusted_slots``: the caller checked the slots on the host (they came from the chains),
        so the device-side range check, a host synchronisation, is skipped (CUDA graphs).
        """
        index = _as_slots(slots, self.device)
        self._check_rows(index, key, value, check_range=not trusted_slots)
        if self.layout.kind == "mha":
            self._flat(self.k[layer]).index_copy_(0, index, key.to(self.layout.dtype))
            self._flat(self.v[layer]).index_copy_(0, index, value.to(self.layout.dtype))
        else:
            self._flat(self.latent[layer]).index_copy_(0, index, key.to(self.layout.dtype))

    def rows_to_write(
        self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, trusted_slots: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate an 'mha' write of ``key``/``value (n, num_kv_heads, head_dim)`` at ``slots (n,)``
        as :meth:`write` does, and return the layer's ``(slots_total, num_kv_heads, head_dim)``
        key and value rows for a kernel that writes them itself (fused RoPE and write)."""
        if self.layout.kind != "mha":
            raise ValueError("rows_to_write is for 'mha' caches")
        self._check_rows(_as_slots(slots, self.device), key, value, check_range=False)
        return self.mha_rows(layer, slots, trusted_slots=trusted_slots)

    def mha_rows(self, layer: int, slots: torch.Tensor, *, trusted_slots: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate the slots of an 'mha' write as :meth:`write` does and return the layer's
        ``(slots_total, num_kv_heads, head_dim)`` key and value rows, for a kernel that makes the
        rows and writes them itself (the one-launch q/k/v product)."""
        if self.layout.kind != "mha":
            raise ValueError("mha_rows is for 'mha' caches")
        if not trusted_slots:
            self._check_slot_range(_as_slots(slots, self.device))
        return self._flat(self.k[layer]), self._flat(self.v[layer])

    def latent_rows_to_write(self, layer: int, slots: torch.Tensor, *, trusted_slots: bool = False) -> torch.Tensor:
        """Validate the slots of an 'mla' write as :meth:`write` does and return the layer's
        ``(slots_total, kv_lora_rank + rope_dim)`` latent rows, for a kernel that makes the rows
        and writes them itself (fused RoPE and latent write)."""
        if self.layout.kind != "mla":
            raise ValueError("latent_rows_to_write is for 'mla' caches")
        if not trusted_slots:
            self._check_slot_range(_as_slots(slots, self.device))
        return self._flat(self.latent[layer])

    def _check_rows(
        self, index: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None, *, check_range: bool = True
    ) -> None:
        """Validate a write before touching any tensor, so a bad write changes nothing."""
        n = index.numel()
        lay = self.layout
        if lay.kind == "mha":
            if value is None:
                raise ValueError("an 'mha' cache write needs both key and value")
            want = (n, lay.num_kv_heads, lay.head_dim)
            for name, t in (("key", key), ("value", value)):
                if tuple(t.shape) != want:
                    raise ValueError(f"{name} rows have shape {tuple(t.shape)}, expected {want}")
        else:
            if value is not None:
                raise ValueError("an 'mla' cache write takes only the latent rows")
            if tuple(key.shape) != (n, lay.key_dim):
                raise ValueError(f"latent rows have shape {tuple(key.shape)}, expected {(n, lay.key_dim)}")
        if check_range:
            self._check_slot_range(index)

    def _check_slot_range(self, index: torch.Tensor) -> None:
        """Every slot of ``index`` inside the pool (a host synchronisation)."""
        capacity = self.pool.num_pages * self.page_size
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= capacity):
            raise ValueError(f"slots out of range 0..{capacity - 1}")

    def read(self, layer: int, slots: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Gather rows at ``slots``: ``(k, v)`` for MHA, ``(latent,)`` for MLA."""
        index = _as_slots(slots, self.device)
        if self.layout.kind == "mha":
            return self._flat(self.k[layer])[index], self._flat(self.v[layer])[index]
        return (self._flat(self.latent[layer])[index],)

    def copy_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy rows from slots ``src`` to slots ``dst`` in every layer (compaction)."""
        if len(src) != len(dst):
            raise ValueError(f"copy of {len(src)} rows into {len(dst)} slots")
        src_index = _as_slots(src, self.device)
        dst_index = _as_slots(dst, self.device)
        for tensor in (*self.k, *self.v, *self.latent):
            flat = self._flat(tensor)
            flat.index_copy_(0, dst_index, flat[src_index])
        self.pool.record_copy(num_rows=len(src), row_bytes=self.layout.row_bytes)

    @staticmethod
    def _flat(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view(tensor.shape[0] * tensor.shape[1], *tensor.shape[2:])
