"""Where the GPU waits between decode steps: idle gaps in a Chrome trace of graph steps
(``scripts/profile_decode.py --trace T.json``) and the host events that overlap them.

Prints each GPU idle gap longer than ``--min-us`` (between the end of one kernel or copy and the
start of the next), then, summed over all gaps, the host events that ran during them (torch ops and
CUDA runtime calls, by name: total overlapped microseconds and count).

    python3 scripts/trace_gaps.py T.json --min-us 20

``--kernels``: instead, the GPU's busy time by kernel name (count, total, mean) and the small gaps
(shorter than ``--min-us``) between one kernel's end and the next one's start, summed: what the
kernel boundaries inside graph replays cost. ``--by-grid`` names each kernel with its launch grid,
so launches of one kernel at different sizes (an expert GEMV's gate/up and down products) are
counted apart.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATEGORIES = {"cpu_op", "cuda_runtime", "cuda_driver", "python_function", "user_annotation"}


def gpu_gaps(events: list[dict], min_us: float) -> list[tuple[float, float]]:
    """``(start, end)`` of the intervals longer than ``min_us`` in which no GPU event ran."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in GPU_CATEGORIES)
    gaps, busy_until = [], None
    for start, end in spans:
        if busy_until is not None and start - busy_until > min_us:
            gaps.append((busy_until, start))
        busy_until = end if busy_until is None else max(busy_until, end)
    return gaps


def kernel_label(event: dict, by_grid: bool) -> str:
    """The event's name, with its launch grid (``args.grid`` of torch's trace) when ``by_grid``."""
    grid = event.get("args", {}).get("grid") if by_grid else None
    return f"{event['name']} grid={tuple(grid)}" if grid else event["name"]


def kernel_summary(events: list[dict], min_us: float, rows: int, by_grid: bool = False) -> None:
    """Print busy time by kernel name (and grid, ``by_grid``) and the sum of the inter-kernel gaps
    below ``min_us``."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0), kernel_label(e, by_grid)) for e in events
                   if e.get("cat") in GPU_CATEGORIES)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    small_gaps, count, busy_until = 0.0, 0, None
    for start, end, name in spans:
        by_name[name][0] += end - start
        by_name[name][1] += 1
        if busy_until is not None and 0 < start - busy_until < min_us:
            small_gaps += start - busy_until
            count += 1
        busy_until = end if busy_until is None else max(busy_until, end)
    busy = sum(us for us, _ in by_name.values())
    print(f"GPU busy {busy:.0f} us over {len(spans)} kernels/copies; {count} gaps under {min_us:g} us "
          f"sum to {small_gaps:.0f} us")
    for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:rows]:
        print(f"  {us:9.1f} us {100 * us / busy:5.1f}%  {n:5d} x {us / n:7.2f} us  {name[:110]}")
    # With programmatic dependent launch a kernel starts while the one before it runs, so its span
    # counts that overlap twice. Along a chain each kernel ends after the one before: the time from
    # the previous end to its own end is what it adds to the step.
    # (Idle time before a kernel's start is left out: that is the gaps above.)
    added: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    last_end = None
    for start, end, name in sorted(spans, key=lambda s: s[1]):
        if last_end is not None:
            added[name][0] += end - max(last_end, start)
            added[name][1] += 1
        last_end = end
    total = sum(us for us, _ in added.values())
    print(f"busy end to end: {total:.0f} us; by the kernel that ends (its end minus the previous end or its start)")
    for name, (us, n) in sorted(added.items(), key=lambda kv: -kv[1][0])[:rows]:
        print(f"  {us:9.1f} us {100 * us / total:5.1f}%  {n:5d} x {us / n:7.2f} us  {name[:110]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--min-us", type=float, default=20.0)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--kernels", action="store_true", help="busy time by kernel and the small gaps between kernels")
    p.add_argument("--by-grid", action="store_true", help="with --kernels: each kernel's launch grids apart")
    args = p.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    if args.kernels:
        kernel_summary(events, args.min_us, args.rows, args.by_grid)
        return
    gaps = gpu_gaps(events, args.min_us)
    print(f"{len(gaps)} GPU idle gaps over {args.min_us:g} us: "
          + ", ".join(f"{(end - start):.0f}" for start, end in gaps) + " us")
    overlap: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("cat") not in HOST_CATEGORIES or "dur" not in e:
            continue
        start, end = e["ts"], e["ts"] + e["dur"]
        for g0, g1 in gaps:
            shared = min(end, g1) - max(start, g0)
            if shared > 0:
                overlap[e["name"]][0] += shared
                overlap[e["name"]][1] += 1
    print("host events during the gaps (overlapped us, count):")
    for name, (us, count) in sorted(overlap.items(), key=lambda kv: -kv[1][0])[: args.rows]:
        print(f"  {us:9.1f} us  {count:4d}  {name[:100]}")


if __name__ == "__main__":
    main()
