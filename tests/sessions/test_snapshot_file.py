"""Snapshot files: bit-exact round trips, a fresh process, and loads that fail changing nothing."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from segkv.cache import KVChain, OutOfPagesError, PagedKVCache, files
from segkv.config import CacheConfig, KVLayout
from segkv.sessions import snapshot_file
from segkv.sessions.snapshot_file import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_DIGEST_KEY,
    MANIFEST_KEY,
    LoadedSnapshot,
    load_snapshot,
    save_snapshot,
)

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {
    "mha": dict(kind="mha", num_layers=2, num_kv_heads=2, head_dim=8),
    "mla": dict(kind="mla", num_layers=2, kv_lora_rank=12, rope_dim=4),
}
FINGERPRINT = "model-sha256:" + "ab" * 32
METADATA = {"messages": [{"role": "user", "content": "héllo ✓"}, {"role": "assistant", "content": "hi"}],
            "turn": 3, "temperature": 0.7, "tags": None}
# The source chain: turns of 37, 20 and 11 rows; trim 18 (the 11-row turn and 7 rows of the
# 20-row one, a mid-page point at page size 16); then 9 more rows. Segments: 37, 13, 9.
TURNS, TRIM, LAST = (37, 20, 11), 18, 9
SEGMENT_ROWS = [37, 13, 9]


def make_cache(kind="mha", dtype="bfloat16", page_size=16, num_pages=256) -> PagedKVCache:
    layout = KVLayout(**LAYOUTS[kind], dtype=dtype)
    return PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=num_pages))


def random_parts(layout: KVLayout, n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Fresh rows for one layer, with a signed zero, infinities and a NaN with a payload."""
    row = (layout.num_kv_heads, layout.head_dim) if layout.kind == "mha" else (layout.key_dim,)
    parts = []
    for _ in range(2 if layout.kind == "mha" else 1):
        t = torch.randn((n, *row), generator=gen).to(layout.dtype)
        if n:
            bits = t.view(torch.int16 if layout.dtype == torch.bfloat16 else torch.int32).flatten()
            nan = 0x7FC1 if layout.dtype == torch.bfloat16 else 0x7FC00001
            specials = [0.0, -0.0, float("inf"), float("-inf")]
            t.flatten()[: len(specials)] = torch.tensor(specials[: t.numel()], dtype=layout.dtype)
            bits[-1] = nan
        parts.append(t)
    return tuple(parts)


def append_turn(chain, cache, gen, n, rows, tokens, *, with_tokens=True):
    tok = torch.randint(0, 150_000, (n,), generator=gen).tolist()
    slots = chain.append(n, token_ids=tok if with_tokens else None)
    for layer in range(cache.layout.num_layers):
        parts = random_parts(cache.layout, n, gen)
        cache.storage.write(layer, slots, *parts)
        rows[layer] = tuple(torch.cat([old, new]) for old, new in zip(rows[layer], parts))
    tokens.extend(tok)


def build_history(cache, gen, *, with_tokens=True):
    """A multi-segment snapshot with a mid-page trim point; its expected rows and tokens."""
    chain = KVChain(cache.pool)  # no compaction: the boundaries stay where the turns put them
    rows = [random_parts(cache.layout, 0, gen) for _ in range(cache.layout.num_layers)]
    tokens: list[int] = []
    for n in TURNS:
        append_turn(chain, cache, gen, n, rows, tokens, with_tokens=with_tokens)
        chain.seal()
    chain.trim(TRIM)
    rows = [tuple(p[:-TRIM] for p in parts) for parts in rows]
    del tokens[-TRIM:]
    append_turn(chain, cache, gen, LAST, rows, tokens, with_tokens=with_tokens)
    snapshot = chain.snapshot()
    chain.release()
    assert [ref.num_rows for ref in snapshot.refs] == SEGMENT_ROWS
    return snapshot, rows, tokens


