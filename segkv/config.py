"""Typed configuration value objects shared by every layer of segkv."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_KV_KINDS = ("mha", "mla")
_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Return the torch dtype for ``"float32" | "float16" | "bfloat16"`` (or a dtype)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; expected one of {sorted(_DTYPES)}")
        return dtype
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
    name = aliases.get(dtype, dtype)
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclass(slots=True, frozen=True)
class KVLayout:
    """Shape of the KV rows one token stores in every layer.

    ``kind="mha"`` covers multi-head, grouped-query and multi-query attention: each layer
    stores K and V of shape ``(num_kv_heads, head_dim)`` per token. ``kind="mla"`` is
    multi-head latent attention in absorbed form: each layer stores one latent row of
    ``kv_lora_rank + rope_dim`` columns; values are its first ``kv_lora_rank`` columns.
    """

    num_layers: int
    kind: str = "mha"
    num_kv_heads: int = 1
    head_dim: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.kind not in _KV_KINDS:
            raise ValueError(f"KVLayout.kind must be one of {_KV_KINDS}, got {self.kind!r}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        if self.kind == "mha":
            if self.num_kv_heads < 1 or self.head_dim < 1:
                raise ValueError(
                    "an 'mha' layout needs num_kv_heads >= 1 and head_dim >= 1, got "
                    f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
                )
        else:
            if self.kv_lora_rank < 1 or self.rope_dim < 0:
                raise ValueError(
                    "an 'mla' layout needs kv_lora_rank >= 1 and rope_dim >= 0, got "
                    f"kv_lora_rank={self.kv_lora_rank}, rope_dim={self.rope_dim}"
                )

    @property
    def key_dim(self) -> int:
        """Width of one key head: ``head_dim`` (MHA) or ``kv_lora_rank + rope_dim`` (MLA)."""
        return self.head_dim if self.kind == "mha" else self.kv_lora_rank + self.rope_dim

    @property
    def value_dim(self) -> int:
        """Width of one value head: ``head_dim`` (MHA) or ``kv_lora_rank`` (MLA)."""
        return self.head_dim if self.kind == "mha" else self.kv_lora_rank

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def row_bytes_per_layer(self) -> int:
        """Bytes one token occupies in one layer (K and V, or the one latent row)."""
        if self.kind == "mha":
            return 2 * self.num_kv_heads * self.head_dim * self.element_size
        return self.key_dim * self.element_size

    @property
    def row_bytes(self) -> int:
        """Bytes one token occupies across all layers."""
        return self.num_layers * self.row_bytes_per_layer


def default_page_size(device_type: str) -> int:
    """Rows per KV page when none is asked for: 32 on CUDA, where whole-model decode measured
    level or faster than with 16 (``docs/benchmarks.md``), 16 elsewhere."""
    return 32 if device_type == "cuda" else 16


@dataclass(slots=True, frozen=True)
class CacheConfig:
    """Size of the paged KV cache: ``num_pages`` pages of ``page_size`` rows each."""

    page_size: int = 16
    num_pages: int = 1024

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")


@dataclass(slots=True, frozen=True)
class CompactionPolicy:
    """When a chain merges its trailing small segments (see ``cache.compaction``).

    The last two sealed segments are merged while the older one holds fewer than
    ``ratio`` times the rows of the newer one, which keeps segment sizes geometric and the
    segment count logarithmic in the number of turns. A segment with more than
    ``max_copy_rows`` rows is never copied, so the big history segment stays in place.
    """

    ratio: float = 2.0
    max_copy_rows: int = 4096
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.ratio < 1.0:
            raise ValueError(f"CompactionPolicy.ratio must be >= 1, got {self.ratio}")
        if self.max_copy_rows < 0:
            raise ValueError(f"max_copy_rows must be >= 0, got {self.max_copy_rows}")
