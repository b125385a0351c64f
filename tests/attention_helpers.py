"""Shared builders for attention tests: random segmented batches and dense oracles."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from segkv.attention import AttentionShape, SequenceQuery
from segkv.cache import KVChain, PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, KVLayout

# name -> (num_q_heads, num_kv_heads, kind)
LAYOUTS = {
    "mha": (4, 4, "mha"),
    "gqa4": (8, 2, "mha"),
    "gqa8": (16, 2, "mha"),
    "mqa": (4, 1, "mha"),
    "mla": (4, 1, "mla"),
}
HEAD_DIM = 32
KV_LORA_RANK, ROPE_DIM = 512, 64
MLA_SCALE = 1.0 / math.sqrt(128 + 64)  # DeepSeek: softmax scale of qk_nope + qk_rope dims


@dataclass
class Batch:
    cache: PagedKVCache
    chains: list[KVChain]
    queries: list[SequenceQuery]
    query: torch.Tensor  # (R, Hq, Dk) in the cache dtype
    shape: AttentionShape
    scale: float


def make_layout(name: str, dtype: torch.dtype) -> tuple[KVLayout, AttentionShape, float]:
    num_q, num_kv, kind = LAYOUTS[name]
    if kind == "mla":
        layout = KVLayout(num_layers=1, kind="mla", kv_lora_rank=KV_LORA_RANK, rope_dim=ROPE_DIM, dtype=dtype)
        return layout, AttentionShape(num_q, 1, KV_LORA_RANK + ROPE_DIM, KV_LORA_RANK), MLA_SCALE
    layout = KVLayout(num_layers=1, num_kv_heads=num_kv, head_dim=HEAD_DIM, dtype=dtype)
    return layout, AttentionShape(num_q, num_kv, HEAD_DIM, HEAD_DIM), HEAD_DIM**-0.5


def write_rows(cache: PagedKVCache, chain: KVChain, n: int, gen: torch.Generator, *, scale: float = 1.0) -> None:
    """Append ``n`` rows of fresh random K/V (or latent), times ``scale``, to ``chain``
    (drawn on the CPU, written on the cache's device)."""
    slots = chain.append(n)
    layout = cache.layout
    device = cache.storage.device
    if layout.kind == "mla":
        cache.storage.write(0, slots, (scale * torch.randn(n, layout.key_dim, generator=gen)).to(device))
    else:
        shape = (n, layout.num_kv_heads, layout.head_dim)
        kv = scale * torch.randn(2, *shape, generator=gen)
        cache.storage.write(0, slots, kv[0].to(device), kv[1].to(device))


def forked_history(cache: PagedKVCache, gen: torch.Generator, *, rows: int, segments: int,
                   scale: float = 1.0) -> list[KVChain]:
    """Three chains over one history of ``segments - 1`` sealed random-length segments: the
    history itself, a fork trimmed back to end mid-page, and a plain fork; each then gets a
    tail of at least ``rows`` rows (segment boundaries fall mid-page)."""
    page_size = cache.page_size
    history = cache.new_chain()
    for _ in range(segments - 1):
        write_rows(cache, history, int(torch.randint(1, 2 * page_size, (1,), generator=gen)), gen, scale=scale)
        history.seal()
    fork = history.fork()
    if fork.num_rows > 1:
        fork.trim(1 if fork.num_rows % page_size != 1 else 2)  # end mid-page
    chains = [history, fork, history.fork()]
    for chain in chains:
        write_rows(cache, chain, rows + int(torch.randint(0, page_size, (1,), generator=gen)), gen, scale=scale)
    return chains


def build_batch(
    layout_name: str,
    dtype: torch.dtype,
    *,
    page_size: int,
    num_segments: int,
    num_query_rows: int,
    gen: torch.Generator,
) -> Batch:
    """Three sequences over one history of ``num_segments - 1`` sealed segments.

    Sequence 0 continues the history, sequence 1 is a fork trimmed back to a mid-page
    point, sequence 2 a plain fork; each then gets its own tail (the last segment)
    holding at least the query window. Segment lengths are random, so boundaries fall
    mid-page. Compaction is off so the segment count is what was asked for.
    """
    layout, shape, scale = make_layout(layout_name, dtype)
    max_len = page_size + page_size // 2 + 1 if page_size > 1 else 5  # crosses page ends
    num_pages = 4 * (num_segments + 3) * (max_len // page_size + 2) + 64
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=num_pages),
                         compaction=CompactionPolicy(enabled=False))
    history = cache.new_chain()

    def rand_len(low: int = 1) -> int:
        return int(torch.randint(low, max(max_len, low) + 1, (1,), generator=gen))

    for _ in range(num_segments - 1):
        write_rows(cache, history, rand_len(), gen)
        history.seal()
    fork_mid = history.fork()
    if history.num_rows > 1:
        # step back to a point that is not a page boundary when one exists
        back = next((k for k in range(1, history.num_rows) if (history.num_rows - k) % page_size), 0)
        fork_mid.trim(back)
    chains = [history, fork_mid, history.fork()]
    for chain in chains:
        write_rows(cache, chain, rand_len(num_query_rows), gen)
    queries = [SequenceQuery.from_chain(chain, num_query_rows) for chain in chains]
    rows = sum(q.num_query_rows for q in queries)
    query = torch.randn(rows, shape.num_q_heads, shape.key_dim, generator=gen).to(dtype)
    return Batch(cache, chains, queries, query, shape, scale)