def gather(cache, snapshot):
    slots = [slot for ref in snapshot.refs for slot in ref.slots()]
    return [cache.storage.read(layer, slots) for layer in range(cache.layout.num_layers)]


def assert_bits_equal(actual, expected):
    assert len(actual) == len(expected)
    for got_parts, want_parts in zip(actual, expected):
        for got, want in zip(got_parts, want_parts, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


def rows_checksum(rows) -> str:
    h = hashlib.sha256()
    for parts in rows:
        for t in parts:
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def pool_state(cache):
    pool = cache.pool
    return (pool.pages_in_use, pool.pages_allocated_total, pool.peak_pages_in_use,
            [pool.ref_count(i) for i in range(pool.num_pages)])


def busy_cache(**kwargs):
    """A cache already holding another conversation, so 'unchanged' means something."""
    cache = make_cache(**kwargs)
    other = cache.new_chain()
    other.append(21, token_ids=list(range(21)))
    other.seal()
    return cache, other


@pytest.fixture
def saved(tmp_path, gen):
    cache = make_cache()
    snapshot, rows, tokens = build_history(cache, gen)
    path = tmp_path / "conv.segkv"
    save_snapshot(path, snapshot, cache, fingerprint=FINGERPRINT, metadata=METADATA)
    return path, rows, tokens


def rewrite(src: Path, dst: Path, edit) -> None:
    """Re-save ``src`` as ``dst`` after ``edit(manifest, tensors)``, with valid digests."""
    with safe_open(src, framework="pt") as f:
        manifest = json.loads(f.metadata()[MANIFEST_KEY])
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    edit(manifest, tensors)
    text = json.dumps(manifest)
    save_file(tensors, dst, metadata={MANIFEST_KEY: text,
                                      MANIFEST_DIGEST_KEY: hashlib.sha256(text.encode()).hexdigest()})


# -- round trips ----------------------------------------------------------------------------
@pytest.mark.parametrize("save_ps,load_ps", [(1, 1), (16, 16), (16, 1), (1, 16)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_round_trip_is_bit_exact(tmp_path, gen, kind, dtype, save_ps, load_ps):
    src = make_cache(kind, dtype, save_ps)
    snapshot, rows, tokens = build_history(src, gen)
    assert_bits_equal(gather(src, snapshot), rows)
    before = pool_state(src)
    path = tmp_path / "conv.segkv"
    save_snapshot(path, snapshot, src, fingerprint=FINGERPRINT, metadata=METADATA)
    assert pool_state(src) == before and src.pool.bytes_copied == 0

    dst = make_cache(kind, dtype, load_ps)
    loaded = load_snapshot(path, dst, fingerprint=FINGERPRINT)
    assert isinstance(loaded, LoadedSnapshot)
    assert [ref.num_rows for ref in loaded.snapshot.refs] == SEGMENT_ROWS
    assert loaded.num_rows == loaded.snapshot.num_rows == sum(SEGMENT_ROWS)
    assert loaded.token_ids == loaded.snapshot.token_ids() == tokens
    assert loaded.metadata == METADATA
    assert_bits_equal(gather(dst, loaded.snapshot), rows)
    assert dst.pool.pages_in_use == sum(-(-n // load_ps) for n in SEGMENT_ROWS)
    loaded.snapshot.release()
    assert dst.pool.pages_in_use == 0


def test_empty_snapshot_round_trips(tmp_path):
    src, dst = make_cache(), make_cache()
    empty = src.new_chain().snapshot()
    save_snapshot(tmp_path / "e", empty, src, fingerprint=FINGERPRINT)
    loaded = load_snapshot(tmp_path / "e", dst, fingerprint=FINGERPRINT)
    assert loaded.num_rows == 0 and loaded.token_ids == [] and loaded.metadata == {}
    assert loaded.snapshot.refs == () and dst.pool.pages_in_use == 0


def test_manifest_describes_the_file(saved):
    path, rows, tokens = saved
    with safe_open(path, framework="pt") as f:
        header = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    text = header[MANIFEST_KEY]
    assert hashlib.sha256(text.encode()).hexdigest() == header[MANIFEST_DIGEST_KEY]
    manifest = json.loads(text)
    assert manifest["format"] == FORMAT_NAME and manifest["version"] == FORMAT_VERSION
    assert manifest["fingerprint"] == FINGERPRINT and manifest["metadata"] == METADATA
    assert manifest["layout"] == {"kind": "mha", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
                                  "kv_lora_rank": 0, "rope_dim": 0, "dtype": "bfloat16"}
    assert manifest["segment_rows"] == SEGMENT_ROWS and manifest["token_ids"] == tokens
    assert sorted(tensors) == ["layers.0.key", "layers.0.value", "layers.1.key", "layers.1.value"]
    for layer, (k, v) in enumerate(rows):
        assert_bits_equal([(tensors[f"layers.{layer}.key"], tensors[f"layers.{layer}.value"])], [(k, v)])
    for name, t in tensors.items():
        assert manifest["sha256"][name] == hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()


def test_loaded_snapshot_restores_into_a_chain_and_extends(tmp_path, gen):
    src = make_cache("mla", "bfloat16", 16)
    snapshot, rows, tokens = build_history(src, gen)
    save_snapshot(tmp_path / "c", snapshot, src, fingerprint=FINGERPRINT)
    dst = make_cache("mla", "bfloat16", 16)
    loaded = load_snapshot(tmp_path / "c", dst, fingerprint=FINGERPRINT)
    assert dst.pool.pages_allocated_total == 3 + 1 + 1  # 37, 13 and 9 rows of page size 16
    chain = dst.new_chain()
    chain.restore(loaded.snapshot)
    assert dst.pool.pages_allocated_total == 5  # restore shares the loaded pages, copies nothing
    append_turn(chain, dst, gen, 7, rows, tokens)
    assert dst.pool.pages_allocated_total == 6  # the new rows start on a fresh page
    assert chain.token_ids() == tokens
    got = [dst.storage.read(layer, chain.slots()) for layer in range(dst.layout.num_layers)]
    assert_bits_equal(got, rows)
    # The loaded snapshot is a value: extending the chain did not change what it names.
    assert_bits_equal(gather(dst, loaded.snapshot), [tuple(p[:-7] for p in parts) for parts in rows])
    chain.release()
    loaded.snapshot.release()
    assert dst.pool.pages_in_use == 0


CHILD = """
import hashlib, json, sys
import torch
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, KVLayout
from segkv.sessions.snapshot_file import load_snapshot

results = []
for job in json.load(open(sys.argv[1])):
    layout = KVLayout(**job["layout"])
    cache = PagedKVCache(layout, CacheConfig(page_size=job["page_size"], num_pages=64))
    loaded = load_snapshot(job["path"], cache, fingerprint=job["fingerprint"])
    slots = [s for ref in loaded.snapshot.refs for s in ref.slots()]
    h = hashlib.sha256()
    for layer in range(layout.num_layers):
        for t in cache.storage.read(layer, slots):
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    results.append({"checksum": h.hexdigest(), "token_ids": loaded.token_ids, "metadata": loaded.metadata,
                    "segment_rows": [ref.num_rows for ref in loaded.snapshot.refs]})
json.dump(results, open(sys.argv[2], "w"))
"""


def test_load_in_a_separate_process_gives_the_same_rows(tmp_path, gen):
    jobs, expected = [], []
    for kind, dtype in [("mha", "bfloat16"), ("mla", "float32")]:
        src = make_cache(kind, dtype, 16)
        snapshot, rows, tokens = build_history(src, gen)
        path = tmp_path / f"{kind}.segkv"
        save_snapshot(path, snapshot, src, fingerprint=FINGERPRINT, metadata=METADATA)
        jobs.append({"path": str(path), "layout": {**LAYOUTS[kind], "dtype": dtype}, "page_size": 1,
                     "fingerprint": FINGERPRINT})
        expected.append({"checksum": rows_checksum(rows), "token_ids": tokens, "metadata": METADATA,
                         "segment_rows": SEGMENT_ROWS})
    script, job_file, out = tmp_path / "child.py", tmp_path / "jobs.json", tmp_path / "out.json"
    script.write_text(CHILD)
    job_file.write_text(json.dumps(jobs))
    venv_python = ROOT / ".venv" / "bin" / "python"
    python = str(venv_python if venv_python.exists() else sys.executable)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([python, str(script), str(job_file), str(out)], cwd=ROOT, env=env, check=True, timeout=300)
    assert json.loads(out.read_text()) == expected


# -- loads that fail change nothing ---------------------------------------------------------
def assert_load_fails(path, cache, exc_type, match, fingerprint=FINGERPRINT):
    before = pool_state(cache)
    with pytest.raises(exc_type, match=match) as info:
        load_snapshot(path, cache, fingerprint=fingerprint)
    assert pool_state(cache) == before
    return info.value


def test_a_different_fingerprint_is_refused(saved):
    path, _, _ = saved
    cache, _ = busy_cache()
    err = assert_load_fails(path, cache, ValueError, "saved from a different model",
                            fingerprint="other-model")
    assert FINGERPRINT in str(err) and "'other-model'" in str(err)


@pytest.mark.parametrize("change,field", [(dict(dtype="float32"), "dtype"), (dict(kind="mla"), "kind")])
def test_a_different_layout_is_refused(saved, change, field):
    path, _, _ = saved
    cache, _ = busy_cache(**change)
    assert_load_fails(path, cache, ValueError, f"different KV layout.*{field}: file")


@pytest.mark.parametrize("layout", [
    dict(kind="mha", num_layers=3, num_kv_heads=2, head_dim=8),
    dict(kind="mha", num_layers=2, num_kv_heads=1, head_dim=8),
    dict(kind="mha", num_layers=2, num_kv_heads=2, head_dim=16),
])
def test_a_different_shape_of_layout_names_the_field(saved, layout):
    path, _, _ = saved
    cache = PagedKVCache(KVLayout(**layout, dtype="bfloat16"), CacheConfig(page_size=16, num_pages=64))
    field = next(k for k, v in layout.items() if v != LAYOUTS["mha"][k])
    assert_load_fails(path, cache, ValueError, f"different KV layout.*{field}: file")


def test_a_truncated_file_is_refused(saved, tmp_path):
    path, _, _ = saved
    raw = path.read_bytes()
    data_start = 8 + int.from_bytes(raw[:8], "little")
    cuts = [0, 1, 7, 8, 9, data_start // 2, data_start - 1, data_start, data_start + 1,
            (data_start + len(raw)) // 2, len(raw) - 2, len(raw) - 1]
    cache, _ = busy_cache()
    for cut in cuts:
        cut_path = tmp_path / f"cut{cut}"
        cut_path.write_bytes(raw[:cut])
        err = assert_load_fails(cut_path, cache, ValueError, "is truncated or corrupted")
        assert str(cut_path) in str(err)


def flip_each(path: Path, offsets, masks):
    """Yield once per (offset, mask) with that byte of ``path`` flipped (restored afterwards)."""
    raw = path.read_bytes()
    fd = os.open(path, os.O_RDWR)
    try:
        for offset in offsets:
            for mask in masks:
                os.pwrite(fd, bytes([raw[offset] ^ mask]), offset)
                yield offset, mask
                os.pwrite(fd, raw[offset : offset + 1], offset)
    finally:
        os.close(fd)
    assert path.read_bytes() == raw


def test_flipped_tensor_bytes_are_refused(saved, gen):
    path, _, _ = saved
    raw = path.read_bytes()
    data_start = 8 + int.from_bytes(raw[:8], "little")
    offsets = [data_start, data_start + 1, len(raw) - 1, (data_start + len(raw)) // 2]
    offsets += torch.randint(data_start, len(raw), (12,), generator=gen).tolist()
    cache, _ = busy_cache()
    for _ in flip_each(path, offsets, (0x01, 0x80, 0xFF)):
        assert_load_fails(path, cache, ValueError, "corrupted: sha256 of tensor")


def test_every_flipped_header_byte_is_refused(saved):
    """One flipped bit or byte anywhere in the header (tensor table or manifest) is caught."""
    path, _, _ = saved
    raw = path.read_bytes()
    data_start = 8 + int.from_bytes(raw[:8], "little")
    cache, _ = busy_cache()
    before = pool_state(cache)
    for offset, mask in flip_each(path, range(data_start), (0x01, 0xFF)):
        with pytest.raises(ValueError):
            load_snapshot(path, cache, fingerprint=FINGERPRINT)
    assert pool_state(cache) == before
    assert load_snapshot(path, cache, fingerprint=FINGERPRINT).num_rows == sum(SEGMENT_ROWS)


def test_a_missing_file_is_refused(tmp_path):
    cache, _ = busy_cache()
    missing = tmp_path / "nowhere" / "conv.segkv"
    err = assert_load_fails(missing, cache, FileNotFoundError, "does not exist")
    assert str(missing) in str(err)


def test_a_plain_safetensors_file_is_not_a_snapshot(tmp_path):
    save_file({"w": torch.zeros(2, 2)}, tmp_path / "weights.safetensors", metadata={"format": "pt"})
    cache, _ = busy_cache()
    assert_load_fails(tmp_path / "weights.safetensors", cache, ValueError, "not a segkv snapshot")


def test_a_newer_format_version_is_refused(saved, tmp_path):
    path, _, _ = saved
    rewrite(path, tmp_path / "v2", lambda manifest, tensors: manifest.update(version=FORMAT_VERSION + 1))
    cache, _ = busy_cache()
    assert_load_fails(tmp_path / "v2", cache, ValueError, f"format version {FORMAT_VERSION + 1}")


def _drop_last_row(manifest, tensors):
    tensors["layers.1.value"] = tensors["layers.1.value"][:-1].contiguous()
    manifest["sha256"]["layers.1.value"] = hashlib.sha256(
        tensors["layers.1.value"].view(torch.uint8).numpy().tobytes()).hexdigest()


def _drop_a_tensor(manifest, tensors):
    del tensors["layers.0.key"]


def _extra_token(manifest, tensors):
    manifest["token_ids"].append(7)


@pytest.mark.parametrize("edit,match", [
    (_drop_last_row, r"'layers.1.value' is \(58, 2, 8\)"),
    (_drop_a_tensor, "tensors .* expected"),
    (_extra_token, "60 token ids"),
])
def test_tensors_inconsistent_with_the_manifest_are_refused(saved, tmp_path, edit, match):
    path, _, _ = saved
    rewrite(path, tmp_path / "edited", edit)
    cache, _ = busy_cache()
    assert_load_fails(tmp_path / "edited", cache, ValueError, "truncated or corrupted: .*" + match)


def test_a_pool_too_small_is_refused_and_an_exact_fit_loads(saved):
    path, rows, _ = saved
    need = 3 + 1 + 1  # 37, 13 and 9 rows, each segment on its own pages of 16
    cache = make_cache(num_pages=need - 1)
    err = assert_load_fails(path, cache, OutOfPagesError, "need 5 pages of 16 rows, 4 of 4 pages are free")
    assert str(path) in str(err)
    busy, _ = busy_cache(num_pages=need + 1)  # 21 rows of another conversation hold 2 pages
    assert_load_fails(path, busy, OutOfPagesError, "need 5 pages of 16 rows, 4 of 6")
    exact = make_cache(num_pages=need)
    loaded = load_snapshot(path, exact, fingerprint=FINGERPRINT)
    assert exact.pool.num_free_pages == 0
    assert_bits_equal(gather(exact, loaded.snapshot), rows)


def test_a_failure_midway_gives_every_page_back(saved, monkeypatch):
    path, _, _ = saved
    cache, _ = busy_cache()
    in_use, ref_counts = cache.pool.pages_in_use, pool_state(cache)[3]
    calls = []

    def failing_write(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # the second segment's second layer
            raise RuntimeError("device lost")
        return type(cache.storage).write(cache.storage, *args, **kwargs)

    monkeypatch.setattr(cache, "write_rows", failing_write)  # what snapshot files write rows through
    with pytest.raises(RuntimeError, match="device lost"):
        load_snapshot(path, cache, fingerprint=FINGERPRINT)
    assert cache.pool.pages_in_use == in_use and pool_state(cache)[3] == ref_counts


# -- saving ---------------------------------------------------------------------------------
def test_a_snapshot_without_token_ids_cannot_be_saved(tmp_path, gen):
    cache = make_cache()
    snapshot, _, _ = build_history(cache, gen, with_tokens=False)
    with pytest.raises(ValueError, match="without token ids"):
        save_snapshot(tmp_path / "c", snapshot, cache, fingerprint=FINGERPRINT)
    assert list(tmp_path.iterdir()) == []


def test_a_released_snapshot_cannot_be_saved(tmp_path, gen):
    cache = make_cache()
    snapshot, _, _ = build_history(cache, gen)
    snapshot.release()
    with pytest.raises(ValueError, match="released"):
        save_snapshot(tmp_path / "c", snapshot, cache, fingerprint=FINGERPRINT)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("metadata", [{"x": object()}, {"x": float("nan")}, ["not", "a", "dict"]])
def test_bad_metadata_writes_no_file(tmp_path, gen, metadata):
    cache = make_cache()
    snapshot, _, _ = build_history(cache, gen)
    with pytest.raises(ValueError, match="metadata"):
        save_snapshot(tmp_path / "c", snapshot, cache, fingerprint=FINGERPRINT, metadata=metadata)
    assert list(tmp_path.iterdir()) == []


def test_a_crash_while_writing_keeps_the_old_file(saved, tmp_path, gen, monkeypatch):
    path, rows, tokens = saved
    old = path.read_bytes()

    def crash(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise KeyboardInterrupt  # even an interrupt leaves no partial file behind

    cache = make_cache()
    snapshot, _, _ = build_history(cache, gen)
    monkeypatch.setattr(files, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        save_snapshot(path, snapshot, cache, fingerprint=FINGERPRINT)
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    monkeypatch.undo()
    loaded = load_snapshot(path, make_cache(), fingerprint=FINGERPRINT)
    assert loaded.token_ids == tokens


def test_saving_over_an_existing_file_replaces_it(saved, tmp_path, gen):
    path, _, _ = saved
    cache = make_cache()
    snapshot, rows, tokens = build_history(cache, gen)
    save_snapshot(path, snapshot, cache, fingerprint=FINGERPRINT, metadata={"v": 2})
    loaded = load_snapshot(path, make_cache(), fingerprint=FINGERPRINT)
    assert loaded.metadata == {"v": 2} and loaded.token_ids == tokens
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_a_manifest_too_large_for_the_header_is_a_value_error(saved, tmp_path, gen, monkeypatch):
    from safetensors import SafetensorError

    def refuse(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: header too large")

    path, _, _ = saved
    old = path.read_bytes()
    cache = make_cache()
    snapshot, _, _ = build_history(cache, gen)
    monkeypatch.setattr(files, "save_file", refuse)
    with pytest.raises(ValueError, match="cannot write snapshot file .*header too large"):
        save_snapshot(path, snapshot, cache, fingerprint=FINGERPRINT)
    assert path.read_bytes() == old and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


@pytest.mark.parametrize("fingerprint", ["", None, b"bytes"])
def test_the_fingerprint_must_be_a_non_empty_string(saved, tmp_path, gen, fingerprint):
    path, _, _ = saved
    cache = make_cache()
    snapshot, _, _ = build_history(cache, gen)
    with pytest.raises(ValueError, match="fingerprint must be a non-empty string"):
        save_snapshot(tmp_path / "new", snapshot, cache, fingerprint=fingerprint)
    assert not (tmp_path / "new").exists()
    assert_load_fails(path, make_cache(), ValueError, "fingerprint must be", fingerprint=fingerprint)


def test_a_compacted_chain_keeps_its_segments(tmp_path, gen):
    src = make_cache("mha", "float32", 16)
    chain = src.new_chain()  # compaction on: seals merge the small trailing segments
    rows = [random_parts(src.layout, 0, gen) for _ in range(src.layout.num_layers)]
    tokens: list[int] = []
    for n in (50, 10, 10, 10, 3):
        append_turn(chain, src, gen, n, rows, tokens)
        chain.seal()
    segment_rows = [ref.num_rows for ref in chain.refs]
    assert len(segment_rows) >= 2 and src.pool.bytes_copied > 0
    snapshot = chain.snapshot()
    save_snapshot(tmp_path / "c", snapshot, src, fingerprint=FINGERPRINT)
    dst = make_cache("mha", "float32", 16)
    loaded = load_snapshot(tmp_path / "c", dst, fingerprint=FINGERPRINT)
    assert [ref.num_rows for ref in loaded.snapshot.refs] == segment_rows
    assert dst.pool.bytes_copied == 0  # loading writes each row once and never compacts
    assert_bits_equal(gather(dst, loaded.snapshot), rows)
    assert loaded.token_ids == tokens


def test_saving_into_a_missing_directory_names_the_file(tmp_path, gen):
    """A save whose directory does not exist fails naming the file asked for (not the temporary
    file beside it) and leaves nothing behind."""
    cache = make_cache()
    snapshot, _, _ = build_history(cache, gen)
    target = tmp_path / "missing" / "conv.segkv"
    with pytest.raises(FileNotFoundError, match=f"cannot write '{target}'"):
        save_snapshot(target, snapshot, cache, fingerprint=FINGERPRINT)
    assert list(tmp_path.iterdir()) == []


# -- atomic saves and predictable errors ------------------------------------------------------
def test_a_directory_is_refused_on_load_and_on_save(saved, tmp_path, gen):
    """A directory is a ValueError both ways (safetensors alone gives an OSError naming no path);
    the pool, the directory and its contents stay as they were."""
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "inside").write_bytes(b"kept")
    cache, _ = busy_cache()
    err = assert_load_fails(folder, cache, ValueError, "is a directory")
    assert str(folder) in str(err)
    snapshot, _, _ = build_history(cache, gen)
    with pytest.raises(ValueError, match="is a directory"):
        save_snapshot(folder, snapshot, cache, fingerprint=FINGERPRINT)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conv.segkv", "folder"]
    assert [p.name for p in folder.iterdir()] == ["inside"] and (folder / "inside").read_bytes() == b"kept"


def test_a_directory_appearing_during_the_save_is_a_value_error(tmp_path, gen, monkeypatch):
    cache = make_cache()
    snapshot, _, _ = build_history(cache, gen)
    target = tmp_path / "conv.segkv"
    real_save = files.save_file

    def save_then_mkdir(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        target.mkdir()  # another process takes the name between the check and the rename

    monkeypatch.setattr(files, "save_file", save_then_mkdir)
    with pytest.raises(ValueError, match="is a directory"):
        save_snapshot(target, snapshot, cache, fingerprint=FINGERPRINT)
    assert [p.name for p in tmp_path.iterdir()] == ["conv.segkv"] and target.is_dir()


def test_the_save_writes_a_temporary_file_beside_the_target_then_renames(saved, tmp_path, gen, monkeypatch):
    """Order: the whole file is written and fsynced under a temporary name in the same
    directory, then renamed over the target, then the directory is fsynced."""
    path, _, _ = saved
    cache = make_cache()
    snapshot, _, tokens = build_history(cache, gen)
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        src = Path(src)
        # at the rename the temporary file is complete: it loads, and the target is still the old one
        assert load_snapshot(src, make_cache(), fingerprint=FINGERPRINT).token_ids == tokens
        assert load_snapshot(dst, make_cache(), fingerprint=FINGERPRINT).token_ids != tokens
        events.append(("replace", str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(snapshot_file.os, "fsync", fsync)
    monkeypatch.setattr(snapshot_file.os, "replace", replace)
    save_snapshot(path, snapshot, cache, fingerprint=FINGERPRINT)
    monkeypatch.undo()
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"]
    tmp = events[1][1]
    assert events[0][1] == os.path.realpath(tmp) and Path(tmp).parent == path.parent and tmp != str(path)
    assert events[1][2] == str(path) and events[2][1] == os.path.realpath(path.parent)
    assert load_snapshot(path, make_cache(), fingerprint=FINGERPRINT).token_ids == tokens
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_failed_fsync_or_rename_leaves_the_old_file_and_no_temporary(saved, tmp_path, gen, monkeypatch,
                                                                        failing):
    path, _, tokens = saved
    old = path.read_bytes()
    cache = make_cache()
    snapshot, _, _ = build_history(cache, gen)

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshot_file.os, failing, fail)
    with pytest.raises(OSError, match="No space left"):
        save_snapshot(path, snapshot, cache, fingerprint=FINGERPRINT)
    monkeypatch.undo()
    assert path.read_bytes() == old and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert load_snapshot(path, make_cache(), fingerprint=FINGERPRINT).token_ids == tokens


def test_a_directory_that_cannot_be_fsynced_is_still_closed(tmp_path, gen, monkeypatch):
    """Where a directory refuses fsync the save still succeeds and leaks no descriptor."""
    cache = make_cache()
    snapshot, _, tokens = build_history(cache, gen)
    real_fsync = os.fsync

    def fsync(fd):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(22, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(snapshot_file.os, "fsync", fsync)
    before = len(os.listdir("/proc/self/fd"))
    for i in range(5):
        save_snapshot(tmp_path / f"c{i}", snapshot, cache, fingerprint=FINGERPRINT)
    assert len(os.listdir("/proc/self/fd")) == before
    monkeypatch.undo()
    assert load_snapshot(tmp_path / "c4", make_cache(), fingerprint=FINGERPRINT).token_ids == tokens


def test_make_room_is_asked_for_the_pages_missing_before_a_load_is_refused(saved):
    path, rows, _ = saved
    cache, other = busy_cache(num_pages=6)  # 5 pages needed, 4 free: 1 missing
    asked = []
    with pytest.raises(OutOfPagesError, match="need 5 pages of 16 rows, 4 of 6"):
        load_snapshot(path, cache, fingerprint=FINGERPRINT, make_room=asked.append)  # frees nothing
    assert asked == [1] and cache.pool.num_free_pages == 4

    def release_other(short):
        asked.append(short)
        other.release()  # like evicting an unreferenced cached segment: its 2 pages come back

    loaded = load_snapshot(path, cache, fingerprint=FINGERPRINT, make_room=release_other)
    assert asked == [1, 1] and cache.pool.num_free_pages == 1
    assert_bits_equal(gather(cache, loaded.snapshot), rows)
    never = []
    loaded.snapshot.release()
    load_snapshot(path, cache, fingerprint=FINGERPRINT, make_room=never.append)
    assert never == []  # enough free pages: nothing is asked of make_room
