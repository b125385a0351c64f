"""Structured output benchmark: the time per output token of requests constrained by a JSON schema
(xgrammar's token mask filled, applied and advanced every step) against the same requests free.

Per batch size (``--batches``), ``batch`` requests with short prompts run together in the engine
core of the built-in default model (``--model``); each generates exactly ``--max-tokens`` tokens on
both sides so that the two decode the same number of steps at the same context lengths:

* ``free``: no constraint, EOS ignored;
* ``json_schema``: constrained by ``SCHEMA`` (an object holding an array of at least 1000 objects
  with strings, an enum, numbers and a nested array), which no output completes within
  ``--max-tokens``, so every sequence runs to its length limit as the free one does.

Time per output token (TPOT) of a request = (its last token's time - its first token's time) /
(tokens - 1), the prefill left out; a trial's TPOT is the median over its requests. Each trial runs
the free side, then the constrained one (so they alternate and share the machine's state),
``--trials`` times after one untimed warm-up of each (the warm-up compiles the grammar: a cache
miss, timed separately as ``compile_s``; the timed runs hit the cache). Reported per batch: the
median [min-max] TPOT of each side and the overhead: the median [min-max] over the trials of
constrained TPOT / free TPOT - 1, each ratio from one back-to-back pair (so a machine whose load
changes between trials, as a shared CPU's does, moves both sides of a ratio alike).

Run on the CPU: ``python -m benchmarks.structured_output --device cpu``; on a GPU
``python -m benchmarks.structured_output --json build/structured/gpu.json``. ``--shape llama-3.1-8b``
(a ``benchmarks.decode_e2e`` shape) first writes a model directory of that shape with random
weights and ``--model``'s tokenizer and vocabulary (under ``--work-dir``), and measures on it: a
step bound by reading its weights, where the built-in 7M model's step is bound by host work.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.decode_e2e import build_segkv, model_config
from benchmarks.runs import int_list
from segkv.config import parse_dtype
from segkv.models.default_models import resolve_model_dir
from segkv.engine.llm import LLM
from segkv.sampling_params import SamplingParams, StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 1000,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "kind": {"enum": ["tool", "plant", "animal", "place"]},
                    "score": {"type": "number", "minimum": 0, "maximum": 100},
                    "count": {"type": "integer"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["name", "kind", "score", "count", "tags"],
            },
        },
    },
    "required": ["items"],
}
PROMPTS = ["Inventory as JSON:", "List the items:", "def load(path):", "The answer is"]


def run_side(llm: LLM, batch: int, params: SamplingParams) -> dict:
    """Run ``batch`` requests with ``params`` together; their median TPOT and what they produced."""
    core = llm.core
    requests = [core.add_request(llm.tokenizer.encode(PROMPTS[i % len(PROMPTS)]), params, cache_rows=False)
                for i in range(batch)]
    start = time.perf_counter()
    while not all(r.finished for r in requests):
        core.step()
    wall = time.perf_counter() - start
    tpots, lengths, reasons = [], [], set()
    for r in requests:
        out = r.output().outputs[0]
        lengths.append(len(out.token_ids))
        reasons.add(out.finish_reason)
        tpots.append((r.token_times[-1] - r.token_times[0]) / max(len(r.token_times) - 1, 1))
    return {"tpot_s": statistics.median(tpots), "wall_s": wall, "tokens": sum(lengths),
            "lengths": sorted(set(lengths)), "finish_reasons": sorted(reasons)}


def bench_batch(llm: LLM, batch: int, args) -> dict:
    free = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    constrained = free.replace(structured=StructuredOutput(json_schema=SCHEMA))
    warm = {"max_tokens": 4}
    run_side(llm, batch, free.replace(**warm))
    misses = llm.generator.grammars.misses
    start = time.perf_counter()
    llm.generator.grammars.compile(constrained.structured)
    compile_s = time.perf_counter() - start if llm.generator.grammars.misses > misses else 0.0
    run_side(llm, batch, constrained.replace(**warm))
    sides: dict[str, list[dict]] = {"free": [], "json_schema": []}
    for _ in range(args.trials):
        sides["free"].append(run_side(llm, batch, free))
        sides["json_schema"].append(run_side(llm, batch, constrained))
    out = {"batch": batch, "compile_s": compile_s}
    for name, runs in sides.items():
        tpots = [r["tpot_s"] for r in runs]
        out[name] = {"tpot_ms": statistics.median(tpots) * 1e3, "min_ms": min(tpots) * 1e3,
                     "max_ms": max(tpots) * 1e3, "trials_ms": [t * 1e3 for t in tpots],
                     "lengths": sorted({n for r in runs for n in r["lengths"]}),
                     "finish_reasons": sorted({f for r in runs for f in r["finish_reasons"]})}
    ratios = [c["tpot_s"] / f["tpot_s"] for f, c in zip(sides["free"], sides["json_schema"])]
    out["overhead"] = statistics.median(ratios) - 1
    out["overhead_min"], out["overhead_max"] = min(ratios) - 1, max(ratios) - 1
    return out


def table(report: dict) -> str:
    a = report["args"]
    shape = f" ({a['shape']} shape, random weights)" if a.get("shape") else ""
    lines = [f"device: {report['device']}; model {a['model']}{shape}; {a['max_tokens']} tokens "
             f"per request; {report['args']['trials']} trials",
             "| batch | free TPOT ms, median [min-max] | json_schema TPOT ms, median [min-max] | overhead, median "
             "[min to max] of the pairs |",
             "|---|---|---|---|"]
    for c in report["cases"]:
        f, j = c["free"], c["json_schema"]
        lines.append(f"| {c['batch']} | {f['tpot_ms']:.2f} [{f['min_ms']:.2f}-{f['max_ms']:.2f}] | "
                     f"{j['tpot_ms']:.2f} [{j['min_ms']:.2f}-{j['max_ms']:.2f}] | {c['overhead'] * 100:+.1f}% "
                     f"[{c['overhead_min'] * 100:+.1f}% to {c['overhead_max'] * 100:+.1f}%] |")
    return "\n".join(lines)


def random_model_dir(shape: str, tokenizer_model: str, out: Path, *, device: torch.device, dtype: str,
                     preset: str = "real") -> Path:
    """A model directory of benchmark ``shape`` with random weights, and the tokenizer, vocabulary
    size and special ids of ``tokenizer_model`` (a directory or a built-in name); written once."""
    if (out / "model.safetensors").is_file():
        return out
    from safetensors.torch import save_file

    source = resolve_model_dir(tokenizer_model)
    own = json.loads((source / "config.json").read_text())
    cfg = {**model_config(shape, preset), "torch_dtype": dtype,
           **{k: own[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id") if k in own}}
    model, _ = build_segkv(cfg, device=device, dtype=parse_dtype(dtype))
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    state = {k: v.to("cpu").contiguous() for k, v in model.state_dict().items()}
    del model
    save_file(state, out / "model.safetensors.tmp")
    os.replace(out / "model.safetensors.tmp", out / "model.safetensors")
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="a model directory or a built-in name")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--batches", type=int_list, default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--shape", default=None, help="e.g. llama-3.1-8b: random weights of that shape, --model's tokenizer")
    parser.add_argument("--preset", choices=("real", "tiny"), default="real", help="--shape's sizes (tiny: tests)")
    parser.add_argument("--work-dir", default="/tmp/segkv-structured", help="where --shape's model directory is written")
    parser.add_argument("--json", default=None, help="write the report to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.trials < 1 or args.max_tokens < 2:
        raise SystemExit("--trials must be >= 1 and --max-tokens >= 2")
    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)")
    print(f"device {name}; {dtype}; torch {torch.__version__}", flush=True)
    model = args.model
    if args.shape:
        model = str(random_model_dir(args.shape, args.model, Path(args.work_dir) / f"{args.shape}-{args.preset}",
                                     device=device, dtype=dtype, preset=args.preset))
        torch.cuda.empty_cache() if device.type == "cuda" else None
    llm = LLM(model, dtype=dtype, device=str(device), cuda_graphs="auto")  # as a server decodes
    report = {"device": name, "torch": torch.__version__, "python": sys.version.split()[0], "dtype": dtype,
              "args": vars(args), "cases": []}
    for batch in args.batches:
        case = bench_batch(llm, batch, args)
        report["cases"].append(case)
        print(f"batch {batch}: free {case['free']['tpot_ms']:.2f} ms, json_schema {case['json_schema']['tpot_ms']:.2f}"
              f" ms per token ({case['overhead'] * 100:+.1f}%); grammar compiled in {case['compile_s']:.3f} s",
              flush=True)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(args.json + ".tmp")
            tmp.write_text(json.dumps(report, indent=1))
            os.replace(tmp, args.json)
    print(table(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
