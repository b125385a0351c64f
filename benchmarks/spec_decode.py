"""Speculative decoding benchmark: end-to-end generation with and without verify windows, and
the cost of one verify-window forward against a plain decode step.

**End-to-end** (``--parts e2e``; CPU or GPU): the built-in models through ``LLM.generate``. Per
group (model, workload, batch, temperature) one plain LLM and one speculative LLM per (method,
k) of that model are built; each trial runs the plain LLM, then every speculative one, on the
same prompts (so the sides alternate and share the machine's state), ``--trials`` times. Prompts:
``--prompts`` of ``--prompt-tokens`` tokens (rounded up to a multiple of the batch), each
generating ``--max-tokens`` tokens (EOS ignored), ``batch`` prompts per ``generate`` call.
tokens/s = tokens generated / wall time of the calls; median [min-max] over the trials; speedup
= speculative median / plain median. Workloads:

* ``heldout``: held-out Python text: the first ``--prompt-tokens`` tokens of the files of the
  default models' test split (``segkv/default_models/metrics.json``, ``corpus.test_files``: files
  the training never saw), read from this interpreter's standard library.
* ``repeat``: a file the answer repeats: ``"Here is a file:\\n<file>\\nRewrite the file with the
  function <f> renamed to <f>_v2:\\n"`` followed by the file's first lines (the file: the first
  lines of a held-out file, about ``--prompt-tokens`` tokens; ``<f>``: its first function).

Speculative statistics come from ``llm.generator.spec_stats``, counted over the timed trials only
(the counters are read before and after): verify windows, draft tokens, accepted tokens, mean
accepted length (tokens per window: 1 + accepted / windows), acceptance per position j (windows
whose first j+1 drafts were kept / windows, vLLM's definition) and the acceptance rate (accepted /
draft tokens). Greedy cases check that every speculative trial generates the plain trials' tokens
(``tokens_equal``; the run exits with status 1 after writing its report if one does not). Methods
that the engine does not have yet (``LLM`` raises NotImplementedError) are reported as skipped.

**Verify-step cost** (``--parts verify``; GPU, or the CPU with ``--preset tiny``): models at the
Llama-3.1-8B and DeepSeek-V2-Lite shapes with random weights (``benchmarks.decode_e2e``), per
(batch, context): every chain holds ``context`` random cache rows; one plain decode step (one row
per sequence) and, for each k, one verify-window forward (k + 1 rows per sequence,
``ModelRunner.forward(..., logit_rows=[k + 1] * batch)``), after which the rows are trimmed back so
the context stays fixed. The sides alternate call by call, ``--verify-steps`` calls each per trial.
Per call: the step time (CUDA events around the call, the device synchronised before it; the
wall time on the CPU) and the host time (from the call to its return, before synchronising: the
Python and launch work; it includes any wait the call itself makes on the device). ratio = window
step time / plain step time. ``--cuda-graphs auto`` (the default) replays both sides from CUDA graphs
where the device has them (decode buckets and verify-window buckets of k + 1 rows), ``off`` runs
both eagerly.
Cases whose cache does not fit the free memory are skipped with the reason.

Run on a GPU: ``python -m benchmarks.spec_decode --json build/spec/gpu.json``; on the CPU, e.g.
``python -m benchmarks.spec_decode --parts e2e --device cpu --cases default:ngram --ks 2,3,4
--batches 1``. ``--markdown A.json [B.json ...]`` prints the tables of saved reports.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from benchmarks.decode_e2e import build_segkv, free_memory_bytes, model_config, trim_to
from benchmarks.runs import int_list, release, summary, sync
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, default_page_size, parse_dtype
from segkv.engine.llm import LLM
from segkv.models.default_models import PACKAGE_ROOT
from segkv.runner.model_runner import ModelRunner, StepInput
from segkv.sampling_params import SamplingParams

CASES = "default:ngram,default-mla:draft_model,default-mla:mtp"
WORKLOADS = ("heldout", "repeat")
VERIFY_MODELS = ("llama-3.1-8b", "deepseek-v2-lite")


# -- prompts --------------------------------------------------------------------------------
def heldout_files() -> list[tuple[str, str]]:
    """``(path, text)`` of the default models' held-out test files (``metrics.json``) found in this
    interpreter's standard library, in the split's order."""
    metrics = PACKAGE_ROOT / "metrics.json"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics} is missing: the held-out split of the default models is unknown")
    names = json.loads(metrics.read_text())["corpus"]["test_files"]
    root = Path(sysconfig.get_paths()["stdlib"])
    out = [(n, (root / n).read_bytes().decode("utf-8", errors="replace")) for n in names if (root / n).is_file()]
    if not out:
        raise FileNotFoundError(f"none of the held-out files {names} is in {root}")
    return out


def heldout_prompts(tokenizer, count: int, tokens: int) -> tuple[list[list[int]], list[str]]:
    """``count`` prompts of ``tokens`` tokens: consecutive windows of the held-out files, taken
    from the files in turn (every file's first window, then the second ones...)."""
    encoded = [(name, tokenizer.encode(text)) for name, text in heldout_files()]
    prompts, names, window = [], [], 0
    while len(prompts) < count:
        found = False
        for name, ids in encoded:
            piece = ids[window * tokens:(window + 1) * tokens]
            if len(piece) == tokens and len(prompts) < count:
                prompts.append(piece)
                names.append(f"{name}[{window}]")
                found = True
        if not found:
            raise ValueError(f"the held-out files hold fewer than {count} windows of {tokens} tokens")
        window += 1
    return prompts, names


def repeat_prompt(text: str, tokenizer, tokens: int) -> str:
    """A prompt whose answer repeats its context: the first lines of ``text`` (about ``tokens``
    tokens), then a request to rewrite them with a function renamed, then their first lines."""
    lines, used = [], 0
    for line in text.splitlines(keepends=True):
        n = len(tokenizer.encode(line))
        if used + n > tokens and lines:
            break
        lines.append(line)
        used += n
    body = "".join(lines)
    name = next((ln[4:].split("(")[0] for ln in lines if ln.startswith("def ") and "(" in ln), None)
    ask = f"the function {name} renamed to {name}_v2" if name else "the function renamed"
    return f"Here is a file:\n{body}\nRewrite the file with {ask}:\n" + "".join(lines[:3])


def repeat_prompts(tokenizer, count: int, tokens: int) -> tuple[list[list[int]], list[str]]:
    files = [(n, t) for n, t in heldout_files() if len(t) > 200]
    out = [(tokenizer.encode(repeat_prompt(files[i % len(files)][1], tokenizer, tokens)), files[i % len(files)][0])
           for i in range(count)]
    return [ids for ids, _ in out], [name for _, name in out]


# -- end to end -----------------------------------------------------------------------------
def parse_cases(text: str) -> list[tuple[str, str]]:
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        model, _, method = item.partition(":")
        if not method:
            raise argparse.ArgumentTypeError(f"a case is model:method, got {item!r}")
        out.append((model, method))
    return out


def size_pair(text: str) -> list[int]:
    """``MIN,MAX`` n-gram sizes."""
    sizes = int_list(text)
    if len(sizes) != 2:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX, got {text!r}")
    return sizes


def spec_config(method: str, k: int, *, draft_model: str, prompt_lookup: list[int] | None = None) -> dict:
    method, _, tree = method.partition("@")  # eagle3@TOPKxNODES: a tree of topk, NODES window rows
    config = {"method": method, "num_speculative_tokens": k}
    if tree:
        topk, _, rows = tree.partition("x")
        config["topk"], config["num_draft_tokens"] = int(topk), int(rows)
    if method == "draft_model":
        config["model"] = draft_model
    if method == "eagle3":  # the target's built-in head
        config["model"] = "default"
    if method == "ngram" and prompt_lookup:
        config["prompt_lookup_min"], config["prompt_lookup_max"] = prompt_lookup
    return config


def stats_snapshot(llm: LLM) -> dict:
    s = llm.generator.spec_stats
    return {"drafts": s.drafts, "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
            "accepted_per_position": list(s.accepted_per_position)}


def stats_delta(before: dict, after: dict) -> dict:
    """Speculative counters between two snapshots, with the derived rates."""
    d = {key: after[key] - before[key] for key in ("drafts", "draft_tokens", "accepted_tokens")}
    per = [a - b for a, b in zip(after["accepted_per_position"], before["accepted_per_position"])]
    windows = d["drafts"]
    d.update(accepted_per_position=per,
             mean_accepted_length=1 + d["accepted_tokens"] / windows if windows else None,
             acceptance_per_position=[n / windows for n in per] if windows else None,
             acceptance_rate=d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else None)
    return d


def tokens_per_forward(case: dict) -> float:
    """Tokens the speculative side generated per forward that produced tokens (the prompt's last
    chunk, decode steps and verify windows each emit one token plus the drafts they accept):
    tokens / (tokens - accepted drafts); the plain side's is 1. Independent of the machine's load."""
    tokens = case.get("generated_tokens") or len(case["speculative"]["trials"]) * case["prompts"] * case["max_tokens"]
    return tokens / (tokens - case["stats"]["accepted_tokens"])


def run_side(llm: LLM, prompts: list[list[int]], batch: int, params: SamplingParams) -> tuple[float, int, list]:
    """Generate every prompt, ``batch`` per call: ``(seconds, tokens generated, token ids per prompt)``."""
    sync(llm.device)
    start = time.perf_counter()
    outputs = []
    for i in range(0, len(prompts), batch):
        outputs += [o.outputs[0].token_ids for o in llm.generate(prompts[i:i + batch], params)]
    sync(llm.device)
    return time.perf_counter() - start, sum(len(t) for t in outputs), [list(t) for t in outputs]


def make_llm(model: str, args, *, pages: int, speculative: dict | None = None) -> LLM:
    return LLM(model, dtype=args.dtype, device=args.device, num_pages=pages, speculative_config=speculative,
               cuda_graphs=graphs_mode(args))


def graphs_mode(args) -> bool | str:
    """The engine's ``cuda_graphs`` for ``--cuda-graphs``."""
    return {"off": False, "auto": "auto", "emulate": "emulate"}[args.cuda_graphs]


def graphs_note(args) -> str:
    if args.cuda_graphs == "emulate":
        return "the CUDA-graph code path emulated on both sides"
    if args.cuda_graphs == "off" or torch.device(args.device).type != "cuda":
        return "eager steps on both sides"
    return "decode steps and verify windows replayed from CUDA graphs on both sides"


def e2e_model(model: str, methods: list[str], workloads: list[str], args) -> Iterator[list[dict]]:
    """The cases of ``model``, a list per (workload, batch, temperature): one plain LLM and one LLM
    per (method, k) are built once; each trial runs the plain LLM, then every speculative one."""
    page = default_page_size(torch.device(args.device).type)
    pages = max(args.batches) * -(-(args.prompt_tokens * 2 + args.max_tokens + 64) // page) + 4
    plain = make_llm(model, args, pages=pages)
    sides: list[tuple[dict, LLM | None]] = []
    for method in methods:
        for k in args.ks:
            config = spec_config(method, k, draft_model=args.draft_model, prompt_lookup=args.prompt_lookup)
            try:
                sides.append(({"method": method, "k": k, "speculative_config": config},
                              make_llm(model, args, pages=pages, speculative=config)))
            except NotImplementedError as exc:
                sides.append(({"method": method, "k": k, "speculative_config": config,
                               "skipped": f"{method} not available: {exc}"}, None))
    try:
        for workload in workloads:
            make = heldout_prompts if workload == "heldout" else repeat_prompts
            for batch in args.batches:
                prompts, names = make(plain.tokenizer, -(-args.prompts // batch) * batch, args.prompt_tokens)
                for temperature in args.temperatures:
                    base = {"model": model, "workload": workload, "batch": batch, "temperature": temperature,
                            "prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts],
                            "prompt_sources": names, "max_tokens": args.max_tokens}
                    cases = e2e_group(plain, [({**base, **c}, llm) for c, llm in sides], prompts, batch,
                                      temperature, args)
                    for case in cases:
                        print(e2e_line(case), flush=True)
                    yield cases
    finally:
        plain = sides = None
        release(torch.device(args.device))


def e2e_group(plain: LLM, sides: list[tuple[dict, LLM | None]], prompts: list[list[int]], batch: int,
              temperature: float, args) -> list[dict]:
    """Plain and each speculative LLM on the same prompts, alternating, ``--trials`` times."""
    live = [(c, llm) for c, llm in sides if llm is not None]
    params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True,
                            seed=None if temperature == 0 else args.seed)
    warm = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True)
    for llm in [plain] + [llm for _, llm in live]:  # untimed: first-call costs out of the trials
        llm.generate(prompts[:batch], warm)
    before = {id(c): stats_snapshot(llm) for c, llm in live}
    rates: dict[int, list[float]] = {id(c): [] for c, _ in live}
    made = {id(c): 0 for c, _ in live}
    plain_rates, reference, plain_equal = [], None, True
    equal = {id(c): True for c, _ in live}
    for _ in range(args.trials):
        seconds, tokens, ids = run_side(plain, prompts, batch, params)
        plain_rates.append(tokens / seconds)
        reference = reference or ids
        plain_equal &= ids == reference
        for case, llm in live:
            seconds, tokens, ids = run_side(llm, prompts, batch, params)
            rates[id(case)].append(tokens / seconds)
            made[id(case)] += tokens
            equal[id(case)] &= ids == reference
    plain_summary = summary(plain_rates)
    for case, llm in live:
        spec = summary(rates[id(case)])
        case.update(plain=plain_summary, speculative=spec,
                    speedup=spec["tokens_per_s"] / plain_summary["tokens_per_s"],
                    stats=stats_delta(before[id(case)], stats_snapshot(llm)), generated_tokens=made[id(case)])
        case["tokens_per_forward"] = tokens_per_forward(case)
        if temperature == 0:
            case["tokens_equal"] = equal[id(case)] and plain_equal
    return [c for c, _ in sides]


def e2e_line(case: dict) -> str:
    head = (f"{case['model']} {case['method']} k={case['k']} {case['workload']} batch {case['batch']} "
            f"T={case['temperature']:g}: ")
    if "skipped" in case:
        return head + "skipped: " + case["skipped"]
    p, s, st = case["plain"], case["speculative"], case["stats"]
    acc = "/".join(f"{a:.2f}" for a in st["acceptance_per_position"] or [])
    mal = st["mean_accepted_length"]
    return (head + f"plain {_rate(p)} spec {_rate(s)} tok/s, speedup {case['speedup']:.2f}x, "
            f"{tokens_per_forward(case):.2f} tokens per forward, accepted length {'-' if mal is None else f'{mal:.2f}'}, per position {acc or '-'}"
            + ("" if "tokens_equal" not in case else f", greedy equal {case['tokens_equal']}"))


def _rate(r: dict) -> str:
    fmt = lambda x: f"{x:.0f}" if x >= 100 else f"{x:.1f}"  # noqa: E731
    return f"{fmt(r['tokens_per_s'])} [{fmt(r['min'])}-{fmt(r['max'])}]"


# -- verify-step cost -----------------------------------------------------------------------
def timed_call(fn, device: torch.device) -> tuple[float, float]:
    """``(step seconds, host seconds)`` of ``fn()``: the device synchronised before; host = time
    until the call returns; step = CUDA events around the call (the wall time on the CPU)."""
    sync(device)
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        start = time.perf_counter()
        fn()
        host = time.perf_counter() - start
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3, host
    start = time.perf_counter()
    fn()
    host = time.perf_counter() - start
    return host, host


def verify_case(model, *, device: torch.device, dtype: torch.dtype, batch: int, context: int, ks: list[int],
                steps: int, trials: int, warmup: int, page_size: int, seed: int, graphs: bool | str = False) -> dict:
    """Step and host times of a plain decode step and of a verify window of k + 1 rows per sequence."""
    layout = model.kv_layout(dtype)
    pages = batch * -(-(context + max(ks) + 2) // page_size) + 2
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=pages), device=device,
                         compaction=CompactionPolicy(enabled=False))
    torch.manual_seed(seed)
    for layer in range(layout.num_layers):  # random rows: the values do not change a step's cost
        cache.storage.key_cache(layer).normal_()
        if layout.kind == "mha":
            cache.storage.value_cache(layer).normal_()
    chains = [cache.new_chain() for _ in range(batch)]
    try:
        for chain in chains:
            chain.append(context)
        # verify windows run MLA absorbed, and replay graphs of their own, as the engine's do
        runner = ModelRunner(model, cache, device=device, cuda_graphs=graphs, max_model_len=context + max(ks) + 2,
                             graph_windows=tuple(k + 1 for k in ks), decode_rows_threshold=max(ks) + 1)
        gen = torch.Generator().manual_seed(seed)
        vocab = model.cfg.vocab_size
        sides = [0, *ks]  # 0: the plain step
        tokens = {n: torch.randint(0, vocab, (batch, n + 1), generator=gen).tolist() for n in sides}

        def call(n: int):
            def step():
                inputs = [StepInput(c, t) for c, t in zip(chains, tokens[n])]
                logits = runner.forward(inputs) if n == 0 else runner.forward(inputs, logit_rows=[n + 1] * batch)
                if logits.shape[0] != batch * (n + 1):
                    raise RuntimeError(f"{logits.shape[0]} logit rows, expected {batch * (n + 1)}")
            return step

        for n in sides:
            for _ in range(warmup):
                timed_call(call(n), device)
                trim_to(chains, context)
        times = {n: {"step": [], "host": []} for n in sides}
        for _ in range(trials):
            trial = {n: ([], []) for n in sides}
            for _ in range(steps):
                for n in sides:
                    step_s, host_s = timed_call(call(n), device)
                    trim_to(chains, context)
                    trial[n][0].append(step_s)
                    trial[n][1].append(host_s)
            for n in sides:
                times[n]["step"].append(statistics.median(trial[n][0]))
                times[n]["host"].append(statistics.median(trial[n][1]))
        if any(c.num_rows != context for c in chains):
            raise RuntimeError("a chain's context changed")
        plain = {key: _spread(values) for key, values in times[0].items()}
        out = {"status": "done", "kv_cache_bytes": pages * page_size * layout.row_bytes, "plain": plain,
               "windows": {}}
        for k in ks:
            w = {key: _spread(values) for key, values in times[k].items()}
            w["ratio"] = w["step"]["median"] / plain["step"]["median"]
            w["host_ratio"] = w["host"]["median"] / plain["host"]["median"]
            out["windows"][str(k)] = w
        return out
    finally:
        for chain in chains:
            chain.release()


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "trials": values}