def dense_attention(
    batch: Batch, *, dtype: torch.dtype = torch.float64, queries: list[SequenceQuery] | None = None
) -> torch.Tensor:
    """Whole-history attention of every query row, gathered densely, computed in ``dtype``.

    Returns ``(R, Hq, Dv)`` in ``dtype``; a row that sees no key is 0.
    """
    queries = queries or batch.queries
    outs, row = [], 0
    for chain, query in zip(batch.chains, queries):
        q = batch.query[row : row + query.num_query_rows].to(dtype)
        row += query.num_query_rows
        key, value = gather_kv(batch, chain)
        key, value = key.to(dtype), value.to(dtype)
        num_kv = key.shape[1]
        q = q.reshape(q.shape[0], num_kv, q.shape[1] // num_kv, q.shape[2])
        scores = torch.einsum("rhgd,nhd->rhgn", q, key) * batch.scale
        positions = query.query_start + torch.arange(query.num_query_rows)
        mask = torch.arange(key.shape[0]).unsqueeze(0) <= positions.unsqueeze(1)
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows -> 0
        out = torch.einsum("rhgn,nhd->rhgd", probs, value)
        outs.append(out.reshape(out.shape[0], -1, out.shape[-1]))
    return torch.cat(outs)


def sdpa_attention(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The stock kernel (``scaled_dot_product_attention``) in the cache dtype.

    Returns ``(out, valid)``: ``(R, Hq, Dv)`` and a ``(R,)`` bool of rows that see a key
    (SDPA gives NaN for the others).
    """
    outs, valid, row = [], [], 0
    for chain, query in zip(batch.chains, batch.queries):
        q = batch.query[row : row + query.num_query_rows]
        row += query.num_query_rows
        key, value = gather_kv(batch, chain)
        group = q.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        positions = query.query_start + torch.arange(query.num_query_rows)
        mask = torch.arange(key.shape[0]).unsqueeze(0) <= positions.unsqueeze(1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), attn_mask=mask, scale=batch.scale
        )
        outs.append(out.transpose(0, 1))
        valid.append(mask.any(dim=1))
    return torch.cat(outs), torch.cat(valid)


def gather_kv(batch: Batch, chain: KVChain) -> tuple[torch.Tensor, torch.Tensor]:
    """A chain's keys and values as dense ``(n, Hkv, D)`` tensors in the cache dtype."""
    slots = chain.slots()
    storage = batch.cache.storage
    if batch.cache.layout.kind == "mla":
        (latent,) = storage.read(0, slots)
        return latent.unsqueeze(1), latent[:, : batch.cache.layout.kv_lora_rank].unsqueeze(1)
    return storage.read(0, slots)


def ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of ``x``'s dtype at each element's magnitude (as float64)."""
    finfo = torch.finfo(x.dtype)
    mag = x.double().abs().clamp(min=finfo.tiny)
    return torch.pow(2.0, torch.floor(torch.log2(mag))) * finfo.eps


def triton_and_reference(plan, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, *,
                         page_size: int, scale: float, device, launch=None) -> tuple[torch.Tensor, ...]:
    """``(out, lse, ref, ref_lse)``: the plan run by the Triton backend (outputs poisoned first;
    ``launch``: its ``LaunchConfig``, default the kernels') and by the torch reference, on the
    same tensors."""
    from segkv.attention.reference import TorchReferenceBackend
    from segkv.attention.triton_backend import TritonBackend

    tb = TritonBackend(page_size=page_size, device=device, poison=True, launch=launch)
    out, lse = tb.run(tb.prepare(plan), query, key_cache, value_cache, scale=scale)
    rb = TorchReferenceBackend(page_size=page_size, device=device)
    ref, ref_lse = rb.run(rb.prepare(plan), query, key_cache, value_cache, scale=scale)
    return out, lse, ref, ref_lse


def rope_table(max_position: int, dim: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The ``[cos | sin]`` table ``(max_position, dim)`` the model layers hand the RoPE kernels."""
    from segkv.layers.rotary import RotaryEmbedding

    return RotaryEmbedding(dim, base=10000.0, max_position=max_position).to(device).cos_sin_table(dtype)


@pytest.fixture
def exact_attention(monkeypatch):
    """Plans in the ``exact`` precision mode whatever the device: tests that check the exact
    contract (one unit in the last place of float32 attention rounded once) would otherwise get
    the ``fast`` mode the CUDA planner picks for prefill chunks (test_precision_modes checks that
    mode against its own bound). A plan_attention ``precision`` argument still wins."""
    import dataclasses

    import segkv.settings as settings

    monkeypatch.setattr(settings, "SETTINGS", dataclasses.replace(settings.SETTINGS, attention_precision="exact"))


def dense_attention_with_sinks(
    batch: Batch, sinks: torch.Tensor, *, dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole-history attention with attention sinks, gathered densely, computed in ``dtype``:
    ``sinks (Hq,)`` (natural-log logits) join each row's softmax denominator with a zero value,
    ``out = sum_k exp(s_k) v_k / (sum_k exp(s_k) + exp(sink_h))``, ``lse = log(sum_k exp(s_k) +
    exp(sink_h))``. Returns ``(out (R, Hq, Dv), lse (R, Hq))`` in ``dtype``; a row that sees no key
    is 0 with LSE ``sink_h``."""
    outs, lses, row = [], [], 0
    for chain, query in zip(batch.chains, batch.queries):
        q = batch.query[row : row + query.num_query_rows].cpu().to(dtype)
        row += query.num_query_rows
        key, value = gather_kv(batch, chain)
        key, value = key.cpu().to(dtype), value.cpu().to(dtype)
        num_kv = key.shape[1]
        q = q.reshape(q.shape[0], num_kv, q.shape[1] // num_kv, q.shape[2])
        scores = torch.einsum("rhgd,nhd->rhgn", q, key) * batch.scale
        positions = query.query_start + torch.arange(query.num_query_rows)
        mask = torch.arange(key.shape[0]).unsqueeze(0) <= positions.unsqueeze(1)
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        sink = sinks.cpu().to(dtype).reshape(1, num_kv, -1)
        lse = torch.logaddexp(torch.logsumexp(scores, dim=-1), sink.expand(scores.shape[:-1]))
        out = torch.einsum("rhgn,nhd->rhgd", torch.exp(scores - lse.unsqueeze(-1)), value)
        outs.append(out.reshape(out.shape[0], -1, out.shape[-1]))
        lses.append(lse.reshape(lse.shape[0], -1))
    return torch.cat(outs), torch.cat(lses)
