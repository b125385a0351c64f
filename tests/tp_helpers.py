"""Tensor-parallel ranks as processes on this machine (gloo): each loads its shard; rank 0
prefills a prompt and decodes greedily, the others follow its forwards; the parent compares
what they saved with one whole model."""

from __future__ import annotations

import multiprocessing
import traceback
from pathlib import Path

import torch

from segkv.cache import PagedKVCache
from segkv.config import CacheConfig
from segkv.models.loader import load_model
from segkv.runner.model_runner import ModelRunner
from segkv.runner.tp_steps import broadcast_step, follow_steps


def greedy_run(model, prompt: list[int], steps: int, *, fused: bool = False) -> dict:
    """The prompt's float32 logits ``(P, V)``, ``steps`` greedy tokens (each step's prompt
    prefilled again on a fresh chain), and the model's parameter bytes. ``fused``: the fused ops
    (stacked projections, fused kernels in Triton's interpreter on the CPU)."""
    torch.manual_seed(0)
    cache = PagedKVCache(model.kv_layout(torch.float32), CacheConfig(page_size=16, num_pages=64))
    runner = ModelRunner(model, cache, prefill_chunk=16, fused_ops=fused)
    ids, tokens, logits = list(prompt), [], None
    for _ in range(steps + 1):
        chain = cache.new_chain()
        step = runner.prompt_logits(chain, ids)
        chain.release()
        logits = step if logits is None else logits
        tokens.append(int(step[-1].argmax()))
        ids.append(tokens[-1])
    return {"logits": logits, "tokens": tokens[:steps], "weight_bytes": weight_bytes(model)}


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def _rank(rank: int, size: int, model_dir: str, prompt: list[int], steps: int, out: str, fused: bool) -> None:
    from segkv.distributed import init_tensor_parallel

    torch.set_num_threads(1)
    try:
        tp = init_tensor_parallel(size, rank, init_method=f"file://{out}.rendezvous", timeout_s=60)
        model = load_model(model_dir, dtype="float32", tensor_parallel=tp)
        if rank == 0:  # it plans and broadcasts every forward; the others follow
            result = greedy_run(model, prompt, steps, fused=fused)
            broadcast_step(tp, None)
        else:
            cache = PagedKVCache(model.kv_layout(torch.float32), CacheConfig(page_size=16, num_pages=64))
            follow_steps(ModelRunner(model, cache, fused_ops=fused))
            result = {"weight_bytes": weight_bytes(model)}
        torch.save(result, f"{out}.{rank}")
    except BaseException:
        Path(f"{out}.{rank}.error").write_text(traceback.format_exc())
        raise


def run_ranks(size: int, model_dir, prompt: list[int], steps: int, work: Path, *, fused: bool = False) -> list[dict]:
    """Run ``size`` ranks as processes (``fused``: with the fused ops); every rank's results (an
    AssertionError with a rank's traceback if one failed)."""
    out = str(work / f"tp{size}{'-fused' if fused else ''}")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, size, str(model_dir), prompt, steps, out, fused))
             for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    errors = [Path(f"{out}.{r}.error") for r in range(size)]
    failed = [e.read_text() for e in errors if e.exists()]
    assert not failed and all(p.exitcode == 0 for p in procs), failed or [p.exitcode for p in procs]
    return [torch.load(f"{out}.{r}") for r in range(size)]
