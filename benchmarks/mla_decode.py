"""MLA decode benchmark: absorbed multi-head latent attention over the paged latent cache.

Each cached token holds one latent row of ``kv_lora_rank + rope = 512 + 64`` columns (the
key; the value is its first 512 columns). For every (dtype, batch, context) one latent cache
is filled with random rows and shared by every head count and variant; all variants run in
one process on the same tensors.

Kernel level, per (heads, batch, context, dtype): one decode step's attention, query
``(batch, heads, 576)`` over the latent pages, result ``(batch, heads, 512)``:

- ``torch_default``: plain torch. Each sequence's latent rows are gathered once, before
  timing, into a contiguous ``(batch, context, 576)`` tensor; a step is ``bmm(q, latent^T)``
  in the cache dtype, softmax in float32, ``bmm(p, latent[..., :512])``;
- ``segkv_single``: the planner's ``single`` route, run by the Triton backend;
- ``segkv_split``: the planner's automatic plan when it splits, else a forced ``split``
  (flagged ``split_forced``), so every case has a split figure. The planner's choice is
  reported in every row.

Layer level, same cases: one decode step of a whole ``MultiHeadLatentAttention`` layer with
DeepSeek-V2 widths (128 heads: hidden 5120, q_lora_rank 1536; 16 heads, V2-Lite: hidden
2048, no q_lora_rank; kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128; random weights in
the benchmark dtype): query projection, latent projection of the new token, RoPE, the cache
write, attention, value up-projection and output projection, with attention by
``torch_reference`` (the torch reference backend, absorbed, single plan), ``segkv_single``
or ``segkv_split`` (the kernel level's plans). Plans and their preparation (the step's
metadata, shared by all layers of a model) are built before timing; their host time is
reported separately (``metadata_host_ms``). Every call writes the new token's latent row
into the same slot (each chain's last row, appended once), so the cache does not grow.
``PagedKVStorage.write`` checks the slot range on the host, a device sync a CUDA graph
cannot hold: after one checked call per variant, the timed calls write through the same
``index_copy_`` without that check.

Timing: every variant is captured in a CUDA graph (no launch overhead; a variant whose
capture fails is timed eagerly with events, and the row says so). When a case's latent rows
are smaller than ``4 x L2`` the graph walks through enough copies of the data (chains,
queries, and at layer level weights) that L2 is cold for each call. Trials run the variants
in shuffled order; each figure is the median per call over the trials, with min and max.
GB/s counts the unique bytes a step must read: ``batch x context x 576 x element size`` of
latent rows (layer level: plus the layer's weights); the fraction is of the device-to-device
copy bandwidth measured at the start of the same run.

Run on a CUDA device::

    python -m benchmarks.mla_decode --json mla.json                  # the full grid, or in two parts:
    python -m benchmarks.mla_decode --dtypes bfloat16 --json mla-bf16.json
    python -m benchmarks.mla_decode --dtypes float16 --json mla-fp16.json
    python -m benchmarks.mla_decode --summarise mla-bf16.json mla-fp16.json   # one summary of both
    python -m benchmarks.mla_decode --heads 16,128 --batches 1,8 --contexts 32768,131072 \\
        --dtypes bfloat16 --trials 5                                   # a quick subset

Rows are written to ``--json`` as they complete; ``--stop-after-s`` starts no new case after
that many seconds and lists the cases not run.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from dataclasses import dataclass, field

import torch

from segkv.attention import AttentionShape, DeviceSpec, Route, SequenceQuery, TorchReferenceBackend, plan_attention
from segkv.attention.metadata import AttentionMetadata
from segkv.attention.triton_backend import TritonBackend
from benchmarks.decode_attention import (  # noqa: F401  (MAX_L2_COPIES: re-exported, the cap of l2_copies)
    MAX_L2_COPIES,
    Timer,
    fill_random,
    l2_copies,
    measured_read_bandwidth,
    run_trials,
    time_summary,
)
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, KVLayout
from segkv.layers.mla import MLADims, MultiHeadLatentAttention
from segkv.layers.rotary import RotaryEmbedding, yarn_mscale

KV_LORA_RANK, ROPE_DIM = 512, 64
LATENT_DIM = KV_LORA_RANK + ROPE_DIM
QK_NOPE_DIM, V_HEAD_DIM = 128, 128
# (hidden_size, q_lora_rank) by head count: DeepSeek-V2 and DeepSeek-V2-Lite
LAYER_WIDTHS = {128: (5120, 1536), 16: (2048, None)}
ROPE_THETA, MAX_POSITION = 10000.0, 163840
ROPE_SCALING = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}

DEFAULT_HEADS = "16,128"
DEFAULT_BATCHES = "1,2,8,32"
DEFAULT_CONTEXTS = "2048,8192,32768,65536,131072"
DEFAULT_DTYPES = "bfloat16,float16"
ELEMENT_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}
LONG_CONTEXT = 32768  # the acceptance's "context >= 32K"

KERNEL_VARIANTS = ("torch_default", "segkv_single", "segkv_split")
LAYER_VARIANTS = ("torch_reference", "segkv_single", "segkv_split")
TORCH_VARIANT = {"kernel": "torch_default", "layer": "torch_reference"}
# acceptance at batch 1, context >= 32K (kernel level)
TARGET_FRACTION, TARGET_VS_SINGLE, TARGET_VS_TORCH = 0.8, 1.3, 20.0


# -- grid and arithmetic (no device needed) ---------------------------------------------------
def parse_ints(text: str) -> list[int]:
    """``"1,8, 32"`` -> ``[1, 8, 32]``; every value must be >= 1."""
    values = [int(x) for x in text.replace(" ", "").split(",") if x]
    if not values or min(values) < 1:
        raise ValueError(f"expected a comma-separated list of positive integers, got {text!r}")
    return values


def parse_dtypes(text: str) -> list[str]:
    """``"bfloat16,float16"`` -> the names, each one of ``ELEMENT_SIZES``."""
    names = [x for x in text.replace(" ", "").split(",") if x]
    unknown = [n for n in names if n not in ELEMENT_SIZES]
    if not names or unknown:
        raise ValueError(f"dtypes must be among {', '.join(ELEMENT_SIZES)}; got {text!r}")
    return names


def latent_bytes(batch: int, context: int, element_size: int, latent_dim: int = LATENT_DIM) -> int:
    """Unique latent bytes one decode step reads: ``batch x context x latent_dim x element_size``."""
    return batch * context * latent_dim * element_size


@dataclass(frozen=True, slots=True)
class Case:
    """One latent cache: shared by every head count and variant."""

    dtype: str
    batch: int
    context: int

    @property
    def latent_bytes(self) -> int:
        return latent_bytes(self.batch, self.context, ELEMENT_SIZES[self.dtype])


def grid(batches: list[int], contexts: list[int], dtypes: list[str], *,
         max_latent_gib: float) -> tuple[list[Case], list[tuple[Case, str]]]:
    """The cases in run order (dtype, then batch, then context) and the skipped ones with why.

    A case is skipped when its latent rows exceed ``max_latent_gib`` GiB (the torch default
    path holds a second, contiguous copy of them).
    """
    run, skipped = [], []
    for dtype in dtypes:
        for batch in batches:
            for context in contexts:
                case = Case(dtype, batch, context)
                gib = case.latent_bytes / 2**30
                if gib > max_latent_gib:
                    skipped.append((case, f"{gib:.1f} GiB of latent rows > --max-latent-gib {max_latent_gib:g}"))
                else:
                    run.append(case)
    return run, skipped


def layer_dims(heads: int) -> MLADims:
    """DeepSeek-V2 widths for ``heads`` (128: V2, 16: V2-Lite; other counts: 40 x heads
    hidden, a q_lora_rank of 1536 from 64 heads up)."""
    hidden, q_lora = LAYER_WIDTHS.get(heads, (40 * heads, 1536 if heads >= 64 else None))
    return MLADims(hidden_size=hidden, num_heads=heads, q_lora_rank=q_lora, kv_lora_rank=KV_LORA_RANK,
                   qk_nope_head_dim=QK_NOPE_DIM, qk_rope_head_dim=ROPE_DIM, v_head_dim=V_HEAD_DIM)


def softmax_scale(dims: MLADims) -> float:
    """DeepSeek's: ``qk_head_dim ** -0.5 x mscale(factor, mscale_all_dim) ** 2`` under YaRN."""
    mscale = yarn_mscale(ROPE_SCALING["factor"], ROPE_SCALING["mscale_all_dim"])
    return dims.qk_head_dim**-0.5 * mscale**2


