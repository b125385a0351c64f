"""The ranks of a tensor-parallel engine on one host: rank 0 is the engine (scheduler,
tokenizer, sampler, server); ranks 1..N-1 are processes that each load their shard, build a KV
cache of rank 0's size and run the forwards rank 0 broadcasts (``runner/tp_steps.py``). On CUDA
each rank takes one GPU (rank r of a host: ``cuda:r``) and the model's collectives run over
NCCL; on the CPU over gloo."""

from __future__ import annotations

import logging
import multiprocessing
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import segkv.settings as settings
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig
from segkv.distributed.parallel import TensorParallel, init_tensor_parallel, rank_device
from segkv.config import resolve_dtype
from segkv.engine.devices import parse_device
from segkv.models.default_models import check_model_dir, resolve_model_dir
from segkv.models.loader import load_model, read_config
from segkv.runner.model_runner import ModelRunner
from segkv.runner.tp_steps import broadcast_step, follow_steps

logger = logging.getLogger(__name__)


def launched_rank() -> tuple[int, int] | None:
    """``(rank, size)`` when torchrun started this process (``RANK``, ``WORLD_SIZE``), else None."""
    s = settings.SETTINGS
    if s.launcher_rank is None or s.launcher_world_size is None:
        return None
    return s.launcher_rank, s.launcher_world_size


def local_rank(rank: int) -> int:
    """``rank``'s place on its host: torchrun's ``LOCAL_RANK`` when it started this process, else
    ``rank`` (segkv spawns every rank on one host)."""
    launched = settings.SETTINGS.launcher_local_rank
    return rank if launched_rank() is None or launched is None else launched


def follow_as_launched_rank(model: str, *, dtype: str = "auto", device: str = "auto", backend: str = "auto") -> None:
    """A rank other than 0 that torchrun started (``segkv serve|generate|chat`` on every host):
    resolve the model, device and dtype as rank 0's ``LLM`` does, load the shard and follow rank
    0's steps until it stops (the group set up from torchrun's environment)."""
    rank, size = launched_rank()
    model_dir = check_model_dir(resolve_model_dir(model))
    device_ = parse_device(device)
    config = read_config(model_dir)
    dtype_ = resolve_dtype(dtype, device_type=device_.type,
                           checkpoint_dtype=config.get("torch_dtype", config.get("dtype")))
    _follower_main(rank, size, str(model_dir), dtype_, str(rank_device(device_, local_rank(rank))), backend,
                   "env://")


class TensorParallelRanks:
    """Ranks 1..size-1 as processes (spawned), and rank 0's membership of their group.

    ``model_dir``/``dtype``/``device``/``backend``: what every follower loads and runs (a CUDA
    ``device``: each rank its own GPU, :func:`rank_device`; rank 0 the first).
    :meth:`start_followers` hands them the cache size once rank 0 knows it; :meth:`close` stops
    them (safe to call twice; also run when the owner is collected or the interpreter exits).

    A watchdog thread checks the followers every second: when one ends before :meth:`close`,
    :attr:`failure` says which and how, and ``on_failure`` (if set; a server sets it to exit) is
    called with that text. Rank 0's next collective then fails too (gloo reports the lost peer),
    so no step waits on a dead rank."""

    def __init__(self, size: int, model_dir: str | Path, *, dtype: torch.dtype, device: torch.device,
                 backend: str) -> None:
        if size < 2:
            raise ValueError(f"tensor_parallel_size must be >= 2 for ranks, got {size}")
        self.size = size
        launched = launched_rank()
        if launched is not None:  # torchrun started every rank (across hosts): none to spawn
            if launched != (0, size):
                raise ValueError(f"torchrun started rank {launched[0]} of {launched[1]}: the engine runs on rank 0 "
                                 f"with --tensor-parallel-size {launched[1]} (not {size})")
            init_method, self.processes = "env://", []
        else:
            self._dir = tempfile.mkdtemp(prefix="segkv-tp-")
            init_method = f"file://{self._dir}/rendezvous"
            devices = [rank_device(device, rank) for rank in range(size)]  # refused before any starts
            ctx = multiprocessing.get_context("spawn")
            self.processes = [ctx.Process(target=_follower_main, daemon=True, name=f"segkv-tp-rank-{rank}",
                                          args=(rank, size, str(model_dir), dtype, str(devices[rank]), backend,
                                                init_method))
                              for rank in range(1, size)]
        for process in self.processes:
            process.start()
        self.tp: TensorParallel = init_tensor_parallel(size, 0, init_method=init_method,
                                                       device=rank_device(device, local_rank(0)))
        self._closed = False
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        threading.Thread(target=self._watch, name="segkv-tp-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while not self._closed:
            dead = [p for p in self.processes if not p.is_alive()]
            if dead and not self._closed:
                self.failure = ", ".join(f"tensor-parallel {p.name} (pid {p.pid}) ended with exit code {p.exitcode}"
                                         for p in dead)
                logger.error("%s", self.failure)
                if self.on_failure is not None:
                    self.on_failure(self.failure)
                return
            threading.Event().wait(1.0)

    def kill(self) -> None:
        """End every follower at once (a rank failed: the group cannot go on)."""
        self._closed = True
        for process in self.processes:
            if process.is_alive():
                process.kill()

    def start_followers(self, page_size: int, num_pages: int, **options) -> None:
        """Tell the followers the KV cache's size (rank 0's, in pages of its layout): each builds
        its own (replacing one it had: the profiling pass's) and a runner over it with rank 0's
        ``options`` (``cuda_graphs``, ``max_model_len``), and follows the steps over it."""
        broadcast_step(self.tp, ("cache", (page_size, num_pages, options)))

    def close(self) -> None:
        """Stop the followers (their step loops end, or they stop before their first), wait for
        them, leave the group."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.failure is None:  # a lost rank cannot take the message
                broadcast_step(self.tp, None)
        except RuntimeError as exc:
            logger.warning("stopping the tensor-parallel ranks: %s", exc)
        finally:
            for process in self.processes:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
            if dist.is_initialized():
                dist.destroy_process_group()


def runner_builder(model, dtype: torch.dtype, device: torch.device | str, backend: str = "auto"):
    """``build(page_size, num_pages, **options)``: a runner over a new KV cache of that size for this
    rank's shard ``model`` (``options``: rank 0's ``cuda_graphs``, ``max_model_len``, ...; fused ops
    on CUDA, as rank 0's), what a "cache" step builds (``runner/tp_steps.py``)."""
    device = torch.device(device)

    def build(page_size: int, num_pages: int, **options) -> ModelRunner:
        if device.type == "cuda":  # the old cache's memory is free before the new one is made
            torch.cuda.empty_cache()
        cache = PagedKVCache(model.kv_layout(dtype), CacheConfig(page_size=page_size, num_pages=num_pages),
                             device=device)
        return ModelRunner(model, cache, device=device, **{"backend": backend, **options})

    return build


def _follower_main(rank: int, size: int, model_dir: str, dtype: torch.dtype, device: str, backend: str,
                   init_method: str) -> None:
    """Rank ``rank``: load the shard, then follow rank 0's steps (over the caches it sizes) until
    told to stop."""
    tp = init_tensor_parallel(size, rank, init_method=init_method, device=device)
    model = load_model(model_dir, dtype=dtype, device=device, tensor_parallel=tp)
    steps = follow_steps(None, tp, runner_builder(model, dtype, device, backend))
    logger.debug("tensor-parallel rank %d ran %d steps (pid %d)", rank, steps, os.getpid())
    dist.destroy_process_group()
