"""Small host-to-device transfers that do not wait for the GPU.

``torch.tensor(values, device="cuda")`` (or ``.to("cuda")`` from ordinary host memory) copies and
then synchronises the stream: the host stops until every queued kernel has run. In a decode step
that stall lets the GPU run dry while the host catches up. Copying from page-locked memory with
``non_blocking=True`` queues the copy behind the queued work instead (PyTorch's pinned-memory
allocator keeps the host buffer alive until the copy ran).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence | torch.Tensor, dtype: torch.dtype,
              device: torch.device | str) -> torch.Tensor:
    """``values`` (a list, nested lists, or a host tensor) as a ``dtype`` tensor on ``device``,
    without synchronising the stream when the device is a GPU."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def select_rows(tensor: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """``tensor[rows]`` along dimension 0 without a stream synchronisation: the tensor itself when
    ``rows`` are all of its rows in order, a view when they are consecutive, else a gather."""
    rows = list(rows)
    if rows == list(range(tensor.shape[0])):
        return tensor
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return tensor[rows[0]:rows[0] + len(rows)]
    return tensor.index_select(0, to_device(rows, torch.long, tensor.device))


class HostCopy:
    """A device tensor's values on their way to the host, queued now, read later with
    :meth:`tolist`, which waits for this copy only (``tensor.tolist()`` waits for every kernel
    queued on the stream, including ones launched after the values were ready)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cuda":
            self._host, self._ready = tensor.detach().clone(), None
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def tolist(self) -> list:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()