def deepseek_rotary() -> RotaryEmbedding:
    """The V2 RoPE of the 64 rope columns: YaRN x40 over 4K, interleaved pairs."""
    return RotaryEmbedding(ROPE_DIM, base=ROPE_THETA, max_position=MAX_POSITION, scaling=dict(ROPE_SCALING),
                           interleaved=True)


def torch_default_attention(query: torch.Tensor, latent: torch.Tensor, *, rank: int, scale: float) -> torch.Tensor:
    """Absorbed MLA decode in plain torch over contiguous latent rows.

    Args:
        query: ``(B, H, rank + rope)``; latent: ``(B, n, rank + rope)``, same dtype.
        rank: value width (the first ``rank`` latent columns are the values).
        scale: softmax scale.

    Returns:
        ``(B, H, rank)`` in the query dtype: scores by ``bmm`` in the input dtype, softmax in
        float32, probabilities rounded back to the input dtype for the second ``bmm``.
    """
    scores = torch.bmm(query, latent.transpose(1, 2))
    probs = torch.softmax(scores.float() * scale, dim=-1).to(query.dtype)
    return torch.bmm(probs, latent[:, :, :rank])


class UncheckedLatentWrites:
    """An MLA ``PagedKVStorage`` whose ``write`` is the bare ``index_copy_`` of the storage's own,
    without its host-side slot-range check (a device sync, which a CUDA graph cannot hold).
    Reads are the storage's views."""

    def __init__(self, storage) -> None:
        if not storage.latent:
            raise ValueError("UncheckedLatentWrites needs an 'mla' storage")
        self.storage = storage
        self._flat = [t.view(t.shape[0] * t.shape[1], t.shape[2]) for t in storage.latent]

    def key_cache(self, layer: int) -> torch.Tensor:
        return self.storage.key_cache(layer)

    def value_cache(self, layer: int) -> torch.Tensor:
        return self.storage.value_cache(layer)

    def kv_scales(self, layer: int):
        return self.storage.kv_scales(layer)

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None = None,
              *, trusted_slots: bool = True) -> None:
        """``key (n, rank + rope)`` rows into int64 ``slots (n,)`` on the storage's device."""
        flat = self._flat[layer]
        flat.index_copy_(0, slots, key.to(flat.dtype))


