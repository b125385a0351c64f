"""Tree-window attention benchmark: a tree verify window of N nodes against one decode row over
the same history, through the planner and backend the engine uses.

**Attention** (``--parts attention``, the default): per (shape, batch, history, nodes) every
sequence has its own history of ``context`` random rows, sealed and forked three times (as the
engine's chains are): a decode fork that appends 1 row, a chain fork and a tree fork that append
``nodes`` rows each. Variants, each planned by ``plan_attention`` (route auto, or ``--route``) and
run by the engine's backend (Triton on CUDA, the torch reference on the CPU; ``--backend``):

- ``decode``: one query row over the history (a plain decode step);
- ``chain``: a causal window of ``nodes`` rows (a chain verify window);
- ``tree``: a tree window of ``nodes`` nodes (``SequenceQuery(..., tree_parents=...)``), an
  EAGLE-like tree drawn from ``--seed``: 4-8 children of the last history row, 2-4 children for
  each of the best 2-4 of those, then 1-3 children for each of the best 1-4 nodes of every
  further level, until ``nodes`` nodes.

Shapes: ``llama3-8b`` (GQA, 32 query heads, 8 KV heads, head dim 128) and absorbed MLA
``mla16`` / ``mla128`` (DeepSeek-V2-Lite / V2: 16 / 128 heads over one latent head of 512 + 64
columns, values the first 512; the softmax scale of ``benchmarks.mla_decode``). ``--preset tiny``
(the default on the CPU) shrinks every shape for a smoke run.

Each case prints and records every variant's plan (route, reason, pieces, work items, partials).
Before timing, the tree window's output is checked once against the torch reference backend on
the same plan and against a dense float32 attention over the gathered rows with the tree's mask
(relative error ``max |out - want| / max |want|``; ``--tolerance``); a case that fails is
reported and the run exits with status 1.

Timing on CUDA: each variant's calls are captured in a CUDA graph (an eager timer with CUDA
events where capture fails; the case says which), warmed up first; when the history is smaller
than ``4 x L2`` the calls walk through enough copies of the data that L2 is cold for each
(``benchmarks.decode_attention``). Trials run the variants in shuffled order; figures are the
median, min and max over the trials of the time per call, in microseconds. On the CPU: wall time
per call after one warm-up call, each trial about 5 ms of calls. Ratios: ``tree / decode`` and
``chain / decode`` of the medians. The issue's target (GQA, history >= 32K, 64 nodes, batch 1:
``tree / decode <= 1.3``) is printed as met or not where a case qualifies.

**Model** (``--parts model``): the Llama-3.1-8B shape with random weights
(``benchmarks.decode_e2e``), one ``ModelRunner`` over chains of ``context`` random cache rows:
a plain decode step (one row per sequence), a chain window of ``nodes`` rows and a tree window of
``nodes`` nodes (``StepInput(chain, token_ids, tree_parents=...)``, the same tree as above), each
one forward returning the window's logits, the rows trimmed back afterwards so the context stays
fixed. Sides alternate call by call, ``--model-steps`` calls each per trial; per call the step
time (CUDA events, the device synchronised before it; wall time on the CPU). ratio = window /
plain. Before timing, the tree's logits along its deepest path are compared once with those of a
chain window of that path's tokens (relative error, reported). Where the runner does not take
``tree_parents`` the tree side is reported as skipped.

Run on a CUDA device::

    python -m benchmarks.tree_attention --json build/tree/attention.json
    python -m benchmarks.tree_attention --contexts 8K,32K,128K --nodes 16,64 --batches 1,8 \\
        --json build/tree/attention-grid.json
    python -m benchmarks.tree_attention --parts model --json build/tree/model.json
    python -m benchmarks.tree_attention --parts attention,model --json build/tree/all.json

CPU smoke run (tiny shapes, the torch reference)::

    python -m benchmarks.tree_attention --device cpu --contexts 256 --nodes 16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.decode_attention import fill_random, l2_copies, run_trials
from benchmarks.decode_e2e import build_segkv, free_memory_bytes, model_config, trim_to
from benchmarks.mla_decode import build_timers, layer_dims, relative_error, softmax_scale
from benchmarks.runs import int_list, release, sync
from benchmarks.spec_decode import timed_call
from segkv.attention import AttentionShape, DeviceSpec, SequenceQuery, TorchReferenceBackend, plan_attention
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, KVLayout, default_page_size, parse_dtype
from segkv.runner.model_runner import ModelRunner, StepInput

VARIANTS = ("decode", "chain", "tree")


@dataclass(frozen=True, slots=True)
class ShapeSpec:
    """One attention shape: GQA (``kind`` "mha") or absorbed MLA (``kind`` "mla": one latent head
    of ``key_dim = rank + rope`` columns, values its first ``value_dim = rank``)."""

    name: str
    kind: str
    num_q_heads: int
    num_kv_heads: int
    key_dim: int
    value_dim: int
    mla_heads: int = 0  # MLA: the DeepSeek-V2 layer whose softmax scale is used (0: key_dim ** -0.5)

    @property
    def attention(self) -> AttentionShape:
        return AttentionShape(self.num_q_heads, self.num_kv_heads, self.key_dim, self.value_dim)

    @property
    def scale(self) -> float:
        return softmax_scale(layer_dims(self.mla_heads)) if self.mla_heads else self.key_dim**-0.5

    def layout(self, dtype: torch.dtype) -> KVLayout:
        if self.kind == "mla":
            return KVLayout(num_layers=1, kind="mla", kv_lora_rank=self.value_dim,
                            rope_dim=self.key_dim - self.value_dim, dtype=dtype)
        return KVLayout(num_layers=1, num_kv_heads=self.num_kv_heads, head_dim=self.key_dim, dtype=dtype)

    def row_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one history row (K and V; MLA: the latent row)."""
        element = torch.empty((), dtype=dtype).element_size()
        if self.kind == "mla":
            return self.key_dim * element
        return self.num_kv_heads * (self.key_dim + self.value_dim) * element


