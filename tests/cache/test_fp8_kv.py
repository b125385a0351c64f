"""FP8 KV storage: e4m3 quantization against an independent decoder, scales, writes and copies."""

from __future__ import annotations

import pytest
import torch

from segkv.cache import PagedKVCache
from segkv.cache.storage import FP8_MAX, dequantize_fp8, quantize_fp8
from segkv.config import FP8_KV_DTYPE, CacheConfig, KVLayout, resolve_kv_cache_dtype


def e4m3_value(byte: int) -> float:
    """The e4m3fn value of ``byte`` from the format's definition (bias 7, no infinities; NaN at
    S.1111.111)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return float("nan")
    if exponent == 0:
        return sign * mantissa / 8 * 2.0 ** -6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


FINITE = [b for b in range(256) if b & 0x7F != 0x7F]
TABLE = torch.tensor([e4m3_value(b) for b in FINITE], dtype=torch.float64)


def test_every_e4m3_value_decodes_and_round_trips():
    raw = torch.tensor(FINITE, dtype=torch.uint8)
    decoded = raw.view(FP8_KV_DTYPE).double()
    assert torch.equal(decoded, TABLE)
    for scale in (1.0, 0.25, 3.0):  # powers of two are exact; 3.0 rounds x * 3 / 3 back to x
        heads = torch.full((1,), scale)
        stored = quantize_fp8((TABLE * scale).float().view(-1, 1, 1), heads)
        assert torch.equal(stored.view(torch.uint8).flatten()[TABLE != 0], raw[TABLE != 0])
        assert torch.equal(dequantize_fp8(stored, heads).flatten().double(), (TABLE.float() * scale).double())


def test_quantize_rounds_to_nearest_and_saturates():
    x = torch.randn(4096, dtype=torch.float64) * 50
    x = torch.cat([x, torch.tensor([448.0, 449.0, 464.0, 1e6, -1e6, -500.0, 1e-9, -1e-9, 0.0])])
    got = quantize_fp8(x.float().view(-1, 1, 1), torch.ones(1)).double().flatten()
    target = x.float().double().clamp(-FP8_MAX, FP8_MAX)
    distance = (TABLE[None, :] - target[:, None]).abs()
    nearest = distance.min(dim=1).values
    assert torch.equal((got - target).abs(), nearest)  # no value lies nearer (ties: either side)
    assert got.abs().max() == FP8_MAX and not torch.isnan(got).any()
    assert got[-8:-5].tolist() == [FP8_MAX] * 3 and got[-5:-3].tolist() == [-FP8_MAX] * 2


def test_quantize_applies_per_head_scales():
    rows = torch.randn(7, 3, 16) * torch.tensor([1.0, 100.0, 0.01]).view(1, 3, 1)
    scales = rows.abs().amax(dim=(0, 2)) / FP8_MAX
    back = dequantize_fp8(quantize_fp8(rows, scales), scales)
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 for normal values
    assert ((back - rows).abs() <= rows.abs() * 2 ** -4 + scales.view(1, 3, 1) * 2 ** -10).all()


def test_layout_counts_one_byte_per_element():
    bf16 = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    fp8 = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, dtype=FP8_KV_DTYPE)
    assert fp8.fp8 and not bf16.fp8
    assert 2 * fp8.row_bytes == bf16.row_bytes == 3 * 2 * 2 * 64 * 2
    mla = KVLayout(num_layers=2, kind="mla", kv_lora_rank=32, rope_dim=8, dtype=FP8_KV_DTYPE)
    assert mla.row_bytes == 2 * 40
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == FP8_KV_DTYPE
    with pytest.raises(ValueError, match="'fp16'"):
        resolve_kv_cache_dtype("fp16", torch.bfloat16)


def _cache(kind: str = "mha") -> PagedKVCache:
    if kind == "mha":
        layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=FP8_KV_DTYPE)
    else:
        layout = KVLayout(num_layers=2, kind="mla", kv_lora_rank=12, rope_dim=4, dtype=FP8_KV_DTYPE)
    return PagedKVCache(layout, CacheConfig(page_size=4, num_pages=8))


def test_storage_writes_quantized_rows_and_copies_bytes():
    cache = _cache()
    storage = cache.storage
    storage.set_scales(torch.tensor([[0.5, 2.0], [1.0, 4.0]]), torch.tensor([0.25, 8.0]))  # v: per layer
    assert torch.equal(storage.kv_scales(1)[1], torch.tensor([8.0, 8.0]))
    k, v = torch.randn(5, 2, 8) * 3, torch.randn(5, 2, 8)
    storage.write(1, [0, 1, 2, 9, 10], k, v)
    key, value = storage.read(1, [0, 1, 2, 9, 10])
    assert key.dtype == value.dtype == FP8_KV_DTYPE
    assert torch.equal(key.view(torch.uint8), quantize_fp8(k, torch.tensor([1.0, 4.0])).view(torch.uint8))
    assert torch.equal(storage.dequantized(value, 1, value=True), dequantize_fp8(value, torch.tensor([8.0, 8.0])))
    storage.copy_rows([0, 1], [20, 21])
    assert torch.equal(storage.read(1, [20, 21])[0].view(torch.uint8), key[:2].view(torch.uint8))
    # rows given as float8 are stored values: copied as they are (a snapshot load)
    storage.write(0, [3, 4], key[:2], value[:2])
    assert torch.equal(storage.read(0, [3, 4])[1].view(torch.uint8), value[:2].view(torch.uint8))
    assert storage.nbytes == 2 * 2 * 8 * 4 * 2 * 8


def test_mla_storage_has_one_scale_per_layer():
    storage = _cache("mla").storage
    storage.set_scales(torch.tensor([2.0, 0.5]))
    k_scale, v_scale = storage.kv_scales(0)
    assert k_scale.shape == (1,) and v_scale is k_scale or torch.equal(v_scale, k_scale)
    latent = torch.randn(3, 16)
    storage.write(0, [0, 1, 2], latent)
    (stored,) = storage.read(0, [0, 1, 2])
    assert torch.equal(storage.dequantized(stored, 0), quantize_fp8(latent, torch.tensor([2.0])).float() * 2.0)
    assert torch.equal(storage.value_cache(0).flatten(0, 1)[:3, 0].float(), stored[:, :12].float())
    with pytest.raises(ValueError, match="one scale per layer"):
        storage.set_scales(1.0, 2.0)


def test_fp8_storage_refuses_fused_writes_and_bad_scales():
    cache, mla = _cache(), _cache("mla")
    with pytest.raises(ValueError, match="FP8"):
        cache.storage.rows_to_write(0, torch.tensor([0]), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
    with pytest.raises(ValueError, match="FP8"):
        mla.storage.latent_rows_to_write(0, torch.tensor([0]))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive and finite"):
            cache.storage.set_scales(bad)
    with pytest.raises(ValueError, match="do not fit"):
        cache.storage.set_scales(torch.ones(3, 3))
    plain = PagedKVCache(KVLayout(num_layers=1, num_kv_heads=1, head_dim=4), CacheConfig(page_size=4, num_pages=2))
    assert plain.storage.kv_scales(0) is None
    with pytest.raises(ValueError, match="FP8 cache"):
        plain.storage.set_scales(1.0)
