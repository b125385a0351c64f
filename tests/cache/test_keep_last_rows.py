"""KVChain.keep_last_rows: a tree window's accepted rows moved to the window's first rows in
every layer, their token ids with them, the rest dropped; nothing else touched; bad input refused."""

from __future__ import annotations

import pytest
import torch

from segkv.cache import PagedKVCache
from segkv.cache.chain import KVChain
from segkv.config import CacheConfig, CompactionPolicy, KVLayout

PAGE_SIZES = [1, 4, 16]
KINDS = ["mha", "mla"]


def make_cache(kind: str, page_size: int, *, num_pages: int = 96) -> PagedKVCache:
    if kind == "mha":
        layout = KVLayout(num_layers=3, kind="mha", num_kv_heads=2, head_dim=3)
    else:
        layout = KVLayout(num_layers=3, kind="mla", kv_lora_rank=4, rope_dim=2)
    return PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=num_pages),
                        compaction=CompactionPolicy(enabled=False))


def row_width(layout: KVLayout) -> int:
    return 2 * layout.num_kv_heads * layout.head_dim if layout.kind == "mha" else layout.key_dim


def write(cache: PagedKVCache, slots: list[int], data: torch.Tensor) -> None:
    """Write ``data`` (n, num_layers, width) at ``slots`` in every layer."""
    lay = cache.layout
    for layer in range(lay.num_layers):
        x = data[:, layer]
        if lay.kind == "mha":
            hd = lay.num_kv_heads * lay.head_dim
            shape = (-1, lay.num_kv_heads, lay.head_dim)
            cache.storage.write(layer, slots, x[:, :hd].reshape(shape), x[:, hd:].reshape(shape))
        else:
            cache.storage.write(layer, slots, x)


def gather(cache: PagedKVCache, slots: list[int]) -> torch.Tensor:
    """The rows at ``slots`` as (n, num_layers, width), K then V for MHA."""
    layers = [torch.cat([t.flatten(1) for t in cache.storage.read(layer, list(slots))], dim=1)
              for layer in range(cache.layout.num_layers)]
    return torch.stack(layers, dim=1)


def fill(cache: PagedKVCache, chain: KVChain, n: int, gen: torch.Generator, *, tokens=True) -> torch.Tensor:
    """Append ``n`` rows of fresh random data (and random token ids unless ``tokens`` is False)."""
    ids = torch.randint(0, 1000, (n,), generator=gen).tolist() if tokens else None
    slots = chain.append(n, token_ids=ids)
    data = torch.randn(n, cache.layout.num_layers, row_width(cache.layout), generator=gen)
    write(cache, slots, data)
    return data


def random_keep(gen: torch.Generator, window: int) -> list[int]:
    """Ascending offsets in [0, window): the root (0) usually, then a random subset."""
    picked = (torch.rand(window, generator=gen) < 0.5).tolist()
    picked[0] = picked[0] or bool(torch.rand(1, generator=gen) < 0.8)
    return [k for k in range(window) if picked[k]]


@pytest.fixture(params=[(k, p) for k in KINDS for p in PAGE_SIZES], ids=lambda kp: f"{kp[0]}-ps{kp[1]}")
def cache(request):
    return make_cache(*request.param)


def test_kept_rows_move_into_place_in_every_layer(cache, gen):
    pool = cache.pool
    for trial in range(12):
        chain = cache.new_chain()
        history = fill(cache, chain, int(torch.randint(0, 2 * cache.page_size + 3, (1,), generator=gen)), gen)
        chain.seal()  # a sealed segment before the tail: never touched
        before = fill(cache, chain, int(torch.randint(0, 9, (1,), generator=gen)), gen)
        window = int(torch.randint(1, 12, (1,), generator=gen))
        rows = fill(cache, chain, window, gen)
        keep = random_keep(gen, window)
        tokens = chain.token_ids()
        num_rows, base = chain.num_rows, chain.num_rows - window
        copied = cache.stats()["bytes_copied"]
        moved = chain.keep_last_rows(window, keep)

        assert moved == sum(k != j for j, k in enumerate(keep))
        assert cache.stats()["bytes_copied"] == copied + moved * cache.layout.row_bytes
        assert chain.num_rows == num_rows - window + len(keep)
        assert chain.token_ids() == tokens[:base] + [tokens[base + k] for k in keep]
        got = gather(cache, chain.slots())
        want = torch.cat([history, before, rows[keep]])
        assert got.shape == want.shape and torch.equal(got, want)
        # the tail holds exactly the pages its rows need
        assert len(chain.tail.page_ids) == pool.pages_for_rows(chain.tail.num_rows)
        chain.release()
    assert pool.pages_in_use == 0


