"""Model decode benchmark: segkv's runner against its bandwidth limit and Hugging Face ``transformers``.

Models are built at their published shapes with random weights directly on the device (no
download, nothing on disk): Llama-3.1-8B, Qwen3-8B, Qwen3-32B (GQA) and DeepSeek-V2-Lite (MLA,
MoE). With the Hugging Face comparison on, the ``transformers`` model is built first (its own
initialisation: normal(0, ``--init-std``), norms 1) and segkv's model is assembled on ``meta``
from the same tensors (no copy: fused expert tensors are viewed per expert; a tensor is copied
only where segkv keeps another dtype, e.g. float32 MoE routers). With ``--skip-hf`` segkv's
model is initialised alone the same way. Cases whose KV cache does not fit the free memory
are skipped with the reason.

segkv, per (batch, context): each sequence's chain gets ``context`` rows and the cache storage
is filled with random values (no prefill: a decode step's cost does not depend on the K/V
values, only on their number). After ``--warmup`` untimed steps (Triton compilation, CUDA
graph capture), ``--trials`` runs of ``--steps`` greedy steps: ``ModelRunner.forward`` on one
new token per sequence, argmax of the logits, the ids back to the host for the next step (as
the engine does); the chains are trimmed back after each run so every run sees the same
context. tokens/s = batch x (steps - 4) / (time from the third decode step's mark to the last),
measured as Hugging Face's below (``StepMarks``: a CUDA event queued after each step, so idle time
between steps counts); the whole run's rate (batch x steps / wall time, the generator's set-up
and first steps included) is reported beside it. The runner is made with ``cuda_graphs="auto"``
when its constructor has that argument (graphs where the runner supports them: CUDA, models
without MoE); the report says whether they were on, why not, and how many steps replayed. An
eager runner first decodes the same steps once, untimed, to check the greedy tokens agree and,
for MoE models, to count the experts each layer really touches.

Bandwidth limit per step = (weight bytes read + KV bytes read) / the device-to-device copy
bandwidth measured in the same run (``decode_attention.measured_read_bandwidth``). Weights
read: every parameter except the embedding table (a step gathers only ``batch`` of its rows)
and MTP layers; for MoE layers only the routed experts touched: ``E (1 - (1 - k/E)^B)``
expected distinct experts per layer for ``B`` tokens each routing to ``k`` of ``E`` experts
independently and uniformly (``k`` at batch 1). KV read: ``batch x context x row bytes`` (all
layers). ratio = achieved tokens/s / limit tokens/s.

Hugging Face, same weights, per variant (``eager``: dynamic cache; ``static``: static cache;
``compiled``: static cache with ``generate``'s automatic ``torch.compile`` of the decode step,
CUDA only): greedy ``generate`` of ``--steps`` tokens (min = max new tokens) from a random
prompt of ``context`` tokens. A logits processor records a CUDA event (or the clock on the
CPU) each time ``generate`` produces logits: the first after prefill, then one per decode
forward. Decode rate = batch x (steps - 4) / (time from the third decode forward's mark to the
last): prefill and the first three decode forwards (a new cache each call: allocation, CUDA
graph warm-up and recording at its addresses) are excluded; their time is reported apart.
Cases whose prompt (batch x context) exceeds ``--hf-max-prompt-tokens`` or whose estimated
memory does not fit are skipped with the reason; failures are recorded. (That side's code: ``hf_baseline``.)

Run on a CUDA device, e.g. ``python -m benchmarks.decode_e2e --models llama-3.1-8b --hf-variants
eager --stop-after-s 420 --json build/e2e/llama.json`` (the report is rewritten after every case;
``--stop-after-s`` starts no case after that time, and the same command with ``--resume`` runs
the cases left). ``--markdown A.json [B.json ...]`` prints the table of saved reports, merged per
case (segkv from one run, a Hugging Face variant from another), without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import math
import os
import platform
import re
import statistics
import time
from pathlib import Path

import torch

from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, default_page_size, parse_dtype, resolve_kv_cache_dtype
from segkv.models.fp8_loading import quantize_linears
from segkv.models.loader import keep_fp32
from segkv.models.registry import model_class
from benchmarks.hf_baseline import (
    HF_SKIPPED_FORWARDS,
    HF_VARIANTS,
    build_hf,
    drop_compiled,
    hf_case,
    hf_case_bytes,
    hf_tensor,
)
from benchmarks.runs import StepTimes, int_list, release, summary, sync
from benchmarks.turns import TokenIdsOnly
from segkv.engine.generation import Generator, default_lookahead
from segkv.layers.sampler import argmax_rows
from segkv.runner.model_runner import ModelRunner, StepInput
from segkv.sampling_params import SamplingParams

_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
_DSV2_YARN = {"type": "yarn", "rope_type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
              "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096}


def _gqa(arch: str, model_type: str, **shape) -> dict:
    return {"architectures": [arch], "model_type": model_type, "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "tie_word_embeddings": False, **shape}


# Published shapes. Qwen3's max_position_embeddings is raised from 40960 to 131072 so the 64K
# contexts are in range (plain RoPE: no shape or cost changes).
MODELS = {
    "llama-3.1-8b": _gqa("LlamaForCausalLM", "llama", vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling=_LLAMA31_ROPE, max_position_embeddings=131072),
    "llama-3.1-70b": _gqa("LlamaForCausalLM", "llama", vocab_size=128256, hidden_size=8192,
                          intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                          rope_scaling=_LLAMA31_ROPE, max_position_embeddings=131072),
    "qwen3-8b": _gqa("Qwen3ForCausalLM", "qwen3", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     max_position_embeddings=131072),
    "qwen3-32b": _gqa("Qwen3ForCausalLM", "qwen3", vocab_size=151936, hidden_size=5120,
                      intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                      max_position_embeddings=131072),
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
        "hidden_size": 2048, "intermediate_size": 10944, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64, "num_experts_per_tok": 6,
        "n_shared_experts": 2, "moe_intermediate_size": 1408, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "n_group": 1, "topk_group": 1, "topk_method": "greedy", "scoring_func": "softmax",
        "norm_topk_prob": False, "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": _DSV2_YARN, "max_position_embeddings": 163840, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False},
}
# the default models: those whose bf16 weights fit one GPU (the 70B shape is tensor-parallel's: tp_decode)
ONE_GPU_MODELS = [name for name in MODELS if name != "llama-3.1-70b"]
# Tiny shapes of the same families (CPU tests); shapes keep expert/hidden sizes distinct.
TINY = {
    "llama-3.1-8b": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "llama-3.1-70b": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=8),
    "qwen3-8b": dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "qwen3-32b": dict(vocab_size=320, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16),
    "deepseek-v2-lite": dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=48),
}
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.")


def model_config(name: str, preset: str = "real", *, init_std: float = 0.02) -> dict:
    """The ``config.json``-style dict of a benchmark model (``preset`` "real" or "tiny")."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    cfg = {**MODELS[name], **(TINY[name] if preset == "tiny" else {}), "initializer_range": init_std}
    return json.loads(json.dumps(cfg))  # a deep copy: the rope dicts are shared


