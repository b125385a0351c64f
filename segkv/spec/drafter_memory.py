"""The device memory a separate drafter (a draft model, an EAGLE-3 head) will take, estimated before it loads."""

from __future__ import annotations

from pathlib import Path

import torch

from segkv.models.default_models import check_model_dir, resolve_model_dir
from segkv.models.loader import checkpoint_weight_bytes
from segkv.spec.config import MODEL_METHODS, SpeculativeConfig
from segkv.spec.draft_model import DEFAULT_DRAFT_CACHE_BYTES
from segkv.spec.eagle3 import DEFAULT_HEAD_CACHE_BYTES, resolve_head_dir

# What a drafter holds beyond its weights and cache pool. Its forwards run between the target's,
# once the target's step has freed its activations, so the caching allocator serves them from
# blocks the target's profiled peak already counts. What stays allocated is small next to a pool:
# the drafter runner's persistent buffers (page tables, slot and position indices), its CUDA
# graphs' private pools (decode-sized steps: a few rows of hidden, MLP and logit activations), an
# EAGLE-3 proposer's recorded auxiliary hidden states (three hidden vectors per target row awaiting
# its next token), and allocator fragmentation. 256 MiB, the target budget's own margin, covers
# these for drafters of a few billion parameters.
DRAFTER_MARGIN_BYTES = 256 << 20


def drafter_bytes(config: SpeculativeConfig | None, *, dtype: str | torch.dtype,
                  target_dir: str | Path | None = None) -> int:
    """The bytes the drafter of ``config`` takes on the target's device once loaded: its weights
    in ``dtype`` (the target's, which the drafter loads in) from its checkpoint's headers, the
    cache pool its proposer allocates (``DEFAULT_DRAFT_CACHE_BYTES`` for ``draft_model``,
    ``DEFAULT_HEAD_CACHE_BYTES`` for ``eagle3``: the proposers' defaults, which the generator
    keeps; a pool is whole pages of at most those bytes) and :data:`DRAFTER_MARGIN_BYTES`.

    The target's KV pool is sized before the drafter loads, so the pool must leave this free.
    0 without speculation or for methods without a model of their own (``mtp``'s layers are
    the target's weights; ``ngram`` has none). ``target_dir``: where an ``eagle3`` model
    ``"default"`` is looked up (``resolve_head_dir``). A bad directory raises the error the
    proposer would, before anything loads."""
    if config is None or config.method not in MODEL_METHODS:
        return 0
    if config.method == "draft_model":
        directory, cache = check_model_dir(resolve_model_dir(config.model)), DEFAULT_DRAFT_CACHE_BYTES
    else:
        directory, cache = resolve_head_dir(config.model, target_dir), DEFAULT_HEAD_CACHE_BYTES
    return checkpoint_weight_bytes(directory, dtype=dtype) + cache + DRAFTER_MARGIN_BYTES
