"""Multi-turn serving with more conversations than the KV pool holds, with the KV tiers off and on.

Starts ``segkv serve`` twice on the same model and pool (``--kv-cache-memory``): once without
tiers (histories that no longer fit are dropped and recomputed at their next turn) and once with
a host tier (``--kv-offload-host-gib``, and a disk tier with ``--kv-offload-dir``). Against each
it runs ``segkv bench serve --workload multi-turn``: ``--conversations`` conversations at once
over the stateless chat API, each repeating its whole history every turn. Reports per turn the
prompt tokens served from cache and the median TTFT (min and max), tiers off against on, and
the server's tier counters (``/health``).

Run: ``python -m benchmarks.tiers_serve --model DIR --kv-cache-memory GIB`` (any device the
server takes; ``--server-flag`` passes more flags to ``segkv serve``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx

from segkv.bench.serve import run_benchmark


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def server(flags: list[str], *, timeout: float):
    """``segkv serve`` with ``flags`` on a free port until healthy; yields its base URL."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "segkv.cli", "serve", "--port", str(port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"segkv serve exited:\n{proc.stdout.read()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("segkv serve did not come up")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield base
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_mode(args, tiers: list[str]) -> dict:
    """One server (``tiers``: its tier flags) and one multi-turn benchmark against it."""
    flags = ["--model", args.model, "--kv-cache-memory", str(args.kv_cache_memory), *args.server_flag, *tiers]
    with server(flags, timeout=args.start_timeout) as base:
        result = asyncio.run(run_benchmark({
            "base_url": base, "workload": "multi-turn", "num_prompts": args.conversations,
            "max_concurrency": args.conversations, "turns": args.turns, "input_len": args.input_len,
            "output_len": args.output_len, "temperature": 0.0, "num_warmups": 1, "seed": args.seed,
            "timeout": args.request_timeout}))
        health = httpx.get(f"{base}/health", timeout=10).json()
    return {"flags": flags, "per_turn": [
        {"turn": t["turn"], "completed": t["completed"], "failed": t["failed"],
         "input_tokens": t["total_input_tokens"], "cached_tokens": t["total_cached_tokens"],
         "median_ttft_ms": t["median_ttft_ms"], "min_ttft_ms": t["min_ttft_ms"], "max_ttft_ms": t["max_ttft_ms"]}
        for t in result["per_turn"]], "failed": result["failed"], "duration_s": result["duration"],
        "errors": sorted({e for e in result["errors"] if e})[:10],
        "kv_tiers": health.get("kv_tiers"), "kv_capacity_tokens": health["engine"]["kv_cache_tokens"]}


def table(report: dict) -> str:
    off, on = report["modes"]["off"]["per_turn"], report["modes"]["on"]["per_turn"]
    lines = ["| turn | prompt tokens | cached, tiers off | cached, tiers on | TTFT ms, off: median [min-max] "
             "| TTFT ms, on | off / on |", "|---|---|---|---|---|---|---|"]
    for a, b in zip(off, on):
        ratio = a["median_ttft_ms"] / b["median_ttft_ms"] if b["median_ttft_ms"] else float("nan")
        lines.append(f"| {a['turn']} | {b['input_tokens']} | {a['cached_tokens']} | {b['cached_tokens']} | "
                     f"{a['median_ttft_ms']:.1f} [{a['min_ttft_ms']:.1f}-{a['max_ttft_ms']:.1f}] | "
                     f"{b['median_ttft_ms']:.1f} [{b['min_ttft_ms']:.1f}-{b['max_ttft_ms']:.1f}] | {ratio:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--kv-cache-memory", type=float, required=True, help="the KV pool in GiB (small: the point)")
    p.add_argument("--host-gib", type=float, default=4.0, help="the host tier of the tiers-on server")
    p.add_argument("--disk-dir", default=None, help="a disk tier too (--disk-gib of it)")
    p.add_argument("--disk-gib", type=float, default=8.0)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--input-len", type=int, default=256, help="words of each new user message")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-flag", action="append", default=[], help="one more flag for segkv serve (repeat)")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.server_flag = [f for flag in args.server_flag for f in flag.split()]
    tiers = ["--kv-offload-host-gib", str(args.host_gib)]
    if args.disk_dir:
        tiers += ["--kv-offload-dir", args.disk_dir, "--kv-offload-disk-gib", str(args.disk_gib)]
    report = {"args": vars(args), "modes": {"off": run_mode(args, []), "on": run_mode(args, tiers)}}
    print(table(report))
    print(f"KV capacity {report['modes']['on']['kv_capacity_tokens']} tokens; tiers: {report['modes']['on']['kv_tiers']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(m["failed"] == 0 for m in report["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
