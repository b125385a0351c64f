"""Follow-up-turn benchmark: tokens/s, time to first token and peak memory per turn, and forks.

segkv (paged, segmented cache, driven by the engine's Generator) against Hugging Face
``transformers`` holding the same weights, its ``DynamicCache`` carried across turns. A
conversation is a first turn of ``F`` random token ids, then follow-ups of ``--new-tokens`` ids,
each answered with ``--gen-tokens`` greedy tokens (EOS ignored). A turn processes the previous
reply's last token (it has no KV row yet) plus its new ids, in both systems.

Timing, both systems alike, the device synchronised at every mark: TTFT is the turn's prefill
plus its first sampled token (segkv: one ``Generator.step`` over the pending ids, prefilled in
``--prefill-chunk`` pieces; transformers: ``generate(max_new_tokens=1)`` on the cache); decode
is the ``gen - 1`` following tokens (segkv: ``Generator.run``; transformers: a second
``generate`` on the same cache), tokens/s = ``(gen - 1) / decode seconds``.

Memory above the turn's start: ``max_memory_allocated`` after ``reset_peak_memory_stats``
(None on the CPU). segkv's pool is allocated once, so its pages are counted by the pool: segkv's
peak is torch's peak plus the pool's peak above its bytes in use at the start (a compaction
copy at the turn's seal included). The new turn's KV bytes are its rows times the bytes of one
row over all layers, the same for both systems.

Each part is written to ``--json`` as it finishes; a part that fails (e.g. out of memory) is
recorded under ``errors`` and the others go on. ``--markdown A.json B.json ...`` merges reports
into the tables for docs/benchmarks.md, with the acceptance summary (see ``summarize``).
On one GPU, e.g. three commands (turns after 20K, turns after 50K, forks of 50K):
``--first-turns 20000 --skip-forks``, ``--first-turns 50000 --skip-forks``,
``--first-turns 50000 --skip-turns``, each with ``--json`` and ``--stop-after-s``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import os
import platform
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from segkv.cache.kv_cache import PagedKVCache
from segkv.config import CacheConfig, default_page_size, default_prefill_chunk, parse_dtype
from segkv.engine.generation import Generator
from segkv.models.registry import model_class
from segkv.runner.model_runner import ModelRunner
from segkv.sampling_params import SamplingParams
from tools.default_models.training import init_weights

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
}
TINY = {**QWEN3_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096,
        "rope_theta": 10000.0}
# preset -> (config, dtype, weight std); tiny's larger std gives sharp logits (no greedy ties in fp32)
PRESETS = {"qwen3-8b": (QWEN3_8B, "bfloat16", 0.02), "tiny": (TINY, "float32", 0.08)}
MIB = 1 << 20
STOPPED = "stopped (time budget)"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.turns", description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-8b")
    p.add_argument("--first-turns", default="20000,50000", help="comma-separated first-turn token counts")
    p.add_argument("--follow-ups", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=1000, help="new token ids per follow-up turn")
    p.add_argument("--gen-tokens", type=int, default=200, help="greedy tokens generated per turn (>= 2)")
    p.add_argument("--runs", type=int, default=2, help="conversations per system and first turn")
    p.add_argument("--forks", type=int, default=8, help="forks in the fork test")
    p.add_argument("--fork-history", type=int, default=None, help="fork test's first turn (default: largest)")
    p.add_argument("--skip-hf", action="store_true", help="segkv only")
    p.add_argument("--skip-turns", action="store_true", help="only the fork test")
    p.add_argument("--skip-forks", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: the preset's (bfloat16 for qwen3-8b)")
    p.add_argument("--page-size", type=int, default=None, help="rows per page (default: the engine's, 32 on "
                   "CUDA and 16 elsewhere)")
    p.add_argument("--prefill-chunk", type=int, default=None, help="default: the engine's (2048 on CUDA)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="do not ask the runner for CUDA graphs")
    p.add_argument("--hf-attn", default="sdpa", help="transformers attn_implementation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="report file, rewritten after every finished part")
    p.add_argument("--stop-after-s", type=float, default=None,
                   help="start no conversation or fork test expected to end after this many seconds")
    p.add_argument("--markdown", nargs="+", metavar="REPORT_JSON", help="print docs tables of saved reports")
    args = p.parse_args(argv)
    if args.markdown:
        return args
    args.first_turns = [int(x) for x in args.first_turns.split(",") if x.strip()]
    if not args.first_turns or min(args.first_turns) < 1:
        p.error("--first-turns needs positive token counts")
    if args.gen_tokens < 2 or args.new_tokens < 1 or min(args.follow_ups, args.runs, args.forks) < 0:
        p.error("need --gen-tokens >= 2, --new-tokens >= 1 and non-negative counts")
    args.fork_history = args.fork_history or max(args.first_turns)
    if args.page_size is None:
        args.page_size = default_page_size(torch.device(args.device).type)
    return args


# -- models ------------------------------------------------------------------------------
def model_config(args: argparse.Namespace) -> dict:
    """The preset's config, ``max_position_embeddings`` raised to fit the longest chain."""
    cfg = dict(PRESETS[args.preset][0])
    per_turn = args.new_tokens + args.gen_tokens + 1
    need = 64 + max(max(args.first_turns) + args.gen_tokens + args.follow_ups * per_turn,
                    args.fork_history + args.gen_tokens + per_turn)
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], -(-need // 4096) * 4096)
    return cfg


def build_segkv_model(cfg: dict, dtype: torch.dtype, device: torch.device, std: float, seed: int):
    """Random weights made on ``device`` (no checkpoint): built on meta, then empty storage, then init."""
    with torch.device("meta"):
        model = model_class(cfg).from_hf_config(cfg)
    model = model.to_empty(device=device).to(dtype)
    for module in model.modules():  # buffers computed at construction (RoPE tables) were on meta
        if hasattr(module, "init_buffers"):
            module.init_buffers(device)
    torch.manual_seed(seed)
    init_weights(model, std=std)
    return model.eval()


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """segkv's weights under transformers' names, copied (the runner may lay its own out anew).

    segkv's Qwen3 parameters keep the checkpoint names its loader reads one to one, so the map is
    the identity; ``build_hf_model`` loads it strictly, so any drift between the two fails loudly.
    """
    return {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}


def build_hf_model(cfg: dict, state: dict[str, torch.Tensor], device: torch.device, attn: str):
    """transformers' Qwen3ForCausalLM holding ``state``: built on meta, no random init, no host copy."""
    import transformers

    transformers.logging.set_verbosity_error()
    hf_cfg = transformers.Qwen3Config(**cfg, attn_implementation=attn)
    with torch.device("meta"):
        hf = transformers.Qwen3ForCausalLM(hf_cfg)
    hf.load_state_dict(state, strict=True, assign=True)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf.config).to(device)  # its buffers were meta
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"transformers model tensors left on meta: {left[:5]}")
    hf.generation_config.eos_token_id = None  # greedy for the length asked, like ignore_eos
    return hf.eval()