# -- ratios and the summary (no device needed) -----------------------------------------------
def speedups(row: dict) -> dict[str, float | None]:
    """``split_vs_single`` (single ms / split ms) and ``split_vs_torch`` (torch ms / split ms);
    None where a variant has no figure."""
    v = row["variants"]

    def ratio(slow: str, fast: str) -> float | None:
        if slow in v and fast in v and v[fast]["median_ms"] > 0:
            return v[slow]["median_ms"] / v[fast]["median_ms"]
        return None

    return {"split_vs_single": ratio("segkv_single", "segkv_split"),
            "split_vs_torch": ratio(TORCH_VARIANT[row["level"]], "segkv_split")}


def summarise(rows: list[dict], *, long_context: int = LONG_CONTEXT) -> dict:
    """The acceptance view of a run's rows.

    ``batch1_long_context``: every row (kernel and layer) at batch 1 and context >=
    ``long_context``: split's fraction of the copy bandwidth and its speed-ups over single
    and the torch path; kernel rows also say whether each target is met.
    ``split_slower_than_single``: over the whole grid, the rows where the planner chose
    split but split's median is above single's (``beyond_noise``: even split's fastest trial
    is slower than single's slowest).
    """
    long_rows, slower = [], []
    planner_split = {"kernel": 0, "layer": 0}
    for r in rows:
        level, v = r["level"], r["variants"]
        ratios = r.get("speedup") or speedups(r)
        split = v.get("segkv_split")
        if r["batch"] == 1 and r["context"] >= long_context:
            entry = {"level": level, "heads": r["heads"], "context": r["context"], "dtype": r["dtype"],
                     "planner_route": r["planner_route"], "split_forced": r["split_forced"],
                     "split_fraction": split["fraction_of_bandwidth"] if split else None, **ratios}
            if level == "kernel":
                entry["meets"] = {
                    "fraction": split is not None and split["fraction_of_bandwidth"] >= TARGET_FRACTION,
                    "vs_single": (ratios["split_vs_single"] or 0) >= TARGET_VS_SINGLE,
                    "vs_torch": (ratios["split_vs_torch"] or 0) >= TARGET_VS_TORCH,
                }
            long_rows.append(entry)
        if r["planner_route"] == Route.SPLIT.value:
            planner_split[level] += 1
            single = v.get("segkv_single")
            if split and single and split["median_ms"] > single["median_ms"]:
                slower.append({"level": level, "heads": r["heads"], "batch": r["batch"], "context": r["context"],
                               "dtype": r["dtype"], "split_ms": split["median_ms"], "single_ms": single["median_ms"],
                               "slowdown": split["median_ms"] / single["median_ms"],
                               "beyond_noise": split["min_ms"] > single["max_ms"]})
    counts = {level: sum(r["level"] == level for r in rows) for level in ("kernel", "layer")}
    return {"long_context": long_context, "batch1_long_context": long_rows, "rows": counts,
            "planner_split": planner_split, "split_slower_than_single": slower}


