"""First-burst latency of a fresh server, with and without ``LLM.warm_up`` before it reports ready.

A server started in a subprocess (this script with ``--serve``: the LLM, ``warm_up`` unless
``--no-warm``, the engine and the app under uvicorn, as ``segkv serve`` wires them) is polled at
``/health`` until it answers; then a burst of ``--num-requests`` concurrent streamed completions
(``--input-len`` words of random text, ``--output-len`` tokens, greedy, all sent at once) is
measured with ``segkv.bench.serve``, and a second burst of the same shape (other random text, so
no prompt is served from the prefix cache). The JSON printed (and written to ``--out``) holds
each burst's mean TTFT and the ratio first / second; the acceptance is a ratio under 1.5.

Each server compiles into a fresh Triton cache (``--shared-triton-cache`` keeps the user's), so
a run shows a first start on a machine; the kernels each burst compiled are counted there (``triton_cache_entries_added``).

The model: ``llama-3.1-8b`` (default; random weights of the published shape built on the device,
with the built-in model's tokenizer: generated ids past its vocabulary decode to no text, which
the token chunks still count), or ``default`` / ``default-mla`` / a model directory.

    python scripts/warm_burst.py --out $OUT/warm_burst.json            # GPU: warmed server
    python scripts/warm_burst.py --both --out $OUT/warm_burst.json     # GPU: warmed and not
    python scripts/warm_burst.py --model default --device cpu --num-requests 8 --input-len 32 \\
        --output-len 4 --out /tmp/warm_burst.json                       # CPU smoke check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RANDOM_MODELS = ("llama-3.1-8b", "qwen3-8b")  # benchmarks.decode_e2e shapes, random weights


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b",
                   help=f"{', '.join(RANDOM_MODELS)} (random weights), default, default-mla or a model directory")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 elsewhere")
    p.add_argument("--kv-cache-gib", type=float, default=None, help="default: 8 on CUDA, 1 elsewhere")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256, help="words of random text per prompt")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--no-warm", action="store_true", help="serve without warming up (the baseline)")
    p.add_argument("--both", action="store_true", help="a warmed server, then one without warm-up")
    p.add_argument("--shared-triton-cache", action="store_true",
                   help="compile into the usual Triton cache instead of a fresh one per server")
    p.add_argument("--ready-timeout", type=float, default=1200.0, help="seconds to wait for /health")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server subprocess
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--report", type=Path, default=None, help=argparse.SUPPRESS)
    return p


# -- the server (subprocess) --------------------------------------------------------------------
def random_model_dir(name: str, directory: Path) -> Path:
    """A model directory for ``name``: its config.json and the built-in model's tokenizer files
    (the weights are made on the device by :func:`install_random_weights`)."""
    from benchmarks.decode_e2e import model_config
    from segkv.models.default_models import resolve_model_dir

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model_config(name)))
    tokenizer_dir = resolve_model_dir("default")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / f).is_file():
            shutil.copy(tokenizer_dir / f, directory / f)
    return directory


def install_random_weights() -> None:
    """Make ``LLM`` build random weights on the device instead of reading a checkpoint (an 8B
    checkpoint would take a minute to write and read back; the weights' values do not matter)."""
    import segkv.engine.llm as llm_module
    from benchmarks.decode_e2e import build_segkv
    from segkv.config import parse_dtype
    from segkv.models.loader import read_config

    def load_model(model_dir, *, dtype, device, progress=False):
        return build_segkv(read_config(model_dir), device=device, dtype=parse_dtype(dtype))[0]

    llm_module.load_model = load_model
    llm_module.fingerprint = lambda model_dir: "random-weights"


def serve(args) -> int:
    import torch
    import uvicorn

    from segkv.engine import LLM, AsyncEngine, SchedulerConfig
    from segkv.server.app import create_app

    model = args.model
    if model in RANDOM_MODELS:
        install_random_weights()
        model = random_model_dir(model, Path(tempfile.mkdtemp(prefix="warm-burst-model-")))
    cuda = torch.device(args.device).type == "cuda"
    started = time.perf_counter()
    llm = LLM(model, dtype=args.dtype or ("bfloat16" if cuda else "float32"), device=args.device,
              kv_cache_bytes=int((args.kv_cache_gib or (8 if cuda else 1)) * (1 << 30)), cuda_graphs="auto")
    report = {"load_seconds": time.perf_counter() - started, "warm_up": None,
              "graphs": llm.runner.graphs is not None}
    if not args.no_warm:
        report["warm_up"] = llm.warm_up(max_batch=args.max_num_seqs,
                                        max_num_batched_tokens=args.max_num_batched_tokens, progress=True)
    report["triton_cache_entries_at_ready"] = cache_entries(os.environ.get("WARM_BURST_TRITON_CACHE"))
    engine = AsyncEngine(llm, SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                              max_num_batched_tokens=args.max_num_batched_tokens))
    app = create_app(engine, model_name="warm-burst")
    args.report.write_text(json.dumps(report))
    try:
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", lifespan="off")
    finally:
        engine.shutdown()
    return 0


