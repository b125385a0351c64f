"""The steps of a tensor-parallel model: rank 0 plans each forward and broadcasts its inputs;
every other rank runs the same forward on its shard (its all-reduces meet rank 0's).

A step is ``("cache", (page_size, num_pages, options))``: a new KV cache of that size (and a
runner over it, with rank 0's ``options``: CUDA graphs, the length they are sized for) replaces the
rank's (the profiling pass's scratch pool, then the engine's),
``("graph", (ids, positions, slots, plan, mla_mode, windowed, on_device))``: a decode step rank 0's
graphs may replay, replayed from the rank's own (token ids ``on_device`` follow by
:func:`broadcast_tensor`), ``("warm", (size, mla_mode))``: capture the graphs of a bucket,
``("forward", (chunks, positions, slots, plan, mla_mode, rows, windowed))``, the
arguments of ``ModelRunner._eager_logits`` (token ids on the host; plans are plain
dataclasses), ``("copy", (src, dst))``: rows copied between slots of every layer (compaction),
``("read", (layer, slots))``: every rank's rows at those slots gathered on rank 0 (a snapshot
file holds every KV head), or ``("write", (layer, slots, parts))``: the whole rows of a loaded
file, each rank writing its heads. ``None`` stops the followers. Broadcasts go through
``torch.distributed.broadcast_object_list`` over the ranks' host group (gloo: the objects stay
on the host beside NCCL's collectives), bounded by the group's timeout: a rank that died makes
the others raise instead of waiting.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from segkv.distributed.parallel import TensorParallel
from segkv.models.tensor_parallel import kv_heads_of


def broadcast_step(tp: TensorParallel, step: tuple | None) -> None:
    """Rank 0: send the next step (None: stop) to every other rank."""
    dist.broadcast_object_list([step], src=0, group=tp.host_group)


def broadcast_tensor(tp: TensorParallel, tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``tensor`` into every rank's ``tensor`` (same shape and dtype, on each rank's
    device), over the model's group: on GPUs a device-to-device broadcast the host does not wait for."""
    dist.broadcast(tensor, src=0, group=tp.group)
    return tensor


def receive_step(tp: TensorParallel) -> tuple | None:
    """Another rank: the next step rank 0 sent (None: stop)."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=tp.host_group)
    return box[0]


def follow_steps(runner, tp: TensorParallel | None = None, new_runner: Callable[..., Any] | None = None) -> int:
    """Run the steps rank 0 broadcasts on ``runner`` (a ``ModelRunner`` over this rank's shard
    and cache; None before a "cache" step) until it sends None; returns how many ran.
    ``new_runner(page_size, num_pages, **options)``: the runner over a new cache, for "cache" steps. ``tp``:
    the group (default: the runner's model's)."""
    tp = tp or runner.model.tp
    count = 0
    with torch.inference_mode():
        while (step := receive_step(tp)) is not None:
            runner = apply_step(runner, tp, step, new_runner)
            count += 1
    return count


def apply_step(runner, tp: TensorParallel, step: tuple, new_runner: Callable[..., Any] | None = None):
    """Run one step rank 0 broadcast (not None) on ``runner``; returns the runner from then on
    (a new one after a "cache" step). ValueError for an unknown step."""
    kind, args = step
    if kind == "cache":
        if new_runner is None:
            raise ValueError("this rank cannot build a KV cache: it follows one runner")
        runner = None  # the old cache goes before the new one is allocated
        gc.collect()
        page_size, num_pages, options = args
        return new_runner(page_size, num_pages, **options)
    if kind == "forward":
        runner.run_followed_step(args)
    elif kind == "graph":
        runner.run_followed_graph(args)
    elif kind == "warm":
        size, mla_mode = args
        runner.graphs.warm(size, mla_mode)
    elif kind == "copy":
        runner.cache.storage.copy_rows(*args)
    elif kind == "read":
        _gather_rows(tp, runner.cache.storage.read(*args))
    elif kind == "write":
        layer, slots, parts = args
        storage = runner.cache.storage
        storage.write(layer, slots, *(part.to(storage.device)
                                      for part in _own_heads(parts, tp, runner.model.whole_num_kv_heads)))
    else:
        raise ValueError(f"unknown tensor-parallel step {kind!r}")
    return runner


def install_row_files(cache, tp: TensorParallel, whole_layout) -> None:
    """Rank 0: snapshot files of a sharded K/V cache hold every KV head (``whole_layout``, the
    model's): reading gathers each rank's heads, writing sends each rank its own. A file is the
    same whatever the number of ranks that saved or loads it. A latent (MLA) cache is the same on
    every rank: read on rank 0, written on all."""
    storage = cache.storage
    num_kv_heads = whole_layout.num_kv_heads if whole_layout.kind == "mha" else None

    def read_rows(layer, slots) -> tuple[torch.Tensor, ...]:
        if whole_layout.kind != "mha":
            return storage.read(layer, slots)
        broadcast_step(tp, ("read", (layer, list(map(int, slots)))))
        parts = _gather_rows(tp, storage.read(layer, slots))
        ranks = _first_rank_of_each_head(num_kv_heads, tp.size)
        return tuple(torch.cat([parts[r][i] for r in ranks], dim=1) for i in range(2))

    def write_rows(layer, slots, *parts) -> None:
        host = [p.cpu() for p in parts]
        broadcast_step(tp, ("write", (layer, list(map(int, slots)), host)))
        storage.write(layer, slots, *_own_heads(parts, tp, num_kv_heads))

    cache.file_layout, cache.read_rows, cache.write_rows = whole_layout, read_rows, write_rows


def _first_rank_of_each_head(num_kv_heads: int, size: int) -> list[int]:
    """Ranks whose KV heads, concatenated in this order, are every head once, in order."""
    ranks, seen = [], set()
    for rank in range(size):
        heads = kv_heads_of(rank, num_kv_heads, size)
        if heads[0] not in seen:
            ranks.append(rank)
            seen.update(heads)
    return ranks


def _own_heads(parts, tp: TensorParallel, num_kv_heads: int | None) -> tuple[torch.Tensor, ...]:
    """This rank's heads of whole K/V rows ``(n, heads, d)`` (a latent cache, ``num_kv_heads``
    None: the whole row)."""
    if num_kv_heads is None:
        return tuple(parts)
    heads = kv_heads_of(tp.rank, num_kv_heads, tp.size)
    return tuple(p[:, heads.start : heads.stop] for p in parts)


def _gather_rows(tp: TensorParallel, rows: tuple[torch.Tensor, ...]) -> list | None:
    """Every rank's ``rows`` on rank 0 (rank order; None elsewhere)."""
    out = [None] * tp.size if tp.rank == 0 else None
    dist.gather_object(tuple(r.cpu() for r in rows), out, dst=0, group=tp.host_group)
    return out


def broadcasting_copier(tp: TensorParallel, copy_rows):
    """Rank 0's row copier: every rank copies the same slots of its own heads, then rank 0."""

    def copy(src, dst) -> None:
        broadcast_step(tp, ("copy", (list(src), list(dst))))
        copy_rows(src, dst)

    return copy