def _x(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}x"


def format_summary(summary: dict) -> list[str]:
    """The summary as printable lines."""
    lines = [f"summary: batch 1, context >= {summary['long_context']} (segkv_split; targets at kernel level: "
             f">= {TARGET_FRACTION:.0%} of copy bandwidth, >= {TARGET_VS_SINGLE}x single, "
             f">= {TARGET_VS_TORCH:g}x torch_default)"]
    if not summary["batch1_long_context"]:
        lines.append("  (no such rows)")
    for e in summary["batch1_long_context"]:
        torch_name = TORCH_VARIANT[e["level"]]
        fraction = "n/a" if e["split_fraction"] is None else f"{e['split_fraction']:.0%}"
        text = (f"  {e['level']:6s} H={e['heads']:3d} ctx={e['context']:6d} {e['dtype']:8s} "
                f"planner={e['planner_route']}{' (split forced)' if e['split_forced'] else ''}: "
                f"{fraction} of bandwidth, {_x(e['split_vs_single'])} single, "
                f"{_x(e['split_vs_torch'], 1)} {torch_name}")
        if "meets" in e:
            text += "  [" + ", ".join(f"{k} {'ok' if ok else 'MISSED'}" for k, ok in e["meets"].items()) + "]"
        lines.append(text)
    slower = summary["split_slower_than_single"]
    for level in ("kernel", "layer"):
        n = summary["planner_split"][level]
        bad = [s for s in slower if s["level"] == level]
        lines.append(f"{level} level: planner chose split in {n} of {summary['rows'][level]} rows; "
                     f"split slower than single in {len(bad)} of them")
        for s in bad:
            lines.append(f"  H={s['heads']:3d} B={s['batch']:2d} ctx={s['context']:6d} {s['dtype']:8s}: split "
                         f"{s['split_ms']:.4f} ms vs single {s['single_ms']:.4f} ms ({s['slowdown']:.3f}x; "
                         f"beyond min/max noise: {'yes' if s['beyond_noise'] else 'no'})")
    return lines


def format_row(r: dict, elapsed: float) -> str:
    """One printed line per completed row."""
    auto = r["plans"]["auto"]
    split = r["plans"]["split"]
    plan = f"planner={auto['route']}x{auto['max_partitions']}"
    if r["split_forced"]:
        plan += f" (split forced x{split['max_partitions']})"
    figures = " ".join(
        f"{n}={x['median_ms']:.4f}ms[{x['min_ms']:.4f}-{x['max_ms']:.4f}] {x['gbps']:.0f}GB/s"
        f"({x['fraction_of_bandwidth']:.0%})" for n, x in r["variants"].items())
    ratios = r.get("speedup") or speedups(r)
    text = (f"[{elapsed:5.0f}s] {r['level']:6s} H={r['heads']:3d} B={r['batch']:2d} ctx={r['context']:6d} "
            f"{r['dtype']:8s} p{r['page_size']} {plan} {figures} split/single={_x(ratios['split_vs_single'])} "
            f"split/{TORCH_VARIANT[r['level']]}={_x(ratios['split_vs_torch'], 1)}")
    if r.get("relative_error"):
        text += f" max_rel_err={max(r['relative_error'].values()):.1e}"
    if r["level"] == "layer" and "metadata_host_ms" in r:
        totals = r["metadata_host_ms"]["totals"]
        text += " metadata(host, untimed)=" + ",".join(f"{n}:{ms:.1f}ms" for n, ms in totals.items())
    eager = [n for n, mode in r["timing"].items() if mode != "cuda_graph"]
    if eager:
        text += " timing=" + ",".join(f"{n}:{r['timing'][n]}" for n in eager)
    if r["errors"]:
        text += f" errors={r['errors']}"
    return text


# -- timing -----------------------------------------------------------------------------------
def relative_error(out: torch.Tensor, want: torch.Tensor) -> float:
    """``max |out - want| / max |want|``, in float32."""
    out, want = out.float(), want.float()
    return float((out - want).abs().max() / want.abs().max().clamp_min(1e-30))


