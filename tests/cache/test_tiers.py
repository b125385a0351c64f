"""KV tiers below the GPU pages (``segkv.cache.tiers``): host and disk copies of sealed segments'
rows, least recently used first down the tiers, checked by checksum when they come back, and
files that a killed writer leaves behind never trusted."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from gpu_helpers import DEVICE
from segkv.cache.tiers import FILE_PREFIX, SegmentTiers, rows_checksum, tensor_bytes


def segment_rows(gen, rows: int = 32, layers: int = 2, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """A segment's rows as the tiers see them: K and V per layer, (rows, heads, dim)."""
    return {f"layers.{i}.{kind}": torch.randn(rows, 2, 8, generator=gen).to(dtype).to(DEVICE)
            for i in range(layers) for kind in ("key", "value")}


def stored(tiers: SegmentTiers, key: int, tensors) -> bool:
    return tiers.put(key, tensors, rows_checksum(tensors))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu().view(torch.uint8), b[k].cpu().view(torch.uint8))
                                        for k in a)


def test_the_checksum_sees_changed_moved_and_lost_words(gen):
    rows = segment_rows(gen)
    base = rows_checksum(rows)
    assert base == rows_checksum({k: v.clone() for k, v in rows.items()})  # the same bytes, a new tensor
    assert base == rows_checksum({k: v.cpu() for k, v in rows.items()})  # any device
    flipped = {k: v.clone() for k, v in rows.items()}
    bits = flipped["layers.1.value"].view(torch.int16)
    bits.view(-1)[7] ^= 1  # one bit of one element
    assert rows_checksum(flipped) != base
    swapped = {k: v.clone() for k, v in rows.items()}
    key = swapped["layers.0.key"]
    key[[0, 1]] = key[[1, 0]]  # two rows trade places: the same words, moved
    assert not torch.equal(key, rows["layers.0.key"]) and rows_checksum(swapped) != base
    renamed = dict(rows)
    renamed["layers.0.key"], renamed["layers.0.value"] = rows["layers.0.value"], rows["layers.0.key"]
    assert rows_checksum(renamed) != base
    assert rows_checksum({k: v[:-1] for k, v in rows.items()}) != base  # a row lost
    odd = {"x": torch.arange(7, dtype=torch.uint8)}  # not a whole number of words
    assert rows_checksum(odd) != rows_checksum({"x": torch.arange(8, dtype=torch.uint8)})


def test_copies_come_back_bit_identical_from_host_and_disk(gen, tmp_path):
    segments = {key: segment_rows(gen) for key in range(5)}
    size = tensor_bytes(segments[0])
    tiers = SegmentTiers(host_bytes=2 * size, disk_dir=tmp_path, disk_bytes=10 * size)
    for key, rows in segments.items():
        assert stored(tiers, key, rows)
    # the host keeps the two most recent; the three older went to disk, oldest first
    assert [tiers.tier_of(k) for k in range(5)] == ["disk", "disk", "disk", "host", "host"]
    assert len(list(tmp_path.glob(f"{FILE_PREFIX}*"))) == 3
    stats = tiers.stats()
    assert (stats["host_segments"], stats["disk_segments"], stats["spilled_to_disk"]) == (2, 3, 3)
    assert stats["host_bytes"] == 2 * size and stats["disk_bytes"] == 3 * size
    for key in (0, 4, 2):
        back = tiers.get(key)
        assert back is not None and same(back, segments[key]) and all(t.device.type == "cpu" for t in back.values())
        assert rows_checksum(back) == tiers.checksum_of(key)
    # 0 came back to the host, pushing 3 down; 4 was used next, then 2 came back, pushing 0 down
    assert [tiers.tier_of(k) for k in range(5)] == ["disk", "disk", "host", "disk", "host"]
    assert tiers.stats()["disk_hits"] == 2 and tiers.stats()["host_hits"] == 1
    # every direction's copies are timed: bytes over seconds is its rate
    stats = tiers.stats()
    assert stats["bytes_to_host"] == 5 * size and stats["bytes_to_disk"] >= 4 * size
    assert stats["bytes_from_disk"] == 2 * size
    for direction in ("to_host", "to_disk", "from_disk"):
        assert stats[f"seconds_{direction}"] > 0, direction
        rate = stats[f"{direction}_bytes_per_s"]
        assert rate > 0 and rate == pytest.approx(stats[f"bytes_{direction}"] / stats[f"seconds_{direction}"],
                                                  rel=1e-6), direction
    assert stats["seconds_from_host"] == 0 and stats["from_host_bytes_per_s"] == 0  # no copy into pages here
    tiers.discard(1)
    tiers.discard(0)
    assert 1 not in tiers and 0 not in tiers and tiers.get(1) is None and tiers.stats()["misses"] == 1
    tiers.close()
    assert not list(tmp_path.iterdir()) and tiers.stats()["host_bytes"] == tiers.stats()["disk_bytes"] == 0


