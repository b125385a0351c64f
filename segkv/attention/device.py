"""DeviceSpec: what the planner needs to know about the device that runs attention."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from segkv.settings import or_default
import segkv.settings as settings


# The CUDA planner's numbers, measured on the H100 and H200 (docs/benchmarks.md, "Decode attention
# kernels against torch SDPA"; docs/performance-notes.md has what else was tried).
# Stage-1 programs per multiprocessor the split planner aims for: stage 1 at (BLOCK_N 64, 4 warps,
# 3 stages) holds about 204 registers and 72 KB of shared memory, so two fit an SM.
CUDA_BLOCKS_PER_SM = 2
# The same for tall decode programs (64 pairs from at most 16 query rows: forks sharing a prefix),
# launched with 32-row tiles under a 168-register cap (paged_attention.default_launch_config): three fit.
CUDA_TALL_BLOCKS_PER_SM = 3
# The same for a full device's waves of lean decode programs (8-16 pairs over 64-row tiles of four
# 16-row pages), which hold about 150 registers, so the driver places three per SM. The planner
# still aims an idle device at CUDA_BLOCKS_PER_SM and re-costs a full one's single pass at this
# (planner._lean_single_pass). 0: off.
CUDA_LEAN_BLOCKS_PER_SM = 3
# The most query rows per work item of a tall decode program (more: a prefill chunk's); the
# launcher's kernels.attention.paged_attention.TALL_DECODE_MAX_ROWS
TALL_DECODE_MAX_ROWS = 16
# Fewest KV rows per partition on CUDA: one BLOCK_N tile, so short contexts at small batches still
# fill the device.
CUDA_MIN_PARTITION_ROWS = 64
# The CUDA planner's automatic ``fast`` precision: plans of prefill programs (prefill_programs)
CUDA_FAST_PREFILL = True
# ... and latent (MLA) plans of this many (query row x head) pairs or more: 128 heads at batch 32
# ran 1.6x exact in fast mode's wide programs split to fill the device, and batch 1 ran slower
# (H100, docs/benchmarks.md); batches between were not measured
CUDA_FAST_LATENT_MIN_PAIRS = 4096
# KV rows per tile of the GQA programs (BLOCK_N): a partition costs its whole tiles, so at equal
# cost the planner takes partitions of whole tiles.
CUDA_KEY_TILE_ROWS = 64
# The same for latent (MLA) attention: one 32-row latent tile.
CUDA_MIN_LATENT_PARTITION_ROWS = 32
# What one more latent partition costs the merge, in KV rows (each query row's merge reads one
# 16-head x 512 float32 partial per partition in turn): a cost of 1 picks about sqrt(context)
# partitions.
CUDA_LATENT_MERGE_ROWS_PER_PARTITION = 1
# What a GQA merge launch costs, in KV rows, when stage 1 cannot merge a decode plan's rows itself.
# 0: not costed (costing it measured slower).
CUDA_MERGE_LAUNCH_ROWS = 0
# Float32 split partials (output + LSE) a plan may need; the Triton backend keeps one buffer of
# this size, so a long history adds no per-step workspace (see DeviceSpec.max_partial_bytes).
PARTIAL_WORKSPACE_BYTES = 64 << 20


@functools.cache
def stage1_merge_bound() -> int:
    """The most partials per row the GQA stage-1 kernel merges itself (0: it never does)."""
    from segkv.kernels.attention.paged_attention import MERGE_IN_STAGE1_MAX_PARTIALS  # needs Triton: imported on use

    return MERGE_IN_STAGE1_MAX_PARTIALS


@dataclass(slots=True, frozen=True)
class DeviceSpec:
    """Parallel capacity of a device, as the attention planner sees it.

    ``num_multiprocessors * blocks_per_multiprocessor`` work items run at once (a "wave");
    ``tall_blocks_per_multiprocessor`` (0: the same) for plans of tall decode programs
    (:func:`tall_decode_programs`). ``lean_blocks_per_multiprocessor`` (0: the same) is how many
    lean decode programs (:func:`lean_decode_programs`) the device holds: the planner re-costs a
    full device's single pass of a few waves of them with it (an idle one still aims at
    ``blocks_per_multiprocessor``).
    ``min_rows_per_partition`` is the fewest KV rows worth giving one partition: below it
    the merge costs more than the parallelism gains (``min_rows_per_latent_partition``: the same
    for latent attention, whose tiles are shorter). ``max_query_rows_per_work`` bounds the
    query rows one stage-1 work item serves (tile height on a GPU). ``partition_overhead_rows`` is
    what a partition costs besides its rows (prologue, epilogue), in KV rows;
    ``latent_merge_rows_per_partition`` what each latent partition adds to the merge, which reads
    the partitions' wide partials one after another. ``max_partial_bytes`` bounds
    the float32 partials a split adds: a many-row query (a prefill chunk) over a long history is
    cut into no more partitions than fit, so the workspace never grows with the history.
    ``merge_launch_rows`` is what a merge launch costs (GQA), in KV rows, for a decode plan (one
    query row per sequence, no shared pieces) with more partials per row than
    ``stage1_merge_max_partials``, the most the stage-1 kernel merges itself (0: none).
    ``key_tile_rows``: KV rows per tile of the GQA programs (not tall decode ones); the planner
    costs their partitions in whole tiles (1: in rows). ``fast_prefill``: the planner's automatic
    precision is ``fast`` for plans of prefill programs (:func:`prefill_programs`), where the
    device's kernels run it faster (measured); ``exact`` everywhere else. ``fast_latent_min_pairs``:
    latent (MLA) plans of at least this many (query row x head) pairs are ``fast`` too, in the
    latent kernel's wide programs (compute-bound many-head batches; 0: never).
    """

    kind: str
    name: str
    num_multiprocessors: int
    blocks_per_multiprocessor: int = 1
    tall_blocks_per_multiprocessor: int = 0
    lean_blocks_per_multiprocessor: int = 0
    min_rows_per_partition: int = 256
    min_rows_per_latent_partition: int = 256
    max_partitions: int = 64
    max_query_rows_per_work: int = 64
    partition_overhead_rows: int = 256
    latent_merge_rows_per_partition: int = 0
    max_partial_bytes: int = PARTIAL_WORKSPACE_BYTES
    merge_launch_rows: int = 0
    stage1_merge_max_partials: int = 0
    key_tile_rows: int = 1
    fast_prefill: bool = False
    fast_latent_min_pairs: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "cuda"):
            raise ValueError(f"DeviceSpec.kind must be 'cpu' or 'cuda', got {self.kind!r}")
        for name in ("num_multiprocessors", "blocks_per_multiprocessor", "min_rows_per_partition",
                     "min_rows_per_latent_partition", "max_partitions", "max_query_rows_per_work", "partition_overhead_rows", "max_partial_bytes",
                     "key_tile_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"DeviceSpec.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("latent_merge_rows_per_partition", "merge_launch_rows", "stage1_merge_max_partials",
                     "tall_blocks_per_multiprocessor", "lean_blocks_per_multiprocessor"):
            if getattr(self, name) < 0:  # 0: not costed / no merge inside stage 1
                raise ValueError(f"DeviceSpec.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def wave_size(self) -> int:
        """Work items the device runs concurrently."""
        return self.num_multiprocessors * self.blocks_per_multiprocessor

    @property
    def tall_wave_size(self) -> int:
        """Work items of tall decode programs (:func:`tall_decode_programs`) the device runs concurrently."""
        return self.num_multiprocessors * (self.tall_blocks_per_multiprocessor or self.blocks_per_multiprocessor)

    @property
    def lean_wave_size(self) -> int:
        """Lean decode programs (:func:`lean_decode_programs`) the device holds at once."""
        return self.num_multiprocessors * (self.lean_blocks_per_multiprocessor or self.blocks_per_multiprocessor)

    @classmethod
    def cpu(cls, *, num_threads: int | None = None) -> DeviceSpec:
        """The CPU: one "multiprocessor" per intra-op thread; pieces run one after another,
        each parallelised inside by torch, so splitting pays only for very long pieces."""
        threads = num_threads or torch.get_num_threads() or os.cpu_count() or 1
        return cls(
            kind="cpu",
            name=f"cpu x{threads}",
            num_multiprocessors=threads,
            blocks_per_multiprocessor=1,
            min_rows_per_partition=16384,
            min_rows_per_latent_partition=16384,
            max_partitions=8,
            max_query_rows_per_work=4096,
            partition_overhead_rows=4096,
        )

    @classmethod
    def cuda(cls, index: int = 0, *, blocks_per_multiprocessor: int | None = None,
             min_rows_per_partition: int | None = None) -> DeviceSpec:
        """A CUDA device, from its properties (multiprocessor count). ``blocks_per_multiprocessor``
        (default ``SEGKV_CUDA_BLOCKS_PER_SM``, else the measured default) sets how many stage-1
        programs per multiprocessor the split planner aims for; ``min_rows_per_partition``
        (default ``SEGKV_CUDA_MIN_PARTITION_ROWS``, else one tile) the shortest partition."""
        props = torch.cuda.get_device_properties(index)
        if blocks_per_multiprocessor is None:
            blocks_per_multiprocessor = or_default(settings.SETTINGS.cuda_blocks_per_sm, CUDA_BLOCKS_PER_SM)
        if min_rows_per_partition is None:
            min_rows_per_partition = or_default(settings.SETTINGS.cuda_min_partition_rows,
                                                CUDA_MIN_PARTITION_ROWS)
        return cls(
            kind="cuda",
            name=props.name,
            num_multiprocessors=props.multi_processor_count,
            blocks_per_multiprocessor=blocks_per_multiprocessor,
            tall_blocks_per_multiprocessor=CUDA_TALL_BLOCKS_PER_SM,
            lean_blocks_per_multiprocessor=CUDA_LEAN_BLOCKS_PER_SM,
            min_rows_per_partition=min_rows_per_partition,
            min_rows_per_latent_partition=or_default(settings.SETTINGS.cuda_min_latent_partition_rows,
                                                     CUDA_MIN_LATENT_PARTITION_ROWS),
            max_partitions=256,
            max_query_rows_per_work=64,
            partition_overhead_rows=256,
            latent_merge_rows_per_partition=CUDA_LATENT_MERGE_ROWS_PER_PARTITION,
            merge_launch_rows=CUDA_MERGE_LAUNCH_ROWS,
            stage1_merge_max_partials=stage1_merge_bound(),
            key_tile_rows=CUDA_KEY_TILE_ROWS,
            fast_prefill=CUDA_FAST_PREFILL,
            fast_latent_min_pairs=CUDA_FAST_LATENT_MIN_PAIRS,
        )

    @classmethod
    def detect(cls, device: str | torch.device) -> DeviceSpec:
        device = torch.device(device)
        if device.type == "cuda":
            return cls.cuda(device.index or 0)
        if device.type == "cpu":
            return cls.cpu()
        raise ValueError(f"no attention backend for device type {device.type!r}")


def tall_decode_programs(max_work_rows: int, group_size: int, head_dim: int) -> bool:
    """Whether the GQA stage-1 launch of a plan whose work items hold up to ``max_work_rows`` query
    rows takes tall decode programs: 64 (row, head) pairs (the launcher's ``BLOCK_M`` for more than
    32 pairs with heads of at most 128, ``paged_attention.stage1_launch``) from at most
    :data:`TALL_DECODE_MAX_ROWS` rows, the decode rows of forks that share a prefix."""
    return head_dim <= 128 and max_work_rows * group_size > 32 and max_work_rows <= TALL_DECODE_MAX_ROWS


def prefill_programs(max_work_rows: int, shape_dims: tuple[int, int], latent: bool) -> bool:
    """Whether the stage-1 launch of a plan whose work items hold up to ``max_work_rows`` query rows
    takes prefill programs: GQA work items of more than :data:`TALL_DECODE_MAX_ROWS` rows with
    values of at most 128 columns and keys of at most 256 (the launcher's
    ``paged_attention.prefill_programs``: 128-pair tiles that stop at their causal end).
    ``shape_dims``: the key and value widths."""
    key_dim, value_dim = shape_dims
    return not latent and max_work_rows > TALL_DECODE_MAX_ROWS and value_dim <= 128 and key_dim <= 256


def lean_decode_programs(max_work_rows: int, group_size: int, head_dim: int, page_size: int,
                         key_tile_rows: int) -> bool:
    """Whether the GQA stage-1 launch of a plan whose work items hold up to ``max_work_rows`` query
    rows takes lean decode programs: 8-16 (row, head) pairs (one 16-row M tile) over
    ``key_tile_rows``-row tiles of four pages with their page entries as scalars
    (the GQA stage 1's ``FOUR``, ``paged_attention.stage1_launch``)."""
    pairs = max_work_rows * group_size
    # heads of 128 only: the programs whose occupancy the driver was asked about
    return head_dim == 128 and 8 <= pairs <= 16 and key_tile_rows == 4 * page_size