def check_outputs(fns: dict[str, list], baseline: str) -> tuple[dict[str, float], dict[str, str]]:
    """Each variant's first call against ``baseline``'s: ``(relative errors, errors raised)``.
    Calls return a tensor or an ``(out, lse)`` pair."""

    def first(name: str) -> torch.Tensor:
        value = fns[name][0]()
        return value[0] if isinstance(value, tuple) else value

    errors: dict[str, str] = {}
    try:
        want = first(baseline)
    except Exception as exc:
        return {}, {baseline: f"check: {_short(exc)}"}
    rel = {}
    for name in fns:
        if name != baseline:
            try:
                rel[name] = relative_error(first(name), want)
            except Exception as exc:
                errors[name] = f"check: {_short(exc)}"
    return rel, errors


def _short(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:160] if lines else ''}"


def build_timers(fns: dict[str, list]) -> tuple[dict, dict[str, str], dict[str, str]]:
    """A CUDA-graph timer per variant, else an eager one; returns ``(timers, timing, errors)``
    with ``timing[name]`` one of ``cuda_graph``, ``eager`` or ``failed``."""
    timers, timing, errors = {}, {}, {}
    for name, calls in fns.items():
        try:
            timers[name] = Timer.capture(calls)
            timing[name] = "cuda_graph"
            continue
        except Exception as exc:
            errors[name] = f"capture: {_short(exc)}"
        try:
            torch.cuda.synchronize()
            timers[name] = Timer.eager(calls)
            timing[name] = "eager"
        except Exception as exc:
            errors[name] += f"; eager: {_short(exc)}"
            timing[name] = "failed"
    return timers, timing, errors


# -- cases ------------------------------------------------------------------------------------
@dataclass
class CaseData:
    """One (dtype, batch, context) cache and everything that does not depend on the head count.

    Per L2 copy ``i``: ``chains[i]`` (``batch`` chains of ``context`` rows), their
    ``queries[i]`` (one query row each, the last row), ``slots[i]`` ``(batch,)`` int64 (the
    last rows' slots), ``positions[i]`` ``(batch,)`` int64 (``context - 1``) and
    ``contiguous[i]`` ``(batch, context, 576)`` (the torch default path's gathered rows).
    """

    case: Case
    page_size: int
    copies: int
    cache: PagedKVCache
    chains: list = field(default_factory=list)
    queries: list = field(default_factory=list)
    slots: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    contiguous: list = field(default_factory=list)
    build_s: float = 0.0

    def release(self) -> None:
        for group in self.chains:
            for chain in group:
                chain.release()
        self.chains, self.contiguous = [], []


def build_case(case: Case, *, page_size: int, l2_bytes: int, gen: torch.Generator, device: str = "cuda",
               contiguous: bool = True) -> CaseData:
    """Allocate and fill the latent cache of ``case`` and its chains (see :class:`CaseData`)."""
    started = time.perf_counter()
    dtype = getattr(torch, case.dtype)
    copies = l2_copies(case.latent_bytes, l2_bytes)
    pages_per_seq = -(-case.context // page_size)
    layout = KVLayout(num_layers=1, kind="mla", kv_lora_rank=KV_LORA_RANK, rope_dim=ROPE_DIM, dtype=dtype)
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=copies * case.batch * pages_per_seq + 1),
                         device=device, compaction=CompactionPolicy(enabled=False))
    fill_random(cache, gen)
    data = CaseData(case, page_size, copies, cache)
    latent = cache.storage.latent[0]
    for _ in range(copies):
        chains = [cache.new_chain() for _ in range(case.batch)]
        last = [chain.append(case.context)[-1] for chain in chains]
        data.chains.append(chains)
        data.queries.append([SequenceQuery.from_chain(c, 1) for c in chains])
        data.slots.append(torch.tensor(last, dtype=torch.long, device=device))
        data.positions.append(torch.full((case.batch,), case.context - 1, dtype=torch.long, device=device))
        if contiguous:
            rows = []
            for chain in chains:
                pages = torch.tensor([p for s in chain.spans() for p in s.page_ids], device=device)
                rows.append(latent[pages].flatten(0, 1)[:case.context])
            data.contiguous.append(torch.stack(rows))
    if device == "cuda":
        torch.cuda.synchronize()
    data.build_s = time.perf_counter() - started
    return data


@dataclass
class PlanSet:
    """The plans of one (case, heads): ``describe()`` of ``single``, ``auto`` (the planner's
    choice) and ``split``, and per copy the Triton backend's preparations of ``single`` and
    ``split`` and the reference backend's of ``single``."""

    describe: dict
    planner_route: str
    split_forced: bool
    prepared: dict  # variant name -> [prepared per copy]
    metadata_host_ms: dict  # host wall time of copy 0's planning and preparation


