"""A tensor-parallel group: which shard this process holds and the collectives a sharded model
runs (NCCL on GPUs, gloo on CPUs), each bounded by the group's timeout."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# A collective that waits longer than this means a rank died or hung: the survivors raise
# instead of waiting forever.
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """Rank ``rank`` of ``size`` processes that each hold ``1/size`` of a model.

    ``group``: the torch.distributed process group of the model's collectives (None: the default
    group; unused at size 1). ``host_group``: the group that carries Python objects between the
    ranks (a step's inputs; gloo beside NCCL; None: the default group). Tensors handed to the
    collectives are ``(..., D)`` of any dtype the backend reduces, on the rank's device."""

    rank: int = 0
    size: int = 1
    group: Any = None
    host_group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} of size {self.size} is not a rank")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, in place (every rank gets it)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x (..., D)`` side by side: ``(..., size * D)``, rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def split(self, total: int, what: str) -> int:
        """``total / size``; ValueError naming ``what`` when the ranks cannot share it evenly."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) must be divisible by the tensor parallel size {self.size}")
        return total // self.size


def init_tensor_parallel(size: int, rank: int, *, init_method: str, device: torch.device | str = "cpu",
                         timeout_s: float = DEFAULT_TIMEOUT_S) -> TensorParallel:
    """Join the ``size``-process group as ``rank`` (``init_method``: torch.distributed's, e.g.
    ``tcp://host:port`` or ``file:///path``). On a CUDA ``device`` (this rank's GPU) the model's
    collectives run over NCCL and Python objects over a gloo group beside it; on the CPU both
    over gloo. Collectives that wait past ``timeout_s`` raise."""
    device = torch.device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator binds to the current device
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method,
                                world_size=size, rank=rank, timeout=timeout)
    host_group = dist.new_group(backend="gloo", timeout=timeout) if device.type == "cuda" else None
    return TensorParallel(rank=rank, size=size, group=None, host_group=host_group)


def rank_device(device: torch.device | str, local_rank: int) -> torch.device:
    """The device of the rank ``local_rank`` of its host: ``cuda:<local_rank>`` for CUDA (ranks
    on one host take one GPU each, in order), the CPU as it is. ValueError for a CUDA device with
    an index (the ranks choose theirs; ``CUDA_VISIBLE_DEVICES`` chooses the GPUs) or too few GPUs."""
    device = torch.device(device)
    if device.type != "cuda":
        return device
    if device.index is not None:
        raise ValueError(f"tensor-parallel ranks take one GPU each from cuda:0 on: give the device as 'cuda', "
                         f"not {device} (CUDA_VISIBLE_DEVICES chooses the GPUs)")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"tensor-parallel rank {local_rank} of this host needs GPU {local_rank}, and "
                         f"{torch.cuda.device_count()} are visible")
    return torch.device("cuda", local_rank)
