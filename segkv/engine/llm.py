"""LLM: the synchronous engine API: load a model directory, generate, hold conversations."""

from __future__ import annotations

import atexit
import dataclasses
import gc
import hashlib
import itertools
import logging
import math
import time
import weakref
from collections import deque
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from segkv.cache.kv_cache import PagedKVCache
from segkv.cache.tiers import SegmentTiers
from segkv.attention.plan import Route
from segkv.attention.planner import forced_route_from_env
from segkv.config import (GIB, CacheConfig, CompactionPolicy, KVLayout, check_capacity,
                          check_gpu_memory_utilization, default_page_size, default_prefill_chunk, kv_cache_budget,
                          resolve_dtype, resolve_kv_cache_dtype)
from segkv.engine.core import EngineCore, EngineRequest
from segkv.engine.devices import parse_device
from segkv.engine.generation import Generator
from segkv.scheduler import SchedulerConfig
from segkv.models.default_models import check_model_dir, resolve_model_dir
from segkv.models.fp8_loading import check_quantization
from segkv.engine.tensor_parallel import TensorParallelRanks
from segkv.runner.tp_steps import broadcasting_copier, install_row_files
from segkv.models.loader import fingerprint, load_model, read_config
from segkv.outputs import RequestOutput
from segkv.runner.model_runner import ModelRunner, StepInput
from segkv.runner.warmup import warm_up, warm_up_shapes
from segkv.sampling_params import SamplingParams
from segkv.sessions.conversation import Conversation
from segkv.spec.config import SpeculativeConfig
from segkv.spec.drafter_memory import drafter_bytes
from segkv.spec.eagle3 import resolve_head_dir
from segkv.tokenizer.tokenizer import Tokenizer

DEFAULT_KV_CACHE_BYTES = 1 << 30  # the pool on the CPU when --kv-cache-memory is not given
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_PROFILE_TOKENS = 2048  # the scheduler's max_num_batched_tokens default
logger = logging.getLogger("segkv")
# Engines gc.freeze() what they hold; unfrozen at exit, the final collection frees it (frozen
# cycles left at exit made the Triton bindings print a leak report after every command)
atexit.register(gc.unfreeze)