# -- bytes and limits -----------------------------------------------------------------------
def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts ``batch`` tokens touch, each routing to ``top_k`` of ``num_experts``
    independently and uniformly: ``E (1 - (1 - k/E)^B)`` (exactly ``k`` at batch 1)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def step_weight_bytes(param_bytes: dict[str, int], *, batch: int, num_experts: int = 0, top_k: int = 0,
                      embedding: str = "model.embed_tokens.weight", tied: bool = False
                      ) -> tuple[float, float]:
    """``(bytes of weights one decode step reads, expected distinct experts per MoE layer)``.

    Every parameter but the embedding table (unless tied to the head) and MTP layers; of a MoE
    layer's routed experts (``*.experts.{i}.*``) only the expected distinct ones."""
    total, experts = 0.0, {}
    for name, n in param_bytes.items():
        if (name == embedding and not tied) or name.startswith("mtp."):
            continue
        match = _EXPERT.match(name)
        if match:
            layer = experts.setdefault(match.group(1), {})
            layer[int(match.group(2))] = layer.get(int(match.group(2)), 0) + n
        else:
            total += n
    distinct = expected_distinct_experts(num_experts, top_k, batch) if experts else 0.0
    total += sum(distinct * statistics.fmean(layer.values()) for layer in experts.values())
    return total, distinct


def bandwidth_limit(*, weight_bytes: float, kv_bytes: float, bandwidth: float, batch: int) -> dict:
    step_s = (weight_bytes + kv_bytes) / bandwidth
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "bandwidth_bytes_per_s": bandwidth,
            "step_s": step_s, "tokens_per_s": batch / step_s}


def cache_layout(model, dtype: torch.dtype, kv_cache_dtype: str = "auto"):
    """The model's KV layout for activations of ``dtype``, stored as ``kv_cache_dtype`` says
    (``"fp8"``: e4m3 bytes, one per element)."""
    return dataclasses.replace(model.kv_layout(dtype), dtype=resolve_kv_cache_dtype(kv_cache_dtype, dtype))


def case_limit(model, *, batch: int, context: int, dtype: torch.dtype, bandwidth: float,
               kv_cache_dtype: str = "auto") -> dict:
    """The bandwidth limit of one (batch, context) decode step of segkv's ``model``."""
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    router = getattr(model.cfg, "router", None)
    experts = {"num_experts": router.num_experts, "top_k": router.top_k} if router else {}
    tied = bool(getattr(model.cfg, "tie_word_embeddings", False))
    weights, distinct = step_weight_bytes(sizes, batch=batch, tied=tied, **experts)
    out = bandwidth_limit(weight_bytes=weights, kv_bytes=batch * context * cache_layout(model, dtype, kv_cache_dtype).row_bytes,
                          bandwidth=bandwidth, batch=batch)
    if router:
        out["expected_distinct_experts"] = distinct
    return out


