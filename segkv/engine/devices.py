"""The torch device a user names, checked against this machine."""

from __future__ import annotations

import torch


def parse_device(device: str | torch.device) -> torch.device:
    """The torch device for ``device`` ("auto": CUDA when available, else the CPU; "cpu", "cuda",
    "cuda:1", ...), refused with a clear error
    when torch does not know it or it is not on this machine (a CUDA device without a CUDA build
    of torch or a visible GPU, or past the last GPU)."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}: {exc}") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} is not available: torch {torch.__version__} "
                             f"{'has no CUDA support' if torch.version.cuda is None else 'sees no GPU'}")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} is not available: {torch.cuda.device_count()} GPU(s) visible")
    elif parsed.type != "cpu":
        raise ValueError(f"device {device!r} is not supported: 'cpu' or 'cuda' (e.g. 'cuda:0')")
    return parsed
