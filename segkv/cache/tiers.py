"""KV tiers below the GPU's pages: host memory, then disk, for sealed segments' rows.

A sealed segment is immutable, so its rows move as one unit, copied once and never dirty.
:class:`SegmentTiers` keeps a copy of them under the segment's key: in host memory (pinned
when the rows come from a GPU, so the copies run asynchronously) up to ``host_bytes``, and
past that in files under ``disk_dir`` up to ``disk_bytes``, the least recently used going down
a tier first and, past the disk's bound, dropped (their rows are then recomputed). Every copy
carries :func:`rows_checksum` of the rows it was made from; a copy read back from disk is
checked against it, and a missing, unreadable or different file is dropped with a warning, so
a bad file costs a recompute, never wrong tokens. Files are written under a temporary name,
fsynced and renamed (``cache.files``); at start the directory's temporary files and the
segment files of earlier runs are removed, since no segment of this process refers to them.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from segkv.cache.files import atomic_save_file, is_temporary
from segkv.cache.page_pool import OutOfPagesError
from segkv.cache.segment import Segment

log = logging.getLogger(__name__)

FILE_PREFIX = "segment-"
FILE_SUFFIX = ".safetensors"
CHECKSUM_KEY = "segkv.tier.checksum"
TRANSFERS = ("to_host", "from_host", "to_disk", "from_disk")  # the directions copies are timed in
_WEIGHT_PERIOD = 1_048_573  # a prime: word i weighs (i mod period) + 1, so moved words change the sum
# int32 words summed per step of rows_checksum: a whole number of periods, so every step's weights
# are the same (made once per device, 32 MiB of int64), and its temporaries stay small
CHECKSUM_CHUNK_WORDS = 4 * _WEIGHT_PERIOD
_weights: dict[torch.device, torch.Tensor] = {}


def rows_checksum(tensors: Mapping[str, torch.Tensor]) -> int:
    """A 64-bit checksum of ``tensors``' bytes (any device, any dtype), equal on every device:
    each tensor's bytes as int32 words (zero-padded to a whole word), each times its position
    weight, summed in int64 with wraparound (integer sums do not depend on their order), and the
    tensors' sums mixed in name order. It catches changed, lost and moved words; it is not
    cryptographic. On a GPU it reads the rows at memory speed."""
    return checksum_of_rows(tensors.items())


def weighted_word_sum(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """One tensor's part of :func:`rows_checksum`: its words' weighted sum as a 0-dim int64 tensor
    on ``tensor``'s device (the sum mod 2^64 once read) and the number of words. No host
    synchronisation: on a GPU it runs on the current stream while the host goes on."""
    data = tensor.detach().contiguous().view(-1).view(torch.uint8)
    pad = (-data.numel()) % 4
    if pad:
        data = torch.cat([data, data.new_zeros(pad)])
    words = data.view(torch.int32)
    part = torch.zeros((), dtype=torch.int64, device=words.device)
    weights = _weights.get(words.device)
    if weights is None:
        weights = torch.arange(CHECKSUM_CHUNK_WORDS, dtype=torch.int64, device=words.device)
        weights = _weights[words.device] = weights.remainder_(_WEIGHT_PERIOD).add_(1)
        if weights.is_cuda:  # made once, then read on any stream: complete before anyone reads it
            torch.cuda.current_stream(weights.device).synchronize()
    for start in range(0, words.numel(), CHECKSUM_CHUNK_WORDS):
        chunk = words[start:start + CHECKSUM_CHUNK_WORDS]
        part += (chunk.to(torch.int64) * weights[:chunk.numel()]).sum()  # int64 wraps around: the sum mod 2^64
    return part, words.numel()


def checksum_of_rows(rows: Iterable[tuple[str, torch.Tensor]]) -> int:
    """:func:`rows_checksum` of the ``(name, tensor)`` pairs ``rows`` yields, read one at a time
    (a device holds one of them at a time) and read back to the host once, at the end."""
    names, words, sums = [], [], []
    for name, tensor in rows:
        part, count = weighted_word_sum(tensor)
        names.append(name), words.append(count), sums.append(part)
    return _mixed(names, words, torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64))


def _mixed(names: list[str], words: list[int], sums: torch.Tensor) -> int:
    """:func:`mix_checksum` of parts whose weighted sums are the int64 tensor ``sums`` (any device)."""
    return mix_checksum({name: (int(part) % 2**64, count) for name, count, part in zip(names, words, sums.tolist())})


def mix_checksum(parts: Mapping[str, tuple[int, int]]) -> int:
    """:func:`rows_checksum` from its tensors' parts ``(weighted word sum mod 2^64, words)``, mixed
    in name order."""
    total = len(parts)
    for name in sorted(parts):
        part, words = parts[name]
        total = (total * 0x100000001B3 + part + words) % 2**64
    return total


def tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@dataclass(slots=True)
class _Copy:
    """One segment's rows below the GPU: on the host (``tensors``) or in a file (``path``).

    A copy from the GPU is asynchronous until :meth:`SegmentTiers._settle`: ``ready`` (a CUDA
    event) completes with it, ``started`` timed its start, and its checksum (None until then)
    is mixed from ``sums``, the parts' weighted sums copied into pinned memory beside the rows."""

    nbytes: int
    checksum: int | None
    tensors: dict[str, torch.Tensor] | None = None
    path: Path | None = None
    ready: object | None = None
    started: object | None = None
    sums: tuple[list[str], list[int], torch.Tensor] | None = None


