#!/usr/bin/env python
"""Soak test: mixed HTTP load against a live segkv server for a while, then checks that it settles.

    python scripts/soak.py --duration 600 --out /tmp/soak.json         # starts `segkv serve --model default`
    python scripts/soak.py --url http://127.0.0.1:8000 --pid 1234 ...  # a server that already runs

``--concurrency`` asyncio workers send a weighted mix: completions and chats, plain and streamed;
sessions with turns, forks, restores and deletes; clients that leave mid-request (a stream closed
after its first chunk, a plain request or a session turn cancelled before its answer); and bad
inputs (malformed JSON, wrong types, an unknown model, a lone surrogate, a huge max_tokens, a
~20 MB body, deep nesting, unknown routes, missing sessions). Every request has a deadline
(``--request-timeout``): one that passes it is a hang.

A sampler records the server's RSS (psutil, else /proc/<pid>/status) and /health (pages in use,
running and waiting requests, cached segments) every second, with /dashboard/stats for the pages
only the prefix index holds. At the end the script deletes the sessions it created, waits for the
engine to be idle and checks:

  server_alive    the server still answers /health (and its process still runs)
  no_5xx          no response had a 5xx status and no stream ended in an error payload
  no_hangs        no request passed its deadline, and the engine became idle afterwards
  pages_baseline  running and waiting requests are back to their values before the load, and
                  so are the pages held by anything but the prefix index (pages_in_use minus
                  pages_cached_only): cached prefixes stay after the load, evictable, and are
                  reported apart (cached_segments, cached_tokens, pages_cached_only)
  rss_growth      the server's RSS grew less than 5% from the window that ends at
                  min(120 s, duration/3) to the last window (windows of min(60 s, duration/6))

It prints the summary as JSON, writes it with the time series to ``--out``, and exits 1 when a
check fails (2 when the server never came up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # soak_load.py lies beside this script

from soak_load import BAD_INPUTS, Load, Recorder  # noqa: E402

RSS_GROWTH_LIMIT = 0.05
SAMPLE_EVERY_S = 1.0
IDLE_TIMEOUT_S = 60.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--concurrency", type=int, default=4, help="concurrent workers (default 4)")
    p.add_argument("--url", default=None, help="a running server; by default one is started")
    p.add_argument("--pid", type=int, default=None, help="the --url server's process id, for its RSS")
    p.add_argument("--model", default=None,
                   help="the model to serve ('default' if not given) and to name in requests (the server's if not)")
    p.add_argument("--device", default="cpu", help="the device of the server this script starts")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    p.add_argument("--max-tokens", type=int, default=8, help="largest max_tokens of a normal request")
    p.add_argument("--request-timeout", type=float, default=60.0, help="seconds before a request is a hang")
    p.add_argument("--api-key", default=os.environ.get("SEGKV_API_KEY"), help="bearer token, if the server needs one")
    p.add_argument("--out", default=None, help="write the JSON summary (with the time series) here")
    p.add_argument("--server-log", default=None, help="where the started server's output goes")
    args = p.parse_args(argv)
    if args.duration <= 0 or args.concurrency < 1 or args.max_tokens < 1 or args.request_timeout <= 0:
        p.error("--duration, --concurrency, --max-tokens and --request-timeout must be positive")
    return args


# -- the server --------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args) -> tuple[subprocess.Popen, str, str]:
    """``segkv serve`` on a free port, its output in a log file; returns (process, url, log path)."""
    port = free_port()
    log = args.server_log or os.path.join(tempfile.gettempdir(), f"segkv-soak-server-{port}.log")
    cmd = [sys.executable, "-m", "segkv.cli", "serve", "--model", args.model or "default", "--device", args.device,
           "--port", str(port)]
    with open(log, "wb") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}", log


def stop_server(proc: subprocess.Popen) -> int | None:
    proc.terminate()
    try:
        return proc.wait(timeout=20)
    except subprocess.TimeoutExpired:  # a shutdown that hangs is reported by the exit code
        proc.kill()
        return proc.wait(timeout=10)


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        import psutil
        return psutil.Process(pid).memory_info().rss
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - the process is gone
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def wait_ready(client: httpx.AsyncClient, proc: subprocess.Popen | None, timeout: float = 600) -> None:
    """Until /health answers 200 (the server answers 503 while the model loads)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.3)
    raise RuntimeError(f"the server was not ready after {timeout:.0f} s")


