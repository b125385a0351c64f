"""The steps of a tensor-parallel model: rank 0 plans each forward and broadcasts its inputs;
every other rank runs the same forward on its shard (its all-reduces meet rank 0's).

A step is ``("forward", (chunks, positions, slots, plan, mla_mode, rows, windowed))``, the
arguments of ``ModelRunner._eager_logits`` (token ids on the host; plans are plain
dataclasses), or ``("copy", (src, dst))``: rows copied between slots of every layer (compaction).
``None`` stops the followers. Broadcasts go through ``torch.distributed.broadcast_object_list``, bounded
by the group's timeout: a rank that died makes the others raise instead of waiting.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from segkv.distributed.parallel import TensorParallel


def broadcast_step(tp: TensorParallel, step: tuple | None) -> None:
    """Rank 0: send the next step (None: stop) to every other rank."""
    dist.broadcast_object_list([step], src=0, group=tp.group)


def receive_step(tp: TensorParallel) -> tuple | None:
    """Another rank: the next step rank 0 sent (None: stop)."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=tp.group)
    return box[0]


def follow_steps(runner) -> int:
    """Run the steps rank 0 broadcasts on ``runner`` (a ``ModelRunner`` over this rank's shard
    and cache) until it sends None; returns how many ran."""
    tp = runner.model.tp
    count = 0
    with torch.inference_mode():
        while (step := receive_step(tp)) is not None:
            kind, args = step
            if kind == "forward":
                runner.run_followed_step(args)
            elif kind == "copy":
                runner.cache.storage.copy_rows(*args)
            else:
                raise ValueError(f"unknown tensor-parallel step {kind!r}")
            count += 1
    return count


def broadcasting_copier(tp: TensorParallel, copy_rows):
    """Rank 0's row copier: every rank copies the same slots of its own heads, then rank 0."""

    def copy(src, dst) -> None:
        broadcast_step(tp, ("copy", (list(src), list(dst))))
        copy_rows(src, dst)

    return copy