class SegmentTiers:
    """Host and disk copies of sealed segments' rows, keyed by an int (the segment's id).

    ``host_bytes``: the host tier's bound (0: no host tier). ``disk_dir`` and ``disk_bytes``:
    the disk tier (both or neither). ``pin_memory``: host copies in pinned memory (CUDA pages),
    copied without blocking. ValueError for negative bounds or a disk tier half given."""

    def __init__(self, *, host_bytes: int, disk_dir: str | Path | None = None, disk_bytes: int = 0,
                 pin_memory: bool = False) -> None:
        if host_bytes < 0 or disk_bytes < 0:
            raise ValueError(f"tier sizes must be >= 0, got host {host_bytes} and disk {disk_bytes} bytes")
        if (disk_dir is None) != (disk_bytes == 0):
            raise ValueError("a disk tier needs both a directory and a size in bytes")
        self.host_capacity = host_bytes
        self.disk_capacity = disk_bytes
        self.pin_memory = pin_memory
        self.disk_dir = None if disk_dir is None else Path(disk_dir)
        self._run = uuid.uuid4().hex[:12]
        # per (CUDA device, role): the streams copies between pages and the host run on
        self._side_streams: dict[tuple[int | None, str], torch.cuda.Stream] = {}
        self._host: OrderedDict[int, _Copy] = OrderedDict()  # least recently used first
        self._disk: OrderedDict[int, _Copy] = OrderedDict()
        self.host_bytes = self.disk_bytes = 0
        self.counters = dict.fromkeys(
            ("stored", "host_hits", "disk_hits", "misses", "spilled_to_disk", "dropped", "corrupt",
             "bytes_to_host", "bytes_to_disk", "bytes_from_disk", "bytes_from_host", "files_removed_at_start"), 0)
        # seconds the copies took, per direction (TRANSFERS): bytes over seconds is the rate
        self.seconds = dict.fromkeys(TRANSFERS, 0.0)
        if self.disk_dir is not None:
            self._prepare_directory(self.disk_dir)

    # -- what is where ------------------------------------------------------------------
    def __contains__(self, key: int) -> bool:
        return key in self._host or key in self._disk

    def tier_of(self, key: int) -> str | None:
        """``"host"``, ``"disk"`` or None (no copy)."""
        return "host" if key in self._host else "disk" if key in self._disk else None

    def checksum_of(self, key: int) -> int:
        """The checksum of the rows ``key``'s copy was made from (KeyError without a copy); for a
        copy from the GPU, once it is complete."""
        copy = self._host.get(key) or self._disk[key]
        self._settle(copy)
        return copy.checksum

    def stats(self) -> dict[str, int | float]:
        """Bytes and segments per tier, the counters, the seconds each direction's copies took
        (``seconds_to_host`` ...) and their rates (``to_host_bytes_per_s`` ..., 0 before any)."""
        for copy in self._host.values():  # copies from the GPU finished by now are timed
            if copy.ready is not None and copy.ready.query():
                self._settle(copy)
        seconds = {f"seconds_{d}": t for d, t in self.seconds.items()}
        rates = {f"{d}_bytes_per_s": round(self.counters[f"bytes_{d}"] / t) if t > 0 else 0
                 for d, t in self.seconds.items()}
        return {"host_bytes": self.host_bytes, "host_segments": len(self._host), "host_capacity": self.host_capacity,
                "disk_bytes": self.disk_bytes, "disk_segments": len(self._disk),
                "disk_capacity": self.disk_capacity, **self.counters, **seconds, **rates}

    def record_copy_back(self, nbytes: int, seconds: float) -> None:
        """Count a copy of ``nbytes`` from the host tier into pages that took ``seconds``."""
        self.counters["bytes_from_host"] += nbytes
        self.seconds["from_host"] += seconds

    # -- in and out ---------------------------------------------------------------------
    def put(self, key: int, tensors: Mapping[str, torch.Tensor], checksum: int) -> bool:
        """Keep a copy of ``tensors`` (a segment's rows, any device) under ``key``, whose rows
        have ``checksum`` (:func:`rows_checksum`), in the host tier, moving older copies down to
        make room. False, keeping nothing, when the rows fit neither tier. ValueError when
        ``key`` already has a copy."""
        self._check_new(key)
        nbytes = tensor_bytes(tensors)
        if nbytes > max(self.host_capacity, self.disk_capacity):
            return False
        started = time.perf_counter()
        copy = _Copy(nbytes, checksum, tensors=self._to_host(tensors))
        if any(t.is_cuda for t in tensors.values()):  # pinned copies run on: wait for them
            torch.cuda.synchronize()
        return self._keep(key, copy, time.perf_counter() - started)

    def put_rows(self, key: int, nbytes: int, rows: Iterable[tuple[str, torch.Tensor]],
                 device: torch.device | str = "cpu") -> bool:
        """:meth:`put` of the ``(name, tensor)`` pairs ``rows`` yields (``nbytes`` in all), taken one
        at a time: each is summed into the checksum and copied to the host as it comes, so a
        device holds one of them at a time. False, reading nothing, when ``nbytes`` fit no tier.

        Rows on a CUDA ``device`` are read on a side stream, after the work queued so far, and
        copied asynchronously: the host does not wait, the current stream waits for the copy
        before anything queued after this call (which may reuse the rows' pages), and the copy's
        checksum is read once it is complete."""
        self._check_new(key)
        if nbytes > max(self.host_capacity, self.disk_capacity):
            return False
        device = torch.device(device)
        if device.type == "cuda":
            return self._put_rows_async(key, rows, device)
        started = time.perf_counter()
        names, words, sums, host = [], [], [], {}
        for name, tensor in rows:
            part, count = weighted_word_sum(tensor)
            names.append(name), words.append(count), sums.append(part)
            host[name] = self._to_host({name: tensor})[name]
        checksum = _mixed(names, words, torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64))
        # (the bytes counted are those copied)
        return self._keep(key, _Copy(tensor_bytes(host), checksum, tensors=host), time.perf_counter() - started)

    def _put_rows_async(self, key: int, rows: Iterable[tuple[str, torch.Tensor]], device: torch.device) -> bool:
        current = torch.cuda.current_stream(device)
        side = self.side_stream(device)
        side.wait_stream(current)  # the rows' writes so far come first
        started, ready = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        names, words, sums, host = [], [], [], {}
        with torch.cuda.stream(side):  # the gathers and sums run here too, their memory this stream's
            started.record()
            for name, tensor in rows:
                part, count = weighted_word_sum(tensor)
                names.append(name), words.append(count), sums.append(part)
                host[name] = self._to_host({name: tensor})[name]
            summed = torch.empty(len(sums), dtype=torch.int64, pin_memory=True)
            if sums:
                summed.copy_(torch.stack(sums), non_blocking=True)
            ready.record()
        current.wait_stream(side)  # pages given back after this call are rewritten after the copy
        copy = _Copy(tensor_bytes(host), None, tensors=host, ready=ready, started=started,
                     sums=(names, words, summed))
        return self._keep(key, copy, None)

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The CUDA stream copies between ``device``'s pages and the host run on."""
        return self._stream(device, "side")

    def copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        """A second CUDA stream: copies from the host that overlap the side stream's writes."""
        return self._stream(device, "copy")

    def _stream(self, device: torch.device, role: str) -> torch.cuda.Stream:
        stream = self._side_streams.get((device.index, role))
        if stream is None:
            stream = self._side_streams[(device.index, role)] = torch.cuda.Stream(device)
        return stream

    def _check_new(self, key: int) -> None:
        if key in self:
            raise ValueError(f"segment {key} already has a copy in the {self.tier_of(key)} tier")

    def _keep(self, key: int, copy: _Copy, seconds: float | None) -> bool:
        """File a new host ``copy`` in the host tier, or straight on disk when it is larger than
        the host tier. ``seconds``: the copy's time, or None for a copy still running (timed by
        its events when it is settled)."""
        if seconds is not None:
            self.seconds["to_host"] += seconds
        nbytes = copy.nbytes
        self.counters["stored"] += 1
        self.counters["bytes_to_host"] += nbytes
        if nbytes > self.host_capacity:  # too big for the host tier: straight to disk
            self._make_disk_room(nbytes)
            self._write(key, copy)
            return True
        self._make_host_room(nbytes)
        self._host[key] = copy
        self.host_bytes += nbytes
        return True

    def get(self, key: int) -> dict[str, torch.Tensor] | None:
        """``key``'s rows on the host (CPU tensors), read back from disk and checked when they
        were there, now the most recently used; None when no tier has them or their file is
        missing or does not match its checksum (dropped, with a warning)."""
        copy = self._host.get(key)
        if copy is not None:
            self._host.move_to_end(key)
            self._settle(copy)
            self.counters["host_hits"] += 1
            return copy.tensors
        copy = self._disk.pop(key, None)
        if copy is None:
            self.counters["misses"] += 1
            return None
        self.disk_bytes -= copy.nbytes
        tensors = self._read(key, copy)
        if tensors is None:
            return None
        self.counters["disk_hits"] += 1
        self.counters["bytes_from_disk"] += copy.nbytes
        if copy.nbytes <= self.host_capacity:  # back in the host tier: the next use is cheaper
            copy.path.unlink(missing_ok=True)
            self._make_host_room(copy.nbytes)
            self._host[key] = _Copy(copy.nbytes, copy.checksum, tensors=tensors)
            self.host_bytes += copy.nbytes
        else:  # the file stays, now the most recently used
            self._disk[key] = copy
            self.disk_bytes += copy.nbytes
        return tensors

    def discard(self, key: int) -> None:
        """Forget ``key``'s copy (its segment is gone); nothing when it has none."""
        copy = self._host.pop(key, None)
        if copy is not None:
            self.host_bytes -= copy.nbytes
        copy = self._disk.pop(key, None)
        if copy is not None:
            self.disk_bytes -= copy.nbytes
            copy.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Forget every copy and remove this run's files."""
        for key in list(self._host) + list(self._disk):
            self.discard(key)

    # -- moving down ------------------------------------------------------------------------
    def _make_host_room(self, nbytes: int) -> None:
        """Move least recently used host copies to disk (or drop them) until ``nbytes`` fit."""
        while self._host and self.host_bytes + nbytes > self.host_capacity:
            key, copy = self._host.popitem(last=False)
            self.host_bytes -= copy.nbytes
            if copy.nbytes > self.disk_capacity:
                self._drop(key, "it fits no disk tier")
                continue
            self._make_disk_room(copy.nbytes)
            self._write(key, copy)
            self.counters["spilled_to_disk"] += 1

    def _make_disk_room(self, nbytes: int) -> None:
        while self._disk and self.disk_bytes + nbytes > self.disk_capacity:
            key, copy = self._disk.popitem(last=False)
            self.disk_bytes -= copy.nbytes
            copy.path.unlink(missing_ok=True)
            self._drop(key, "the disk tier is full")

    def _drop(self, key: int, why: str) -> None:
        self.counters["dropped"] += 1
        log.debug("segment %s leaves the KV tiers (%s): its rows will be recomputed", key, why)

    def _settle(self, copy: _Copy) -> None:
        """Wait for ``copy``'s copy from the GPU, count its time and read its checksum (nothing
        for a settled one)."""
        if copy.ready is None:
            return
        copy.ready.synchronize()
        self.seconds["to_host"] += copy.started.elapsed_time(copy.ready) / 1e3
        copy.checksum = _mixed(*copy.sums)
        copy.ready = copy.started = copy.sums = None

    def _write(self, key: int, copy: _Copy) -> None:
        self._settle(copy)
        path = self.disk_dir / f"{FILE_PREFIX}{self._run}-{key}{FILE_SUFFIX}"
        started = time.perf_counter()
        atomic_save_file(path, {name: t.contiguous() for name, t in copy.tensors.items()},
                         {CHECKSUM_KEY: str(copy.checksum)})
        self.seconds["to_disk"] += time.perf_counter() - started
        self._disk[key] = _Copy(copy.nbytes, copy.checksum, path=path)
        self.disk_bytes += copy.nbytes
        self.counters["bytes_to_disk"] += copy.nbytes

    def _read(self, key: int, copy: _Copy) -> dict[str, torch.Tensor] | None:
        """The file's tensors, or None (file removed, warning logged) unless they are whole and
        match the checksum the copy was made with."""
        started = time.perf_counter()
        try:
            with safe_open(copy.path, framework="pt") as reader:
                tensors = {name: reader.get_tensor(name) for name in reader.keys()}
            self.seconds["from_disk"] += time.perf_counter() - started
            problem = None if rows_checksum(tensors) == copy.checksum else "its checksum does not match"
        except (OSError, SafetensorError) as exc:
            tensors, problem = None, f"it cannot be read ({exc})"
        if problem is None:
            return tensors
        log.warning("KV tier file %s of segment %s is not used: %s; its rows will be recomputed",
                    copy.path, key, problem)
        copy.path.unlink(missing_ok=True)
        self.counters["corrupt"] += 1
        return None

    def _to_host(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, tensor in tensors.items():
            pinned = self.pin_memory and tensor.is_cuda
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pinned)
            host.copy_(tensor, non_blocking=pinned)
            out[name] = host
        return out

    def _prepare_directory(self, directory: Path) -> None:
        """Create ``directory``; remove temporary files and earlier runs' segment files in it."""
        if directory.exists() and not directory.is_dir():
            raise ValueError(f"KV tier directory {directory} is not a directory")
        directory.mkdir(parents=True, exist_ok=True)
        for entry in directory.iterdir():
            stale = is_temporary(entry.name) or (entry.name.startswith(FILE_PREFIX)
                                                  and entry.name.endswith(FILE_SUFFIX))
            if stale and entry.is_file():
                entry.unlink(missing_ok=True)
                self.counters["files_removed_at_start"] += 1


