"""Summarise Nsight Compute's per-instruction warp-state samples (``ncu --import R --page source
--print-source sass --csv``, as written by ``scripts/ncu_prefix.sh --source`` and ``--source-engine``): the share of all
samples each stall reason takes, then the instructions that hold the most samples, each with its
leading reasons.

Usage: ``python3 scripts/ncu_source_summary.py source_<variant>.csv [...] [--top 20]``
"""

from __future__ import annotations

import argparse
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"


def summarise(path: str, top: int) -> str:
    """The report for one CSV: totals by reason, then the ``top`` instructions by samples."""
    with open(path, newline="") as f:
        rows = [row for row in csv.reader(f) if row]
    header_at = next(i for i, row in enumerate(rows) if SAMPLES in row)
    header, data = rows[header_at], rows[header_at + 1:]
    col = {name: i for i, name in enumerate(header)}
    reasons = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]

    def value(row: list[str], name: str) -> float:
        text = row[col[name]].replace(",", "") if col[name] < len(row) else ""
        return float(text) if text else 0.0

    total = sum(value(row, SAMPLES) for row in data)
    if total <= 0:
        return f"{path}: no warp-state samples"
    by_reason = sorted(((sum(value(row, r) for row in data), r) for r in reasons), reverse=True)
    lines = [f"{path}: {total:.0f} samples over {len(data)} instructions",
             "  by reason: " + ", ".join(f"{r[6:]} {v / total:.1%}" for v, r in by_reason if v / total >= 0.005)]
    for row in sorted(data, key=lambda row: -value(row, SAMPLES))[:top]:
        leading = sorted(((value(row, r), r[6:]) for r in reasons), reverse=True)[:3]
        where = row[col["Address"]].strip() + " " if "Address" in col else ""
        lines.append(f"  {value(row, SAMPLES) / total:6.1%}  {where}{row[col['Source']].strip()[:64]:64s}  "
                     + " ".join(f"{name} {v / total:.1%}" for v, name in leading if v))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv", nargs="+")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    for path in args.csv:
        print(summarise(path, args.top))


if __name__ == "__main__":
    main()