def run_verify(args, report: dict, write) -> None:
    device, dtype = torch.device(args.device), parse_dtype(args.dtype)
    page_size = args.page_size or default_page_size(device.type)
    reserve = int(args.reserve_gib * 2**30)
    part = report["verify"]
    for name in args.verify_models:
        cfg = model_config(name, args.preset)
        release(device)
        model, _ = build_segkv(cfg, device=device, dtype=dtype)
        part["models"][name] = {"params": sum(p.numel() for p in model.parameters()),
                                "kv_row_bytes": model.kv_layout(dtype).row_bytes,
                                "shape": {k: cfg.get(k) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                                  "num_attention_heads", "num_key_value_heads",
                                                                  "kv_lora_rank", "n_routed_experts")}}
        print(f"{name}: {part['models'][name]['params'] / 1e9:.3f}B parameters ({args.preset} shapes)", flush=True)
        try:
            for batch in args.verify_batches:
                for context in args.contexts:
                    case = {"model": name, "batch": batch, "context": context}
                    pages = batch * -(-(context + max(args.ks) + 2) // page_size) + 2
                    need = pages * page_size * model.kv_layout(dtype).row_bytes + reserve
                    free = free_memory_bytes(device)
                    if need > free:
                        case.update(status="skipped", skipped=f"KV cache + reserve {need / 2**30:.1f} GiB > "
                                                              f"free {free / 2**30:.1f} GiB")
                    else:
                        try:
                            case.update(verify_case(model, device=device, dtype=dtype, batch=batch,
                                                    context=context, ks=args.ks, steps=args.verify_steps,
                                                    trials=args.verify_trials, warmup=args.verify_warmup,
                                                    page_size=page_size, seed=args.seed,
                                                    graphs=graphs_mode(args)))
                        except Exception as exc:
                            case.update(status="error", error=f"{type(exc).__name__}: {str(exc).strip()[:300]}")
                        finally:
                            release(device)
                    part["cases"].append(case)
                    write()
                    print(verify_line(case), flush=True)
        finally:
            model = None
            release(device)


def verify_line(case: dict) -> str:
    head = f"{case['model']} batch {case['batch']} context {_ctx(case['context'])}: "
    if case.get("status") != "done":
        return head + (case.get("skipped") or case.get("error") or "not run")
    p = case["plain"]
    parts = [f"plain {p['step']['median'] * 1e3:.3f} ms (host {p['host']['median'] * 1e3:.3f})"]
    for k, w in case["windows"].items():
        parts.append(f"k={k} {w['step']['median'] * 1e3:.3f} ms x{w['ratio']:.2f} (host {w['host']['median'] * 1e3:.3f})")
    return head + "; ".join(parts)


def _ctx(context: int) -> str:
    return f"{context // 1024}K" if context % 1024 == 0 else str(context)


# -- markdown -------------------------------------------------------------------------------
def markdown_tables(reports: list[dict]) -> str:
    """The end-to-end and verify-step tables of one or more saved reports."""
    lines = []
    e2e = [(r, c) for r in reports for c in r.get("e2e", {}).get("cases", [])]
    if e2e:
        devices = "; ".join(sorted({r["device"] for r, _ in e2e}))
        first = e2e[0][1]
        sizes = [n for _, c in e2e for n in c["prompt_tokens"]]
        lines += [f"Device: {devices}; {e2e[0][0]['dtype']}; {first['max_tokens']} new tokens per prompt, "
                  f"prompts of {min(sizes)}-{max(sizes)} tokens; tokens/s "
                  f"medians [min-max] of {e2e[0][0]['args']['trials']} trials, plain and speculative "
                  "alternating.", "",
                  "| model | method | k | workload | batch | T | plain tok/s | speculative tok/s | speedup "
                  "| tokens / forward | accepted length | acceptance per position | greedy equal |", "|---" * 13 + "|"]
        for _, c in e2e:
            cells = [c["model"], c["method"], str(c["k"]), c["workload"], str(c["batch"]), f"{c['temperature']:g}"]
            if "skipped" in c:
                cells += [f"skipped: {c['skipped'][:80]}"] + ["-"] * 6
            else:
                st = c["stats"]
                mal = st["mean_accepted_length"]
                cells += [_rate(c["plain"]), _rate(c["speculative"]), f"{c['speedup']:.2f}×",
                          f"{tokens_per_forward(c):.2f}",
                          "-" if mal is None else f"{mal:.2f}",
                          " / ".join(f"{a:.2f}" for a in st["acceptance_per_position"] or []) or "-",
                          {True: "yes", False: "NO"}.get(c.get("tokens_equal"), "-")]
            lines.append("| " + " | ".join(x.replace("|", "/") for x in cells) + " |")
    verify = [(r, c) for r in reports for c in r.get("verify", {}).get("cases", [])]
    if verify:
        if lines:
            lines.append("")
        devices = "; ".join(sorted({r["device"] for r, _ in verify}))
        lines += [f"Device: {devices}; {verify[0][0]['dtype']}; {verify[0][0]['args']['preset']} shapes, random "
                  f"weights; {verify[0][0]['graphs']}. Step time per forward (median of trials), ratio = window / plain "
                  "step; host = time to return from the call.", "",
                  "| model | batch | context | k | plain step ms | window step ms | ratio | plain host ms "
                  "| window host ms |", "|---" * 9 + "|"]
        for _, c in verify:
            head = [c["model"], str(c["batch"]), _ctx(c["context"])]
            if c.get("status") != "done":
                lines.append("| " + " | ".join(head + ["-", f"{c.get('skipped') or c.get('error')}"[:80]]
                                                + ["-"] * 4) + " |")
                continue
            p = c["plain"]
            for k, w in c["windows"].items():
                cells = head + [k, f"{p['step']['median'] * 1e3:.3f}", f"{w['step']['median'] * 1e3:.3f}",
                                f"{w['ratio']:.2f}", f"{p['host']['median'] * 1e3:.3f}",
                                f"{w['host']['median'] * 1e3:.3f}"]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- the run --------------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="e2e,verify", help="comma-separated: e2e, verify")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--ks", type=int_list, default=[1, 2, 3, 4], help="speculative tokens per window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cuda-graphs", choices=("auto", "off", "emulate"), default="auto",
                   help="decode steps and verify windows replayed from CUDA graphs (auto: where available)")
    g = p.add_argument_group("end to end")
    g.add_argument("--cases", type=parse_cases, default=parse_cases(CASES), help=f"model:method, ... ({CASES})")
    g.add_argument("--draft-model", default="default", help="the draft model of method draft_model")
    g.add_argument("--prompt-lookup", type=size_pair, default=None, metavar="MIN,MAX",
                   help="the n-gram sizes of method ngram (default: the engine's, 5,5)")
    g.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    g.add_argument("--batches", type=int_list, default=[1, 8])
    g.add_argument("--temperatures", type=_floats, default=[0.0], help="e.g. 0,1 (0: greedy)")
    g.add_argument("--prompts", type=int, default=4, help="prompts per trial (rounded up to the batch)")
    g.add_argument("--prompt-tokens", type=int, default=512)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--trials", type=int, default=3)
    g = p.add_argument_group("verify-step cost")
    g.add_argument("--verify-models", default=",".join(VERIFY_MODELS))
    g.add_argument("--verify-batches", type=int_list, default=[1, 8, 32])
    g.add_argument("--contexts", type=int_list, default=[1024, 32768], help="e.g. 1K,32K")
    g.add_argument("--verify-steps", type=int, default=10, help="calls per side per trial")
    g.add_argument("--verify-trials", type=int, default=3)
    g.add_argument("--verify-warmup", type=int, default=2)
    g.add_argument("--preset", choices=("real", "tiny"), default="real")
    g.add_argument("--page-size", type=int, default=None)
    g.add_argument("--reserve-gib", type=float, default=None, help="memory kept free (default CUDA 4, CPU 0.25)")
    p.add_argument("--json", default=None, help="write the report here after every case")
    p.add_argument("--markdown", nargs="+", default=None, metavar="REPORT_JSON",
                   help="print the tables of saved reports and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.markdown:
        print(markdown_tables([json.loads(Path(p).read_text()) for p in args.markdown]))
        return 0
    parts = [x for x in args.parts.split(",") if x]
    workloads = [x for x in args.workloads.split(",") if x]
    args.verify_models = [x for x in args.verify_models.split(",") if x]
    bad = ([x for x in parts if x not in ("e2e", "verify")] + [w for w in workloads if w not in WORKLOADS]
           + [m for m in args.verify_models if m not in VERIFY_MODELS])
    if bad or args.trials < 1 or args.verify_trials < 1 or args.verify_steps < 1:
        raise SystemExit(f"bad arguments: {bad or 'trials and steps must be >= 1'}")
    device = torch.device(args.device)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if args.reserve_gib is None:
        args.reserve_gib = 4.0 if device.type == "cuda" else 0.25
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)")
    report = {"device": name, "torch": torch.__version__, "python": sys.version.split()[0], "dtype": args.dtype,
              "args": {k: v for k, v in vars(args).items()}, "graphs": graphs_note(args)}

    def write() -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(args.json + ".tmp")
            tmp.write_text(json.dumps(report, indent=1))
            os.replace(tmp, args.json)

    print(f"device {name}; {args.dtype}; torch {torch.__version__}; k {args.ks}; {graphs_note(args)}", flush=True)
    mismatch = False
    if "e2e" in parts:
        report["e2e"] = {"cases": []}
        print(f"end to end: cases {args.cases}; workloads {workloads}; batches {args.batches}; temperatures "
              f"{args.temperatures}; {args.prompts} prompts of {args.prompt_tokens} tokens, {args.max_tokens} new "
              f"tokens; {args.trials} trials", flush=True)
        models: dict[str, list[str]] = {}
        for model, method in args.cases:
            models.setdefault(model, []).append(method)
        for model, methods in models.items():
            for cases in e2e_model(model, methods, workloads, args):
                report["e2e"]["cases"] += cases
                mismatch |= any(c.get("tokens_equal") is False for c in cases)
                write()
        gc.collect()
    if "verify" in parts:
        report["verify"] = {"models": {}, "cases": []}
        print(f"verify-step cost: {args.verify_models} ({args.preset} shapes, random weights); batches "
              f"{args.verify_batches}; contexts {args.contexts}; {args.verify_steps} calls x {args.verify_trials} "
              "trials per side", flush=True)
        run_verify(args, report, write)
    report["greedy_tokens_equal"] = not mismatch
    write()
    if mismatch:
        print("speculative greedy tokens differ from the plain ones (tokens_equal false above)", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