# -- a cache's segments in and out of its tiers ------------------------------------------------
def offload(cache, segment: Segment) -> bool:
    """Copy ``segment``'s held pages (every layer, as stored) into ``cache.tiers`` and give the
    pages back to the pool; its holders keep it, and its spans are refused by the planner until
    :func:`bring_back`. A copy made earlier is reused (sealed rows never change). False, with
    nothing changed, when the cache has no tiers, the rows fit no tier, or the segment cannot
    leave its pages (a tail, rows released behind a window, no holder, already out)."""
    tiers = cache.tiers
    if (tiers is None or not segment.sealed or segment.tier_holds is not None or segment.released_pages
            or not segment.held_pages):
        return False
    if segment.segment_id not in tiers:
        pages = segment.page_ids[:segment.held_pages]
        nbytes = len(pages) * cache.pool.page_size * cache.layout.row_bytes
        # one layer's rows at a time on the device: gathered, summed and copied to the host (on
        # a GPU asynchronously, on a side stream that steps queued later wait for)
        if not tiers.put_rows(segment.segment_id, nbytes, _page_rows(cache, pages), device=cache.storage.device):
            return False
    segment.move_out()
    return True


@dataclass(slots=True)
class Arrival:
    """A segment's rows on their way back into ``pages`` (:func:`start_bring_back`), until
    :func:`land`. On a GPU the copies run on the tiers' side stream: ``ready`` (a CUDA event)
    completes after them and after the written rows' checksum parts, copied into ``sums``."""

    segment: Segment
    pages: list[int]
    checksum: int  # what the rows must sum to
    nbytes: int
    ready: object | None  # None: complete (a CPU cache's copies are synchronous)
    sums: tuple[list[str], list[int], torch.Tensor]
    started: object  # a CUDA event before the copies, or the wall clock's time

    def complete(self) -> bool:
        return self.ready is None or self.ready.query()