SHAPES = {
    "real": {
        "llama3-8b": ShapeSpec("llama3-8b", "mha", 32, 8, 128, 128),
        "mla16": ShapeSpec("mla16", "mla", 16, 1, 576, 512, mla_heads=16),
        "mla128": ShapeSpec("mla128", "mla", 128, 1, 576, 512, mla_heads=128),
    },
    "tiny": {
        "llama3-8b": ShapeSpec("llama3-8b", "mha", 4, 2, 32, 32),
        "mla16": ShapeSpec("mla16", "mla", 4, 1, 40, 32),
        "mla128": ShapeSpec("mla128", "mla", 8, 1, 40, 32),
    },
}
TARGET_RATIO, TARGET_CONTEXT, TARGET_NODES = 1.3, 32768, 64


# -- trees ----------------------------------------------------------------------------------
def eagle_tree(nodes: int, seed: int) -> tuple[int, ...]:
    """``tree_parents`` of an EAGLE-like draft tree of ``nodes`` nodes in level order (parents
    before children): 4-8 children of the last history row (-1); 2-4 children for each of the
    first 2-4 nodes of level 1; then 1-3 children for each of the first 1-4 nodes of every further
    level (the first nodes of a level stand for the drafter's most likely ones)."""
    if nodes < 2:
        raise ValueError(f"a tree needs at least 2 nodes, got {nodes}")
    rng = random.Random(seed)
    parents: list[int] = []
    level = [-1]
    depth = 0
    while len(parents) < nodes:
        depth += 1
        if depth == 1:
            fanouts = [rng.randint(4, 8)]
        elif depth == 2:
            fanouts = [rng.randint(2, 4) for _ in range(min(len(level), rng.randint(2, 4)))]
        else:
            fanouts = [rng.randint(1, 3) for _ in range(min(len(level), rng.randint(1, 4)))]
        nxt: list[int] = []
        for parent, fanout in zip(level, fanouts):
            for _ in range(fanout):
                if len(parents) < nodes:
                    nxt.append(len(parents))
                    parents.append(parent)
        level = nxt
    return tuple(parents)


def tree_depth(parents: tuple[int, ...]) -> int:
    """Levels of the tree (1: every node a child of the last history row)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 + (depths[parent] if parent >= 0 else 0))
    return max(depths, default=0)


# -- attention part -------------------------------------------------------------------------
def chain_rows(chain, tensor: torch.Tensor) -> torch.Tensor:
    """The chain's rows of a ``(num_pages, page_size, heads, dim)`` cache, in position order."""
    parts = []
    for span in chain.spans():
        pages = torch.tensor(span.page_ids, dtype=torch.long, device=tensor.device)
        parts.append(tensor[pages].flatten(0, 1)[:span.num_rows])
    return torch.cat(parts)