def test_rows_in_place_copy_nothing_and_a_chain_without_token_ids_keeps_none(cache, gen):
    chain = cache.new_chain()
    fill(cache, chain, 3, gen, tokens=False)
    rows = fill(cache, chain, 6, gen, tokens=False)
    copied = cache.stats()["bytes_copied"]
    assert chain.keep_last_rows(6, [0, 1, 2]) == 0  # a prefix of the window: a trim only
    assert cache.stats()["bytes_copied"] == copied and chain.num_rows == 6
    assert torch.equal(gather(cache, chain.slots()[3:]), rows[:3])
    assert chain.keep_last_rows(3, [0, 2]) == 1
    assert chain.token_ids() is None and chain.num_rows == 5
    assert torch.equal(gather(cache, chain.slots()[3:]), rows[[0, 2]])
    assert chain.keep_last_rows(2, []) == 0 and chain.num_rows == 3  # nothing kept: the window goes
    assert chain.keep_last_rows(0, []) == 0 and chain.num_rows == 3
    chain.release()
    assert cache.pool.pages_in_use == 0


def test_a_row_moved_across_a_page_boundary(gen):
    cache = make_cache("mha", 4)
    chain = cache.new_chain()
    rows = fill(cache, chain, 11, gen)
    tokens = chain.token_ids()
    assert chain.keep_last_rows(10, [0, 5, 9]) == 2  # from pages 1 and 2 to page 0
    assert chain.token_ids() == tokens[:1] + [tokens[1], tokens[6], tokens[10]]
    assert torch.equal(gather(cache, chain.slots()), rows[[0, 1, 6, 10]])
    assert len(chain.tail.page_ids) == 1 and cache.pool.pages_in_use == 1
    chain.release()


@pytest.mark.parametrize("window,keep,message", [
    (7, [0], "a window of 7 rows is not inside the tail's 6"),
    (-1, [], "a window of -1 rows"),
    (4, [0, 4], "strictly ascending offsets in \\[0, 4\\)"),
    (4, [-1, 2], "strictly ascending"),
    (4, [0, 2, 2], "strictly ascending"),
    (4, [0, 3, 1], "strictly ascending"),
])
def test_bad_windows_and_offsets_are_refused_and_leave_the_chain(cache, gen, window, keep, message):
    chain = cache.new_chain()
    fill(cache, chain, 5, gen)
    chain.seal()
    rows = torch.cat([gather(cache, chain.slots()), fill(cache, chain, 6, gen)])
    tokens, slots = chain.token_ids(), chain.slots()
    with pytest.raises(ValueError, match=message):
        chain.keep_last_rows(window, keep)
    assert chain.token_ids() == tokens and chain.slots() == slots
    assert torch.equal(gather(cache, slots), rows)
    chain.release()
    assert cache.pool.pages_in_use == 0


def test_a_chain_without_a_row_copier_refuses_moves_but_not_trims(gen):
    cache = make_cache("mla", 4)
    chain = KVChain(cache.pool)  # no copy_rows
    slots = chain.append(5, token_ids=[1, 2, 3, 4, 5])
    write(cache, slots, torch.randn(5, 3, row_width(cache.layout), generator=gen))
    with pytest.raises(ValueError, match="no row copier"):
        chain.keep_last_rows(4, [0, 2])
    assert chain.token_ids() == [1, 2, 3, 4, 5]
    assert chain.keep_last_rows(4, [0, 1]) == 0 and chain.token_ids() == [1, 2, 3]
    chain.release()