def start_bring_back(cache, segment: Segment) -> Arrival | None:
    """Begin copying ``segment``'s rows from ``cache.tiers`` into newly allocated pages, and their
    checksum, without waiting (on a GPU, on a side stream after the work queued so far: the pages
    may have been read by it). The segment stays out until :func:`land`. None when no tier has
    the copy (the caller recomputes the rows); :class:`OutOfPagesError` when the pool has too few
    free pages (nothing changed)."""
    tiers = cache.tiers
    rows = None if tiers is None else tiers.get(segment.segment_id)
    if rows is None:
        return None
    need = len(segment.tier_holds)
    if need > cache.pool.num_free_pages:
        raise OutOfPagesError(f"segment {segment.segment_id} needs {need} pages to come back, "
                              f"{cache.pool.num_free_pages} are free")
    checksum = tiers.checksum_of(segment.segment_id)
    pages = cache.pool.allocate(need)
    device = cache.storage.device
    if device.type != "cuda":
        started = time.perf_counter()
        return Arrival(segment, pages, checksum, tensor_bytes(rows), None, _write_rows(cache, pages, rows), started)
    side = tiers.side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    started, ready = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    with torch.cuda.stream(side):
        started.record()
        names, words, sums = _write_rows(cache, pages, rows)
        summed = torch.empty(sums.numel(), dtype=torch.int64, pin_memory=True)
        summed.copy_(sums, non_blocking=True)
        ready.record()
    return Arrival(segment, pages, checksum, tensor_bytes(rows), ready, (names, words, summed), started)