def dense_tree_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sq: SequenceQuery,
                         *, scale: float) -> torch.Tensor:
    """Float32 attention of one sequence's window rows ``query`` ``(N, Hq, Dk)`` over its gathered
    ``keys`` ``(T, Hkv, Dk)`` and ``values`` ``(T, Hkv, Dv)``: every row sees the rows before the
    window and, inside it, the nodes of its ancestor mask. Returns ``(N, Hq, Dv)`` float32."""
    n, hq = query.shape[0], query.shape[1]
    start = sq.query_start
    visible = torch.zeros(n, keys.shape[0], dtype=torch.bool, device=query.device)
    visible[:, :start] = True
    for i, mask in enumerate(sq.ancestor_masks()):
        for j in range(n):
            if mask >> j & 1:
                visible[i, start + j] = True
    group = hq // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)  # (T, Hq, Dk)
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,thd->hnt", query.float(), k) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnt,thd->nhd", torch.softmax(scores, dim=-1), v)


def make_backend(name: str, *, page_size: int, device: torch.device):
    """The engine's attention backend for ``device`` ("auto": Triton on CUDA, else the torch
    reference), or the one named."""
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from segkv.attention.triton_backend import TritonBackend

        return TritonBackend(page_size=page_size, device=device)
    return TorchReferenceBackend(page_size=page_size, device=device)


class WallTimer:
    """The CPU's timer of a variant's calls: wall time per call (``ms()``), after one warm-up call
    each, repeated so that one measurement lasts about 5 ms; the ``run_trials`` interface of
    ``benchmarks.decode_attention.Timer``."""

    def __init__(self, fns: list) -> None:
        self.fns, self.reps = list(fns), 1
        for fn in self.fns:
            fn()
        self.reps = max(1, min(100, round(5.0 / max(self.ms(), 1e-3) / len(self.fns))))

    def ms(self) -> float:
        start = time.perf_counter()
        for _ in range(self.reps):
            for fn in self.fns:
                fn()
        return (time.perf_counter() - start) * 1e3 / (self.reps * len(self.fns))


def spread_us(ms_values: list[float]) -> dict:
    """Median / min / max (and every trial) of per-call times given in ms, in microseconds."""
    us = [v * 1e3 for v in ms_values]
    return {"median_us": statistics.median(us), "min_us": min(us), "max_us": max(us), "trials_us": us}