def test_full_tiers_drop_the_least_recently_used(gen, tmp_path):
    rows = [segment_rows(gen) for _ in range(4)]
    size = tensor_bytes(rows[0])
    host_only = SegmentTiers(host_bytes=2 * size)
    for key, r in enumerate(rows):
        assert stored(host_only, key, r)
    assert [host_only.tier_of(k) for k in range(4)] == [None, None, "host", "host"]
    assert host_only.stats()["dropped"] == 2
    tiers = SegmentTiers(host_bytes=size, disk_dir=tmp_path, disk_bytes=2 * size)
    for key, r in enumerate(rows):
        assert stored(tiers, key, r)
    assert [tiers.tier_of(k) for k in range(4)] == [None, "disk", "disk", "host"]
    assert len(list(tmp_path.iterdir())) == 2
    big = segment_rows(gen, rows=200)
    assert not stored(tiers, 9, big) and 9 not in tiers  # fits no tier: nothing kept
    with pytest.raises(ValueError, match="already has a copy"):
        stored(tiers, 3, rows[3])


def test_a_segment_larger_than_the_host_tier_goes_to_disk(gen, tmp_path):
    rows = segment_rows(gen, rows=64)
    tiers = SegmentTiers(host_bytes=tensor_bytes(rows) // 2, disk_dir=tmp_path, disk_bytes=4 * tensor_bytes(rows))
    assert stored(tiers, 1, rows) and tiers.tier_of(1) == "disk"
    assert same(tiers.get(1), rows) and tiers.tier_of(1) == "disk"  # still too big for the host


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_bad_file_is_dropped_with_a_warning_never_used(damage, gen, tmp_path, caplog):
    rows = [segment_rows(gen) for _ in range(2)]
    tiers = SegmentTiers(host_bytes=tensor_bytes(rows[0]), disk_dir=tmp_path, disk_bytes=8 * tensor_bytes(rows[0]))
    for key, r in enumerate(rows):
        stored(tiers, key, r)
    (path,) = tmp_path.iterdir()  # segment 0's file
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-3] ^= 0x10  # a bit of the last tensor's payload: the file still parses
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        path.unlink()
    with caplog.at_level(logging.WARNING, logger="segkv.cache.tiers"):
        assert tiers.get(0) is None
    assert "recomputed" in caplog.text and tiers.stats()["corrupt"] == 1 and 0 not in tiers
    assert not path.exists()
    assert same(tiers.get(1), rows[1])  # the other copy is untouched


def test_bad_settings_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=">= 0"):
        SegmentTiers(host_bytes=-1)
    with pytest.raises(ValueError, match="both a directory and a size"):
        SegmentTiers(host_bytes=0, disk_dir=tmp_path)
    with pytest.raises(ValueError, match="both a directory and a size"):
        SegmentTiers(host_bytes=0, disk_bytes=10)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        SegmentTiers(host_bytes=0, disk_dir=tmp_path / "file", disk_bytes=10)


WRITER = textwrap.dedent("""
    import sys, torch
    from segkv.cache.tiers import SegmentTiers, rows_checksum
    rows = {"layers.0.key": torch.randn(1 << 20, 8)}  # 32 MiB a segment: writes take a while
    tiers = SegmentTiers(host_bytes=0, disk_dir=sys.argv[1], disk_bytes=1 << 40)
    print("ready", flush=True)
    key = 0
    while True:
        tiers.put(key, rows, rows_checksum(rows))
        key += 1
""")


def test_a_writer_killed_mid_file_leaves_nothing_the_next_start_trusts(tmp_path):
    """SIGKILL while the disk tier writes: the next start on the directory removes the partial
    (temporary) file and the earlier run's finished files, and leaves other files alone."""
    keep = tmp_path / "saved-session.safetensors"  # e.g. a session saved by name
    keep.write_bytes(b"not the tier's")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 60
        while not any(p.name.endswith(".tmp") for p in tmp_path.iterdir()):  # caught writing a file
            assert time.monotonic() < deadline and proc.poll() is None
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    left = {p.name for p in tmp_path.iterdir()}
    assert any(name.endswith(".tmp") for name in left)
    tiers = SegmentTiers(host_bytes=0, disk_dir=tmp_path, disk_bytes=1 << 30)
    assert {p.name for p in tmp_path.iterdir()} == {keep.name}
    assert tiers.stats()["files_removed_at_start"] == len(left) - 1 and keep.read_bytes() == b"not the tier's"


def test_rows_given_one_at_a_time_keep_the_same_copy_and_checksum(gen, tmp_path):
    """``put_rows``: the rows of a segment read one tensor at a time (as pages are, layer by
    layer) give the checksum and the copy ``put`` gives the whole dict; too many bytes read nothing."""
    rows = segment_rows(gen)
    size = tensor_bytes(rows)
    tiers = SegmentTiers(host_bytes=4 * size)
    read = []

    def one_at_a_time():
        for name in rows:
            read.append(name)
            yield name, rows[name]

    assert tiers.put_rows(7, size, one_at_a_time())
    assert tiers.checksum_of(7) == rows_checksum(rows) and same(tiers.get(7), rows)
    assert read == list(rows) and tiers.stats()["bytes_to_host"] == size
    read.clear()
    assert not tiers.put_rows(8, 5 * size, one_at_a_time()) and not read and 8 not in tiers
    with pytest.raises(ValueError, match="already has a copy"):
        tiers.put_rows(7, size, one_at_a_time())