def land(cache, arrival: Arrival) -> bool:
    """Finish ``arrival`` (waiting for its copies if they run on): the segment's rows are in its
    pages when they match the checksum (True). False, the pages given back and the copy dropped
    (warning logged), when they do not: the segment stays out and its rows are recomputed."""
    tiers = cache.tiers
    if arrival.ready is not None:
        arrival.ready.synchronize()
        seconds = arrival.started.elapsed_time(arrival.ready) / 1e3
    else:
        seconds = time.perf_counter() - arrival.started
    segment = arrival.segment
    if _mixed(*arrival.sums) != arrival.checksum:
        cache.pool.decref(arrival.pages)
        tiers.discard(segment.segment_id)
        tiers.counters["corrupt"] += 1
        log.warning("segment %s came back different from its checksum: its rows will be recomputed",
                    segment.segment_id)
        return False
    tiers.record_copy_back(arrival.nbytes, seconds)
    segment.move_in(arrival.pages)
    return True


def bring_back(cache, segment: Segment) -> bool:
    """Give ``segment``'s rows pages again from ``cache.tiers``' copy, checked bit-identical by
    checksum once written (:func:`start_bring_back`, then :func:`land`). False, with the segment
    still out, when no tier has the copy or it does not match (dropped, warning logged): the
    caller recomputes those rows. :class:`OutOfPagesError` when the pool has too few free pages
    (nothing changed)."""
    if segment.tier_holds is None:
        return True
    arrival = start_bring_back(cache, segment)
    return arrival is not None and land(cache, arrival)