def metadata_totals(parts: dict[str, float]) -> dict[str, float]:
    """Per variant, the host time of its step metadata from the timed parts (ms): the plan
    (``plan_single``; ``plan_auto`` plus ``plan_split`` when split was forced) and its
    preparation (``prepare_single``, ``prepare_split``, ``prepare_reference``)."""
    totals = {"segkv_single": parts["plan_single"] + parts["prepare_single"],
              "segkv_split": parts["plan_auto"] + parts.get("plan_split", 0.0) + parts["prepare_split"]}
    if "prepare_reference" in parts:
        totals["torch_reference"] = parts["plan_single"] + parts["prepare_reference"]
    return totals


def plan_case(data: CaseData, heads: int, *, spec: DeviceSpec, backend: TritonBackend,
              reference: TorchReferenceBackend | None) -> PlanSet:
    """Plan and prepare every variant of ``data`` at ``heads`` query heads."""
    shape = AttentionShape(heads, 1, LATENT_DIM, KV_LORA_RANK)
    ps = data.page_size
    cuda = data.cache.storage.device.type == "cuda"
    prepared: dict[str, list] = {"segkv_single": [], "segkv_split": []}
    if reference is not None:
        prepared["torch_reference"] = []
    describe, parts, forced = {}, {}, False

    def timed(key: str, first: bool, fn):
        started = time.perf_counter()
        out = fn()
        if first:
            if cuda:
                torch.cuda.synchronize()
            parts[key] = (time.perf_counter() - started) * 1e3
        return out

    for i, queries in enumerate(data.queries):
        first = i == 0
        single = timed("plan_single", first,
                       lambda: plan_attention(queries, shape, spec, page_size=ps, route="single"))
        auto = timed("plan_auto", first, lambda: plan_attention(queries, shape, spec, page_size=ps))
        if auto.route == Route.SPLIT:
            split = auto
        else:
            forced = True
            split = timed("plan_split", first,
                          lambda: plan_attention(queries, shape, spec, page_size=ps, route="split"))
        prepared["segkv_single"].append(timed("prepare_single", first, lambda: backend.prepare(single)))
        prepared["segkv_split"].append(timed("prepare_split", first, lambda: backend.prepare(split)))
        if reference is not None:
            prepared["torch_reference"].append(timed("prepare_reference", first, lambda: reference.prepare(single)))
        if first:
            describe = {"single": single.describe(), "auto": auto.describe(), "split": split.describe()}
    metadata = {"parts": parts, "totals": metadata_totals(parts)}
    return PlanSet(describe, describe["auto"]["route"], forced, prepared, metadata)


def _row(level: str, data: CaseData, heads: int, plans: PlanSet, samples: dict, timing: dict, errors: dict,
         nbytes: int, bandwidth: float) -> dict:
    c = data.case
    row = {"level": level, "heads": heads, "batch": c.batch, "context": c.context, "dtype": c.dtype,
           "page_size": data.page_size, "latent_bytes": c.latent_bytes, "bytes": nbytes, "l2_copies": data.copies,
           "plans": plans.describe, "planner_route": plans.planner_route, "split_forced": plans.split_forced,
           "timing": timing, "errors": errors,
           "variants": {name: time_summary(t, nbytes, bandwidth) for name, t in samples.items() if t}}
    row["speedup"] = speedups(row)
    return row


@torch.no_grad()
def bench_kernel(data: CaseData, heads: int, plans: PlanSet, *, backend: TritonBackend, trials: int,
                 bandwidth: float, gen: torch.Generator) -> dict:
    """Kernel level of one (case, heads): ``torch_default``, ``segkv_single``, ``segkv_split``."""
    dtype = getattr(torch, data.case.dtype)
    storage = data.cache.storage
    device = storage.device
    kc, vc = storage.key_cache(0), storage.value_cache(0)
    scale = softmax_scale(layer_dims(heads))
    fns: dict[str, list] = {name: [] for name in KERNEL_VARIANTS}
    for i in range(data.copies):
        q = torch.randn(data.case.batch, heads, LATENT_DIM, device=device, dtype=dtype, generator=gen)
        fns["torch_default"].append(lambda q=q, lat=data.contiguous[i]: torch_default_attention(
            q, lat, rank=KV_LORA_RANK, scale=scale))
        for name in ("segkv_single", "segkv_split"):
            fns[name].append(lambda p=plans.prepared[name][i], q=q: backend.run(p, q, kc, vc, scale=scale))
    rel, check_errors = check_outputs(fns, "torch_default")
    timers, timing, errors = build_timers(fns)
    errors = {**check_errors, **errors}
    samples = run_trials(timers, trials)
    row = _row("kernel", data, heads, plans, samples, timing, errors, data.case.latent_bytes, bandwidth)
    row.update(metadata_host_ms=plans.metadata_host_ms, relative_error=rel)
    del timers, fns
    return row


