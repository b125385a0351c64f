"""Files that are whole or absent: safetensors written under a temporary name, fsynced and
renamed over their path (snapshot files, the disk tier's segment files)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

# the prefix and suffix of a file being written; a name like this is never a finished file
TEMP_PREFIX = "."
TEMP_SUFFIX = ".tmp"


def atomic_save_file(path: Path, tensors: dict[str, torch.Tensor], header: dict[str, str]) -> None:
    """Write ``tensors`` (CPU, contiguous) and ``header`` to a temporary file in ``path``'s
    directory, fsync it, then rename it over ``path``: readers see the old file or the new one,
    never part of one, and a failed write (an OSError, an interrupt) leaves no temporary file.
    A directory under ``path`` is a ValueError."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{TEMP_PREFIX}{path.name}.", suffix=TEMP_SUFFIX)
    except OSError as exc:  # name the file asked for, not the temp file beside it
        raise type(exc)(exc.errno, f"cannot write {str(path)!r}: {exc.strerror}") from None
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=header)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, IsADirectoryError):  # a directory appeared under the name meanwhile
            raise ValueError(f"cannot write {path}: it is a directory") from None
        raise
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    """Make a rename inside ``directory`` durable, where the platform can fsync a directory."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # e.g. Windows, some network file systems
            os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def is_temporary(name: str) -> bool:
    """Whether ``name`` is a file :func:`atomic_save_file` was still writing (never trusted):
    its own temporary name, or the ``.tmp*`` one safetensors writes before renaming onto it."""
    return name.startswith(TEMP_PREFIX) and (name.endswith(TEMP_SUFFIX) or name.startswith(".tmp"))
