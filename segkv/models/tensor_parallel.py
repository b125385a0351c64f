"""Sharding a model over a tensor-parallel group (Megatron style), before its weights load.

The model is built with the checkpoint's shapes on the meta device; :func:`shard_model` swaps its
projections for this rank's shares and returns, per parameter, the slice of the checkpoint
tensor the rank loads (``load_model`` reads only those bytes). Grouped-query decoders (Llama,
Mistral, Qwen2, Qwen3):

- q, k, v, gate and up split by output rows (heads; the MLP's intermediate columns);
- o and down split by input columns, summed over the ranks in one all-reduce each
  (:class:`~segkv.layers.parallel.RowParallelLinear`), the bias added once;
- KV heads split over the ranks, or, with fewer KV heads than ranks, each rank holding the one
  its query heads read (replicated ``size / num_kv_heads`` times);
- the embeddings and the LM head split by vocabulary rows (``ceil(V / size)`` a rank, the last
  padded with zeros), the logits gathered;
- norms, RoPE tables and q/k norms whole on every rank.

DeepSeek V2/V3 (latent attention, mixture of experts):

- MLA's query heads split (``q_proj`` or ``q_b_proj`` rows, ``kv_b_proj``'s per-head rows, ``o_proj``
  columns); the latent projection ``kv_a_proj_with_mqa``, its norm and ``q_a_proj`` whole: every
  rank computes and caches the same latent rows (the cache is replicated), its heads read them;
- experts tensor-parallel inside: every routed and shared expert's intermediate columns split
  like a dense MLP's, the router whole, and the layer's combined output (routed and shared
  partial sums together) reduced in one all-reduce. Chosen over expert parallelism for balance:
  every rank does 1/N of every routed pair whatever the routing, and a step still takes one
  all-reduce per layer; expert parallelism would leave a rank idle when the batch's tokens pick
  another's experts;
- multi-token-prediction layers (speculative ``mtp``, refused under tensor parallelism) load
  whole and are not run.

A rank's KV cache holds its own KV heads: ``model.kv_layout`` and ``model.attention_shape``
describe the rank's share.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from segkv.distributed.parallel import TensorParallel
from segkv.layers.activation import GatedMLP
from segkv.layers.mla import MultiHeadLatentAttention
from segkv.layers.moe import MixtureOfExperts
from segkv.layers.parallel import RowParallelLinear, VocabParallelEmbedding
from segkv.models.decoder import DecoderAttention, DecoderForCausalLM, DecoderLayer
from segkv.models.deepseek import DeepseekForCausalLM, DeepseekLayer


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """Indices ``start .. stop - 1`` of the checkpoint tensor along ``dim`` (``stop`` may pass
    its end: the rest is zero padding)."""

    dim: int
    start: int
    stop: int

    def read(self, tensor_slice) -> torch.Tensor:
        """This slice of a safetensors ``get_slice`` handle (only these bytes are read)."""
        shape = tensor_slice.get_shape()
        stop = min(self.stop, shape[self.dim])
        index = tuple(slice(self.start, stop) if d == self.dim else slice(None) for d in range(len(shape)))
        part = tensor_slice[index]
        if stop - self.start < self.stop - self.start:  # the last vocabulary shard's padding
            pad = list(part.shape)
            pad[self.dim] = self.stop - stop
            part = torch.cat([part, part.new_zeros(pad)], dim=self.dim)
        return part


def kv_heads_of(rank: int, num_kv_heads: int, size: int) -> range:
    """The KV heads rank ``rank`` of ``size`` holds: its ``num_kv_heads / size`` share, or (fewer
    KV heads than ranks) the one its query heads read."""
    if num_kv_heads >= size:
        share = num_kv_heads // size
        return range(rank * share, (rank + 1) * share)
    head = rank * num_kv_heads // size
    return range(head, head + 1)


def shard_model(model: nn.Module, tp: TensorParallel) -> dict[str, TensorSlice]:
    """Make ``model`` (meta tensors, the checkpoint's shapes) rank ``tp.rank``'s share; return the
    checkpoint slice of every split parameter (the others load whole). ValueError for a family
    or shape the ranks cannot share."""
    if isinstance(model, DeepseekForCausalLM):
        return _shard_deepseek(model, tp)
    layers = getattr(getattr(model, "model", None), "layers", ())
    if not isinstance(model, DecoderForCausalLM) or any(
            type(layer) is not DecoderLayer or type(layer.self_attn) is not DecoderAttention
            or type(layer.mlp) is not GatedMLP for layer in layers):
        raise ValueError(f"tensor parallelism supports the grouped-query decoders (Llama, Mistral, Qwen2, "
                         f"Qwen3) and DeepSeek V2/V3, not {type(model).__name__}")
    cfg = model.cfg
    heads = tp.split(cfg.num_heads, "num_attention_heads")
    inter = tp.split(cfg.intermediate_size, "intermediate_size")
    if cfg.num_kv_heads % tp.size and tp.size % cfg.num_kv_heads:
        raise ValueError(f"num_key_value_heads ({cfg.num_kv_heads}) must divide, or be divisible by, the "
                         f"tensor parallel size {tp.size}")
    own_kv = kv_heads_of(tp.rank, cfg.num_kv_heads, tp.size)
    kv, first_kv = len(own_kv), own_kv.start
    d, r = cfg.head_dim, tp.rank
    slices: dict[str, TensorSlice] = {}
    with torch.device("meta"):
        for i, layer in enumerate(model.model.layers):
            attn, mlp, name = layer.self_attn, layer.mlp, f"model.layers.{i}"
            _shrink(attn.q_proj, out=heads * d)
            _shrink(attn.k_proj, out=kv * d)
            _shrink(attn.v_proj, out=kv * d)
            attn.o_proj = RowParallelLinear(heads * d, cfg.hidden_size, bias=attn.o_proj.bias is not None, tp=tp)
            attn.num_heads, attn.num_kv_heads = heads, kv
            _shard_mlp(mlp, f"{name}.mlp", tp, slices, reduce=True)
            for proj, start, size in (("q_proj", r * heads * d, heads * d), ("k_proj", first_kv * d, kv * d),
                                      ("v_proj", first_kv * d, kv * d)):
                _rows(slices, f"{name}.self_attn.{proj}", start, size)
            slices[f"{name}.self_attn.o_proj.weight"] = TensorSlice(1, r * heads * d, (r + 1) * heads * d)
        _shard_vocabulary(model, cfg, tp, slices)
    model.cfg = dataclasses.replace(cfg, num_heads=heads, num_kv_heads=kv, intermediate_size=inter)
    model.whole_num_kv_heads = cfg.num_kv_heads  # what snapshot files hold (runner/tp_steps.py)
    model.tp = tp
    return slices


def _shard_deepseek(model: DeepseekForCausalLM, tp: TensorParallel) -> dict[str, TensorSlice]:
    """DeepSeek V2/V3: MLA heads split, the latent whole; dense MLPs and every expert split
    inside, one all-reduce per MoE layer (module docstring)."""
    cfg, r = model.cfg, tp.rank
    mla = cfg.mla
    heads = tp.split(mla.num_heads, "num_attention_heads")
    slices: dict[str, TensorSlice] = {}
    local = dataclasses.replace(mla, num_heads=heads)
    with torch.device("meta"):
        for i, layer in enumerate(model.model.layers):
            if type(layer) is not DeepseekLayer or type(layer.self_attn) is not MultiHeadLatentAttention:
                raise ValueError(f"tensor parallelism supports DeepSeek's own layers, not {type(layer).__name__}")
            attn, name = layer.self_attn, f"model.layers.{i}"
            q = attn.q_proj if mla.q_lora_rank is None else attn.q_b_proj
            q_name = "q_proj" if mla.q_lora_rank is None else "q_b_proj"
            _shrink(q, out=heads * mla.qk_head_dim)
            _rows(slices, f"{name}.self_attn.{q_name}", r * heads * mla.qk_head_dim, heads * mla.qk_head_dim)
            per_head = mla.qk_nope_head_dim + mla.v_head_dim
            _shrink(attn.kv_b_proj, out=heads * per_head)
            _rows(slices, f"{name}.self_attn.kv_b_proj", r * heads * per_head, heads * per_head)
            attn.o_proj = RowParallelLinear(heads * mla.v_head_dim, cfg.hidden_size,
                                            bias=attn.o_proj.bias is not None, tp=tp)
            slices[f"{name}.self_attn.o_proj.weight"] = TensorSlice(
                1, r * heads * mla.v_head_dim, (r + 1) * heads * mla.v_head_dim)
            attn.dims = local
            if isinstance(layer.mlp, MixtureOfExperts):
                moe = layer.mlp
                for j, expert in enumerate(moe.experts):
                    _shard_mlp(expert, f"{name}.mlp.experts.{j}", tp, slices, reduce=False)
                if moe.shared_experts is not None:
                    _shard_mlp(moe.shared_experts, f"{name}.mlp.shared_experts", tp, slices, reduce=False)
                moe.tp = tp  # the combined output's partial sums meet once
            else:
                _shard_mlp(layer.mlp, f"{name}.mlp", tp, slices, reduce=True)
        _shard_vocabulary(model, cfg, tp, slices)
    model.cfg = dataclasses.replace(cfg, mla=local)
    model.whole_num_kv_heads = None  # the latent is whole on every rank
    model.tp = tp
    return slices


def _shard_mlp(mlp: GatedMLP, prefix: str, tp: TensorParallel, slices: dict[str, TensorSlice], *,
               reduce: bool) -> None:
    """Split a gated MLP's intermediate columns: gate and up by rows, down by columns; ``reduce``:
    its down product sums the ranks' parts (else its caller reduces a sum of several)."""
    inter = tp.split(mlp.gate_proj.out_features, f"{prefix} intermediate size")
    r, hidden = tp.rank, mlp.down_proj.out_features
    _shrink(mlp.gate_proj, out=inter)
    _shrink(mlp.up_proj, out=inter)
    bias = mlp.down_proj.bias is not None
    if reduce:
        mlp.down_proj = RowParallelLinear(inter, hidden, bias=bias, tp=tp)
    else:
        if bias:
            raise ValueError(f"{prefix}: an expert's down bias under tensor parallelism is not supported")
        mlp.down_proj = nn.Linear(inter, hidden, bias=False)
    for proj in ("gate_proj", "up_proj"):
        _rows(slices, f"{prefix}.{proj}", r * inter, inter)
    slices[f"{prefix}.down_proj.weight"] = TensorSlice(1, r * inter, (r + 1) * inter)


def _shard_vocabulary(model: nn.Module, cfg, tp: TensorParallel, slices: dict[str, TensorSlice]) -> None:
    """Embeddings and LM head by vocabulary rows, ``ceil(V / size)`` a rank (meta device)."""
    vocab, r = math.ceil(cfg.vocab_size / tp.size), tp.rank
    model.model.embed_tokens = VocabParallelEmbedding(vocab, cfg.hidden_size, tp=tp)
    model.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        slices[name] = TensorSlice(0, r * vocab, (r + 1) * vocab)


def _shrink(linear: nn.Linear, *, out: int) -> None:
    """Give ``linear`` (meta) ``out`` output rows."""
    linear.weight = nn.Parameter(torch.empty(out, linear.in_features))
    if linear.bias is not None:
        linear.bias = nn.Parameter(torch.empty(out))
    linear.out_features = out


def _rows(slices: dict[str, TensorSlice], prefix: str, start: int, size: int) -> None:
    """The weight's and bias's output rows ``start .. start + size - 1``."""
    for part in ("weight", "bias"):
        slices[f"{prefix}.{part}"] = TensorSlice(0, start, start + size)