# -- the two systems ---------------------------------------------------------------------
def sync(device: torch.device) -> float:
    """Wait for the device, then read the clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class MemoryMeter:
    """Peak and retained allocated bytes above the start (CUDA only; None elsewhere)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        if self.cuda:
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.start = torch.cuda.memory_allocated(device)

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) - self.start if self.cuda else None

    def retained(self) -> int | None:
        return torch.cuda.memory_allocated(self.device) - self.start if self.cuda else None


class TokenIdsOnly:
    """The part of a tokenizer the Generator uses: token ids in and out, no text, no EOS."""

    eos_token_ids: tuple[int, ...] = ()

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return ""


class SegkvSystem:
    """Turns as ``Conversation.say`` runs them: a chain per conversation, Generator, seal."""

    name = "segkv"

    def __init__(self, model, cache: PagedKVCache, runner: ModelRunner, device: torch.device) -> None:
        self.cache, self.runner, self.device = cache, runner, device
        self.generator = Generator(runner, TokenIdsOnly(), max_model_len=model.max_model_len)

    def start(self):
        return self.cache.new_chain()

    def turn(self, chain, history: list[int], pending: list[int], gen: int) -> dict:
        assert chain.num_rows == len(history), "chain and history out of step"
        pool, counts = self.cache.pool, self.runner.route_counts
        rows0, pages0, bytes0 = chain.num_rows, pool.pages_in_use, pool.bytes_in_use
        copied0, routes0 = pool.bytes_copied, dict(counts)
        pool.reset_peak()
        meter = MemoryMeter(self.device)
        params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
        seq = self.generator.new_sequence(0, chain, history + pending, pending, params)
        t0 = sync(self.device)
        self.generator.step([(seq, len(seq.pending))])  # the prefill and the first token
        t1 = sync(self.device)
        self.generator.run([seq])
        t2 = sync(self.device)
        unsealed = pool.pages_in_use - pages0
        chain.seal()  # the end of the turn (compaction may merge small trailing segments)
        t3 = sync(self.device)
        torch_peak, pool_peak = meter.peak(), pool.peak_bytes_in_use - bytes0
        return {"tokens": list(seq.output_ids), "ttft_s": t1 - t0, "decode_s": t2 - t1, "seal_s": t3 - t2,
                "rows_added": chain.num_rows - rows0, "pages_added": pool.pages_in_use - pages0,
                "pages_added_before_seal": unsealed, "kv_bytes_added": pool.bytes_in_use - bytes0,
                "bytes_copied": pool.bytes_copied - copied0, "torch_peak_above_start": torch_peak,
                "pool_peak_above_start": pool_peak,
                "peak_above_start": None if torch_peak is None else torch_peak + pool_peak,
                "segments": chain.num_segments,
                "routes": {k: v - routes0.get(k, 0) for k, v in counts.items() if v != routes0.get(k, 0)}}

    def fork(self, chain) -> tuple[object, dict]:
        pool = self.cache.pool
        pages0, alloc0 = pool.pages_in_use, pool.bytes_allocated_total
        t0 = sync(self.device)
        child = chain.fork()
        t1 = sync(self.device)
        return child, {"fork_s": t1 - t0, "fork_pages": pool.pages_in_use - pages0,
                       "fork_bytes": pool.bytes_allocated_total - alloc0}

    def release(self, chain) -> None:
        chain.release()


