"""Host time of a CUDA-graph decode step, without a GPU: the part before the replay (the GPU
waits for it) and the whole step (planning ahead runs after the replay is launched).

The graph step is emulated and its replay replaced by a clock read, so only the runner's host
work is timed: queries, planning (or the plan made ahead), index staging, input staging. A tiny
Llama checkpoint is built in ``--dir``; planning uses an H200-like device spec (132 SMs x 2), so
the plans split as on the GPU.

    python3 scripts/host_step_time.py --batch 32 --context 16384
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from model_helpers import build_model_dir  # noqa: E402

from segkv.attention.device import DeviceSpec  # noqa: E402
from segkv.engine import LLM  # noqa: E402
from segkv.runner.model_runner import StepInput  # noqa: E402

H200_LIKE = DeviceSpec(kind="cuda", name="H200-like", num_multiprocessors=132, blocks_per_multiprocessor=2,
                       min_rows_per_partition=64, max_partitions=256, max_query_rows_per_work=64,
                       partition_overhead_rows=256)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--dir", type=Path, default=Path("/tmp/segkv-host-step-model"))
    p.add_argument("--sealed", action="store_true", help="seal the history first (a conversation's earlier turns)")
    args = p.parse_args()
    if not (args.dir / "config.json").exists():
        args.dir.mkdir(parents=True, exist_ok=True)
        build_model_dir(args.dir, "llama", max_position_embeddings=131072)
    pages = args.batch * (args.context // 16 + args.steps // 16 + 8) + 8
    llm = LLM(args.dir, device="cpu", dtype="float32", backend="triton", page_size=16, num_pages=pages,
              cuda_graphs="emulate")
    runner = llm.runner
    runner.device_spec = runner.graphs.device_spec = H200_LIKE
    chains = [llm.cache.new_chain() for _ in range(args.batch)]
    for chain in chains:
        chain.append(args.context)
        if args.sealed:  # a history sealed as a conversation's earlier turns are; new rows go to a tail
            chain.seal()
    tokens = list(range(1, args.batch + 1))
    runner.forward([StepInput(c, [t]) for c, t in zip(chains, tokens)])  # captures (emulated)
    bucket = next(iter(runner.graphs._buckets.values()))
    marks: list[float] = []
    bucket.step = lambda: marks.append(time.perf_counter())  # the replay: no model work
    before, whole = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        runner.forward([StepInput(c, [t]) for c, t in zip(chains, tokens)])
        whole.append(time.perf_counter() - start)
        before.append(marks[-1] - start)
    print(f"batch {args.batch}, context {args.context}{' sealed' if args.sealed else ''}: host before the replay {statistics.median(before) * 1e3:.3f} ms "
          f"[{min(before) * 1e3:.3f}-{max(before) * 1e3:.3f}], whole step {statistics.median(whole) * 1e3:.3f} ms; "
          f"plans made ahead and used: {getattr(runner, 'plans_ahead_used', 0)} of {args.steps}")


if __name__ == "__main__":
    main()
