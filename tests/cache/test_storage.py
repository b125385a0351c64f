"""PagedKVStorage: write/read round trips, attention views, argument checks, row copies."""

from __future__ import annotations

import pytest
import torch

from segkv.cache import PagedKVStorage, PagePool
from segkv.config import KVLayout

MHA = KVLayout(num_layers=2, kind="mha", num_kv_heads=3, head_dim=4)
MLA = KVLayout(num_layers=2, kind="mla", kv_lora_rank=5, rope_dim=3)


def make(layout, *, num_pages=6, page_size=4):
    pool = PagePool(num_pages=num_pages, page_size=page_size, bytes_per_page=page_size * layout.row_bytes)
    return pool, PagedKVStorage(layout, pool)


def rows(layout, n, gen):
    """Fresh random rows for one layer: (k, v) for MHA, (latent,) for MLA."""
    if layout.kind == "mha":
        shape = (n, layout.num_kv_heads, layout.head_dim)
        return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    return (torch.randn(n, layout.key_dim, generator=gen),)


def snapshot(storage):
    return [t.clone() for t in (*storage.k, *storage.v, *storage.latent)]


def unchanged(storage, before):
    return all(torch.equal(a, b) for a, b in zip(snapshot(storage), before, strict=True))



@pytest.mark.parametrize("layout", [MHA, MLA], ids=["mha", "mla"])
def test_write_read_round_trip(layout, gen):
    pool, storage = make(layout)
    slots = torch.randperm(24, generator=gen)[:10].tolist()
    written = []
    for layer in range(layout.num_layers):
        data = rows(layout, 10, gen)
        storage.write(layer, slots, *data)
        written.append(data)
    for layer in range(layout.num_layers):
        got = storage.read(layer, slots)
        assert len(got) == len(written[layer])
        for g, w in zip(got, written[layer], strict=True):
            assert g.dtype == layout.dtype and torch.equal(g, w)
        # a permuted read returns permuted rows; a tensor of slots works too
        perm = torch.randperm(10, generator=gen)
        got = storage.read(layer, torch.tensor(slots)[perm])
        for g, w in zip(got, written[layer], strict=True):
            assert torch.equal(g, w[perm])
    # the attention views see the rows at page_id * page_size + offset
    page, off = divmod(slots[3], pool.page_size)
    if layout.kind == "mha":
        assert torch.equal(storage.key_cache(1)[page, off], written[1][0][3])
        assert torch.equal(storage.value_cache(1)[page, off], written[1][1][3])
    else:
        assert torch.equal(storage.key_cache(1)[page, off, 0], written[1][0][3])
        assert torch.equal(storage.value_cache(1)[page, off, 0], written[1][0][3, : layout.kv_lora_rank])
    # untouched slots are still zero; writes never touch the pool's counters
    other = sorted(set(range(24)) - set(slots))
    assert all(torch.count_nonzero(t) == 0 for t in storage.read(0, other))
    assert pool.pages_in_use == 0 and pool.bytes_copied == 0


