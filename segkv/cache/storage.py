"""PagedKVStorage: the torch tensors that hold KV pages (the only torch user in cache/)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from segkv.cache.page_pool import PagePool
from segkv.config import FP8_KV_DTYPE, KVLayout

FP8_MAX = 448.0  # e4m3's largest finite magnitude: quantized values saturate there


def quantize_fp8(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Rows ``(n, H, D)`` (or latent rows ``(n, D)``, with ``H = 1``) of any float dtype, divided by
    ``scale (H,)`` float32 per head, saturated to +-448 and rounded to nearest e4m3 (torch's
    conversion) -> ``float8_e4m3fn`` of the same shape. NaN stays NaN."""
    factor = scale.view(-1, 1) if rows.dim() == 3 else scale.view(1)
    return (rows.float() / factor).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_fp8(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``float8_e4m3fn`` rows ``(..., H, D)`` times ``scale (H,)`` float32 per head -> float32 rows of
    the same shape (latent views ``(..., 1, D)`` take a ``(1,)`` scale)."""
    return rows.float() * scale.view(-1, 1)


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

    An FP8 layout (``layout.fp8``, ``kv_cache_dtype="fp8"``) stores ``float8_e4m3fn`` values and
    keeps static float32 scales: ``k_scale`` and ``v_scale`` ``(num_layers, num_kv_heads)`` for
    'mha'; for 'mla' one scale per layer for the whole latent row (``k_scale`` ``(num_layers, 1)``,
    ``v_scale`` the same tensor: the values are the latent rows' first columns). A stored value
    ``q`` means ``q * scale``. They are 1.0 unless :meth:`set_scales` (before any row is written)
    gives the checkpoint's. Other layouts have both None.
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
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if layout.fp8:
            heads = layout.num_kv_heads if layout.kind == "mha" else 1
            self.k_scale = torch.ones(layout.num_layers, heads, dtype=torch.float32, device=self.device)
            self.v_scale = (torch.ones_like(self.k_scale) if layout.kind == "mha" else self.k_scale)

    @property
    def fp8(self) -> bool:
        """Rows stored as float8 e4m3 with :attr:`k_scale`/:attr:`v_scale`."""
        return self.layout.fp8

    def set_scales(self, k_scale: torch.Tensor | float, v_scale: torch.Tensor | float | None = None) -> None:
        """Set an FP8 cache's static scales in place (the tensors keep their addresses, which CUDA
        graphs captured): anything broadcastable to ``(num_layers, H)`` (a float, ``(num_layers,)``
        per layer, ``(num_layers, H)`` per head), positive and finite. 'mla' takes only ``k_scale``
        (``v_scale`` None or equal). Rows written before keep their bytes: set scales first."""
        if not self.fp8:
            raise ValueError(f"KV scales apply to an FP8 cache; this one stores {self.layout.dtype}")
        if self.layout.kind == "mla" and v_scale is not None and not torch.equal(
                torch.as_tensor(v_scale, dtype=torch.float32), torch.as_tensor(k_scale, dtype=torch.float32)):
            raise ValueError("an 'mla' cache has one scale per layer (its latent rows hold keys and values)")
        pairs = [(self.k_scale, k_scale)] + ([(self.v_scale, v_scale)] if self.layout.kind == "mha"
                                              and v_scale is not None else [])
        for target, value in pairs:
            value = torch.as_tensor(value, dtype=torch.float32)
            if value.dim() == 1 and value.numel() == target.shape[0]:
                value = value[:, None]  # one scale per layer
            try:
                value = value.broadcast_to(target.shape)
            except RuntimeError as exc:
                raise ValueError(f"KV scales of shape {tuple(value.shape)} do not fit {tuple(target.shape)} "
                                 "(layers, KV heads)") from exc
            if not bool(torch.isfinite(value).all() and (value > 0).all()):
                raise ValueError("KV scales must be positive and finite")
            target.copy_(value)

    def kv_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An FP8 cache's ``(k_scale, v_scale)`` of one layer, ``(H,)`` float32 views on the device
        (``H = 1`` for 'mla', the same scale twice), for ``AttentionBackend.run``; None otherwise."""
        if self.k_scale is None:
            return None
        return self.k_scale[layer], self.v_scale[layer]

    def dequantized(self, rows: torch.Tensor, layer: int, *, value: bool = False) -> torch.Tensor:
        """Rows as :meth:`read` returns them ``(n, H, D)`` (``(n, D)`` latent rows) as float32 values:
        an FP8 cache's bytes times the layer's key (``value``: value) scales; other caches upcast."""
        if not self.fp8:
            return rows.float()
        scale = (self.v_scale if value else self.k_scale)[layer]
        return dequantize_fp8(rows.unsqueeze(1), scale).squeeze(1) if rows.dim() == 2 else dequantize_fp8(rows, scale)

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
        An FP8 cache quantizes the rows with the layer's scales (:func:`quantize_fp8`); rows given
        as ``float8_e4m3fn`` are taken as stored values and copied as they are (snapshot loads).
        """
        index = _as_slots(slots, self.device)
        self._check_rows(index, key, value, check_range=not trusted_slots)
        if self.layout.kind == "mha":
            self._raw(self._flat(self.k[layer])).index_copy_(0, index, self._stored(key, layer, self.k_scale))
            self._raw(self._flat(self.v[layer])).index_copy_(0, index, self._stored(value, layer, self.v_scale))
        else:
            self._raw(self._flat(self.latent[layer])).index_copy_(0, index, self._stored(key, layer, self.k_scale))

    def _stored(self, rows: torch.Tensor, layer: int, scales: torch.Tensor | None) -> torch.Tensor:
        """Rows as the storage holds them (for FP8, their bytes as uint8: torch has no index_copy_
        for float8 types)."""
        if not self.fp8:
            return rows.to(self.layout.dtype)
        if rows.dtype != FP8_KV_DTYPE:
            rows = quantize_fp8(rows, scales[layer])
        return rows.view(torch.uint8)

    def rows_to_write(
        self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, trusted_slots: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate an 'mha' write of ``key``/``value (n, num_kv_heads, head_dim)`` at ``slots (n,)``
        as :meth:`write` does, and return the layer's ``(slots_total, num_kv_heads, head_dim)``
        key and value rows for a kernel that writes them itself (fused RoPE and write). Not for an
        FP8 cache (those kernels store unscaled values): its writes go through :meth:`write`."""
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
        self._check_not_fp8("mha_rows")
        if not trusted_slots:
            self._check_slot_range(_as_slots(slots, self.device))
        return self._flat(self.k[layer]), self._flat(self.v[layer])

    def latent_rows_to_write(self, layer: int, slots: torch.Tensor, *, trusted_slots: bool = False) -> torch.Tensor:
        """Validate the slots of an 'mla' write as :meth:`write` does and return the layer's
        ``(slots_total, kv_lora_rank + rope_dim)`` latent rows, for a kernel that makes the rows
        and writes them itself (fused RoPE and latent write)."""
        if self.layout.kind != "mla":
            raise ValueError("latent_rows_to_write is for 'mla' caches")
        self._check_not_fp8("latent_rows_to_write")
        if not trusted_slots:
            self._check_slot_range(_as_slots(slots, self.device))
        return self._flat(self.latent[layer])

    def _check_not_fp8(self, name: str) -> None:
        if self.fp8:  # the fused kernels would store unscaled values in the model's dtype
            raise ValueError(f"{name} is not for an FP8 cache: write its rows with write() (which quantizes)")

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
        """Gather rows at ``slots``: ``(k, v)`` for MHA, ``(latent,)`` for MLA, as stored (an FP8
        cache's ``float8_e4m3fn`` values, unscaled: :meth:`dequantized` applies the scales)."""
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
            flat = self._raw(self._flat(tensor))  # an FP8 cache's bytes: the scales stay per layer
            flat.index_copy_(0, dst_index, flat[src_index])
        self.pool.record_copy(num_rows=len(src), row_bytes=self.layout.row_bytes)

    @staticmethod
    def _raw(tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` itself, or an FP8 tensor's uint8 view (index_copy_ has no float8 kernels)."""
        return tensor.view(torch.uint8) if tensor.dtype == FP8_KV_DTYPE else tensor

    @staticmethod
    def _flat(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view(tensor.shape[0] * tensor.shape[1], *tensor.shape[2:])