def cache_entries(directory: str | None) -> int | None:
    """Entries of a private Triton cache (a compiled kernel or launcher each; None: no private
    cache). Compilation is what a warm-up moves out of the first requests' way."""
    if not directory:
        return None
    path = Path(directory)
    return sum(1 for d in path.iterdir() if d.is_dir()) if path.is_dir() else 0


# -- the client ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    import httpx

    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server was not ready after {timeout:.0f} s")


def burst(url: str, args, seed: int) -> dict:
    from segkv.bench.serve import BenchConfig, run_benchmark

    config = BenchConfig(base_url=url, workload="single", endpoint="completions", num_prompts=args.num_requests,
                         max_concurrency=args.num_requests, seed=seed, input_len=args.input_len,
                         output_len=args.output_len, num_warmups=0)
    result = asyncio.run(run_benchmark(config))
    keys = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "mean_ttft_ms",
            "median_ttft_ms", "max_ttft_ms", "mean_tpot_ms")
    return {k: result[k] for k in keys if k in result}


def run_server_and_bursts(args, *, warm: bool) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    work = Path(tempfile.mkdtemp(prefix="warm-burst-"))
    env = dict(os.environ)
    cache = None if args.shared_triton_cache else str(work / "triton")
    if cache is not None:
        env["TRITON_CACHE_DIR"] = env["WARM_BURST_TRITON_CACHE"] = cache
    command = [sys.executable, str(Path(__file__).resolve()), "--serve", "--port", str(port),
               "--report", str(work / "report.json"), "--model", args.model, "--device", args.device,
               "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    command += ["--dtype", args.dtype] if args.dtype else []
    command += ["--kv-cache-gib", str(args.kv_cache_gib)] if args.kv_cache_gib else []
    command += [] if warm else ["--no-warm"]
    print(f"warm_burst: starting the server ({'warm-up' if warm else 'no warm-up'})", file=sys.stderr, flush=True)
    proc = subprocess.Popen(command, env=env, cwd=ROOT)
    try:
        ready = wait_ready(url, proc, args.ready_timeout)
        server = json.loads((work / "report.json").read_text())
        bursts = []
        for seed in (1, 2):
            before = cache_entries(cache)
            bursts.append(burst(url, args, seed))
            after = cache_entries(cache)
            bursts[-1]["triton_cache_entries_added"] = None if before is None else after - before
            print(f"warm_burst: burst {seed}: mean TTFT {bursts[-1]['mean_ttft_ms']:.0f} ms", file=sys.stderr,
                  flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    first, second = bursts
    return {"warm_up": warm, "seconds_to_ready": ready, "server": server, "first_burst": first,
            "second_burst": second,
            "ttft_ratio": first["mean_ttft_ms"] / second["mean_ttft_ms"] if second["mean_ttft_ms"] else None}


def device_name(device: str) -> str:
    import torch

    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.serve:
        return serve(args)
    runs = [True, False] if args.both else [not args.no_warm]
    result = {"device": device_name(args.device), "model": args.model, "num_requests": args.num_requests,
              "input_len_words": args.input_len, "output_len": args.output_len,
              "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
              "runs": [run_server_and_bursts(args, warm=warm) for warm in runs]}
    result["accepted"] = all(r["ttft_ratio"] is not None and r["ttft_ratio"] <= 1.5
                             for r in result["runs"] if r["warm_up"])
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