def _write_rows(cache, pages: list[int], rows: Mapping[str, torch.Tensor]) -> tuple[list[str], list[int], torch.Tensor]:
    """Write a segment's copied ``rows`` into ``pages`` layer by layer (on the current stream) and
    return the written rows' checksum parts, read back from the pages (what attention will read):
    names, words and the weighted sums, an int64 tensor on the cache's device.

    On a GPU the host-to-device copies run on the tiers' copy stream into two staging buffers in
    turn, so one layer's copy overlaps the previous layer's write and sums, and the copy engine
    stays busy; host rows in pinned memory do not block the host."""
    device = cache.storage.device
    slots = torch.tensor(_page_slots(pages, cache.pool.page_size), dtype=torch.long, device=device)
    parts = 2 if cache.layout.kind == "mha" else 1  # K and V, or the latent rows (the storage's read order)
    names, words, sums = [], [], []
    staged = _Staging(cache.tiers, device, parts) if device.type == "cuda" else None
    for layer in range(cache.layout.num_layers):
        host = [rows[f"{layer}.{j}"] for j in range(parts)]
        layer_rows = staged.copy_in(layer, host) if staged is not None else [t.to(device) for t in host]
        # (the slots were just allocated: no range check)
        cache.storage.write(layer, slots, *layer_rows, trusted_slots=True)
        if staged is not None:
            staged.consumed(layer)
        for part, written in enumerate(cache.storage.read(layer, slots)):  # read back
            total, count = weighted_word_sum(written)
            names.append(f"{layer}.{part}"), words.append(count), sums.append(total)
    return names, words, torch.stack(sums)


