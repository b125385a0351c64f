"""Conversation snapshot files: a ChainSnapshot's KV rows and manifest in one safetensors file."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from segkv.cache import ChainSnapshot, KVChain, OutOfPagesError, PagedKVCache, PagePool
from segkv.cache.files import atomic_save_file
from segkv.config import KVLayout

FORMAT_NAME = "segkv.snapshot"
FORMAT_VERSION = 1
MANIFEST_KEY = "segkv.snapshot.manifest"  # safetensors header metadata: the manifest (JSON text)
MANIFEST_DIGEST_KEY = "segkv.snapshot.manifest.sha256"  # sha256 of the manifest text (UTF-8)
_LAYOUT_FIELDS = ("kind", "num_layers", "num_kv_heads", "head_dim", "kv_lora_rank", "rope_dim", "dtype")
_MANIFEST_TYPES = {"fingerprint": str, "layout": dict, "num_rows": int, "segment_rows": list,
                   "token_ids": list, "metadata": dict, "sha256": dict}


@dataclass(slots=True)
class LoadedSnapshot:
    """A snapshot rebuilt from a file: ``snapshot`` holds the only references to its pages."""

    snapshot: ChainSnapshot
    token_ids: list[int]
    metadata: dict
    num_rows: int

    def __post_init__(self) -> None:
        if not self.snapshot.num_rows == len(self.token_ids) == self.num_rows:
            raise ValueError(f"{self.snapshot.num_rows} rows, {len(self.token_ids)} token ids, "
                             f"num_rows={self.num_rows}")


# -- saving -----------------------------------------------------------------------------
def save_snapshot(path: str | os.PathLike, snapshot: ChainSnapshot, cache: PagedKVCache, *,
                  fingerprint: str, metadata: dict | None = None) -> None:
    """Write ``snapshot``'s rows (gathered from ``cache``) and a manifest to ``path`` atomically.

    Tensors (chain order, ``R`` rows, ``layout.dtype``): MHA ``layers.{i}.key`` and
    ``layers.{i}.value`` ``(R, num_kv_heads, head_dim)``; MLA ``layers.{i}.latent``
    ``(R, kv_lora_rank + rope_dim)``. The manifest records the format, ``fingerprint``, layout,
    segment row counts, every row's token id, ``metadata`` (loaded back as JSON decodes it) and
    a sha256 per tensor. Rows released behind a sliding window (``KVChain.release_rows_before``)
    are not in the tensors: ``segment_released`` counts them at the head of each segment. ValueError for a released snapshot, rows without token ids, metadata
    that is not a JSON dict, a manifest over safetensors' 100 MB header limit or a ``path`` that
    is a directory. The file is written beside ``path`` under a temporary name, fsynced and
    renamed over ``path``: readers see the old file or the new one, never part of one, and a
    failed save (an OSError, an interrupt) leaves no temporary file and an existing file
    under ``path`` as it was. The file is readable by its owner only (it holds conversations).
    """
    path = Path(path)
    _check_fingerprint_arg(fingerprint)
    if path.is_dir():
        raise ValueError(f"cannot write snapshot file {path}: it is a directory")
    if not snapshot.live:
        raise ValueError("cannot save a released snapshot")
    refs = [ref for ref in snapshot.refs if ref.num_rows > 0]  # empty refs hold no rows or pages
    if any(ref.segment.pool is not cache.pool for ref in refs):
        raise ValueError("the snapshot's segments do not belong to this cache's page pool")
    token_ids: list[int] = []
    for i, ref in enumerate(refs):
        if ref.token_ids is None:
            raise ValueError(f"cannot save a snapshot with rows without token ids (segment {i})")
        token_ids.extend(ref.token_ids)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict):
        raise ValueError(f"snapshot metadata must be a dict, got {type(metadata).__name__}")
    _dumps(metadata)  # fail on bad metadata before gathering any rows
    released = [min(ref.segment.released_rows, ref.num_rows) for ref in refs]
    manifest = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "fingerprint": fingerprint,
                "layout": _layout_dict(cache.file_layout), "num_rows": len(token_ids),
                "segment_rows": [ref.num_rows for ref in refs], "token_ids": token_ids,
                "metadata": metadata}
    if any(released):
        manifest["segment_released"] = released
    tensors = _gather(cache, [slot for ref, r in zip(refs, released) for slot in ref.segment.slots(r, ref.num_rows)])
    manifest["sha256"] = {name: _digest(tensor) for name, tensor in tensors.items()}
    text = _dumps(manifest)
    header = {MANIFEST_KEY: text, MANIFEST_DIGEST_KEY: hashlib.sha256(text.encode()).hexdigest()}
    try:
        atomic_save_file(path, tensors, header)
    except SafetensorError as exc:  # e.g. "header too large": token ids + metadata over 100 MB
        raise ValueError(f"cannot write snapshot file {path}: {exc}") from exc


def _gather(cache: PagedKVCache, slots: list[int]) -> dict[str, torch.Tensor]:
    """Rows at ``slots`` of every layer, on the CPU, contiguous, keyed by tensor name."""
    index = torch.tensor(slots, dtype=torch.long)
    tensors = {}
    for layer in range(cache.file_layout.num_layers):
        rows = cache.read_rows(layer, index)
        for name, part in zip(_layer_names(cache.file_layout, layer), rows):
            tensors[name] = part.to("cpu").contiguous()
    return tensors


# -- loading ----------------------------------------------------------------------------
def load_snapshot(path: str | os.PathLike, cache: PagedKVCache, *, fingerprint: str,
                  make_room: Callable[[int], object] | None = None) -> LoadedSnapshot:
    """Validate the snapshot file at ``path`` completely, then rebuild its chain in ``cache``.

    Raises FileNotFoundError (missing file), ValueError (a directory, not a snapshot,
    truncated or corrupted, unsupported version, other model fingerprint, other KV layout) or
    OutOfPagesError (too few free pages, after ``make_room(pages_short)``, if given, had its
    chance to free some, e.g. by evicting unreferenced cached segments) before any page is
    allocated. The rebuilt segments keep the saved boundaries (no compaction); if the rebuild
    fails the pool gets back every page it lent. The returned snapshot holds the only
    references: release it when done.
    """
    path = Path(path)
    _check_fingerprint_arg(fingerprint)
    manifest, tensors = _read_validated(path, cache.file_layout, fingerprint)
    _check_capacity(path, cache.pool, manifest["segment_rows"], _released(manifest), make_room)
    snapshot = _rebuild(cache, manifest, tensors)
    return LoadedSnapshot(snapshot, list(manifest["token_ids"]), manifest["metadata"], manifest["num_rows"])


def _read_validated(path: Path, layout: KVLayout, fingerprint: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """The manifest and every tensor of the file, all checked against each other and the cache."""
    if path.is_dir():  # safetensors would fail with an OSError naming no path ("No such device")
        raise ValueError(f"snapshot path {path} is a directory, not a snapshot file")
    try:
        with safe_open(path, framework="pt") as reader:
            manifest = _read_manifest(path, reader.metadata() or {})
            _check_manifest(path, manifest, layout, fingerprint)
            shapes = _tensor_shapes(layout, manifest["num_rows"] - sum(_released(manifest)))
            if set(reader.keys()) != set(shapes) or set(manifest["sha256"]) != set(shapes):
                raise _corrupt(path, f"tensors {sorted(reader.keys())}, expected {sorted(shapes)}")
            tensors = {name: reader.get_tensor(name) for name in shapes}
    except FileNotFoundError as exc:
        raise FileNotFoundError(errno.ENOENT, "snapshot file does not exist", str(path)) from exc
    except IsADirectoryError as exc:  # replaced by a directory since the check above
        raise ValueError(f"snapshot path {path} is a directory, not a snapshot file") from exc
    except SafetensorError as exc:
        raise _corrupt(path, str(exc)) from exc
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != shapes[name] or tensor.dtype != layout.dtype:
            raise _corrupt(path, f"tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"the manifest implies {shapes[name]} {layout.dtype}")
        if _digest(tensor) != manifest["sha256"][name]:
            raise _corrupt(path, f"sha256 of tensor {name!r} does not match the manifest")
    return manifest, tensors


def _read_manifest(path: Path, header: dict[str, str]) -> dict:
    """The manifest from the safetensors header, after checking its digest, format and version."""
    text, digest = header.get(MANIFEST_KEY), header.get(MANIFEST_DIGEST_KEY)
    if text is None or digest is None:
        raise ValueError(f"{path} is not a segkv snapshot file (no {MANIFEST_KEY!r} in its header)")
    if hashlib.sha256(text.encode()).hexdigest() != digest:
        raise _corrupt(path, "sha256 of the manifest does not match")
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _corrupt(path, f"manifest is not JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ValueError(f"{path} is not a segkv snapshot file (format is not {FORMAT_NAME!r})")
    if manifest.get("version") != FORMAT_VERSION:
        raise ValueError(f"snapshot file {path} has format version {manifest.get('version')!r}; "
                         f"this segkv reads version {FORMAT_VERSION}")
    return manifest


def _check_manifest(path: Path, manifest: dict, layout: KVLayout, fingerprint: str) -> None:
    """Field types, row counts, fingerprint and layout (ValueError naming the difference)."""
    for key, kind in _MANIFEST_TYPES.items():
        if not isinstance(manifest.get(key), kind):
            raise _corrupt(path, f"manifest field {key!r} is missing or not a {kind.__name__}")
    rows, tokens = manifest["segment_rows"], manifest["token_ids"]
    if not all(_is_int(n) and n > 0 for n in rows) or not all(_is_int(t) for t in tokens):
        raise _corrupt(path, "segment row counts must be positive integers and token ids integers")
    if not sum(rows) == len(tokens) == manifest["num_rows"]:
        raise _corrupt(path, f"segments of {sum(rows)} rows, {len(tokens)} token ids, "
                             f"num_rows={manifest['num_rows']}")
    released = manifest.get("segment_released", [0] * len(rows))
    if (not isinstance(released, list) or len(released) != len(rows)
            or not all(_is_int(r) and 0 <= r <= n for r, n in zip(released, rows))):
        raise _corrupt(path, "segment_released must list, per segment, how many of its leading rows were "
                             "released (0 .. its rows)")
    if manifest["fingerprint"] != fingerprint:
        raise ValueError(f"snapshot was saved from a different model: {path} has fingerprint "
                         f"{manifest['fingerprint']!r}, this model's is {fingerprint!r}")
    saved, mine = manifest["layout"], _layout_dict(layout)
    diffs = [f"{key}: file {saved.get(key)!r}, cache {value!r}" for key, value in mine.items()
             if saved.get(key) != value]
    if diffs or set(saved) != set(mine):
        raise ValueError(f"snapshot file {path} has a different KV layout than this cache: "
                         + ("; ".join(diffs) or f"fields {sorted(saved)}"))


def _check_capacity(path: Path, pool: PagePool, segment_rows: list[int], released: list[int],
                    make_room: Callable[[int], object] | None) -> None:
    """OutOfPagesError unless the pool has (or ``make_room`` frees) the pages the rebuilt
    segments will take: the most held at once, while the last one (all its pages taken before
    its released head goes back) is written."""
    need, kept = 0, 0
    for n, r in zip(segment_rows, released):
        need = max(need, kept + pool.pages_for_rows(n))
        kept += pool.pages_for_rows(n) - (pool.pages_for_rows(n) if r == n else r // pool.page_size)
    if need > pool.num_free_pages and make_room is not None:
        make_room(need - pool.num_free_pages)
    if need > pool.num_free_pages:
        raise OutOfPagesError(f"cannot load snapshot file {path}: its {sum(segment_rows)} rows in "
                              f"{len(segment_rows)} segments need {need} pages of {pool.page_size} rows, "
                              f"{pool.num_free_pages} of {pool.num_pages} pages are free")


def _rebuild(cache: PagedKVCache, manifest: dict, tensors: dict[str, torch.Tensor]) -> ChainSnapshot:
    """Append, write and seal each saved segment in a fresh chain; return its snapshot."""
    chain = KVChain(cache.pool, copy_rows=None)  # no compaction: keep the saved boundaries
    device, token_ids, start = cache.storage.device, manifest["token_ids"], 0
    live = 0  # rows of the tensors used so far (released rows are not in them)
    try:
        for num_rows, released in zip(manifest["segment_rows"], _released(manifest)):
            end = start + num_rows
            chain.append(num_rows, token_ids=token_ids[start:end])
            chain.release_tail_head(released)
            # rows of a page that also holds live rows, released before the save (with another
            # page size) lie outside every later window: zeros, never attended
            first = chain.tail.released_rows
            slots = chain.tail.slots(first, num_rows)
            for layer in range(cache.file_layout.num_layers):
                names = _layer_names(cache.file_layout, layer)
                rows = [tensors[n][live : live + num_rows - released] for n in names]
                rows = [torch.cat([part.new_zeros(released - first, *part.shape[1:]), part]) for part in rows]
                cache.write_rows(layer, slots, *(part.to(device) for part in rows))
            chain.seal()
            start, live = end, live + num_rows - released
        return chain.snapshot()
    finally:
        chain.release()  # the snapshot holds its own references; on failure all pages go back


# -- helpers ----------------------------------------------------------------------------
def _released(manifest: dict) -> list[int]:
    """Rows released at the head of each segment (none for files without the field)."""
    return manifest.get("segment_released", [0] * len(manifest["segment_rows"]))


def _layer_names(layout: KVLayout, layer: int) -> tuple[str, ...]:
    if layout.kind == "mha":
        return (f"layers.{layer}.key", f"layers.{layer}.value")
    return (f"layers.{layer}.latent",)


def _tensor_shapes(layout: KVLayout, num_rows: int) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor a snapshot of ``num_rows`` rows holds."""
    row = (layout.num_kv_heads, layout.head_dim) if layout.kind == "mha" else (layout.key_dim,)
    names = [n for layer in range(layout.num_layers) for n in _layer_names(layout, layer)]
    return {name: (num_rows, *row) for name in names}


def _layout_dict(layout: KVLayout) -> dict:
    return {f: str(layout.dtype).removeprefix("torch.") if f == "dtype" else getattr(layout, f)
            for f in _LAYOUT_FIELDS}


def _digest(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's bytes as stored in the file (little-endian, row-major)."""
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy()).hexdigest()


def _dumps(value: dict) -> str:
    """Strict JSON (no NaN or infinity), compact; ASCII-only, so header escaping is simple."""
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"snapshot metadata must be JSON-serialisable: {exc}") from exc


def _check_fingerprint_arg(fingerprint: str) -> None:
    """The fingerprint identifies the model (config + weights); it must be a non-empty string."""
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(f"fingerprint must be a non-empty string, got {fingerprint!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _corrupt(path: Path, detail: str) -> ValueError:
    return ValueError(f"snapshot file {path} is truncated or corrupted: {detail}")
