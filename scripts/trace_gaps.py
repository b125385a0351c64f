"""Where the GPU waits between decode steps: idle gaps in a Chrome trace of graph steps
(``scripts/profile_decode.py --trace T.json``) and the host events that overlap them.

Prints each GPU idle gap longer than ``--min-us`` (between the end of one kernel or copy and the
start of the next), then, summed over all gaps, the host events that ran during them (torch ops and
CUDA runtime calls, by name: total overlapped microseconds and count).

    python3 scripts/trace_gaps.py T.json --min-us 20
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--min-us", type=float, default=20.0)
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
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