def checkpoint_kv_scales(found: dict | None, layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 cache's static ``(k_scale, v_scale)``, ``(num_layers, H)`` float32 (``H``: KV heads, 1
    for MLA): the checkpoint's scales (``model.kv_scales`` from the loader, scalars or one per KV
    head) where it has them, 1.0 elsewhere. An MLA latent row holds keys and values: one scale per
    layer, the larger of the two given (so neither saturates sooner than it would alone)."""
    heads = layout.num_kv_heads if layout.kind == "mha" else 1
    scales = {part: torch.ones(layout.num_layers, heads) for part in ("k", "v")}
    given: dict[int, list[torch.Tensor]] = {}  # MLA: the scales given per layer, K's and V's
    for part, per_layer in (found or {}).items():
        for layer, value in per_layer.items():
            if not 0 <= layer < layout.num_layers:
                raise ValueError(f"checkpoint KV scale for layer {layer}; the KV cache has {layout.num_layers} layers")
            if layout.kind == "mla":
                given.setdefault(layer, []).append(value.max())
            elif value.numel() not in (1, heads):
                raise ValueError(f"checkpoint {part}_scale of layer {layer} has {value.numel()} values; "
                                 f"expected 1 or {heads} (KV heads)")
            else:
                scales[part][layer] = value
    if layout.kind == "mla":
        for layer, values in given.items():
            scales["k"][layer] = torch.stack(values).max()
        return scales["k"], scales["k"]
    return scales["k"], scales["v"]


def kv_tiers(host_gib: float, directory: str | Path | None, disk_gib: float, *, device: torch.device,
             tensor_parallel_size: int = 1) -> SegmentTiers | None:
    """The KV tiers the engine's arguments ask for, or None (no host memory and no disk asked for).
    ValueError for negative sizes, a disk tier half given, or tensor parallelism (not combined yet)."""
    if not (host_gib or directory is not None or disk_gib):
        return None
    if tensor_parallel_size != 1:
        raise ValueError("KV offloading does not combine with tensor_parallel_size > 1 yet")
    if directory is not None and not disk_gib:
        raise ValueError("kv_offload_dir needs kv_offload_disk_gib > 0 (the disk tier's size)")
    if disk_gib and directory is None:
        raise ValueError("kv_offload_disk_gib needs kv_offload_dir (where the disk tier's files go)")
    return SegmentTiers(host_bytes=int(host_gib * (1 << 30)), disk_dir=directory,
                        disk_bytes=int(disk_gib * (1 << 30)), pin_memory=device.type == "cuda")


class LLM:
    """A model with its tokenizer, paged KV cache, runner and the :class:`EngineCore` that steps
    requests on them (``generate`` here, and an :class:`AsyncEngine` serving this model).

    ``model_dir``: a model directory, a built-in model (``default``, ``default-mla``) or a
    Hugging Face id (``org/name``) found in the local Hugging Face cache (never downloaded).
    ``device``: "auto" (CUDA when available, else the CPU) or a torch device. ``dtype``: "auto"
    (the checkpoint's ``torch_dtype`` on CUDA, float32 on the CPU) or a dtype.
    ``max_model_len`` defaults to the model's own limit. The cache holds ``num_pages``
    pages of ``page_size`` rows (default: ``config.default_page_size``, 32 on CUDA, 16
    elsewhere), or as many as ``kv_cache_bytes`` allows; without either, on CUDA the pool takes
    what ``gpu_memory_utilization`` of the device leaves after the weights and a profiling forward
    of ``max_num_batched_tokens`` tokens (default 2048, the scheduler's), and 1 GiB on the CPU.
    A ``max_model_len`` the pool cannot hold is a ValueError. ``prefill_chunk``: tokens per sequence per
    forward during prefill (default: ``config.default_prefill_chunk``, 2048 on CUDA, 512 elsewhere).
    ``route`` forces an attention route;
    ``mla_mode`` forces MLA's absorbed or naive path. ``backend``: "auto" (Triton kernels on CUDA
    for K/V caches, the torch reference otherwise), "torch" or "triton". ``cuda_graphs``: decode
    steps replayed from CUDA graphs (``True``, ``"auto"`` where available, ``False``; see
    ``runner/cuda_graphs.py``). ``fused_ops``: stacked projections and fused Triton kernels
    (default: on CUDA; ``ModelRunner``). ``speculative_config``: speculative decoding, vLLM's
    ``speculative_config`` (a JSON string, a dict or a :class:`SpeculativeConfig`), parsed before
    the model loads into ``self.speculative_config`` (``None``: off). Method ``eagle3`` with
    model ``"default"`` takes the built-in head of the built-in target (``default``,
    ``default-mla``). ``quantization``: None loads the checkpoint as stored (FP8 checkpoints as
    FP8); ``"fp8"`` also quantizes the linear projections of a bf16/fp16/fp32 checkpoint to e4m3
    with per-output-channel scales at load (``models/fp8_loading.py``). ``kv_cache_dtype``:
    ``"auto"`` stores K/V in ``dtype``; ``"fp8"`` stores them as float8 e4m3 with static float32
    scales per (layer, KV head) (per layer for MLA), the checkpoint's ``k_scale``/``v_scale`` (or
    ``kv_scale``) tensors where it has them, else 1.0: twice the tokens per byte of bf16.
    ``tensor_parallel_size``: ranks the model is sharded over (``engine/tensor_parallel.py``;
    processes on this host, gloo on the CPU; :meth:`close` stops them). ``kv_offload_host_gib``,
    ``kv_offload_dir`` and ``kv_offload_disk_gib``: the KV tiers (``cache/tiers.py``), host memory
    then disk, where idle cached segments go when pages run short and come back from instead of
    being recomputed (0 and None: off).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        page_size: int | None = None,
        num_pages: int | None = None,
        kv_cache_bytes: int | None = None,
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        route: str | None = None,
        mla_mode: str = "auto",
        prefill_chunk: int | None = None,
        compaction: CompactionPolicy | None = None,
        backend: str = "auto",
        cuda_graphs: bool | str = False,
        fused_ops: bool | None = None,
        speculative_config: str | dict | SpeculativeConfig | None = None,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        tensor_parallel_size: int = 1,
        kv_offload_host_gib: float = 0.0,
        kv_offload_dir: str | Path | None = None,
        kv_offload_disk_gib: float = 0.0,
        progress: bool = False,
    ) -> None:
        # a bad value is refused before anything loads
        self.speculative_config = SpeculativeConfig.parse(speculative_config)
        self.quantization = check_quantization(quantization)
        resolve_kv_cache_dtype(kv_cache_dtype, torch.float32)
        self.kv_cache_dtype = kv_cache_dtype
        # "default", "default-mla" or a directory (refused clearly if it is not one)
        self.model_dir = check_model_dir(resolve_model_dir(model_dir))
        # the config the generator runs: an EAGLE-3 head's directory resolved ("default": the
        # built-in head of this target), refused clearly before anything loads
        speculative = self.speculative_config
        if speculative is not None and speculative.method == "eagle3":
            speculative = dataclasses.replace(speculative,
                                              model=str(resolve_head_dir(speculative.model, self.model_dir)))
        self.device = parse_device(device)
        config = read_config(self.model_dir)
        self.dtype = resolve_dtype(dtype, device_type=self.device.type,
                                   checkpoint_dtype=config.get("torch_dtype", config.get("dtype")))
        self.gpu_memory_utilization = check_gpu_memory_utilization(gpu_memory_utilization)
        if kv_cache_bytes is not None and kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {kv_cache_bytes}")
        page_size = default_page_size(self.device.type) if page_size is None else page_size
        if prefill_chunk is None:
            prefill_chunk = default_prefill_chunk(self.device.type)
        if page_size < 1:  # before the cache budget divides by it
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self._check_tensor_parallel(tensor_parallel_size, kv_cache_dtype)
        if tensor_parallel_size > 1 and cuda_graphs == "auto":
            # graphs capturing the all-reduces are on when asked (True): not yet timed on several GPUs
            cuda_graphs = False
        tiers = kv_tiers(kv_offload_host_gib, kv_offload_dir, kv_offload_disk_gib, device=self.device,
                         tensor_parallel_size=tensor_parallel_size)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.ranks = None if tensor_parallel_size == 1 else TensorParallelRanks(
            tensor_parallel_size, self.model_dir, dtype=self.dtype, device=self.device,
            backend=backend)
        # the ranks stop when this engine is closed or collected, or its construction fails
        self._stop_ranks = None if self.ranks is None else weakref.finalize(self, self.ranks.close)
        self.model = load_model(self.model_dir, dtype=self.dtype, device=self.device, progress=progress,
                                quantization=self.quantization,
                                tensor_parallel=None if self.ranks is None else self.ranks.tp)
        # FP8 layers count their one-byte weights and float32 scales (both parameters)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.fingerprint = fingerprint(self.model_dir)
        if self.quantization is not None:  # other weights compute other KV rows: snapshots must not mix
            self.fingerprint = hashlib.sha256(f"{self.fingerprint}:{self.quantization}".encode()).hexdigest()[:32]
        limit = self.model.max_model_len
        if max_model_len is not None and not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len must be between 1 and the model's {limit}, got {max_model_len}")
        explicit_len = max_model_len is not None
        self.max_model_len = max_model_len or limit
        if self.speculative_config is not None and self.speculative_config.method == "mtp":
            if not len(getattr(self.model, "mtp", ())):
                raise ValueError(f"speculative method 'mtp' needs multi-token-prediction layers, which "
                                 f"{self.model_dir} does not have; use 'ngram' or 'draft_model'")
            layout = self.model.kv_layout(self.dtype, mtp=True)  # the MTP layers keep rows too
        else:
            layout = self.model.kv_layout(self.dtype)
        # an FP8 cache stores one byte per element: the same bytes hold twice the tokens of bf16
        layout = dataclasses.replace(layout, dtype=resolve_kv_cache_dtype(kv_cache_dtype, self.dtype))
        kv_scales = None
        if layout.fp8:
            kv_scales = checkpoint_kv_scales(getattr(self.model, "kv_scales", None), layout)
            # stored rows depend on the scales: snapshots of another cache must not load
            digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in kv_scales)).hexdigest()
            self.fingerprint = hashlib.sha256(f"{self.fingerprint}:kv-fp8:{digest}".encode()).hexdigest()[:32]
        page_bytes = page_size * layout.row_bytes
        self.profile: dict[str, int] | None = None  # the profiling pass's readings (CUDA, sized pool)
        if num_pages is not None:
            self.kv_cache_source = "num_pages"
        elif kv_cache_bytes is not None:
            num_pages, self.kv_cache_source = max(1, kv_cache_bytes // page_bytes), "kv_cache_memory"
        elif self.device.type == "cuda":
            budget = self._profile_kv_budget(
                layout, page_size=page_size, tokens=max_num_batched_tokens or DEFAULT_PROFILE_TOKENS,
                prefill_chunk=prefill_chunk, route=route, mla_mode=mla_mode, backend=backend,
                fused_ops=fused_ops, graphs=bool(cuda_graphs), speculative=speculative)
            num_pages = max(1, budget // page_bytes)
            self.kv_cache_source = f"gpu_memory_utilization {self.gpu_memory_utilization:g}"
        else:
            num_pages, self.kv_cache_source = max(1, DEFAULT_KV_CACHE_BYTES // page_bytes), "cpu default"
        if explicit_len or self.kv_cache_source != "num_pages":  # a pool counted in pages is the caller's
            check_capacity(self.max_model_len, capacity_tokens=num_pages * page_size, explicit=explicit_len)
        self.cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=num_pages),
                                  device=str(self.device), compaction=compaction)
        if kv_scales is not None:
            self.cache.storage.set_scales(*kv_scales)
        if tiers is not None:
            self.cache.attach_tiers(tiers)
        if self.ranks is not None:  # the other ranks' caches: this one's size, their own KV heads
            self.ranks.start_followers(page_size, num_pages, cuda_graphs=cuda_graphs, max_model_len=self.max_model_len)
            self.cache.copy_rows = broadcasting_copier(self.ranks.tp, self.cache.storage.copy_rows)
            whole = self.model.whole_num_kv_heads
            install_row_files(self.cache, self.ranks.tp, layout if whole is None
                              else dataclasses.replace(layout, num_kv_heads=whole))
        # a verify window (its drafts, a tree's nodes, and the pending token) runs like a decode step: MLA absorbed,
        # replayed from its own CUDA graphs
        window = 1 if self.speculative_config is None else self.speculative_config.window_rows
        self.runner = ModelRunner(self.model, self.cache, device=self.device, route=route,
                                  mla_mode=mla_mode, prefill_chunk=prefill_chunk, backend=backend,
                                  cuda_graphs=cuda_graphs, graph_windows=(window,) if window > 1 else (),
                                  decode_rows_threshold=window, max_model_len=self.max_model_len,
                                  fused_ops=fused_ops)
        self.generator = Generator(self.runner, self.tokenizer, max_model_len=self.max_model_len,
                                   speculative=speculative)
        scheduling = None if max_num_batched_tokens is None else SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens)
        self.core = EngineCore(self.cache, self.generator, scheduling, fingerprint=self.fingerprint)
        self._request_ids = itertools.count()
        logger.info("%s", self.describe_summary())
        # what exists now lives as long as the engine: keep it out of the cyclic collector's
        # scans, which otherwise fire inside every step's planning (page lists are large)
        gc.freeze()

    def _check_tensor_parallel(self, size: int, kv_cache_dtype: str) -> None:
        """ValueError for a tensor-parallel size or combination not served yet."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
        if size == 1:
            return
        unsupported = [what for what, on in (
            ("speculative decoding", self.speculative_config is not None),
            ("quantization", self.quantization is not None),
            ("an FP8 KV cache", kv_cache_dtype != "auto")) if on]
        if unsupported:
            raise ValueError(f"tensor_parallel_size {size} does not combine with {', '.join(unsupported)} yet")

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing without them); the engine serves no more."""
        if self._stop_ranks is not None:
            self._stop_ranks()

    # -- sizing the KV pool -----------------------------------------------------------
    @torch.inference_mode()
    def _profile_kv_budget(self, layout: KVLayout, *, page_size: int, tokens: int, prefill_chunk: int,
                           route, mla_mode: str, backend: str, fused_ops, graphs: bool,
                           speculative: SpeculativeConfig | None = None) -> int:
        """The KV pool's bytes on CUDA, as vLLM measures them: one forward of ``tokens`` prompt
        tokens (the largest step the scheduler runs: sequences of ``prefill_chunk`` tokens) on a
        scratch pool, its peak allocation above the loaded weights and that pool (activations,
        workspace, the runner's buffers) counted once for the eager
        step and once more for the CUDA graphs' private pools when ``graphs``; the pool gets
        what :func:`config.kv_cache_budget` leaves of ``gpu_memory_utilization``, less the bytes
        of ``speculative``'s drafter (a draft model or EAGLE-3 head: weights, cache, a margin;
        ``spec/drafter_memory.py``), which loads after the pool."""
        if tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {tokens}")
        # from the drafter's checkpoint headers, before any memory is measured: a bad directory fails fast
        drafter = drafter_bytes(speculative, dtype=self.dtype, target_dir=self.model_dir)
        device = self.device
        chunk = max(1, min(prefill_chunk, self.max_model_len - 1))  # positions the model has
        lengths = [min(chunk, tokens - start) for start in range(0, tokens, chunk)]
        pages = sum(math.ceil(n / page_size) for n in lengths) + len(lengths) + 2
        if (device.type == "cuda" if fused_ops is None else fused_ops) and hasattr(self.model, "use_fused_ops"):
            # stacked projections and packed experts before the baseline: their one-off copies
            # (a layer's experts at a time) are not the step's peak
            self.model.use_fused_ops()
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        scratch = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=pages), device=str(device))
        scratch_bytes = torch.cuda.memory_allocated(device) - base
        # the runner's own buffers count with the step's activations: the real runner makes them again
        runner = ModelRunner(self.model, scratch, device=device, route=route, mla_mode=mla_mode,
                             prefill_chunk=prefill_chunk, backend=backend, cuda_graphs=False,
                             max_model_len=self.max_model_len, fused_ops=fused_ops)
        if self.ranks is not None:  # the other ranks run the forward too, over scratch pools of their own
            self.ranks.start_followers(page_size, pages)
        chains = [scratch.new_chain() for _ in lengths]
        generator = torch.Generator(device="cpu").manual_seed(0)
        vocab = self.model.cfg.vocab_size
        inputs = [StepInput(chain, torch.randint(0, vocab, (n,), generator=generator).tolist())
                  for chain, n in zip(chains, lengths)]
        runner.forward(inputs)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base - scratch_bytes
        for chain in chains:
            chain.release()
        del runner, scratch, chains, inputs
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        self.profile = {"tokens": tokens, "peak_bytes": peak, "graphs_bytes": peak if graphs else 0,
                        "free_bytes": free, "total_bytes": total, "drafter_bytes": drafter}
        return kv_cache_budget(total=total, free=free, weights=self.weight_bytes,
                               peak=peak * (2 if graphs else 1), utilization=self.gpu_memory_utilization,
                               reserved=drafter)

    def summary(self) -> dict[str, object]:
        """What this engine runs on, logged at start and shown by ``/health``: device, dtype,
        weight bytes, the KV pool (bytes, tokens, how it was sized) and the attention routes."""
        forced = self.runner.route or forced_route_from_env()  # the flag, else SEGKV_ATTENTION_ROUTE
        routes = [forced.value] if forced is not None else [r.value for r in Route]
        page_size, num_pages = self.cache.config.page_size, self.cache.config.num_pages
        return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "weight_bytes": self.weight_bytes, "quantization": getattr(self.model, "quantization", None),
                "kv_cache_dtype": str(self.cache.layout.dtype).removeprefix("torch."),
                "kv_cache_bytes": num_pages * page_size * self.cache.layout.row_bytes,
                "kv_cache_tokens": num_pages * page_size,
                "kv_cache_source": self.kv_cache_source, "page_size": self.cache.config.page_size,
                "max_model_len": self.max_model_len, "attention_backend": self.runner.backend.name,
                "attention_routes": routes}

    def describe_summary(self) -> str:
        """:meth:`summary` as one line for the start-up log."""
        s = self.summary()
        weights = f"{s['weight_bytes'] / GIB:.2f} GiB" + (f" ({s['quantization']})" if s["quantization"] else "")
        return (f"segkv: {self.model_dir.name} on {s['device']}, {s['dtype']}, weights "
                f"{weights}; KV cache {s['kv_cache_dtype']} {s['kv_cache_bytes'] / GIB:.2f} GiB = "
                f"{s['kv_cache_tokens']:,} tokens ({s['kv_cache_source']}), max_model_len {s['max_model_len']}; "
                f"attention {s['attention_backend']}, routes {', '.join(s['attention_routes'])}")

    # -- before serving ---------------------------------------------------------------
    def warm_up(self, *, max_batch: int | None = None, max_num_batched_tokens: int | None = None,
                progress: bool = False) -> dict:
        """Compile the kernels and capture the CUDA graphs of the steps a server runs, before it
        reports ready, so its first requests wait for neither (``runner/warmup.py``).

        ``max_batch``: the most sequences a step runs (the server's ``max_num_seqs``, default
        64): decode graph buckets up to the one holding it are captured, every variant.
        ``max_num_batched_tokens`` (default 2048, the scheduler's): the largest forward run.
        On CUDA every step shape is run; elsewhere (nothing to compile) one-token prompts and
        a decode step per batch size up to 4, in milliseconds. The cache is left as it was
        (pages, free-list order, counters), and so are the route counts and the random
        generators: results do not change. Call it while nothing else runs on this engine.

        Returns ``{"seconds", "bytes"`` (device memory it left reserved: graph pools, index
        buffers, the allocator's blocks for the largest step; 0 on the CPU), ``"buckets"``
        (decode batch sizes run), ``"graphs"`` (graph
        variants captured, ``[size, wide, few]``, and ``[sequences, wide, False, window]`` for
        verify windows), ``"forwards"``, ``"skipped"`` (shapes the
        cache had no room for)``}``.
        """
        defaults = self.core.config
        cuda = self.device.type == "cuda"
        if max_batch is None:
            max_batch = defaults.max_num_seqs
        if max_num_batched_tokens is None:
            max_num_batched_tokens = defaults.max_num_batched_tokens
        shapes = warm_up_shapes(self.runner, max_batch=max_batch, max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=self.max_model_len, thorough=cuda)
        start = time.perf_counter()
        if cuda:  # blocks cached since loading: a graph capture frees them, which would hide what is added
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(self.device) if cuda else 0
        report = warm_up(self.runner, self.generator.sampler, shapes, vocab_size=self.model.cfg.vocab_size,
                         progress=progress)
        if cuda:
            torch.cuda.synchronize(self.device)
        added = torch.cuda.memory_reserved(self.device) - reserved if cuda else 0
        gc.collect()  # the graphs and buffers made live as long as the engine: out of the collector's scans
        gc.freeze()
        return {"seconds": time.perf_counter() - start, "bytes": added, **report}

    # -- stateless generation ---------------------------------------------------------
    def generate(
        self, prompts: str | Seq[str] | Seq[Seq[int]], sampling: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Complete each prompt (text, or token ids); ``n`` samples share one prefill.

        The prompts are requests of this engine's core, stepped until all finish (a server's
        requests on the same core run in the same steps); their pages are released at the end.
        """
        params = sampling or SamplingParams()
        batch = self._normalise_prompts(prompts)
        for _, ids in batch:
            self.check_prompt_length(len(ids))
        core, queued = self.core, deque(batch)
        requests: list[EngineRequest] = []
        try:
            active: list[EngineRequest] = []
            while queued or active:
                with core.lock:
                    while queued and len(core.waiting) < core.config.max_waiting:
                        request_id = f"gen-{next(self._request_ids)}"
                        requests.append(core.add_request(queued.popleft()[1], params, request_id=request_id,
                                                         cache_rows=False))
                        active.append(requests[-1])
                    core.step()  # n > 1: samples fork the prefilled prompt (no recompute)
                active = [r for r in active if not r.finished]
            outputs = []
            for (text, _), request in zip(batch, requests):
                if request.aborted:
                    raise RuntimeError(f"request {request.request_id} was aborted: the engine stopped")
                outputs.append(request.output())
                outputs[-1].prompt = text
            return outputs
        finally:
            with core.lock:
                for request in requests:
                    core.abort(request.request_id)  # those not finished (an error, an interrupt)

    def _normalise_prompts(self, prompts) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, Seq) or not prompts:
            raise ValueError("prompts must be a string, a list of strings or a list of token id lists")
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append((p, self.tokenizer.encode(p)))
            elif isinstance(p, Seq) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                out.append((None, list(p)))
            else:
                raise ValueError(f"a prompt must be a string or a list of token ids, got {type(p).__name__}")
            if not out[-1][1]:
                raise ValueError("a prompt must have at least one token")
            vocab = self.model.cfg.vocab_size
            if any(not 0 <= t < vocab for t in out[-1][1]):
                raise ValueError(f"prompt token ids must be in 0..{vocab - 1}")
        return out

    def check_prompt_length(self, num_tokens: int) -> None:
        """Raise a clear ValueError if a prompt leaves no room for one generated token."""
        self.generator.check_prompt_length(num_tokens)

    # -- conversations ----------------------------------------------------------------
    def conversation(self, system: str | None = None) -> Conversation:
        """A new conversation (turns, forks, snapshots) on this engine's cache."""
        return Conversation(self, system=system)

    def load_conversation(self, path: str | Path) -> Conversation:
        """A conversation restored from a snapshot file saved by ``Conversation.save``."""
        return Conversation.load(self, path)

    def stats(self) -> dict[str, object]:
        """Pool counters and the attention routes and precision modes used so far."""
        return {**self.cache.stats(), "routes": dict(self.runner.route_counts),
                "precisions": dict(self.runner.precision_counts),
                "last_plan": self.runner.last_plan.describe() if self.runner.last_plan else None}