def attention_case(spec: ShapeSpec, *, batch: int, context: int, nodes: int, dtype: torch.dtype,
                   device: torch.device, page_size: int, backend_name: str, route: str | None, trials: int,
                   tolerance: float, seed: int) -> dict:
    """One (shape, batch, history, nodes) case: plans, the tree check and the timings."""
    cuda = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(seed)
    history_bytes = batch * context * spec.row_bytes(dtype)
    copies = l2_copies(history_bytes, torch.cuda.get_device_properties(device).L2_cache_size) if cuda else 1
    per_seq = -(-context // page_size) + 3 * (-(-nodes // page_size) + 1)
    config = CacheConfig(page_size=page_size, num_pages=copies * batch * per_seq + 1)
    cache = PagedKVCache(spec.layout(dtype), config,
                         device=device, compaction=CompactionPolicy(enabled=False))
    fill_random(cache, gen)
    kc, vc = cache.storage.key_cache(0), cache.storage.value_cache(0)
    dev_spec = DeviceSpec.detect(device)
    backend = make_backend(backend_name, page_size=page_size, device=device)
    reference = TorchReferenceBackend(page_size=page_size, device=device)
    parents = eagle_tree(nodes, seed)
    shape, scale = spec.attention, spec.scale
    rows = {"decode": 1, "chain": nodes, "tree": nodes}
    fns: dict[str, list] = {name: [] for name in VARIANTS}
    plans: dict[str, dict] = {}
    held = []
    check: dict = {}
    try:
        for copy in range(copies):
            queries: dict[str, list[SequenceQuery]] = {name: [] for name in VARIANTS}
            tree_chains = []
            for _ in range(batch):
                root = cache.new_chain()
                root.append(context)
                root.seal()
                held.append(root)
                for name in VARIANTS:
                    chain = root.fork()
                    chain.append(rows[name])
                    held.append(chain)
                    tree = parents if name == "tree" else None
                    queries[name].append(SequenceQuery.from_chain(chain, rows[name], tree_parents=tree))
                    if name == "tree":
                        tree_chains.append(chain)
            for name in VARIANTS:
                plan = plan_attention(queries[name], shape, dev_spec, page_size=page_size, route=route)
                prepared = backend.prepare(plan)
                q = torch.randn(batch * rows[name], spec.num_q_heads, spec.key_dim, device=device, dtype=dtype,
                                generator=gen)
                fns[name].append(lambda p=prepared, q=q: backend.run(p, q, kc, vc, scale=scale))
                if copy == 0:
                    plans[name] = plan.describe()
                    if name == "tree":
                        check = check_tree(fns[name][0], reference, plan, q, kc, vc, queries[name], tree_chains,
                                           scale=scale, tolerance=tolerance)
        if cuda:
            sync(device)
            timers, timing, errors = build_timers(fns)
        else:
            timers = {name: WallTimer(calls) for name, calls in fns.items()}
            timing, errors = {name: "wall" for name in fns}, {}
        samples = run_trials(timers, trials)
        del timers
    finally:
        fns.clear()
        for chain in reversed(held):
            chain.release()
    variants = {name: spread_us(values) for name, values in samples.items() if values}
    ratios = {}
    if "decode" in variants:
        base = variants["decode"]["median_us"]
        ratios = {f"{name}/decode": variants[name]["median_us"] / base
                  for name in ("tree", "chain") if name in variants}
    case = {"shape": spec.name, "kind": spec.kind, "heads": dataclasses.asdict(spec), "batch": batch,
            "context": context, "nodes": nodes, "tree_depth": tree_depth(parents), "tree_parents": list(parents),
            "dtype": str(dtype).replace("torch.", ""), "page_size": page_size, "history_bytes": history_bytes,
            "l2_copies": copies, "backend": type(backend).__name__, "plans": plans, "timing": timing,
            "errors": errors, "check": check, "variants": variants, "ratios": ratios}
    if spec.kind == "mha" and context >= TARGET_CONTEXT and nodes == TARGET_NODES and batch == 1 and cuda \
            and "tree/decode" in ratios:
        case["target"] = {"ratio": TARGET_RATIO, "met": ratios["tree/decode"] <= TARGET_RATIO}
    return case


def check_tree(call, reference: TorchReferenceBackend, plan, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
               queries: list[SequenceQuery], chains: list, *, scale: float, tolerance: float) -> dict:
    """The timed tree call's output against the reference backend on the same plan and against
    dense float32 attention with the tree's mask: ``{"vs_reference", "vs_dense", "tolerance", "ok"}``."""
    out = call()[0]
    ref = reference.run(reference.prepare(plan), q, kc, vc, scale=scale)[0]
    dense, row = [], 0
    for sq, chain in zip(queries, chains):
        n = sq.num_query_rows
        dense.append(dense_tree_attention(q[row:row + n], chain_rows(chain, kc), chain_rows(chain, vc), sq,
                                          scale=scale))
        row += n
    want = torch.cat(dense)
    result = {"vs_reference": relative_error(out, ref), "vs_dense": relative_error(out, want),
              "reference_vs_dense": relative_error(ref, want), "tolerance": tolerance}
    result["ok"] = all(result[k] <= tolerance for k in ("vs_reference", "vs_dense", "reference_vs_dense"))
    return result


def case_lines(case: dict) -> list[str]:
    head = (f"{case['shape']} batch {case['batch']} history {case['context']} nodes {case['nodes']} "
            f"(depth {case['tree_depth']}), {case['backend']}, {case['l2_copies']} L2 cop"
            f"{'y' if case['l2_copies'] == 1 else 'ies'}")
    lines = [head]
    for name in VARIANTS:
        p = case["plans"].get(name, {})
        v = case["variants"].get(name)
        times = (f"{v['median_us']:.1f} us [{v['min_us']:.1f}-{v['max_us']:.1f}]" if v
                 else f"not timed ({case['errors'].get(name, '')})")
        lines.append(f"  {name:6s} {times} ({case['timing'].get(name, '?')}); plan {p.get('route')}: "
                     f"{p.get('pieces')} pieces, {p.get('work_items')} work items, {p.get('partials')} partials; "
                     f"{p.get('reason')}")
    c = case["check"]
    if c:
        lines.append(f"  tree check: vs reference {c['vs_reference']:.2e}, vs dense {c['vs_dense']:.2e}, "
                     f"reference vs dense {c['reference_vs_dense']:.2e} (tolerance {c['tolerance']:.0e}): "
                     f"{'ok' if c['ok'] else 'FAILED'}")
    ratios = ", ".join(f"{k} {v:.2f}x" for k, v in case["ratios"].items())
    if ratios:
        target = case.get("target")
        lines.append(f"  ratios: {ratios}" + (f"; target tree/decode <= {target['ratio']}: "
                                              f"{'met' if target['met'] else 'NOT met'}" if target else ""))
    return lines


def run_attention(args, report: dict, write) -> bool:
    """Every attention case; False if a tree check failed."""
    device, dtype = torch.device(args.device), parse_dtype(args.dtype)
    page_size = args.page_size or default_page_size(device.type)
    ok = True
    for name in args.shapes:
        spec = SHAPES[args.preset][name]
        for batch in args.batches:
            for context in args.contexts:
                for nodes in args.nodes:
                    started = time.perf_counter()
                    try:
                        case = attention_case(spec, batch=batch, context=context, nodes=nodes, dtype=dtype,
                                              device=device, page_size=page_size, backend_name=args.backend,
                                              route=args.route, trials=args.trials, tolerance=args.tolerance,
                                              seed=args.seed)
                    except Exception as exc:
                        case = {"shape": name, "batch": batch, "context": context, "nodes": nodes,
                                "status": "error", "error": f"{type(exc).__name__}: {str(exc).strip()[:300]}"}
                        print(f"{name} batch {batch} history {context} nodes {nodes}: {case['error']}", flush=True)
                        ok = False
                    else:
                        ok = ok and case["check"].get("ok", False)
                        for line in case_lines(case):
                            print(line, flush=True)
                        print(f"  ({time.perf_counter() - started:.1f} s)", flush=True)
                    finally:
                        release(device)
                    report["attention"].append(case)
                    write()
    return ok


# -- model part -----------------------------------------------------------------------------
def runner_takes_trees() -> bool:
    """Whether ``StepInput`` has a ``tree_parents`` field (the runner's tree verify windows)."""
    return "tree_parents" in {f.name for f in dataclasses.fields(StepInput)}


def model_case(model, *, device: torch.device, dtype: torch.dtype, batch: int, context: int, nodes: int,
               steps: int, trials: int, warmup: int, page_size: int, seed: int, graphs: bool | str) -> dict:
    """Step times of a plain decode step, a chain window and a tree window of ``nodes`` rows."""
    layout = model.kv_layout(dtype)
    pages = batch * -(-(context + nodes + 2) // page_size) + 2
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=pages), device=device,
                         compaction=CompactionPolicy(enabled=False))
    torch.manual_seed(seed)
    for layer in range(layout.num_layers):  # random rows: the values do not change a step's cost
        cache.storage.key_cache(layer).normal_()
        if layout.kind == "mha":
            cache.storage.value_cache(layer).normal_()
    parents = eagle_tree(nodes, seed)
    trees = runner_takes_trees()
    chains = [cache.new_chain() for _ in range(batch)]
    try:
        for chain in chains:
            chain.append(context)
        runner = ModelRunner(model, cache, device=device, cuda_graphs=graphs, max_model_len=context + nodes + 2,
                             graph_windows=(nodes,), decode_rows_threshold=nodes)
        gen = torch.Generator().manual_seed(seed)
        vocab = model.cfg.vocab_size
        tokens = {"plain": torch.randint(0, vocab, (batch, 1), generator=gen).tolist(),
                  "window": torch.randint(0, vocab, (batch, nodes), generator=gen).tolist()}
        sides = ["plain", "chain"] + (["tree"] if trees else [])

        def call(side: str):
            def step():
                if side == "plain":
                    logits = runner.forward([StepInput(c, t) for c, t in zip(chains, tokens["plain"])])
                    want = batch
                else:
                    extra = {"tree_parents": parents} if side == "tree" else {}
                    inputs = [StepInput(c, t, **extra) for c, t in zip(chains, tokens["window"])]
                    logits = runner.forward(inputs, logit_rows=[nodes] * batch)
                    want = batch * nodes
                if logits.shape[0] != want:
                    raise RuntimeError(f"{side}: {logits.shape[0]} logit rows, expected {want}")
            return step

        path_check = tree_path_check(runner, chains[0], tokens["window"][0], parents, context) if trees else None
        for side in sides:
            for _ in range(warmup):
                timed_call(call(side), device)
                trim_to(chains, context)
        times: dict[str, list[float]] = {side: [] for side in sides}
        for _ in range(trials):
            trial: dict[str, list[float]] = {side: [] for side in sides}
            for _ in range(steps):
                for side in sides:
                    step_s, _host = timed_call(call(side), device)
                    trim_to(chains, context)
                    trial[side].append(step_s * 1e3)
            for side in sides:
                times[side].append(statistics.median(trial[side]))
        if any(c.num_rows != context for c in chains):
            raise RuntimeError("a chain's context changed")
        out = {"status": "done", "tree_depth": tree_depth(parents), "tree_parents": list(parents),
               "tree_path_check": path_check,
               "graphs": getattr(runner, "graphs", None) is not None,
               "variants": {side: spread_us(values) for side, values in times.items()}}
        plain = out["variants"]["plain"]["median_us"]
        out["ratios"] = {f"{side}/plain": out["variants"][side]["median_us"] / plain
                         for side in sides if side != "plain"}
        if not trees:
            out["tree"] = "skipped: StepInput has no tree_parents (the runner takes no tree windows)"
        return out
    finally:
        for chain in chains:
            chain.release()