def measure_bandwidth(device: torch.device) -> float:
    """Copy bandwidth in bytes/s (bytes read + written), as ``decode_attention`` measures it on CUDA."""
    if device.type == "cuda":
        from benchmarks.decode_attention import measured_read_bandwidth

        return measured_read_bandwidth(str(device))
    src = torch.empty(1 << 26, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    rates = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        rates.append(2 * src.numel() / (time.perf_counter() - start))
    return statistics.median(rates)


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for a new case: the device's free memory after emptying torch's cache."""
    if device.type == "cuda":
        release(device)
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024






# -- building the models --------------------------------------------------------------------
def build_segkv(cfg: dict, *, device: torch.device, dtype: torch.dtype, hf_state: dict | None = None):
    """segkv's model for ``cfg`` on ``device``: random weights (std ``initializer_range``, norms 1,
    other vectors 0), or the tensors of a Hugging Face ``state_dict(keep_vars=True)``, shared.
    Returns ``(model, bytes copied)``."""
    with torch.device("meta"):
        model = model_class(cfg).from_hf_config(cfg)
    std, state, made, copied = float(cfg.get("initializer_range", 0.02)), {}, {}, 0
    used: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        want = torch.float32 if keep_fp32(name) else dtype
        if id(p) in made:  # tied
            state[name] = made[id(p)]
            continue
        if hf_state is None:
            t = torch.empty(p.shape, dtype=want, device=device)
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            elif t.dim() == 1:
                t.zero_()
            else:
                t.normal_(0.0, std)
        else:
            t = hf_tensor(name, tuple(p.shape), hf_state, used)
            if t.dtype != want or t.device.type != device.type:
                t = t.detach().to(device=device, dtype=want)
                copied += t.numel() * t.element_size()
        made[id(p)] = state[name] = t.detach()
    if hf_state is not None:
        unused = sorted(set(hf_state) - used - {n for n in hf_state if "rotary_emb" in n})
        if unused:
            raise ValueError(f"Hugging Face tensors with no segkv parameter: {', '.join(unused[:5])}")
    model.load_state_dict(state, strict=True, assign=True)
    for module in model.modules():
        if hasattr(module, "init_buffers"):  # built on meta: recompute (RoPE tables)
            module.init_buffers(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"tensors left on meta: {', '.join(left[:5])}")
    return model.eval().requires_grad_(False), copied






def parity(model, hf, *, device: torch.device, dtype: torch.dtype, vocab: int, seed: int) -> dict:
    """segkv and Hugging Face logits of one 16-token prompt (shared weights: they must agree)."""
    ids = torch.randint(0, vocab, (16,), generator=torch.Generator().manual_seed(seed)).tolist()
    cache = PagedKVCache(model.kv_layout(dtype), CacheConfig(page_size=16, num_pages=4), device=device)
    chain = cache.new_chain()
    try:
        ours = build_runner(model, cache, device)[0].prompt_logits(chain, ids).float()
    finally:
        chain.release()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids], device=device), use_cache=False).logits[0].float()
    return {"rel_err": ((ours - theirs).norm() / theirs.norm()).item(),
            "argmax_agree": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()}


# -- segkv decode ---------------------------------------------------------------------------
def build_runner(model, cache, device: torch.device, *, graphs: str = "off", backend: str = "auto"
                 ) -> tuple[ModelRunner, bool]:
    """A runner and whether it decodes through CUDA graphs. ``graphs``: "off", "auto" (where the
    runner has them: CUDA, no MoE) or "emulate" (the graph code path replayed without capture,
    over the Triton backend: CPU tests)."""
    kwargs = {"backend": backend}
    if "cuda_graphs" in inspect.signature(ModelRunner).parameters:
        kwargs["cuda_graphs"] = {"off": False, "auto": "auto", "emulate": "emulate"}[graphs]
    runner = ModelRunner(model, cache, device=device, **kwargs)
    return runner, getattr(runner, "graphs", None) is not None


def decode_steps(runner: ModelRunner, chains, first: list[int], steps: int) -> list[list[int]]:
    """Greedy decode of ``steps`` tokens per chain through ``runner.forward``, one plain step at a
    time (no sampler, no look-ahead): ``first`` holds each chain's next input token. Returns the
    tokens per step, ``steps`` lists of one token id per chain."""
    tokens, out = first, []
    for _ in range(steps):
        logits = runner.forward([StepInput(c, [t]) for c, t in zip(chains, tokens)])
        tokens = argmax_rows(logits).tolist()  # the sampler's greedy argmax, as the engine takes it
        out.append(tokens)
    return out


class StepMarks(StepTimes):
    """Marks each decode step the runner launches (inside ``with``): a CUDA event queued after the
    step's kernels on a GPU (no sync; any idle time before the next step falls between two marks),
    the clock on the CPU. A run's decode rate then leaves out its first steps, as Hugging Face's
    is measured (:data:`HF_SKIPPED_FORWARDS`): the generator's set-up and the steps before the
    loop runs ahead are reported apart (the whole-run rate)."""

    _METHODS = ("forward", "decode_from_device")

    def __init__(self, runner: ModelRunner, device: torch.device) -> None:
        super().__init__(device)
        self.runner = runner

    def __enter__(self) -> StepMarks:
        for name in self._METHODS:
            setattr(self.runner, name, self._marked(getattr(self.runner, name)))
        return self

    def __exit__(self, *exc) -> None:
        for name in self._METHODS:
            delattr(self.runner, name)  # the class's methods again

    def _marked(self, method):
        def call(*args, **kwargs):
            out = method(*args, **kwargs)
            self.mark()
            return out
        return call


def generate_steps(runner: ModelRunner, chains, first: list[int], steps: int, *, lookahead: bool,
                   max_model_len: int) -> tuple[list[list[int]], int]:
    """Greedy decode of ``steps`` tokens per chain as the engine runs it (``Generator``: samples
    drawn on the device, the next step launched before the host reads them when ``lookahead``).
    Returns the tokens per step (as ``decode_steps``) and the steps served by a step launched ahead."""
    gen = Generator(runner, TokenIdsOnly(), max_model_len=max_model_len, lookahead=lookahead)
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    seqs = [gen.new_sequence(0, c, [t], [t], params) for c, t in zip(chains, first)]
    gen.run(seqs)
    return [list(step) for step in zip(*(s.output_ids for s in seqs))], gen.steps_ahead_used


def trim_to(chains, context: int) -> None:
    """Trim every chain longer than ``context`` rows back to ``context`` (the rows a timed run
    decoded are dropped, so the next run starts from the same history)."""
    for chain in chains:
        if chain.num_rows > context:
            chain.trim(chain.num_rows - context)


class _ExpertCounter:
    """Forward hooks on MoE routers: distinct experts per layer per step (eager runs only)."""

    def __init__(self, model) -> None:
        routers = [m for m in model.modules() if type(m).__name__ == "TopKRouter"]
        self.counts: list[int] = []
        self.handles = [r.register_forward_hook(self._hook) for r in routers]

    def _hook(self, module, args, output) -> None:
        self.counts.append(int(output[1].unique().numel()))

    def close(self) -> float | None:
        for h in self.handles:
            h.remove()
        return statistics.fmean(self.counts) if self.counts else None


def case_pages(batch: int, context: int, *, steps: int, warmup: int, page_size: int) -> int:
    """Pages of a segkv case: each sequence's context and decoded rows, the graphs' scratch page."""
    return batch * -(-(context + max(steps, warmup) + 1) // page_size) + 2


def segkv_case(model, *, device: torch.device, dtype: torch.dtype, batch: int, context: int, steps: int,
               trials: int, warmup: int, page_size: int, graphs: str, seed: int, kv_cache_dtype: str = "auto") -> dict:
    """Time greedy decode steps of ``batch`` sequences with ``context`` random cache rows each."""
    layout = cache_layout(model, dtype, kv_cache_dtype)
    pages = case_pages(batch, context, steps=steps, warmup=warmup, page_size=page_size)
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=pages), device=device,
                         compaction=CompactionPolicy(enabled=False))
    torch.manual_seed(seed)
    for layer in range(layout.num_layers):  # random rows: the values do not change a step's cost
        for part in (cache.storage.key_cache(layer), *([cache.storage.value_cache(layer)] if layout.kind == "mha"
                                                       else [])):
            if layout.fp8:  # random finite e4m3 bytes (0x7F and 0xFF are NaN patterns)
                part.view(torch.uint8).random_(0, 0x7F)
            else:
                part.normal_()
    chains = [cache.new_chain() for _ in range(batch)]
    out: dict = {"kv_cache_bytes": pages * page_size * layout.row_bytes, "cuda_graphs": False}
    runners = []
    try:
        for chain in chains:
            chain.append(context)
        gen = torch.Generator().manual_seed(seed)
        first = torch.randint(0, model.cfg.vocab_size, (batch,), generator=gen).tolist()
        backend = "triton" if graphs == "emulate" else "auto"
        eager, _ = build_runner(model, cache, device, backend=backend)
        runners.append(eager)
        runner = eager
        if graphs != "off":  # made first: it packs MoE experts, which the eager reference then uses too
            try:
                runner, out["cuda_graphs"] = build_runner(model, cache, device, graphs=graphs, backend=backend)
                runners.append(runner)
                out["graphs_off_reason"] = getattr(runner, "graphs_off_reason", None)
            except ValueError as exc:  # "emulate" refuses models without graph support
                out["graphs_off_reason"] = str(exc)
        counter = _ExpertCounter(model)
        try:  # the untimed eager reference: greedy tokens, experts touched
            reference = decode_steps(eager, chains, first, steps)
        finally:
            distinct = counter.close()
        trim_to(chains, context)
        if distinct is not None:
            out["distinct_experts_measured"] = distinct
        try:
            decode_steps(runner, chains, first, warmup)
        except Exception as exc:  # graph capture failed: measure eager, say why
            if runner is eager:
                raise
            out["graph_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            trim_to(chains, context)
            runner, out["cuda_graphs"] = eager, False
            decode_steps(runner, chains, first, warmup)
        trim_to(chains, context)
        # the engine's loop (Generator, steps launched ahead by default on CUDA) and, when that is
        # on, the same loop step by step (the host reads each token before the next step starts),
        # alternating in the same trials. What exists now lives through the trials: kept out of the
        # cyclic collector's scans, as the engine does (LLM: gc.freeze() once set up)
        gc.collect()
        gc.freeze()
        lookahead = default_lookahead(device)
        # rates: decode steps after the first HF_SKIPPED_FORWARDS (StepMarks), as Hugging Face's;
        # whole: the run's wall time, the generator's set-up and first steps included
        rates, whole, equal, ahead_used = {True: [], False: []}, {True: [], False: []}, True, 0
        g = getattr(runner, "graphs", None)
        before = (getattr(g, "replays", 0), getattr(g, "fallbacks", 0))
        for _ in range(trials):
            for ahead in ((True, False) if lookahead else (False,)):
                sync(device)
                start = time.perf_counter()
                with StepMarks(runner, device) as marks:
                    # the length limit only so the Generator never stops a case early
                    tokens, used = generate_steps(runner, chains, first, steps, lookahead=ahead,
                                             max_model_len=context + steps + 8)
                sync(device)
                whole[ahead].append(batch * steps / (time.perf_counter() - start))
                if len(marks.marks) != steps:
                    raise RuntimeError(f"the generator launched {len(marks.marks)} decode steps, expected {steps}")
                rates[ahead].append(batch * (steps - 1 - HF_SKIPPED_FORWARDS) / marks.seconds(HF_SKIPPED_FORWARDS))
                equal &= tokens == reference
                ahead_used += used
                trim_to(chains, context)
        out.update(summary(rates[lookahead]), tokens_equal_eager=equal, lookahead=lookahead,
                   steps_ahead_used=ahead_used, whole_run=summary(whole[lookahead]))
        if lookahead:
            out["step_by_step"] = {**summary(rates[False]), "whole_run": summary(whole[False])}
        if g is not None:
            out["graph_replays"] = getattr(g, "replays", 0) - before[0]
            out["graph_fallbacks"] = getattr(g, "fallbacks", 0) - before[1]
        if runner.last_plan is not None:
            out["plan"] = runner.last_plan.describe()
    finally:
        gc.unfreeze()
        for r in runners:
            if getattr(r, "graphs", None) is not None and hasattr(r.graphs, "release"):
                r.graphs.release()
        for chain in chains:
            chain.release()
    return out


# -- the run --------------------------------------------------------------------------------
def _fmt_rate(x: float | None) -> str:
    return "-" if x is None else (f"{x:.0f}" if x >= 100 else f"{x:.1f}")


def _rate(part: dict | None) -> float | None:
    return part.get("tokens_per_s") if isinstance(part, dict) else None


def speedups(case: dict) -> dict:
    ours = _rate(case.get("segkv"))
    return {v: ours / _rate(r) for v, r in case.get("hf", {}).items() if ours and _rate(r)}


def case_line(device_name: str, case: dict, elapsed: float) -> str:
    s, lim = case.get("segkv", {}), case["limit"]
    seg = (f"segkv {_fmt_rate(_rate(s))} tok/s [{_fmt_rate(s['min'])}-{_fmt_rate(s['max'])}] "
           f"limit {_fmt_rate(lim['tokens_per_s'])} ratio {s['tokens_per_s'] / lim['tokens_per_s']:.3f}"
           if _rate(s) else f"segkv {s.get('skipped') or s.get('error') or 'not run'}")
    hf = []
    for variant, r in case.get("hf", {}).items():
        if variant in case["speedup"]:
            hf.append(f"{variant} {_fmt_rate(_rate(r))} (x{case['speedup'][variant]:.2f})")
        else:
            hf.append(f"{variant} {_fmt_rate(_rate(r))}" if _rate(r)
                      else f"{variant}: {r.get('skipped') or r.get('error')}")
    graphs = "on" if s.get("cuda_graphs") else "off"
    plain = s.get("step_by_step")
    if plain:  # the same loop without steps launched ahead, in the same trials
        seg += (f" (step by step {_fmt_rate(plain['tokens_per_s'])} "
                f"[{_fmt_rate(plain['min'])}-{_fmt_rate(plain['max'])}])")
    if _rate(s.get("whole_run")):  # the runs' wall time, set-up and first steps included
        seg += f" (whole runs {_fmt_rate(_rate(s['whole_run']))})"
    return (f"[{elapsed:5.0f}s] {device_name} {case['model']} B={case['batch']} ctx={case['context']} "
            f"graphs={graphs} {seg}" + (" | hf " + "; ".join(hf) if hf else ""))


def run_model(name: str, cfg: dict, cases: list[tuple[int, int]], args, report: dict, *, device, dtype,
              bandwidth: float, deadline: float, write) -> bool:
    """Build one model and run its cases; False when the deadline stopped it."""
    started = time.perf_counter()
    hf, model, info = None, None, {}
    with torch.no_grad():
        if not args.skip_hf:
            try:
                hf = build_hf(cfg, device=device, dtype=dtype)
                model, copied = build_segkv(cfg, device=device, dtype=dtype,
                                            hf_state=hf.state_dict(keep_vars=True))
            except Exception as exc:  # measure segkv alone
                info["hf_error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
                hf = model = None
        if model is None:
            release(device)  # (after the except block: its traceback no longer holds the tensors)
            model, copied = build_segkv(cfg, device=device, dtype=dtype)
        if args.quantization == "fp8":
            info["fp8_layers"] = quantize_linears(model, dtype)
            release(device)
    sync(device)
    info.update(build_s=time.perf_counter() - started, copied_bytes=copied, config=cfg,
                params=sum(p.numel() for p in model.parameters()),
                weight_bytes_all=sum(p.numel() * p.element_size() for p in model.parameters()),
                kv_row_bytes=cache_layout(model, dtype, args.kv_cache_dtype).row_bytes)
    if hf is not None:
        info["parity"] = _guarded(parity, model, hf, device=device, dtype=dtype, vocab=cfg["vocab_size"],
                                  seed=args.seed)
    report["models"][name] = info
    print(f"{name}: {info['params'] / 1e9:.2f}B parameters built in {info['build_s']:.0f}s"
          + (f"; segkv/HF logits: {info['parity']}" if hf is not None else "")
          + (f"; HF failed: {info['hf_error']}" if "hf_error" in info else ""), flush=True)
    element = torch.empty((), dtype=dtype).element_size()
    reserve = int(args.reserve_gib * 2**30)

    def free_for(need: int) -> int:
        """Free memory; compiled HF graphs of earlier cases are dropped first if ``need`` does not fit."""
        free = free_memory_bytes(device)
        if need > free and hf is not None and "_compiled_call" in hf.__dict__:
            drop_compiled(hf, device)
            free = free_memory_bytes(device)
        return free

    try:
        for batch, context in cases:
            if time.time() > deadline:
                return False
            limit = case_limit(model, batch=batch, context=context, dtype=dtype, bandwidth=bandwidth,
                               kv_cache_dtype=args.kv_cache_dtype)
            case = {"model": name, "batch": batch, "context": context, "status": "done", "hf": {},
                    "limit": limit}
            pages = case_pages(batch, context, steps=args.steps, warmup=args.warmup, page_size=args.page_size)
            need = pages * args.page_size * cache_layout(model, dtype, args.kv_cache_dtype).row_bytes + reserve
            if args.skip_segkv:
                case["segkv"] = {"skipped": "--skip-segkv"}
            elif need > (free := free_for(need)):
                case["segkv"] = {"skipped": f"KV cache + reserve {need / 2**30:.1f} GiB > free "
                                            f"{free / 2**30:.1f} GiB"}
            else:
                case["segkv"] = _guarded(segkv_case, model, device=device, dtype=dtype, batch=batch,
                                         context=context, steps=args.steps, trials=args.trials,
                                         warmup=args.warmup, page_size=args.page_size, graphs=args.graphs,
                                         seed=args.seed, kv_cache_dtype=args.kv_cache_dtype)
            if _rate(case["segkv"]):
                case["ratio"] = case["segkv"]["tokens_per_s"] / case["limit"]["tokens_per_s"]
            for variant in ([] if args.skip_hf else args.hf_variants):
                if hf is None:
                    case["hf"][variant] = {"error": f"model build: {info.get('hf_error')}"}
                    continue
                case["hf"][variant] = _hf_variant(hf, variant, cfg, args, device=device, batch=batch,
                                                  context=context, element=element, reserve=reserve,
                                                  free_for=free_for)
                if "error" in case["hf"][variant] and "_compiled_call" in hf.__dict__:
                    drop_compiled(hf, device)  # a failed compiled run may hold graphs and memory
            case["speedup"] = speedups(case)
            report["cases"].append(case)
            write()
            print(case_line(report["device"], case, time.time() - report["_started"]), flush=True)
    finally:
        model = hf = None
        drop_compiled(None, device)
    return True




def _hf_variant(hf, variant: str, cfg: dict, args, *, device, batch: int, context: int, element: int,
                reserve: int, free_for) -> dict:
    if variant == "compiled" and device.type != "cuda":
        return {"skipped": "generate compiles the decode step on CUDA only"}
    if batch * context > args.hf_max_prompt_tokens:
        return {"skipped": f"prompt of {batch} x {context} tokens > --hf-max-prompt-tokens "
                           f"{args.hf_max_prompt_tokens}"}
    need = reserve + hf_case_bytes(hf, cfg, batch=batch, context=context, steps=args.steps,
                                   element_size=element)
    free = free_for(need)
    if need > free:
        return {"skipped": f"estimated {need / 2**30:.1f} GiB with reserve > free {free / 2**30:.1f} GiB"}
    return _guarded(hf_case, hf, variant, device=device, batch=batch, context=context, steps=args.steps,
                    trials=args.hf_trials or args.trials, vocab=cfg["vocab_size"], seed=args.seed)


def _guarded(fn, *args, device: torch.device, **kwargs) -> dict:
    """``fn(*args, device=device, **kwargs)``, or the error it raised (out of memory included),
    with memory released either way."""
    try:
        return fn(*args, device=device, **kwargs)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc).strip()[:300]}"}
    finally:
        release(device)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(ONE_GPU_MODELS), help=f"comma-separated: {', '.join(MODELS)} "
                   f"(default: {', '.join(ONE_GPU_MODELS)})")
    p.add_argument("--batches", type=int_list, default=[1, 8, 32])
    p.add_argument("--contexts", type=int_list, default=[1024, 16384, 65536], help="e.g. 1K,16K,64K")
    p.add_argument("--steps", type=int, default=32, help="decode steps per timed run (>= 5)")
    p.add_argument("--trials", type=int, default=3, help="timed runs per case (median, min, max)")
    p.add_argument("--warmup", type=int, default=4, help="untimed segkv steps before the trials")
    p.add_argument("--hf-trials", type=int, default=None,
                   help="timed generate calls per variant (default: --trials)")
    p.add_argument("--hf-variants", default="eager,compiled",
                   help=f"comma-separated: {', '.join(HF_VARIANTS)}")
    p.add_argument("--hf-max-prompt-tokens", type=int, default=131072,
                   help="skip Hugging Face where batch x context exceeds this")
    p.add_argument("--skip-hf", action="store_true", help="no Hugging Face comparison")
    p.add_argument("--skip-segkv", action="store_true", help="only the Hugging Face variants")
    p.add_argument("--cuda-graphs", choices=("auto", "off", "emulate"), default="auto",
                   help="auto: the runner's CUDA graphs where it has them (CUDA, no MoE); emulate: their "
                        "code path without capture (CPU tests)")
    p.add_argument("--preset", choices=("real", "tiny"), default="real")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="segkv's KV cache: in --dtype, or e4m3 bytes with unit scales (implies --skip-hf)")
    p.add_argument("--quantization", choices=("fp8",), default=None,
                   help="segkv's projections quantized to FP8 per channel after the build (implies --skip-hf)")
    p.add_argument("--page-size", type=int, default=None, help="rows per page (default: the engine's, "
                   "32 on CUDA and 16 elsewhere)")
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--reserve-gib", type=float, default=None,
                   help="memory kept free per case (default CUDA 4, CPU 0.25)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-after-s", type=float, default=None,
                   help="start no new case (or model) after this many seconds")
    p.add_argument("--json", default=None, help="write the report here after every case")
    p.add_argument("--resume", action="store_true",
                   help="keep the finished cases of an existing --json report, run the others")
    p.add_argument("--markdown", nargs="+", default=None, metavar="REPORT_JSON",
                   help="print the table of saved reports (cases merged) and exit; no GPU needed")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.markdown:
        print(markdown_table([json.loads(Path(p).read_text()) for p in args.markdown]))
        return 0
    names = [n for n in args.models.split(",") if n]
    args.hf_variants = [v for v in args.hf_variants.split(",") if v]
    if args.quantization or args.kv_cache_dtype != "auto":  # transformers runs full precision: no comparison
        args.skip_hf = True
    bad = [n for n in names if n not in MODELS] + [v for v in args.hf_variants if v not in HF_VARIANTS]
    if bad or args.steps < HF_SKIPPED_FORWARDS + 2 or args.trials < 1:
        raise SystemExit(f"bad arguments: {bad or 'steps must be >= 5 and trials >= 1'}")
    device, dtype = torch.device(args.device), parse_dtype(args.dtype)
    if args.page_size is None:
        args.page_size = default_page_size(device.type)
    args.graphs = args.cuda_graphs if device.type == "cuda" or args.cuda_graphs == "emulate" else "off"
    if args.reserve_gib is None:
        args.reserve_gib = 4.0 if device.type == "cuda" else 0.25
    report = _start_report(args, device)
    done = {(c["model"], c["batch"], c["context"]) for c in report["cases"]}
    report["_started"] = time.time()
    deadline = report["_started"] + (args.stop_after_s if args.stop_after_s is not None else math.inf)

    def write() -> None:
        if args.json:
            tmp = Path(args.json + ".tmp")
            tmp.write_text(json.dumps({k: v for k, v in report.items() if k != "_started"}, indent=1))
            os.replace(tmp, args.json)

    bandwidth = measure_bandwidth(device)
    report["bandwidth_bytes_per_s"] = bandwidth
    print(f"device {report['device']}; copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + written); "
          f"runner cuda_graphs argument: {report['runner_has_cuda_graphs']}; {args.dtype}; "
          f"steps {args.steps}; trials {args.trials}", flush=True)
    stopped = False
    for name in names:
        cases = [(b, c) for b in args.batches for c in args.contexts if (name, b, c) not in done]
        if not cases:
            continue
        if time.time() > deadline or not run_model(
                name, model_config(name, args.preset, init_std=args.init_std), cases, args, report,
                device=device, dtype=dtype, bandwidth=bandwidth, deadline=deadline, write=write):
            stopped = True
            break
    finished = {(c["model"], c["batch"], c["context"]) for c in report["cases"]}
    report["not_run"] = [[n, b, c] for n in names for b in args.batches for c in args.contexts
                         if (n, b, c) not in finished]
    report["stopped_early"] = stopped
    write()
    if report["not_run"]:
        print(f"stopped after {args.stop_after_s}s: {len(report['not_run'])} cases not run "
              f"(rerun the same command with --resume)", flush=True)
    return 0


def _start_report(args, device: torch.device) -> dict:
    if args.resume and args.json and Path(args.json).is_file():
        report = json.loads(Path(args.json).read_text())
        report["cases"] = [c for c in report["cases"] if c.get("status") == "done"]
        return report
    try:
        import transformers

        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"
    return {"device": name, "torch": torch.__version__, "transformers": hf_version, "dtype": args.dtype,
            "preset": args.preset, "steps": args.steps, "trials": args.trials, "page_size": args.page_size,
            "runner_has_cuda_graphs": "cuda_graphs" in inspect.signature(ModelRunner).parameters,
            "args": {k: v for k, v in vars(args).items()}, "models": {}, "cases": []}


def _merge(reports: list[dict]) -> dict[tuple, dict]:
    """Cases of several reports by (model, batch, context): measured parts win over skipped ones."""
    merged: dict[tuple, dict] = {}
    for report in reports:
        for case in report.get("cases", []):
            key = (case["model"], case["batch"], case["context"])
            into = merged.setdefault(key, {**case, "hf": {}, "segkv": {}})
            if _rate(case.get("segkv")) or not into["segkv"]:
                into["segkv"], into["limit"] = case.get("segkv", {}), case["limit"]
            for variant, r in case.get("hf", {}).items():
                if _rate(r) or variant not in into["hf"]:
                    into["hf"][variant] = r
    order = list(MODELS)
    return dict(sorted(merged.items(), key=lambda kv: (order.index(kv[0][0]) if kv[0][0] in order else 99,
                                                       kv[0][1:])))


def markdown_table(reports: list[dict]) -> str:
    """Cases of one or more reports (merged per model, batch and context) as a markdown table."""
    first = reports[0] if reports else {}
    devices = "; ".join(sorted({r.get("device", "?") for r in reports}))
    lines = [f"Device: {devices}; copy bandwidth {first.get('bandwidth_bytes_per_s', 0) / 1e12:.2f} TB/s; "
             f"{first.get('dtype')}; {first.get('steps')} decode steps, {first.get('trials')} trials; "
             "tokens/s medians [min-max].", "",
             "| model | batch | context | graphs | segkv tok/s | limit tok/s | % of limit | HF eager "
             "| HF static | HF compiled | ÷ eager | ÷ best static/compiled |", "|---" * 12 + "|"]
    for (model, batch, context), case in _merge(reports).items():
        s, lim = case["segkv"], case["limit"]
        ours = _rate(s)
        cells = [model, str(batch), f"{context // 1024}K" if context % 1024 == 0 else str(context),
                 "on" if s.get("cuda_graphs") else "off",
                 f"{_fmt_rate(ours)} [{_fmt_rate(s['min'])}-{_fmt_rate(s['max'])}]" if ours
                 else f"skipped: {s.get('skipped') or s.get('error') or '-'}",
                 _fmt_rate(lim["tokens_per_s"]), f"{ours / lim['tokens_per_s']:.1%}" if ours else "-"]
        for variant in HF_VARIANTS:
            r = case["hf"].get(variant)
            cells.append(_fmt_rate(_rate(r)) if _rate(r) else
                         "-" if r is None else f"({(r.get('skipped') or r.get('error', ''))[:60]})")
        eager = _rate(case["hf"].get("eager"))
        best = max([x for x in (_rate(case["hf"].get(v)) for v in ("static", "compiled")) if x], default=None)
        cells += [f"{ours / eager:.2f}×" if ours and eager else "-",
                  f"{ours / best:.2f}×" if ours and best else "-"]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
