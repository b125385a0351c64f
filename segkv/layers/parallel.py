"""Layers of a tensor-parallel model (Megatron style): the row-parallel product whose partial
sums meet in one all-reduce, and the vocabulary split over the ranks for the embeddings and the
LM head. Column-parallel products need no layer of their own: a rank's q/k/v and gate/up are
plain ``nn.Linear`` of its output slice."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from segkv.distributed.parallel import TensorParallel


class RowParallelLinear(nn.Linear):
    """``x (T, in / size) -> (T, out)``: this rank's input columns of the weight, the partial
    products summed over the ranks, then the bias (held whole, added once)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(F.linear(x, self.weight))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's ``x @ weight^T (T, out)``, made here or by a fused kernel, -> the layer's
        output: summed over the ranks (in place), then the bias."""
        out = self.tp.all_reduce(partial)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``rank * V_local .. (rank + 1) * V_local - 1`` of the embedding table (the last
    rank's tail beyond the vocabulary is zeros): each rank looks up the ids it holds, zeros for
    the others, and the all-reduce assembles every row. ``ids (T,) -> (T, hidden)``."""

    def __init__(self, num_local: int, hidden_size: int, *, tp: TensorParallel) -> None:
        super().__init__(num_local, hidden_size)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start = self.tp.rank * self.num_embeddings
        local = ids - start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside[:, None], 0))


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int,
                          tp: TensorParallel) -> torch.Tensor:
    """``hidden (N, H)`` against this rank's LM-head rows ``weight (V_local, H)``: float32 logits
    ``(N, vocab_size)`` of the whole vocabulary on every rank (gathered, the padding cut)."""
    return tp.all_gather_last(F.linear(hidden, weight).float())[:, :vocab_size]