@torch.no_grad()
def bench_layer(data: CaseData, heads: int, plans: PlanSet, *, backend: TritonBackend,
                reference: TorchReferenceBackend, trials: int, bandwidth: float, l2_bytes: int,
                gen: torch.Generator) -> dict:
    """Layer level of one (case, heads): one decode step of a ``MultiHeadLatentAttention``
    layer with attention by ``torch_reference``, ``segkv_single`` or ``segkv_split``."""
    dtype = getattr(torch, data.case.dtype)
    device = data.cache.storage.device
    dims = layer_dims(heads)
    rotary = deepseek_rotary()
    scale = softmax_scale(dims)

    def new_layer() -> MultiHeadLatentAttention:
        with torch.device(device):
            layer = MultiHeadLatentAttention(dims, 0, rotary, scale=scale)
        return layer.to(dtype).requires_grad_(False).eval()

    layers = [new_layer()]
    weight_bytes = sum(p.numel() * p.element_size() for p in layers[0].parameters())
    num_layers = l2_copies(weight_bytes, l2_bytes, cap=data.copies)  # cold weights too, as in a model
    layers += [new_layer() for _ in range(num_layers - 1)]
    rotary.init_buffers(device)  # float32 frequencies (the cast above rounded them)
    storage = data.cache.storage
    unchecked = UncheckedLatentWrites(storage)
    backends = {"torch_reference": reference, "segkv_single": backend, "segkv_split": backend}
    fns: dict[str, list] = {name: [] for name in LAYER_VARIANTS}
    for i in range(data.copies):
        x = torch.randn(data.case.batch, dims.hidden_size, device=device, dtype=dtype, generator=gen)
        layer, pos, slots = layers[i % num_layers], data.positions[i], data.slots[i]
        for name in LAYER_VARIANTS:
            prepared = plans.prepared[name][i]
            # one call through the real storage checks the slots (and compiles the kernels)
            layer(x, pos, AttentionMetadata(backends[name], prepared, storage, slots))
            meta = AttentionMetadata(backends[name], prepared, unchecked, slots)
            fns[name].append(lambda layer=layer, x=x, pos=pos, meta=meta: layer(x, pos, meta))
    rel, check_errors = check_outputs(fns, "torch_reference")
    timers, timing, errors = build_timers(fns)
    errors = {**check_errors, **errors}
    samples = run_trials(timers, trials)
    row = _row("layer", data, heads, plans, samples, timing, errors, data.case.latent_bytes + weight_bytes,
               bandwidth)
    row.update(weight_bytes=weight_bytes, layer_copies=num_layers, dims=_dims_dict(dims), relative_error=rel,
               metadata_host_ms=plans.metadata_host_ms,
               metadata="plan + prepare built before timing (metadata_host_ms: host wall time, copy 0)",
               storage_write="index_copy_ into the chain's last slot, range checked once before timing")
    del timers, fns, layers
    return row


def _dims_dict(dims: MLADims) -> dict:
    return {"hidden_size": dims.hidden_size, "num_heads": dims.num_heads, "q_lora_rank": dims.q_lora_rank,
            "kv_lora_rank": dims.kv_lora_rank, "qk_nope_head_dim": dims.qk_nope_head_dim,
            "qk_rope_head_dim": dims.qk_rope_head_dim, "v_head_dim": dims.v_head_dim}


# -- command ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mla_decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default=DEFAULT_HEADS, help="query head counts (default %(default)s)")
    parser.add_argument("--batches", default=DEFAULT_BATCHES, help="batch sizes (default %(default)s)")
    parser.add_argument("--contexts", default=DEFAULT_CONTEXTS, help="context lengths (default %(default)s)")
    parser.add_argument("--dtypes", default=DEFAULT_DTYPES, help="cache/query dtypes (default %(default)s)")
    parser.add_argument("--page-size", type=int, default=16, help="rows per page (default 16; e.g. 32)")
    parser.add_argument("--trials", type=int, default=5, help="shuffled trials per case (>= 5 for the table)")
    parser.add_argument("--max-latent-gib", type=float, default=40.0,
                        help="skip cases whose latent rows exceed this many GiB (default %(default)s)")
    parser.add_argument("--skip-layer", action="store_true", help="kernel level only")
    parser.add_argument("--skip-kernel", action="store_true", help="layer level only")
    parser.add_argument("--stop-after-s", type=float, default=None,
                        help="start no new case after this many seconds (the rest are listed as not run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the report here (rewritten after every row)")
    parser.add_argument("--summarise", nargs="+", metavar="JSON", default=None,
                        help="no benchmark: print one summary of the rows of these reports")
    return parser


