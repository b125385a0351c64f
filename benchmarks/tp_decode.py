"""Tensor-parallel decode: a published shape (``decode_e2e.MODELS``; the Llama-3.1-8B and 70B shapes)
with random weights at each ``--tp`` size, per (batch, context) case, against the bandwidth limit
of one rank (its weight bytes and its KV heads' rows read per step, over the device's measured
copy rate), and the time of the all-reduces a step runs.

Each size runs in its own processes, one per rank (on CUDA each on its GPU, collectives over
NCCL; on the CPU over gloo): rank 0 plans, decodes greedily and times; the others follow its
forwards (``runner/tp_steps.py``) over caches of the same pages. Each rank builds its shard with
random weights (no checkpoint: a 70B shape needs none on disk). The cache rows are random on
rank 0 and zero elsewhere (the values do not change a step's cost). Decode steps replay CUDA
graphs at every size (``--cuda-graphs on``, the default on CUDA: each rank replays its own, the
all-reduces captured in them) or run eager (``off``). A step's all-reduces: one per attention
block and one per MLP, one for the vocabulary-parallel embedding, and the logits' all-gather;
timed apart as ``count`` all-reduces of one ``(batch, hidden)`` activation.

    python -m benchmarks.tp_decode --models llama-3.1-8b --tp 1,2 --batches 1,32 --contexts 1K,16K
    python -m benchmarks.tp_decode --models llama-3.1-70b --tp 2,4 --batches 1 --contexts 1K

``--preset tiny --device cpu`` checks the script on the CPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.decode_e2e import case_limit, case_pages, decode_steps, measure_bandwidth, model_config, trim_to
from benchmarks.runs import int_list, summary, sync
from segkv.config import parse_dtype
from segkv.distributed.parallel import TensorParallel, init_tensor_parallel, rank_device
from segkv.engine.tensor_parallel import runner_builder
from segkv.models.loader import keep_fp32
from segkv.models.registry import model_class
from segkv.models.tensor_parallel import shard_model
from segkv.runner.tp_steps import apply_step, broadcast_step, receive_step

PAGE_SIZE = 32


def random_shard(cfg: dict, tp: TensorParallel, *, device: torch.device, dtype: torch.dtype, seed: int):
    """Rank ``tp.rank``'s share of the model of ``cfg`` with random weights (std
    ``initializer_range``, norms 1, other vectors 0) made on ``device``: the whole model is never
    built."""
    with torch.device("meta"):
        model = model_class(cfg).from_hf_config(cfg)
    if tp.size > 1:
        shard_model(model, tp)
    model = model.to(dtype)
    for name, param in model.named_parameters():
        if keep_fp32(name):
            param.data = param.data.float()
    model = model.to_empty(device=device)
    std = float(cfg.get("initializer_range", 0.02))
    gen = torch.Generator(device=device).manual_seed(seed + tp.rank)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif param.dim() == 1:
                param.zero_()
            else:
                param.normal_(0.0, std, generator=gen)
    for module in model.modules():
        if hasattr(module, "init_buffers"):  # built on meta: recompute (RoPE tables)
            module.init_buffers(device)
    return model.eval().requires_grad_(False)


def time_all_reduce(tp: TensorParallel, shape: tuple[int, int], dtype: torch.dtype, device: torch.device,
                    calls: int, rounds: int = 5) -> list[float]:
    """Seconds of ``calls`` all-reduces of one ``shape`` tensor, ``rounds`` times (every rank runs it)."""
    x = torch.randn(shape, device=device).to(dtype)
    for _ in range(3):
        tp.all_reduce(x)
    sync(device)
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            tp.all_reduce(x)
        sync(device)
        out.append(time.perf_counter() - start)
    return out


def _follow(tp: TensorParallel, model, dtype: torch.dtype, device: torch.device) -> None:
    """A rank other than 0: run rank 0's steps and its all-reduce timings until it stops."""
    runner, new_runner = None, runner_builder(model, dtype, device)
    with torch.inference_mode():
        while (step := receive_step(tp)) is not None:
            if step[0] == "all_reduce":
                shape, calls = step[1]
                time_all_reduce(tp, shape, dtype, device, calls)
            else:
                runner = apply_step(runner, tp, step, new_runner)