# -- sampling ----------------------------------------------------------------------------
async def sample(client: httpx.AsyncClient, pid: int | None, t0: float) -> dict:
    """One point of the time series: RSS, /health and the evictable pages from /dashboard/stats."""
    point: dict = {"t": round(time.monotonic() - t0, 2), "rss": rss_bytes(pid)}
    try:
        health = (await client.get("/health", timeout=10)).json()
        for key in ("pages_in_use", "num_pages", "running", "waiting", "cached_segments", "cached_tokens"):
            point[key] = health.get(key)
        dash = await client.get("/dashboard/stats", timeout=10)
        if dash.status_code == 200:
            stats = dash.json()
            point["pages_cached_only"] = stats.get("pages_cached_only")
            point["pages_requests"] = stats.get("pages_requests")
            point["sessions"] = len(stats.get("sessions") or [])
    except (httpx.TransportError, ValueError) as exc:
        point["error"] = f"{type(exc).__name__}: {exc}"
    return point


def pinned(point: dict) -> int | None:
    """Pages held by anything but the prefix index (None when the server does not tell)."""
    if point.get("pages_in_use") is None or point.get("pages_cached_only") is None:
        return None
    return point["pages_in_use"] - point["pages_cached_only"]


async def sampler(client, pid, t0, series: list[dict], stop: asyncio.Event) -> None:
    while not stop.is_set():
        series.append(await sample(client, pid, t0))
        try:
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)
        except asyncio.TimeoutError:
            pass