def cache_bytes(cache) -> int:
    """Bytes of a transformers DynamicCache's K/V tensors (layers API, or the older lists)."""
    if hasattr(cache, "layers"):
        tensors = [getattr(layer, name, None) for layer in cache.layers for name in ("keys", "values")]
    else:
        tensors = [*getattr(cache, "key_cache", []), *getattr(cache, "value_cache", [])]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class HfSystem:
    """Turns through ``generate``, one DynamicCache reused by all of a conversation's turns."""

    name = "hf"

    def __init__(self, hf, device: torch.device) -> None:
        from transformers import DynamicCache

        self.hf, self.device, self._cache_cls = hf, device, DynamicCache

    def start(self):
        if "config" in inspect.signature(self._cache_cls.__init__).parameters:
            return self._cache_cls(config=self.hf.config)
        return self._cache_cls()

    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, cache, n: int) -> torch.Tensor:
        with warnings.catch_warnings():  # later 5.x releases rename past_key_values (still accepted)
            warnings.simplefilter("ignore")
            return self.hf.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True,
                                    max_new_tokens=n, do_sample=False, pad_token_id=0)

    def turn(self, cache, history: list[int], pending: list[int], gen: int) -> dict:
        assert cache.get_seq_length() == len(history), "cache and history out of step"
        meter = MemoryMeter(self.device)
        bytes0 = cache_bytes(cache)
        ids = torch.tensor([history + pending], dtype=torch.long, device=self.device)
        mask = torch.ones((1, ids.shape[1] + 1), dtype=torch.long, device=self.device)
        t0 = sync(self.device)
        first = self._generate(ids, mask[:, :-1], cache, 1)  # the uncached suffix's prefill + a token
        t1 = sync(self.device)
        out = self._generate(first, mask, cache, gen - 1)
        t2 = sync(self.device)
        return {"tokens": out[0, ids.shape[1]:].tolist(), "ttft_s": t1 - t0, "decode_s": t2 - t1,
                "rows_added": cache.get_seq_length() - len(history),
                "kv_bytes_added": cache_bytes(cache) - bytes0, "peak_above_start": meter.peak(),
                "retained_above_start": meter.retained()}

    def fork(self, cache) -> tuple[object, dict]:
        meter = MemoryMeter(self.device)
        t0 = sync(self.device)
        child = copy.deepcopy(cache)
        t1 = sync(self.device)
        return child, {"fork_s": t1 - t0, "fork_bytes": cache_bytes(child), "fork_retained": meter.retained()}

    def release(self, cache) -> None:
        """Nothing to do: the cache is freed when the caller drops it."""


# -- conversations and forks -------------------------------------------------------------
def random_ids(vocab: int, n: int, *key: int) -> list[int]:
    """``n`` random token ids, the same for every system (and process) given the same ``key``."""
    g = torch.Generator().manual_seed(hash(key) % (2**61))
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def finish_record(rec: dict, system, gen: int, row_bytes: int, **extra) -> dict:
    """A turn's record with its system, tokens/s and the new turn's KV bytes (rows x row bytes)."""
    rec.update(extra, system=system.name, generated=len(rec["tokens"]),
               decode_tok_s=(gen - 1) / rec["decode_s"], new_turn_kv_bytes=rec["rows_added"] * row_bytes)
    return rec


