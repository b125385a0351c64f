"""Programmatic dependent launch (PDL) for chains of Triton kernels on Hopper and later GPUs.

A kernel launched with ``launch_pdl`` may be scheduled while the kernel before it in the stream
is still running; it must wait (``gdc_wait``) before reading anything that kernel (or any earlier
one) writes, and may load constant data (weights) before the wait, so that data's memory latency
overlaps the previous kernel's tail. A kernel that calls ``gdc_launch_dependents`` lets the next
one be scheduled from then on; the kernels here call it right after their own wait. Each
kernel takes a ``USE_PDL`` constexpr; :func:`pdl_options` gives it with the launch option.

A program with nothing to do may leave before the wait, but never all of a launch's programs:
the next kernel's wait covers only this launch, so at least one program of every launch waits,
and a launch thus ends only after the one before it has (the merge keeps its program (0, 0, 0)
for that when no row needs merging).
"""

from __future__ import annotations

import functools

import torch
from segkv.kernels.triton_import import tl, triton

import segkv.settings as settings

_INTERPRET = settings.SETTINGS.triton_interpret


@functools.lru_cache(maxsize=None)
def pdl_supported(device_index: int) -> bool:
    """Whether device ``device_index`` and this Triton support PDL (capability 9.0 or later, a
    Triton with ``launch_pdl`` and ``gdc_wait``)."""
    if _INTERPRET or not torch.cuda.is_available():
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda as tl_cuda
    except ImportError:
        return False
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return ("launch_pdl" in fields and hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents")
            and capability_major(device_index) >= 9)


@functools.cache
def capability_major(device_index: int) -> int:
    """The major compute capability of CUDA device ``device_index`` (9: Hopper), asked once."""
    return torch.cuda.get_device_capability(device_index)[0]


@functools.cache
def multiprocessors(device_index: int) -> int:
    """The multiprocessor count of CUDA device ``device_index``, asked once."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pdl_options(tensor: torch.Tensor, pdl: bool | None = None) -> dict:
    """``launch_pdl`` and the ``USE_PDL`` constexpr for a launch on ``tensor``'s device: where
    :func:`pdl_supported` says so, or as ``pdl`` forces it (tests and sweeps)."""
    on = (tensor.is_cuda and pdl_supported(tensor.device.index or 0)) if pdl is None else pdl
    return {"launch_pdl": True, "USE_PDL": True} if on else {"USE_PDL": False}


@triton.jit
def wait_then_release(USE_PDL: tl.constexpr):
    """With ``USE_PDL``: wait for the launch before (whose outputs the program reads next), then
    let the next launch be scheduled; nothing otherwise."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
