"""LLM: the synchronous engine API: load a model directory, generate, hold conversations."""

from __future__ import annotations

import atexit
import dataclasses
import gc
import itertools
import time
from collections import deque
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from segkv.cache.kv_cache import PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, default_page_size, parse_dtype
from segkv.engine.core import EngineCore, EngineRequest
from segkv.engine.generation import Generator
from segkv.models.default_models import check_model_dir, resolve_model_dir
from segkv.models.loader import fingerprint, load_model
from segkv.outputs import RequestOutput
from segkv.runner.model_runner import ModelRunner
from segkv.runner.warmup import warm_up, warm_up_shapes
from segkv.sampling_params import SamplingParams
from segkv.sessions.conversation import Conversation
from segkv.spec.config import SpeculativeConfig
from segkv.spec.eagle3 import resolve_head_dir
from segkv.tokenizer.tokenizer import Tokenizer

DEFAULT_KV_CACHE_BYTES = 1 << 30
# Engines gc.freeze() what they hold; unfrozen at exit, the final collection frees it (frozen
# cycles left at exit made the Triton bindings print a leak report after every command)
atexit.register(gc.unfreeze)


def parse_device(device: str | torch.device) -> torch.device:
    """The torch device for ``device`` ("cpu", "cuda", "cuda:1", ...), refused with a clear error
    when torch does not know it or it is not on this machine (a CUDA device without a CUDA build
    of torch or a visible GPU, or past the last GPU)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}: {exc}") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} is not available: torch {torch.__version__} "
                             f"{'has no CUDA support' if torch.version.cuda is None else 'sees no GPU'}")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} is not available: {torch.cuda.device_count()} GPU(s) visible")
    elif parsed.type != "cpu":
        raise ValueError(f"device {device!r} is not supported: 'cpu' or 'cuda' (e.g. 'cuda:0')")
    return parsed


class LLM:
    """A model with its tokenizer, paged KV cache, runner and the :class:`EngineCore` that steps
    requests on them (``generate`` here, and an :class:`AsyncEngine` serving this model).

    ``max_model_len`` defaults to the model's own limit. The cache holds ``num_pages``
    pages of ``page_size`` rows (default: ``config.default_page_size``, 32 on CUDA, 16
    elsewhere), or as many as ``kv_cache_bytes`` allows. ``route`` forces an attention route;
    ``mla_mode`` forces MLA's absorbed or naive path. ``backend``: "auto" (Triton kernels on CUDA
    for K/V caches, the torch reference otherwise), "torch" or "triton". ``cuda_graphs``: decode
    steps replayed from CUDA graphs (``True``, ``"auto"`` where available, ``False``; see
    ``runner/cuda_graphs.py``). ``fused_ops``: stacked projections and fused Triton kernels
    (default: on CUDA; ``ModelRunner``). ``speculative_config``: speculative decoding, vLLM's
    ``speculative_config`` (a JSON string, a dict or a :class:`SpeculativeConfig`), parsed before
    the model loads into ``self.speculative_config`` (``None``: off). Method ``eagle3`` with
    model ``"default"`` takes the built-in head of the built-in target (``default``,
    ``default-mla``).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        page_size: int | None = None,
        num_pages: int | None = None,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        max_model_len: int | None = None,
        route: str | None = None,
        mla_mode: str = "auto",
        prefill_chunk: int = 512,
        compaction: CompactionPolicy | None = None,
        backend: str = "auto",
        cuda_graphs: bool | str = False,
        fused_ops: bool | None = None,
        speculative_config: str | dict | SpeculativeConfig | None = None,
        progress: bool = False,
    ) -> None:
        # a bad value is refused before anything loads
        self.speculative_config = SpeculativeConfig.parse(speculative_config)
        # "default", "default-mla" or a directory (refused clearly if it is not one)
        self.model_dir = check_model_dir(resolve_model_dir(model_dir))
        # the config the generator runs: an EAGLE-3 head's directory resolved ("default": the
        # built-in head of this target), refused clearly before anything loads
        speculative = self.speculative_config
        if speculative is not None and speculative.method == "eagle3":
            speculative = dataclasses.replace(speculative,
                                              model=str(resolve_head_dir(speculative.model, self.model_dir)))
        self.dtype = parse_dtype(dtype)
        self.device = parse_device(device)
        page_size = default_page_size(self.device.type) if page_size is None else page_size
        if page_size < 1:  # before the cache budget divides by it
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.model = load_model(self.model_dir, dtype=self.dtype, device=self.device, progress=progress)
        self.fingerprint = fingerprint(self.model_dir)
        limit = self.model.max_model_len
        if max_model_len is not None and not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len must be between 1 and the model's {limit}, got {max_model_len}")
        self.max_model_len = max_model_len or limit
        if self.speculative_config is not None and self.speculative_config.method == "mtp":
            if not len(getattr(self.model, "mtp", ())):
                raise ValueError(f"speculative method 'mtp' needs multi-token-prediction layers, which "
                                 f"{self.model_dir} does not have; use 'ngram' or 'draft_model'")
            layout = self.model.kv_layout(self.dtype, mtp=True)  # the MTP layers keep rows too
        else:
            layout = self.model.kv_layout(self.dtype)
        if num_pages is None:
            num_pages = max(1, kv_cache_bytes // (page_size * layout.row_bytes))
        self.cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=num_pages),
                                  device=str(self.device), compaction=compaction)
        # a verify window (k drafts and the pending token) runs like a decode step: MLA absorbed,
        # replayed from its own CUDA graphs
        window = 1 if self.speculative_config is None else self.speculative_config.num_speculative_tokens + 1
        self.runner = ModelRunner(self.model, self.cache, device=self.device, route=route,
                                  mla_mode=mla_mode, prefill_chunk=prefill_chunk, backend=backend,
                                  cuda_graphs=cuda_graphs, graph_windows=(window,) if window > 1 else (),
                                  decode_rows_threshold=window, max_model_len=self.max_model_len,
                                  fused_ops=fused_ops)
        self.generator = Generator(self.runner, self.tokenizer, max_model_len=self.max_model_len,
                                   speculative=speculative)
        self.core = EngineCore(self.cache, self.generator, fingerprint=self.fingerprint)
        self._request_ids = itertools.count()
        # what exists now lives as long as the engine: keep it out of the cyclic collector's
        # scans, which otherwise fire inside every step's planning (page lists are large)
        gc.freeze()

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
        """Pool counters and the attention routes used so far."""
        return {**self.cache.stats(), "routes": dict(self.runner.route_counts),
                "last_plan": self.runner.last_plan.describe() if self.runner.last_plan else None}