class _Staging:
    """Two sets of device buffers that host rows are copied into on the tiers' copy stream, one
    layer in each in turn: the copy of layer ``l`` waits until the current stream is done with the
    buffers of layer ``l - 2``, and the current stream waits for the copy before using them."""

    def __init__(self, tiers: SegmentTiers, device: torch.device, parts: int) -> None:
        self.stream = tiers.copy_stream(device)
        self.current = torch.cuda.current_stream(device)
        self.stream.wait_stream(self.current)  # the pages' earlier readers come first
        self.device, self.parts = device, parts
        self.buffers: list[list[torch.Tensor] | None] = [None, None]
        self.done: list[object | None] = [None, None]

    def copy_in(self, layer: int, host: list[torch.Tensor]) -> list[torch.Tensor]:
        """``host`` (one layer's parts) on the device, copied on the copy stream; the current stream
        waits for the copy."""
        slot = layer % 2
        buffers = self.buffers[slot]
        if buffers is None or any(b.shape != h.shape or b.dtype != h.dtype for b, h in zip(buffers, host)):
            buffers = self.buffers[slot] = [torch.empty(h.shape, dtype=h.dtype, device=self.device) for h in host]
            for buffer in buffers:  # (made on the current stream, written on the copy stream)
                buffer.record_stream(self.stream)
        landed = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            if self.done[slot] is not None:
                self.stream.wait_event(self.done[slot])
            for buffer, rows in zip(buffers, host):
                buffer.copy_(rows, non_blocking=True)
            landed.record()
        self.current.wait_event(landed)
        return buffers

    def consumed(self, layer: int) -> None:
        """The current stream has queued everything that reads layer ``layer``'s buffers."""
        done = torch.cuda.Event()
        done.record(self.current)
        self.done[layer % 2] = done


def bring_back_chain(cache, chain) -> int:
    """Bring every segment of ``chain`` that is in the tiers back into pages (:func:`bring_back`);
    where one cannot come back, trim the chain to the rows before it (they are recomputed).
    Returns the rows trimmed (0 when everything came back). :class:`OutOfPagesError` as
    :func:`bring_back`'s."""
    for segment in chain.segments_in_lower_tiers():
        if not bring_back(cache, segment):
            return trim_from(chain, segment)
    return 0


def trim_from(chain, segment: Segment) -> int:
    """Trim ``chain`` to the rows before its first reference to ``segment`` (whose rows are lost:
    they and every later row are recomputed); returns the rows trimmed."""
    kept = 0
    for ref in chain.refs:
        if ref.segment is segment:
            break
        kept += ref.num_rows
    trimmed = chain.num_rows - kept
    chain.trim(trimmed)
    return trimmed


def _page_slots(pages: list[int], page_size: int) -> list[int]:
    return [page * page_size + offset for page in pages for offset in range(page_size)]


def _page_rows(cache, pages: list[int]):
    """Every row of ``pages`` as stored, one layer's part at a time: ``("{layer}.{part}", (rows, ...))``
    (part 0 and 1 are K and V, or 0 the latent rows), each gathered when asked for."""
    index = torch.tensor(_page_slots(pages, cache.pool.page_size), dtype=torch.long, device=cache.storage.device)
    for layer in range(cache.layout.num_layers):
        for part, rows in enumerate(cache.storage.read(layer, index)):
            yield f"{layer}.{part}", rows