def _lead(tp: TensorParallel, model, args, dtype: torch.dtype, device: torch.device, bandwidth: float) -> list[dict]:
    """Rank 0: every (batch, context) case, timed."""
    cases, new_runner = [], runner_builder(model, dtype, device)
    steps_per_case = max(args.steps, args.warmup)
    for batch in args.batches:
        for context in args.contexts:
            pages = case_pages(batch, context, steps=steps_per_case, warmup=args.warmup, page_size=PAGE_SIZE)
            options = {"cuda_graphs": {"on": True, "off": False, "emulate": "emulate"}[args.cuda_graphs],
                       "max_model_len": context + steps_per_case + 8}
            if args.cuda_graphs == "emulate":  # the graph code path on the CPU: Triton's interpreter
                options["backend"] = "triton"
            if tp.size > 1:
                broadcast_step(tp, ("cache", (PAGE_SIZE, pages, options)))
            runner = new_runner(PAGE_SIZE, pages, **options)
            storage = runner.cache.storage
            for tensor in (*storage.k, *storage.v, *storage.latent):
                tensor.normal_()
            chains = [runner.cache.new_chain() for _ in range(batch)]
            for chain in chains:
                chain.append(context)
            first = torch.randint(0, model.cfg.vocab_size, (batch,), generator=torch.Generator().manual_seed(batch))
            first = first.tolist()
            decode_steps(runner, chains, first, args.warmup)
            trim_to(chains, context)
            rates = []
            for _ in range(args.trials):
                sync(device)
                start = time.perf_counter()
                decode_steps(runner, chains, first, args.steps)
                sync(device)
                rates.append(batch * args.steps / (time.perf_counter() - start))
                trim_to(chains, context)
            hidden = model.cfg.hidden_size
            calls = 2 * len(model.model.layers) + 1  # attention and MLP per layer, the embedding
            if tp.size > 1:
                broadcast_step(tp, ("all_reduce", ((batch, hidden), calls)))
            reduce_s = time_all_reduce(tp, (batch, hidden), dtype, device, calls) if tp.size > 1 else [0.0]
            limit = case_limit(model, batch=batch, context=context, dtype=dtype, bandwidth=bandwidth)
            graphs = getattr(runner.graphs, "replays", 0) if runner.graphs is not None else 0
            case = {"tp": tp.size, "batch": batch, "context": context, **summary(rates), "limit": limit,
                    "cuda_graphs": args.cuda_graphs, "graph_replays": graphs,
                    "ratio": statistics.median(rates) / limit["tokens_per_s"],
                    "step_ms": 1e3 * batch / statistics.median(rates),
                    "all_reduce_ms_per_step": 1e3 * statistics.median(reduce_s), "all_reduces_per_step": calls,
                    "plan": None if runner.last_plan is None else runner.last_plan.describe()}
            cases.append(case)
            print(f"TP={tp.size} batch {batch:3d} context {context:6d}: {case['tokens_per_s']:9.1f} tok/s "
                  f"[{case['min']:.1f}-{case['max']:.1f}], step {case['step_ms']:.2f} ms, limit "
                  f"{limit['tokens_per_s']:.1f} tok/s (ratio {case['ratio']:.2f}), all-reduces "
                  f"{case['all_reduce_ms_per_step']:.3f} ms/step", flush=True)
            for chain in chains:
                chain.release()
            del runner, chains
    return cases


def _rank_main(rank: int, size: int, args, init_method: str, out: str) -> None:
    try:
        device = rank_device(args.device, rank)
        dtype = parse_dtype(args.dtype)
        if device.type == "cpu":
            torch.set_num_threads(max(1, torch.get_num_threads() // size))
        tp = init_tensor_parallel(size, rank, init_method=init_method, device=device, timeout_s=600)
        cfg = model_config(args.model, args.preset)
        model = random_shard(cfg, tp, device=device, dtype=dtype, seed=args.seed)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if rank == 0:
            bandwidth = measure_bandwidth(device)
            cases = _lead(tp, model, args, dtype, device, bandwidth)
            if size > 1:
                broadcast_step(tp, None)
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            Path(out).write_text(json.dumps({"tp": size, "device": name, "rank_weight_bytes": weight_bytes,
                                             "bandwidth_bytes_per_s": bandwidth, "cases": cases}))
        else:
            _follow(tp, model, dtype, device)
        dist.destroy_process_group()
    except BaseException:
        Path(f"{out}.{rank}.error").write_text(traceback.format_exc())
        raise


def run_size(size: int, args, work: Path) -> dict:
    """All cases at tensor-parallel size ``size``: its ranks as processes; rank 0's report. A rank's
    failure raises RuntimeError with its traceback."""
    out = str(work / f"tp{size}.json")
    init = f"file://{work}/rendezvous-{size}"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, size, args, init, out), name=f"tp{size}-rank{r}")
             for r in range(size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout_s
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    errors = [e.read_text() for e in sorted(work.glob(f"tp{size}.json.*.error"))]
    for p in procs:
        if p.is_alive():
            p.kill()
            errors.append(f"{p.name} still running after {args.timeout_s} s")
    if errors or any(p.exitcode for p in procs):
        raise RuntimeError(f"TP={size} failed: " + "\n".join(errors or [str([p.exitcode for p in procs])]))
    return json.loads(Path(out).read_text())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "--models", dest="model", default="llama-3.1-8b")
    p.add_argument("--preset", choices=("real", "tiny"), default="real")
    p.add_argument("--tp", type=int_list, default=[1, 2], help="tensor-parallel sizes, e.g. 1,2,4")
    p.add_argument("--batches", type=int_list, default=[1, 32])
    p.add_argument("--contexts", type=int_list, default=[1024, 16384])
    p.add_argument("--steps", type=int, default=32, help="decode steps per timed trial")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cuda-graphs", choices=("on", "off", "emulate"), default=None,
                   help="decode steps from CUDA graphs (default: on with CUDA, off on the CPU)")
    p.add_argument("--timeout-s", type=float, default=1200.0, help="per tensor-parallel size")
    p.add_argument("--json", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.cuda_graphs = args.cuda_graphs or ("on" if args.device.startswith("cuda") else "off")
    report = {"model": args.model, "preset": args.preset, "dtype": args.dtype, "sizes": []}
    with tempfile.TemporaryDirectory(prefix="segkv-tp-bench-") as work:
        for size in args.tp:
            report["sizes"].append(run_size(size, args, Path(work)))
            if args.json:  # rewritten after every size
                Path(args.json).write_text(json.dumps(report, indent=1))
    base = {(c["batch"], c["context"]): c for s in report["sizes"] if s["tp"] == min(args.tp) for c in s["cases"]}
    for s in report["sizes"]:
        for case in s["cases"]:
            ref = base.get((case["batch"], case["context"]))
            case["speedup_vs_smallest_tp"] = None if ref is None else case["tokens_per_s"] / ref["tokens_per_s"]
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
