"""Resuming a long session from the KV tiers: time to first token of a follow-up turn after a
``--history``-token first turn whose rows are (a) still in pages, (b) in host memory, (c) on disk,
or (d) gone, so the whole history is prefilled again; and the rate of the copy back against the
host-to-device copy rate measured in the same run.

One model (random weights of a published shape, ``benchmarks.decode_e2e.MODELS``; ``--layers``
cuts it), one cache with the KV tiers attached. Each case: the history's chain (one sealed
segment) moved as the case says, then, timed, the follow-up's ``--follow-up`` new tokens: the
segments brought back (``cache.tiers.bring_back_chain``) and one forward until the last row's
logits are on the host. Medians of ``--runs`` after a warm-up, with min and max.

Run: ``python -m benchmarks.kv_tiers --help`` (CUDA; ``--preset tiny --device cpu`` checks the
script on the CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from benchmarks.decode_e2e import build_runner, build_segkv, model_config
from benchmarks.runs import sync
from segkv.cache import PagedKVCache
from segkv.cache.tiers import SegmentTiers, bring_back_chain, offload
from segkv.config import CacheConfig, CompactionPolicy
from segkv.runner.model_runner import StepInput


def copy_rate(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second of one pinned host-to-device copy of ``nbytes`` (the bound of a copy back)."""
    if device.type != "cuda":
        return float("nan")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host)
    sync(device)
    start = time.perf_counter()
    dev.copy_(host)
    sync(device)
    return nbytes / (time.perf_counter() - start)


def stats(times: list[float]) -> dict:
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--preset", choices=("real", "tiny"), default="real")
    p.add_argument("--layers", type=int, default=None, help="cut the model to this many layers")
    p.add_argument("--history", type=int, default=50000)
    p.add_argument("--follow-up", type=int, default=32, help="new tokens of the timed turn")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--disk-dir", default=None, help="the disk tier's directory (default: a temporary one)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = model_config(args.model, args.preset)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    model, _ = build_segkv(cfg, device=device, dtype=dtype)
    layout = model.kv_layout(dtype)
    pages = 2 * (args.history + args.follow_up) // args.page_size + 8
    cache = PagedKVCache(layout, CacheConfig(page_size=args.page_size, num_pages=pages), device=str(device),
                         compaction=CompactionPolicy(enabled=False))
    runner, _ = build_runner(model, cache, device, graphs="off")
    history_bytes = -(-args.history // args.page_size) * args.page_size * layout.row_bytes
    gen = torch.Generator().manual_seed(0)
    history = torch.randint(0, cfg["vocab_size"], (args.history,), generator=gen).tolist()
    follow = torch.randint(0, cfg["vocab_size"], (args.follow_up,), generator=gen).tolist()

    def turn(chain, tokens) -> None:
        bring_back_chain(cache, chain)
        logits = runner.forward([StepInput(chain, tokens)])
        logits.argmax(-1).tolist()

    first = cache.new_chain()
    turn(first, history)
    first.seal()
    disk = tempfile.TemporaryDirectory() if args.disk_dir is None else None
    host_tiers = SegmentTiers(host_bytes=2 * history_bytes + (1 << 20), pin_memory=device.type == "cuda")
    disk_tiers = SegmentTiers(host_bytes=0, disk_dir=args.disk_dir or disk.name, disk_bytes=2 * history_bytes + (1 << 20))
    results, bring_back_s = {}, []

    def case(name: str, tiers: SegmentTiers | None) -> None:
        times = []
        for run in range(args.runs + 1):
            chain = first.fork()
            if tiers is not None:
                cache.attach_tiers(tiers)
                for ref in chain.refs:
                    tiers.discard(ref.segment.segment_id)  # a fresh copy each run
                    assert offload(cache, ref.segment)
            sync(device)
            start = time.perf_counter()
            if name == "recompute":
                chain.release()
                chain = cache.new_chain()
                turn(chain, history + follow)
            else:
                if name == "host":
                    back = time.perf_counter()
                    bring_back_chain(cache, chain)
                    sync(device)
                    if run:
                        bring_back_s.append(time.perf_counter() - back)
                turn(chain, follow)
            sync(device)
            if run:  # the first is a warm-up
                times.append(time.perf_counter() - start)
            chain.release()
        results[name] = stats(times)
        print(f"{name:9s}: TTFT {results[name]['median_ms']:9.1f} ms [{results[name]['min_ms']:.1f}-"
              f"{results[name]['max_ms']:.1f}]", flush=True)

    case("resident", None)
    case("host", host_tiers)
    case("disk", disk_tiers)
    case("recompute", None)
    rate = copy_rate(device)
    back = statistics.median(bring_back_s)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "model": args.model,
              "layers": cfg["num_hidden_layers"], "history": args.history, "follow_up": args.follow_up,
              "history_bytes": history_bytes, "cases": results, "bring_back_ms": back * 1e3,
              "bring_back_GBps": history_bytes / back / 1e9, "h2d_GBps": rate / 1e9,
              "recompute_over_host": results["recompute"]["median_ms"] / results["host"]["median_ms"]}
    print(f"history {args.history} tokens = {history_bytes / 2**30:.2f} GiB of KV; back from the host in "
          f"{back * 1e3:.1f} ms = {report['bring_back_GBps']:.1f} GB/s against a {rate / 1e9:.1f} GB/s pinned copy; "
          f"re-prefill / host = {report['recompute_over_host']:.1f}x (target >= 5x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    host_tiers.close()
    disk_tiers.close()  # this run's files
    if disk is not None:
        disk.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