def _write(path: str | None, report: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


def summarise_files(paths: list[str]) -> list[str]:
    """The summary lines of the rows of several reports (a grid split across commands)."""
    rows, devices = [], set()
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        rows.extend(report.get("rows", []))
        devices.add(report.get("device", "?"))
    return [f"devices: {', '.join(sorted(devices))}; {len(rows)} rows"] + format_summary(summarise(rows))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.summarise:
        print("\n".join(summarise_files(args.summarise)), flush=True)
        return 0
    if args.trials < 1 or args.page_size < 1:
        raise SystemExit("--trials and --page-size must be >= 1")
    heads = parse_ints(args.heads)
    cases, skipped = grid(parse_ints(args.batches), parse_ints(args.contexts), parse_dtypes(args.dtypes),
                          max_latent_gib=args.max_latent_gib)
    random.seed(args.seed)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    bandwidth = measured_read_bandwidth()
    device_name = torch.cuda.get_device_name()
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    spec = DeviceSpec.cuda()
    import triton

    print(f"device {device_name}; measured copy bandwidth {bandwidth / 1e12:.2f} TB/s (bytes read + written); "
          f"fractions below are of this rate; L2 {l2_bytes / 2**20:.0f} MiB; planner wave {spec.wave_size}; "
          f"{len(cases)} caches x {len(heads)} head counts", flush=True)
    for case, why in skipped:
        print(f"skip {case.dtype} B={case.batch} ctx={case.context}: {why}", flush=True)
    report = {"device": device_name, "bandwidth_bytes_per_s": bandwidth, "l2_bytes": l2_bytes,
              "torch": torch.__version__, "triton": triton.__version__, "args": vars(args),
              "planner_device": {"name": spec.name, "wave_size": spec.wave_size}, "rows": [],
              "skipped": [{"dtype": c.dtype, "batch": c.batch, "context": c.context, "why": w} for c, w in skipped],
              "not_run": []}
    backend = TritonBackend(page_size=args.page_size, device="cuda")
    reference = TorchReferenceBackend(page_size=args.page_size, device="cuda")
    started = time.time()
    for index, case in enumerate(cases):
        if args.stop_after_s is not None and time.time() - started > args.stop_after_s:
            report["not_run"] = [{"dtype": c.dtype, "batch": c.batch, "context": c.context} for c in cases[index:]]
            print(f"--stop-after-s {args.stop_after_s:g} reached; not run: "
                  + ", ".join(f"{c.dtype} B={c.batch} ctx={c.context}" for c in cases[index:]), flush=True)
            break
        data = build_case(case, page_size=args.page_size, l2_bytes=l2_bytes, gen=gen,
                          contiguous=not args.skip_kernel)
        for h in heads:
            plans = plan_case(data, h, spec=spec, backend=backend,
                              reference=None if args.skip_layer else reference)
            rows = []
            if not args.skip_kernel:
                rows.append(bench_kernel(data, h, plans, backend=backend, trials=args.trials, bandwidth=bandwidth,
                                         gen=gen))
                print(format_row(rows[-1], time.time() - started), flush=True)
            if not args.skip_layer:
                rows.append(bench_layer(data, h, plans, backend=backend, reference=reference, trials=args.trials,
                                        bandwidth=bandwidth, l2_bytes=l2_bytes, gen=gen))
                print(format_row(rows[-1], time.time() - started), flush=True)
            for row in rows:
                row["cache_build_s"] = data.build_s
            report["rows"].extend(rows)
            _write(args.json, report)
            del plans
            gc.collect()
            torch.cuda.empty_cache()
        data.release()
        del data
        gc.collect()
        torch.cuda.empty_cache()
    report["elapsed_s"] = time.time() - started
    report["summary"] = summarise(report["rows"])
    print("\n".join(format_summary(report["summary"])), flush=True)
    print(f"done in {report['elapsed_s']:.0f} s", flush=True)
    _write(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