def test_layers_are_independent(gen):
    _, storage = make(MHA)
    k0, v0 = rows(MHA, 3, gen)
    k1, v1 = rows(MHA, 3, gen)
    storage.write(0, [1, 2, 3], k0, v0)
    storage.write(1, [1, 2, 3], k1, v1)
    assert torch.equal(storage.read(0, [1, 2, 3])[0], k0)
    assert torch.equal(storage.read(1, [1, 2, 3])[1], v1)
    assert not torch.equal(k0, k1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_write_converts_to_layout_dtype(dtype, gen):
    layout = KVLayout(num_layers=1, kind="mla", kv_lora_rank=4, rope_dim=2, dtype=dtype)
    _, storage = make(layout)
    (latent,) = rows(layout, 5, gen)
    storage.write(0, [0, 5, 9, 10, 23], latent)
    (got,) = storage.read(0, [0, 5, 9, 10, 23])
    assert got.dtype == dtype
    assert torch.equal(got, latent.to(dtype))


def test_shapes_and_nbytes_match_the_pool():
    for layout in (MHA, MLA):
        pool, storage = make(layout, num_pages=7, page_size=16)
        assert storage.nbytes == pool.num_pages * pool.bytes_per_page
        assert storage.key_cache(0).shape[:2] == (7, 16)
    _, storage = make(MHA, num_pages=7, page_size=16)
    assert storage.key_cache(1).shape == (7, 16, 3, 4) and storage.value_cache(1).shape == (7, 16, 3, 4)
    assert storage.key_cache(1) is storage.k[1] and storage.value_cache(1) is storage.v[1]
    _, storage = make(MLA, num_pages=7, page_size=16)
    assert storage.key_cache(0).shape == (7, 16, 1, 8)
    assert storage.value_cache(0).shape == (7, 16, 1, 5)


def test_mla_value_cache_is_a_view_of_the_latent(gen):
    _, storage = make(MLA)
    values = storage.value_cache(1)
    latent = storage.latent[1]
    assert values.untyped_storage().data_ptr() == latent.untyped_storage().data_ptr()
    assert values.data_ptr() == latent.data_ptr()  # starts at column 0
    assert values.stride()[:2] == latent.stride()[:2]
    (new,) = rows(MLA, 4, gen)
    storage.write(1, [2, 3, 4, 17], new)  # a write after the view was taken shows through it
    assert torch.equal(values.reshape(-1, MLA.kv_lora_rank)[[2, 3, 4, 17]], new[:, : MLA.kv_lora_rank])
    assert torch.equal(storage.key_cache(1).reshape(-1, MLA.key_dim)[[2, 3, 4, 17]], new)
    values[0, 1, 0, 2] = 7.5  # and the view writes into the latent storage itself
    assert latent[0, 1, 2].item() == 7.5


def test_write_with_wrong_value_argument_raises(gen):
    _, mha = make(MHA)
    k, _ = rows(MHA, 2, gen)
    with pytest.raises(ValueError, match="both key and value"):
        mha.write(0, [0, 1], k)
    _, mla = make(MLA)
    (latent,) = rows(MLA, 2, gen)
    before = snapshot(mla)
    with pytest.raises(ValueError, match="only the latent"):
        mla.write(0, [0, 1], latent, latent)
    assert unchanged(mla, before)


def _bad_write(case, gen):
    k = torch.randn(2, 3, 4, generator=gen)
    return {
        "mha-more-slots-than-rows": (MHA, [0, 1, 2], k, k),
        "mha-value-rows-differ": (MHA, [0, 1], k, torch.randn(3, 3, 4, generator=gen)),
        "mha-wrong-head-dim": (MHA, [0, 1], k[..., :3], k[..., :3]),
        "mla-wrong-width": (MLA, [0, 1], torch.randn(2, 5, generator=gen), None),
    }[case]


@pytest.mark.parametrize(
    "case", ["mha-more-slots-than-rows", "mha-value-rows-differ", "mha-wrong-head-dim", "mla-wrong-width"]
)
def test_write_with_mismatched_shapes_raises_value_error(case, gen):
    layout, slots, key, value = _bad_write(case, gen)
    _, storage = make(layout)
    storage.write(0, [0, 1, 2, 3], *rows(layout, 4, gen))  # rows a partial write would clobber
    before = snapshot(storage)
    with pytest.raises(ValueError):
        storage.write(0, slots, key, value)
    assert unchanged(storage, before)


@pytest.mark.parametrize("layout", [MHA, MLA], ids=["mha", "mla"])
def test_copy_rows_copies_every_layer_and_records_bytes(layout, gen):
    pool, storage = make(layout)
    src, dst = [1, 2, 3, 9, 10], [12, 13, 14, 15, 20]
    written = []
    for layer in range(layout.num_layers):
        data = rows(layout, 5, gen)
        storage.write(layer, src, *data)
        written.append(data)
    storage.copy_rows(src, dst)
    assert pool.rows_copied == 5
    assert pool.bytes_copied == 5 * layout.row_bytes
    for layer in range(layout.num_layers):
        for got, want in zip(storage.read(layer, dst), written[layer], strict=True):
            assert torch.equal(got, want)
        for got, want in zip(storage.read(layer, src), written[layer], strict=True):
            assert torch.equal(got, want)  # the source is left intact
    storage.copy_rows([], [])
    assert pool.rows_copied == 5 and pool.bytes_copied == 5 * layout.row_bytes


def test_copy_rows_length_mismatch_raises_and_changes_nothing(gen):
    pool, storage = make(MHA)
    storage.write(0, [0, 1], *rows(MHA, 2, gen))
    before = snapshot(storage)
    with pytest.raises(ValueError, match="copy of 2 rows into 1"):
        storage.copy_rows([0, 1], [5])
    assert unchanged(storage, before)
    assert pool.bytes_copied == 0 and pool.rows_copied == 0


def test_rows_for_kernels_that_write_themselves_are_checked_first():
    """``rows_to_write`` / ``mha_rows`` / ``latent_rows_to_write`` hand a layer's rows to a fused kernel only
    after the write's checks: the wrong cache kind or slots out of range change nothing."""
    (_, mha), (_, mla) = make(MHA), make(MLA)
    latent = mla.latent_rows_to_write(1, torch.tensor([0, 23]))
    assert latent.shape == (6 * 4, MLA.key_dim) and latent.data_ptr() == mla.latent[1].data_ptr()
    before = snapshot(mla)
    with pytest.raises(ValueError, match="out of range"):
        mla.latent_rows_to_write(0, torch.tensor([3, 24]))
    with pytest.raises(ValueError, match="'mla' caches"):
        mha.latent_rows_to_write(0, torch.tensor([0]))
    with pytest.raises(ValueError, match="'mha' caches"):
        mla.rows_to_write(0, torch.tensor([0]), torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))
    with pytest.raises(ValueError, match="'mha' caches"):
        mla.mha_rows(0, torch.tensor([0]))
    assert unchanged(mla, before)
    keys, values = mha.mha_rows(1, torch.tensor([5]))  # for a kernel that makes the rows itself
    assert keys.data_ptr() == mha.k[1].data_ptr() and values.data_ptr() == mha.v[1].data_ptr()
    assert keys.shape == values.shape == (mha.k[1].shape[0] * mha.k[1].shape[1], *mha.k[1].shape[2:])
    before = snapshot(mha)
    with pytest.raises(ValueError, match="out of range"):
        mha.mha_rows(0, torch.tensor([keys.shape[0]]))
    assert unchanged(mha, before)