def tree_path_check(runner, chain, tokens: list[int], parents: tuple[int, ...], context: int) -> dict:
    """The tree window's logits along its deepest path against a chain window of the path's tokens
    on the same history: ``{"path", "relative_error"}``."""
    depth = [0] * len(parents)
    for node, parent in enumerate(parents):
        depth[node] = 1 + (depth[parent] if parent >= 0 else 0)
    node, path = max(range(len(parents)), key=depth.__getitem__), []
    while node >= 0:
        path.append(node)
        node = parents[node]
    path.reverse()
    tree = runner.forward([StepInput(chain, tokens, tree_parents=parents)], logit_rows=[len(tokens)])
    trim_to([chain], context)
    line = runner.forward([StepInput(chain, [tokens[i] for i in path])], logit_rows=[len(path)])
    trim_to([chain], context)
    return {"path": path, "relative_error": relative_error(tree[path], line)}


def run_model(args, report: dict, write) -> None:
    device, dtype = torch.device(args.device), parse_dtype(args.dtype)
    page_size = args.page_size or default_page_size(device.type)
    cfg = model_config("llama-3.1-8b", args.preset)
    release(device)
    model, _ = build_segkv(cfg, device=device, dtype=dtype)
    part = report["model"]
    part["model"] = {"name": "llama-3.1-8b", "preset": args.preset, "random_weights": True,
                     "params": sum(p.numel() for p in model.parameters()),
                     "kv_row_bytes": model.kv_layout(dtype).row_bytes, "runner_takes_trees": runner_takes_trees()}
    print(f"llama-3.1-8b ({args.preset} shapes, random weights): {part['model']['params'] / 1e9:.3f}B parameters; "
          f"runner tree windows: {'yes' if part['model']['runner_takes_trees'] else 'no (tree side skipped)'}",
          flush=True)
    graphs = {"off": False, "auto": "auto"}[args.cuda_graphs]
    try:
        for batch in args.batches:
            for context in args.contexts:
                for nodes in args.nodes:
                    case = {"batch": batch, "context": context, "nodes": nodes}
                    pages = batch * -(-(context + nodes + 2) // page_size)
                    need = pages * page_size * model.kv_layout(dtype).row_bytes
                    free = free_memory_bytes(device)
                    if need > free:
                        case.update(status="skipped", skipped=f"KV cache {need / 2**30:.1f} GiB > free "
                                                              f"{free / 2**30:.1f} GiB")
                    else:
                        try:
                            case.update(model_case(model, device=device, dtype=dtype, batch=batch, context=context,
                                                   nodes=nodes, steps=args.model_steps, trials=args.trials,
                                                   warmup=args.model_warmup, page_size=page_size, seed=args.seed,
                                                   graphs=graphs))
                        except Exception as exc:
                            case.update(status="error", error=f"{type(exc).__name__}: {str(exc).strip()[:300]}")
                        finally:
                            release(device)
                    part["cases"].append(case)
                    write()
                    print(model_line(case), flush=True)
    finally:
        model = None
        release(device)


def model_line(case: dict) -> str:
    head = f"model batch {case['batch']} context {case['context']} nodes {case['nodes']}"
    if case.get("status") != "done":
        return f"{head}: {case.get('status')}: {case.get('skipped') or case.get('error')}"
    parts = [f"{side} {v['median_us'] / 1e3:.2f} ms [{v['min_us'] / 1e3:.2f}-{v['max_us'] / 1e3:.2f}]"
             for side, v in case["variants"].items()]
    ratios = ", ".join(f"{k} {v:.2f}x" for k, v in case["ratios"].items())
    tail = f"; {case['tree']}" if "tree" in case else ""
    if case.get("tree_path_check"):
        tail += f"; tree path vs chain logits: relative error {case['tree_path_check']['relative_error']:.2e}"
    return f"{head} (depth {case['tree_depth']}, graphs {case['graphs']}): {', '.join(parts)}; {ratios}{tail}"


# -- command line ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="attention", help="comma-separated: attention, model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--preset", choices=("real", "tiny"), default=None,
                        help="shape sizes (default: real on CUDA, tiny on the CPU)")
    parser.add_argument("--shapes", default="llama3-8b,mla16,mla128",
                        help=f"comma-separated, of {', '.join(SHAPES['real'])}")
    parser.add_argument("--contexts", type=int_list, default=[32768], help="history rows (1K = 1024)")
    parser.add_argument("--nodes", type=int_list, default=[64], help="tree nodes (window rows)")
    parser.add_argument("--batches", type=int_list, default=[1])
    parser.add_argument("--page-size", type=int, default=None, help="default: the engine's for the device")
    parser.add_argument("--backend", choices=("auto", "triton", "reference"), default="auto")
    parser.add_argument("--route", default=None, help="force an attention route (default: the planner's)")
    parser.add_argument("--trials", type=int, default=None, help="default: 20 on CUDA, 5 on the CPU")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="the tree check's relative error bound (default: 2e-2 for 16-bit dtypes, 1e-4 else)")
    parser.add_argument("--model-steps", type=int, default=5, help="model part: calls per side per trial")
    parser.add_argument("--model-warmup", type=int, default=2, help="model part: warm-up calls per side")
    parser.add_argument("--cuda-graphs", choices=("off", "auto"), default="auto",
                        help="model part: the runner's graphs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the report to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.preset = args.preset or ("real" if cuda else "tiny")
    args.trials = args.trials or (20 if cuda else 5)
    dtype = parse_dtype(args.dtype)
    if args.tolerance is None:
        args.tolerance = 2e-2 if torch.empty((), dtype=dtype).element_size() <= 2 else 1e-4
    args.shapes = [s for s in args.shapes.replace(" ", "").split(",") if s]
    parts = [p for p in args.parts.replace(" ", "").split(",") if p]
    unknown = [s for s in args.shapes if s not in SHAPES[args.preset]]
    unknown += [p for p in parts if p not in ("attention", "model")]
    if unknown or not parts:
        raise SystemExit(f"unknown shapes or parts: {', '.join(unknown) or '(none given)'}")
    if min(args.nodes) < 2 or args.trials < 1:
        raise SystemExit("--nodes must be >= 2 and --trials >= 1")
    name = (torch.cuda.get_device_name(device) if cuda
            else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)")
    print(f"device {name}; {args.dtype}; torch {torch.__version__}; preset {args.preset}", flush=True)
    report = {"device": name, "torch": torch.__version__, "python": sys.version.split()[0], "dtype": args.dtype,
              "preset": args.preset, "args": vars(args),
              "shapes": {s: dataclasses.asdict(SHAPES[args.preset][s]) for s in args.shapes},
              "attention": [], "model": {"cases": []}}

    def write() -> None:
        if args.json:
            path = Path(args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=1))

    ok = True
    if "attention" in parts:
        with torch.no_grad():
            ok = run_attention(args, report, write)
    if "model" in parts:
        with torch.no_grad():
            run_model(args, report, write)
    write()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