def conversation(system, first_ids: list[int], followups: list[list[int]], gen: int, row_bytes: int,
                 on_turn=None, keep: bool = False):
    """A first turn, then one turn per follow-up. Returns (records, state or None, history, last)."""
    state, history, pending, last, records = system.start(), [], list(first_ids), None, []
    try:
        for index, new in enumerate([None, *followups]):
            if new is not None:
                pending = [last, *new]
            rec = finish_record(system.turn(state, history, pending, gen), system, gen, row_bytes, turn=index,
                                history_rows=len(history), new_tokens=len(pending))
            history, last = history + pending + rec["tokens"][:-1], rec["tokens"][-1]
            records.append(rec)
            if on_turn is not None:
                on_turn(rec)
    except BaseException:
        system.release(state)  # a failed conversation gives its pages back
        raise
    if not keep:
        system.release(state)
        state = None
    return records, state, history, last


def fork_test(system, args, vocab: int, row_bytes: int, report: dict, save) -> None:
    """From one history, ``--forks`` forks each answer their own follow-up (segkv keeps all alive)."""
    key = (args.seed, args.fork_history, -1)
    base, parent, history, last = conversation(system, random_ids(vocab, args.fork_history, *key), [],
                                               args.gen_tokens, row_bytes, keep=True)
    report["fork_history"][system.name] = {k: v for k, v in base[0].items() if k != "tokens"}
    children = []
    try:
        for i in range(args.forks):
            child, info = system.fork(parent)
            if system.name == "segkv":
                children.append(child)
            pending = [last, *random_ids(vocab, args.new_tokens, *key, i)]
            rec = system.turn(child, history, pending, args.gen_tokens)
            finish_record(rec, system, args.gen_tokens, row_bytes, fork=i, history_rows=len(history),
                          new_tokens=len(pending), **info)
            if system.name == "segkv":
                rec["expected_pages"] = -(-rec["rows_added"] // args.page_size)
                added = f"pages={rec['pages_added']} (own rows' {rec['expected_pages']}) " \
                        f"bytes={rec['kv_bytes_added']:,}"
            else:
                system.release(child)
                added = f"copy={rec['fork_bytes']:,} bytes in {rec['fork_s'] * 1e3:.1f} ms"
            del child
            report["forks"].append(rec)
            print(f"fork  {system.name:5s} #{i} history={len(history)} rows={rec['rows_added']} {added} "
                  f"ttft={rec['ttft_s'] * 1e3:.1f} ms decode={rec['decode_tok_s']:.1f} tok/s", flush=True)
            save()
    finally:
        for child in children:
            system.release(child)
        system.release(parent)


def attempt(report: dict, device: torch.device, what: dict, fn, *args, **kwargs) -> bool:
    """``fn(*args, **kwargs)``; on an error (e.g. out of memory) record it, free memory, go on."""
    try:
        fn(*args, **kwargs)
        return True
    except Exception as exc:  # noqa: BLE001 - one failed part must not lose the others
        report["errors"].append({**what, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        print(f"FAILED {what}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return False
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


# -- summary -----------------------------------------------------------------------------
def _spread(values: list[float]) -> float | None:
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else None


def _max(values) -> float | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _first_turn_summary(rows: list[dict]) -> dict:
    """One system's follow-ups after one first-turn size: tokens/s spread and memory above new KV."""
    by_turn, by_run = {}, {}
    for t in rows:
        by_turn.setdefault(t["turn"], []).append(t["decode_tok_s"])
        by_run.setdefault(t["run"], []).append(t["decode_tok_s"])
    medians = [statistics.median(v) for _, v in sorted(by_turn.items())]
    mem = [t for t in rows if t.get("peak_above_start") is not None]
    return {
        "tok_s_median_per_follow_up": medians, "tok_s_spread": _spread(medians),
        "tok_s_spread_worst_run": _max(map(_spread, by_run.values())),
        "ttft_s_median": statistics.median(t["ttft_s"] for t in rows),
        "max_peak_minus_new_kv": _max(t["peak_above_start"] - t["new_turn_kv_bytes"] for t in mem),
        "max_peak_minus_1p1_new_kv": _max(t["peak_above_start"] - 1.1 * t["new_turn_kv_bytes"] for t in mem),
        "max_new_turn_kv_bytes": max(t["new_turn_kv_bytes"] for t in rows),
    }


def summarize(turns: list[dict], forks: list[dict]) -> dict:
    """The acceptance numbers: memory above the new turn's KV, tokens/s spread, fork pages, agreement."""
    out: dict = {"systems": {}, "forks": {}}
    for system in sorted({t["system"] for t in turns}):
        firsts = sorted({t["first_turn"] for t in turns if t["system"] == system})
        follow_ups = [t for t in turns if t["system"] == system and t["turn"] > 0]
        per = {f: _first_turn_summary(rows) for f in firsts
               if (rows := [t for t in follow_ups if t["first_turn"] == f])}
        ws = [v["max_peak_minus_new_kv"] for v in per.values() if v["max_peak_minus_new_kv"] is not None]
        spreads = [v["tok_s_spread"] for v in per.values() if v["tok_s_spread"] is not None]
        growth = ws[-1] - ws[0] if len(ws) > 1 else None
        tolerance = 0.1 * max((v["max_new_turn_kv_bytes"] for v in per.values()), default=0)
        out["systems"][system] = {
            "by_first_turn": {str(f): v for f, v in per.items()},
            # max(peak - new turn KV) after the longest first turn minus after the shortest
            "workspace_growth_bytes": growth,
            "workspace_independent_of_history": None if growth is None else growth <= tolerance,
            # peak <= 1.1 x new turn KV + this on every follow-up
            "fixed_workspace_bytes": _max(v["max_peak_minus_1p1_new_kv"] for v in per.values()),
            "tok_s_spread_max": _max(spreads),
            "tok_s_spread_within_10pct": None if not spreads else max(spreads) <= 0.10,
        }
    for system in sorted({f["system"] for f in forks}):
        mine = [f for f in forks if f["system"] == system]
        entry = {"forks": len(mine), "ttft_s_median": statistics.median(f["ttft_s"] for f in mine),
                 "rows_added": [f["rows_added"] for f in mine]}
        if system == "segkv":
            entry.update(pages_added=[f["pages_added"] for f in mine],
                         expected_pages=[f["expected_pages"] for f in mine],
                         only_own_pages=all(f["pages_added"] == f["expected_pages"] and f["fork_pages"] == 0
                                            and f["bytes_copied"] == 0 for f in mine))
        else:
            entry.update(copy_bytes_per_fork=[f["fork_bytes"] for f in mine],
                         copy_s_median=statistics.median(f["fork_s"] for f in mine))
        out["forks"][system] = entry
    out["token_agreement"] = token_agreement(turns + forks)
    return out


def token_agreement(records: list[dict]) -> dict:
    """Position-wise equal greedy tokens of segkv and transformers on the same turns."""
    pairs: dict[tuple, dict] = {}
    for r in records:
        key = (r.get("first_turn"), r.get("run"), r.get("turn"), r.get("fork"))
        pairs.setdefault(key, {})[r["system"]] = r["tokens"]
    both = [(p["segkv"], p["hf"]) for p in pairs.values() if "segkv" in p and "hf" in p]
    total = sum(len(a) for a, _ in both)
    equal = sum(x == y for a, b in both for x, y in zip(a, b))
    return {"turns": len(both), "identical_turns": sum(a == b for a, b in both),
            "equal_fraction": equal / total if total else None}


def summary_lines(summary: dict) -> list[str]:
    def mib(x):
        return "n/a" if x is None else f"{x / MIB:,.1f} MiB"

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    lines = []
    for system, s in summary["systems"].items():
        by = s["by_first_turn"]
        ws = ", ".join(f"after {int(f):,}: {mib(v['max_peak_minus_new_kv'])}" for f, v in by.items())
        spread = ", ".join(f"after {int(f):,}: {pct(v['tok_s_spread'])}" for f, v in by.items())
        lines.append(f"{system}: max over follow-ups of (peak above turn start - new turn KV) {ws}; "
                     f"growth with history {mib(s['workspace_growth_bytes'])} (within 10% of a turn's KV: "
                     f"{s['workspace_independent_of_history']}); every follow-up's peak <= 1.1 x new turn KV "
                     f"+ {mib(s['fixed_workspace_bytes'])}")
        lines.append(f"{system}: decode tok/s spread (max - min) / median over the follow-ups {spread} "
                     f"(<= 10%: {s['tok_s_spread_within_10pct']})")
    for system, f in summary["forks"].items():
        if system == "segkv":
            lines.append(f"segkv forks: pages added {f['pages_added']}, own rows' pages "
                         f"{f['expected_pages']}: only their own pages: {f['only_own_pages']}; "
                         f"TTFT median {f['ttft_s_median'] * 1e3:.1f} ms")
        else:
            copy_bytes = statistics.median(f["copy_bytes_per_fork"])
            lines.append(f"{system} forks: a DynamicCache copy per fork costs {mib(copy_bytes)} "
                         f"({f['copy_s_median'] * 1e3:.1f} ms); "
                         f"TTFT median {f['ttft_s_median'] * 1e3:.1f} ms")
    agree = summary.get("token_agreement") or {}
    if agree.get("turns"):
        lines.append(f"greedy tokens segkv vs transformers: {pct(agree['equal_fraction'])} equal by "
                     f"position, {agree['identical_turns']}/{agree['turns']} turns identical")
    return lines


# -- report ------------------------------------------------------------------------------
def _stat(values, scale: float = 1.0, fmt: str = ".1f") -> str:
    values = [v * scale for v in values if v is not None]
    if not values:
        return "n/a"
    med = statistics.median(values)
    return f"{med:{fmt}}" if len(values) == 1 else f"{med:{fmt}} [{min(values):{fmt}}–{max(values):{fmt}}]"


def format_markdown(reports: list[dict]) -> str:
    """Tables for docs/benchmarks.md from one or more saved reports, merged."""
    turns = [t for r in reports for t in r["turns"]]
    forks = [f for r in reports for f in r["forks"]]
    out = ["Runs:", ""] + [f"- `{r['command']}`: {r['config_line']}; {r['status']}" for r in reports]
    out += ["", "Per turn, median [min–max] over runs (turn 0 is the first turn):", "",
            "| system | first turn | turn | history tokens | new tokens | TTFT ms | decode tok/s | "
            "peak above start MiB | new turn KV MiB | peak − new KV MiB | KV copied MiB |",
            "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    groups: dict[tuple, list[dict]] = {}
    for t in turns:
        groups.setdefault((t["system"], t["first_turn"], t["turn"]), []).append(t)
    for (system, first, turn), g in sorted(groups.items()):
        peaks = [t.get("peak_above_start") for t in g]
        over = [None if p is None else p - t["new_turn_kv_bytes"] for p, t in zip(peaks, g)]
        out.append(f"| {system} | {first:,} | {turn} | {_stat([t['history_rows'] for t in g], fmt=',.0f')} | "
                   f"{g[0]['new_tokens']:,} | {_stat([t['ttft_s'] for t in g], 1e3)} | "
                   f"{_stat([t['decode_tok_s'] for t in g])} | {_stat(peaks, 1 / MIB)} | "
                   f"{_stat([t['new_turn_kv_bytes'] for t in g], 1 / MIB)} | {_stat(over, 1 / MIB)} | "
                   f"{_stat([t.get('bytes_copied') for t in g], 1 / MIB)} |")
    if forks:
        out += ["", "Forks of one history, each answering its own follow-up (segkv keeps every fork alive; "
                "transformers copies the DynamicCache per fork):", "",
                "| system | fork | history tokens | rows added | pages added (own rows' pages) | "
                "bytes added | fork op ms | TTFT ms | decode tok/s |",
                "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
        for f in forks:
            segkv = f["system"] == "segkv"
            pages = f"{f['pages_added']} ({f['expected_pages']})" if segkv else "–"
            added = f["kv_bytes_added"] + (0 if segkv else f["fork_bytes"])
            out.append(f"| {f['system']} | {f['fork']} | {f['history_rows']:,} | {f['rows_added']:,} | "
                       f"{pages} | {added:,} | {f['fork_s'] * 1e3:.2f} | {f['ttft_s'] * 1e3:.1f} | "
                       f"{f['decode_tok_s']:.1f} |")
    out += ["", "Summary:", ""] + [f"- {line}" for line in summary_lines(summarize(turns, forks))]
    return "\n".join(out) + "\n"


def write_report(path: str | None, report: dict) -> None:
    """Write the report (with its summary) atomically, if a path was given."""
    if path is None:
        return
    report["summary"] = summarize(report["turns"], report["forks"])
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, target)


def graph_state(runner: ModelRunner) -> dict:
    """The runner's plain attributes that mention graphs (what its CUDA-graph code exposes)."""
    plain = (bool, int, float, str, type(None))
    out = {}
    for name, value in getattr(runner, "__dict__", {}).items():
        if "graph" not in name.lower():
            continue
        if isinstance(value, plain):
            out[name] = value
        elif isinstance(value, dict):
            out[name] = {str(k): v if isinstance(v, plain) else type(v).__name__ for k, v in value.items()}
        elif isinstance(value, (list, tuple, set)):
            out[name] = f"{type(value).__name__} of {len(value)}"
        else:
            out[name] = type(value).__name__
    return out


def pool_pages(args: argparse.Namespace) -> int:
    """Pages for the largest conversation or fork test, a compaction copy and 5% margin."""
    def pages(rows: int) -> int:
        return -(-rows // args.page_size) + 1

    turn = pages(args.new_tokens + args.gen_tokens + 1)
    conv = 0 if args.skip_turns else pages(max(args.first_turns) + args.gen_tokens) + args.follow_ups * turn
    forks = 0 if args.skip_forks else pages(args.fork_history + args.gen_tokens) + args.forks * turn
    warm = pages(min(4096, *args.first_turns) + 16) + 2 * turn
    return int(1.05 * (max(conv, forks, warm) + pages(4096))) + 64


def turn_line(rec: dict) -> str:
    peak = rec.get("peak_above_start")
    peak_s = "n/a" if peak is None else f"{peak / MIB:.1f} MiB"
    return (f"{rec['system']:5s} first={rec['first_turn']} run={rec['run']} turn={rec['turn']} "
            f"history={rec['history_rows']} new={rec['new_tokens']} ttft={rec['ttft_s'] * 1e3:.1f} ms "
            f"decode={rec['decode_tok_s']:.1f} tok/s peak_above_start={peak_s} "
            f"new_kv={rec['new_turn_kv_bytes'] / MIB:.1f} MiB")


def graph_words(requested, runner: ModelRunner) -> str:
    if requested is None:
        return "off"
    active = getattr(runner, "graphs", None) is not None
    return f"asked for (cuda_graphs={requested!r}; runner.graphs {'set' if active else 'unset'})"


def make_runner(model, cache: PagedKVCache, device: torch.device, prefill_chunk: int | None, *, graphs: bool):
    """The runner, with CUDA graphs asked for where its constructor takes ``cuda_graphs`` (True, or
    "auto" where it wants a mode name). Returns it and the value passed (None: not asked)."""
    param = inspect.signature(ModelRunner).parameters.get("cuda_graphs")
    if param is None or not graphs:
        return ModelRunner(model, cache, device=device, prefill_chunk=prefill_chunk), None
    value = "auto" if isinstance(param.default, str) else True
    try:
        return ModelRunner(model, cache, device=device, prefill_chunk=prefill_chunk, cuda_graphs=value), value
    except (TypeError, ValueError):  # the other spelling
        value = True if value == "auto" else "auto"
        return ModelRunner(model, cache, device=device, prefill_chunk=prefill_chunk, cuda_graphs=value), value


def setup(args: argparse.Namespace, argv: list[str]) -> tuple[dict, list, ModelRunner]:
    """The model(s), cache and runner on the device, and the report's configuration."""
    device, cfg = torch.device(args.device), model_config(args)
    _, preset_dtype, std = PRESETS[args.preset]
    dtype = parse_dtype(args.dtype or preset_dtype)
    model = build_segkv_model(cfg, dtype, device, std, args.seed)
    hf = None if args.skip_hf else build_hf_model(cfg, hf_state_dict(model), device, args.hf_attn)
    layout, num_pages = model.kv_layout(dtype), pool_pages(args)
    cache = PagedKVCache(layout, CacheConfig(page_size=args.page_size, num_pages=num_pages),
                         device=str(device))
    args.prefill_chunk = args.prefill_chunk or default_prefill_chunk(device.type)
    runner, graphs = make_runner(model, cache, device, args.prefill_chunk,
                                 graphs=device.type == "cuda" and not args.no_cuda_graphs)
    graphs_supported = "cuda_graphs" in inspect.signature(ModelRunner).parameters
    if device.type == "cuda":
        torch.cuda.empty_cache()
    systems = [SegkvSystem(model, cache, runner, device)] + ([] if hf is None else [HfSystem(hf, device)])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"
    versions = f"torch {torch.__version__}"
    if hf is not None:
        versions += f", transformers {sys.modules['transformers'].__version__}"
    dtype_name = str(dtype).removeprefix("torch.")
    config = {"preset": args.preset, "model": cfg, "dtype": dtype_name, "device": name, "versions": versions,
              "page_size": args.page_size, "num_pages": num_pages,
              "pool_bytes": num_pages * cache.pool.bytes_per_page, "row_bytes": layout.row_bytes,
              "prefill_chunk": args.prefill_chunk, "hf_attn": None if hf is None else args.hf_attn,
              "cuda_graphs_supported": graphs_supported, "cuda_graphs_requested": graphs,
              "cuda_graphs_active": getattr(runner, "graphs", None) is not None, "seed": args.seed}
    line = (f"{name}, {versions}; {args.preset} random weights ({cfg['num_hidden_layers']} layers, "
            f"{dtype_name}); page size {args.page_size}, pool {num_pages:,} pages; prefill chunk "
            f"{args.prefill_chunk}; CUDA graphs {graph_words(graphs, runner)}; transformers attention "
            f"{'-' if hf is None else args.hf_attn}")
    report = {"benchmark": "turns", "command": " ".join(["python -m benchmarks.turns", *argv]),
              "status": "running", "config": config, "config_line": line, "turns": [], "forks": [],
              "fork_history": {}, "warmup_s": {}, "errors": []}
    return report, systems, runner


def main(argv: list[str] | None = None) -> int:
    """Build the model(s), warm up, run the shuffled conversations, then the fork tests."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.markdown:
        print(format_markdown([json.loads(Path(p).read_text()) for p in args.markdown]), end="")
        return 0
    began = time.perf_counter()
    report, systems, runner = setup(args, argv)
    print(report["config_line"], flush=True)
    device, gen = torch.device(args.device), args.gen_tokens
    vocab, row_bytes = report["config"]["model"]["vocab_size"], report["config"]["row_bytes"]

    def save() -> None:
        write_report(args.json, report)

    def out_of_time(estimate: float) -> bool:
        return args.stop_after_s is not None and time.perf_counter() - began + estimate > args.stop_after_s

    def record(rec: dict) -> None:
        report["turns"].append(rec)
        print(turn_line(rec), flush=True)
        save()

    warm_first = random_ids(vocab, min(4096, *args.first_turns), args.seed, -1)
    warm_follow = [random_ids(vocab, args.new_tokens, args.seed, -1, i) for i in range(2)]
    for system in list(systems):  # compile kernels, capture graphs, initialise libraries: not recorded
        t0 = sync(device)
        if attempt(report, device, {"system": system.name, "part": "warmup"}, conversation, system,
                   warm_first, warm_follow, min(gen, 16), row_bytes):
            report["warmup_s"][system.name] = sync(device) - t0
        else:
            systems.remove(system)
    report["config"]["cuda_graph_state"] = graph_state(runner)
    save()

    jobs = [(s, f, r) for s in systems for f in args.first_turns for r in range(args.runs)]
    random.Random(args.seed).shuffle(jobs)
    took: dict[tuple, float] = {}
    stopped = False
    for system, first, run in [] if args.skip_turns else jobs:
        if out_of_time(took.get((system.name, first), 0.0)):
            stopped = True
            break
        t0 = time.perf_counter()
        ids = random_ids(vocab, first, args.seed, first, run)
        followups = [random_ids(vocab, args.new_tokens, args.seed, first, run, i)
                     for i in range(args.follow_ups)]
        where = {"system": system.name, "first_turn": first, "run": run}
        attempt(report, device, where, conversation, system, ids, followups, gen, row_bytes,
                on_turn=lambda rec, where=where: record({**rec, **where}))
        took[(system.name, first)] = time.perf_counter() - t0
    fork_order = random.Random(args.seed + 1).sample(systems, len(systems))
    for system in [] if args.skip_forks or stopped else fork_order:
        conv_s = took.get((system.name, args.fork_history), 0.0)  # a first turn and the follow-ups
        if out_of_time(conv_s * (1 + args.forks) / (1 + args.follow_ups)):
            stopped = True
            break
        attempt(report, device, {"system": system.name, "part": "forks"}, fork_test, system, args, vocab,
                row_bytes, report, save)
    report["status"] = STOPPED if stopped else "complete" + (" with errors" if report["errors"] else "")
    report["elapsed_s"] = time.perf_counter() - began
    report["config"]["cuda_graph_state"] = graph_state(runner)
    save()
    for line in summary_lines(summarize(report["turns"], report["forks"])):
        print(line, flush=True)
    print(f"{report['status']} in {report['elapsed_s']:.1f} s", flush=True)
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