async def wait_idle(client: httpx.AsyncClient, timeout: float = IDLE_TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            h = (await client.get("/health", timeout=10)).json()
            if h.get("running") == 0 and h.get("waiting") == 0:
                return True
        except (httpx.TransportError, ValueError):
            pass
        await asyncio.sleep(0.5)
    return False


# -- checks ------------------------------------------------------------------------------
def rss_check(series: list[dict], duration: float) -> dict:
    """Median RSS of the window ending at min(120 s, duration/3) against the last window."""
    warm_end, window = min(120.0, duration / 3), min(60.0, duration / 6)
    load = [p for p in series if p.get("rss") is not None and p["t"] <= duration]

    def median(lo: float, hi: float) -> float | None:
        values = sorted(p["rss"] for p in load if lo <= p["t"] <= hi)
        return values[len(values) // 2] if values else None

    warm, end = median(warm_end - window, warm_end), median(duration - window, duration)
    if warm is None or end is None:
        return {"ok": None, "reason": "no RSS samples (no --pid, or the process was not readable)"}
    growth = (end - warm) / warm
    return {"ok": growth < RSS_GROWTH_LIMIT, "warm_window_s": [round(warm_end - window, 1), round(warm_end, 1)],
            "end_window_s": [round(duration - window, 1), round(duration, 1)], "warm_mb": round(warm / 2**20, 1),
            "end_mb": round(end / 2**20, 1), "growth_pct": round(100 * growth, 2),
            "limit_pct": 100 * RSS_GROWTH_LIMIT}


def pages_check(baseline: dict, final: dict) -> dict:
    out = {"baseline": {k: baseline.get(k) for k in ("pages_in_use", "pages_cached_only", "running", "waiting")},
           "final": {k: final.get(k) for k in ("pages_in_use", "pages_cached_only", "pages_requests", "running",
                                              "waiting", "cached_segments", "cached_tokens", "sessions")}}
    out["baseline"]["pinned"], out["final"]["pinned"] = pinned(baseline), pinned(final)
    requests_back = final.get("running") == baseline.get("running") and final.get("waiting") == baseline.get("waiting")
    if pinned(final) is None or pinned(baseline) is None:
        out.update(ok=False, reason="the server does not report pages_cached_only in /dashboard/stats")
    else:
        out["ok"] = requests_back and pinned(final) == pinned(baseline)
    return out


def summarize(args, recorder: Recorder, series: list[dict], baseline: dict, final: dict, *, elapsed: float,
              alive: bool, idle: bool, exit_code: int | None, log: str | None, url: str, pid: int | None) -> dict:
    counts = recorder.counts()
    rss = [p["rss"] for p in series if p.get("rss") is not None]
    checks = {
        "server_alive": {"ok": alive and exit_code is None, "server_exit_code": exit_code},
        "no_5xx": {"ok": counts["errors"]["5xx"] == 0 and counts["errors"]["stream_errors"] == 0,
                   "5xx": counts["errors"]["5xx"], "stream_errors": counts["errors"]["stream_errors"]},
        "no_hangs": {"ok": counts["errors"]["timeouts"] == 0 and idle, "timeouts": counts["errors"]["timeouts"],
                     "idle_after_load": idle},
        "pages_baseline": pages_check(baseline, final),
        "rss_growth": rss_check(series, args.duration),
    }
    return {
        "ok": all(c["ok"] is not False for c in checks.values()),
        "checks": checks,
        "config": {k: getattr(args, k) for k in ("duration", "concurrency", "url", "model", "device", "seed",
                                                 "max_tokens", "request_timeout")},
        "server": {"url": url, "pid": pid},
        "elapsed_s": round(elapsed, 1),
        **counts,
        "rss_mb": {"first": round(rss[0] / 2**20, 1), "last": round(rss[-1] / 2**20, 1),
                   "max": round(max(rss) / 2**20, 1)} if rss else None,
        "pages": {"max_in_use": max((p.get("pages_in_use") or 0 for p in series), default=0),
                  "max_running": max((p.get("running") or 0 for p in series), default=0),
                  "max_waiting": max((p.get("waiting") or 0 for p in series), default=0)},
        "server_log": log,
    }


# -- main --------------------------------------------------------------------------------
async def soak(args) -> int:
    proc, log, url, pid = None, None, args.url, args.pid
    if url is None:
        proc, url, log = start_server(args)
        pid = proc.pid
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency * 2 + 4)
    timeout = httpx.Timeout(args.request_timeout, connect=10)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits) as client, \
            httpx.AsyncClient(base_url=url, headers=headers, timeout=10) as probe:
        try:
            try:
                await wait_ready(probe, proc)
            except RuntimeError as exc:
                print(json.dumps({"ok": False, "error": str(exc), "server_log": log}), flush=True)
                return 2
            model = args.model or (await probe.get("/v1/models")).json()["data"][0]["id"]
            baseline = await sample(probe, pid, time.monotonic())
            series: list[dict] = []
            recorder = Recorder(args.request_timeout)
            load = Load(client, recorder, model=model, max_tokens=args.max_tokens)
            t0 = time.monotonic()
            stop = asyncio.Event()
            watcher = asyncio.create_task(sampler(probe, pid, t0, series, stop))
            await asyncio.gather(*(load.worker(random.Random(args.seed * 1000 + i), t0 + args.duration,
                                               index=i, num_workers=args.concurrency)
                                   for i in range(args.concurrency)))
            await load.delete_sessions()
            idle = await wait_idle(probe)
            await asyncio.sleep(2 * SAMPLE_EVERY_S)  # a sample or two of the idle server
            stop.set()
            await watcher
            elapsed = time.monotonic() - t0
            final = await sample(probe, pid, t0)
            alive = "error" not in final
        finally:
            exit_code = None
            if proc is not None:
                exit_code = proc.poll()  # None: it was still running when the load ended
                stop_server(proc)
    summary = summarize(args, recorder, series, baseline, final, elapsed=elapsed, alive=alive, idle=idle,
                        exit_code=exit_code, log=log, url=url, pid=pid)
    print(json.dumps(summary, indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({**summary, "bad_inputs": sorted(BAD_INPUTS), "baseline": baseline,
                                              "series": series, "failures": recorder.failures,
                                              "refusals": recorder.refusals}, indent=1))
    return 0 if summary["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(soak(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
