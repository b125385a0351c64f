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


# --kv-cache-dtype: "auto" stores K/V in the model's dtype; "fp8" stores float8 e4m3 bytes with
# float32 scales per (layer, KV head) (cache/storage.py)
KV_CACHE_DTYPES = ("auto", "fp8")
FP8_KV_DTYPE = torch.float8_e4m3fn


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's storage dtype: ``model_dtype`` for ``"auto"``, ``torch.float8_e4m3fn`` for
    ``"fp8"``; any other value is a ValueError naming it."""
    if kv_cache_dtype == "auto":
        return parse_dtype(model_dtype)
    if kv_cache_dtype == "fp8":
        return FP8_KV_DTYPE
    raise ValueError(f"unsupported kv_cache_dtype {kv_cache_dtype!r}; expected one of {list(KV_CACHE_DTYPES)}")


@dataclass(slots=True, frozen=True)
class KVLayout:
    """Shape of the KV rows one token stores in every layer.

    ``kind="mha"`` covers multi-head, grouped-query and multi-query attention: each layer
    stores K and V of shape ``(num_kv_heads, head_dim)`` per token. ``kind="mla"`` is
    multi-head latent attention in absorbed form: each layer stores one latent row of
    ``kv_lora_rank + rope_dim`` columns; values are its first ``kv_lora_rank`` columns.
    ``dtype``: float32, float16, bfloat16, or ``torch.float8_e4m3fn`` (an FP8 cache: one byte per
    element, with float32 scales the storage keeps; ``PagedKVStorage``).
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
        if self.dtype != FP8_KV_DTYPE:
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
    def fp8(self) -> bool:
        """Whether rows are stored as float8 e4m3 with scales (``kv_cache_dtype="fp8"``)."""
        return self.dtype == FP8_KV_DTYPE

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


def default_prefill_chunk(device_type: str) -> int:
    """Tokens per sequence per forward during prefill when none is asked for: 2048 on CUDA, where
    a chunk's host time and launches amortise over four times the rows of 512 (per-token wall time
    0.7x, docs/benchmarks.md; 4096 measured no better), 512 elsewhere (the CPU reference's score
    blocks grow with the chunk)."""
    return 2048 if device_type == "cuda" else 512


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


# --- the new-user defaults: --device auto, --dtype auto, --gpu-memory-utilization

GIB = 1 << 30
# On a GPU the pool leaves this much of the utilization's share unused, for the allocator's
# fragmentation and the buffers made after profiling (graph index buffers, the sampler's)
KV_MARGIN_BYTES = 256 << 20


def resolve_dtype(dtype: str | torch.dtype, *, device_type: str, checkpoint_dtype: object = None) -> torch.dtype:
    """The dtype the weights load in: ``dtype`` itself, or for ``"auto"`` the checkpoint's
    ``torch_dtype`` (config.json; float32 when absent) on CUDA and float32 on the CPU, where
    half-precision matmuls are slow. A checkpoint dtype other than float32, float16 or bfloat16
    is a ValueError naming it."""
    if not (isinstance(dtype, str) and dtype == "auto"):
        return parse_dtype(dtype)
    if device_type != "cuda":
        return torch.float32
    if checkpoint_dtype is None:
        return torch.float32
    name = str(checkpoint_dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"--dtype auto: the checkpoint's torch_dtype {checkpoint_dtype!r} is not one segkv "
                         f"runs ({', '.join(sorted(_DTYPES))}); pass --dtype explicitly")
    return _DTYPES[name]


def check_gpu_memory_utilization(value: float) -> float:
    """``value`` if it is in (0, 1], else a ValueError."""
    if not 0 < value <= 1:  # NaN too
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {value}")
    return float(value)


def kv_cache_budget(*, total: int, free: int, weights: int, peak: int, utilization: float,
                    margin: int = KV_MARGIN_BYTES, reserved: int = 0) -> int:
    """Bytes the KV pool may take on a GPU, as vLLM sizes it: ``utilization`` of the device's
    ``total`` bytes, less what is in use now (``total - free``: the weights, the CUDA context,
    other processes), less the ``peak`` bytes a profiling forward at the largest step allocated
    on top of that (activations, workspace, and as much again for CUDA graphs where the caller
    counts them in), less ``margin``, less ``reserved``: the bytes of a speculative drafter
    (weights, cache, activations), which loads after the pool and so is not in use yet.
    ``weights`` (included in ``total - free``) names the weights' share in the errors. A
    ValueError names the numbers and the flags when nothing is left."""
    check_gpu_memory_utilization(utilization)
    if min(total, free, weights, peak, margin, reserved) < 0 or free > total:
        raise ValueError(f"inconsistent memory figures: total={total}, free={free}, weights={weights}, "
                         f"peak={peak}, margin={margin}, reserved={reserved}")
    allowed = int(total * utilization)
    used = total - free
    if weights >= allowed:
        raise ValueError(f"--gpu-memory-utilization {utilization:g} allows {allowed / GIB:.2f} GiB of the "
                         f"device's {total / GIB:.2f} GiB, but the weights alone take {weights / GIB:.2f} GiB; "
                         "raise --gpu-memory-utilization, or use a smaller model or dtype")
    budget = allowed - used - peak - margin - reserved
    if budget <= 0:
        drafter = (f", and the speculative drafter (its weights, cache and activations, loaded after the "
                   f"pool) needs {reserved / GIB:.2f} GiB" if reserved else "")
        raise ValueError(f"no memory is left for the KV cache: --gpu-memory-utilization {utilization:g} "
                         f"allows {allowed / GIB:.2f} GiB of {total / GIB:.2f} GiB, but {used / GIB:.2f} GiB "
                         f"is in use (weights {weights / GIB:.2f} GiB) and the largest step needs "
                         f"{peak / GIB:.2f} GiB more (+{margin / GIB:.2f} GiB margin){drafter}; raise "
                         "--gpu-memory-utilization, lower --max-num-batched-tokens, "
                         f"{'use a smaller drafter, ' if reserved else ''}or give "
                         "--kv-cache-memory GIB explicitly")
    return budget


def check_capacity(max_model_len: int, *, capacity_tokens: int, explicit: bool) -> None:
    """A ValueError when one sequence of ``max_model_len`` tokens cannot fit the KV pool's
    ``capacity_tokens``; ``explicit``: the length was asked for (--max-model-len) rather than
    taken from the model."""
    if max_model_len <= capacity_tokens:
        return
    asked = "--max-model-len" if explicit else "the model's maximum length (--max-model-len unset)"
    raise ValueError(f"{asked} is {max_model_len} tokens, more than the KV cache holds: "
                     f"{capacity_tokens} tokens; lower --max-model-len, or give the cache more memory "
                     "(--gpu-memory-utilization on a GPU, --kv-cache-memory GIB)")
