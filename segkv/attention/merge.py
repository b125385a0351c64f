"""The exact log-sum-exp merge of partial attention states (the numerical contract).

Each partial state is a float32 output ``o_i`` normalised over its own keys and its
natural-log ``lse_i``. For one row: ``m = max_i lse_i``; if ``m == -inf`` the row is 0 with
LSE ``-inf``; else ``w_i = exp(lse_i - m)``, ``out = sum_i w_i o_i / sum_i w_i`` and
``lse = m + log(sum_i w_i)``. A state with ``lse = -inf`` has weight 0 whatever its output
holds. Everything stays float32; callers round the result once.

Attention sinks (gpt-oss): a per-head sink logit ``sink_h`` (natural log, comparable to the
scaled scores) is one more state with ``lse = sink_h`` and a zero output: it joins the maximum
and the weight sum, so ``out = sum_i w_i o_i / (sum_i w_i + exp(sink_h - m))`` and
``lse = m + log(sum_i w_i + exp(sink_h - m))`` with ``m = max(max_i lse_i, sink_h)``. A row with
no live state is then 0 with LSE ``sink_h``. The sink is folded here, in float32, before the
caller's single rounding (never by rescaling a rounded output).
"""

from __future__ import annotations

import torch

LSE_API = "torch-reference"


def merge_states(outputs: torch.Tensor, lses: torch.Tensor, *,
                 sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``S`` states along dim 0.

    Args:
        outputs: ``(S, *batch, D)`` partial outputs (any float dtype; computed in float32).
        lses: ``(S, *batch)`` float LSEs; ``-inf`` marks an empty state.
        sinks: optional sink logits broadcastable to ``*batch`` (e.g. ``(H,)`` for a last batch
            dimension of heads), float32: one more state each, with a zero output (module docstring).

    Returns:
        ``(out, lse)``: ``(*batch, D)`` and ``(*batch,)``, float32.
    """
    if outputs.shape[:-1] != lses.shape:
        raise ValueError(f"outputs {tuple(outputs.shape)} do not match lses {tuple(lses.shape)}")
    lses = lses.float()
    if sinks is not None:  # the sink as one more state: LSE sink_h, output 0
        sink_lse = sinks.float().expand(lses.shape[1:]).unsqueeze(0)
        lses = torch.cat((lses, sink_lse))
        outputs = torch.cat((outputs.float(), outputs.new_zeros(1, *outputs.shape[1:], dtype=torch.float32)))
    if outputs.shape[0] == 0:
        batch = outputs.shape[1:]
        return outputs.new_zeros(batch, dtype=torch.float32), lses.new_full(batch[:-1], float("-inf"))
    m = lses.amax(dim=0)
    empty = torch.isneginf(m)
    weights = torch.exp(lses - torch.where(empty, 0.0, m))
    weights = torch.where(torch.isneginf(lses), 0.0, weights)
    safe = torch.where(torch.isneginf(lses).unsqueeze(-1), 0.0, outputs.float())
    total = weights.sum(dim=0)
    out = (weights.unsqueeze(-1) * safe).sum(dim=0) / torch.where(empty, 1.0, total).unsqueeze(-1)
    lse = torch.where(empty, float("-inf"), m + torch.log(torch.where(empty, 1.0, total)))
    return out, lse


def merge_partials(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    partial_rows: torch.Tensor,
    num_rows: int,
    *,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial states into their query rows (the plan's reduce map, scattered).

    Args:
        partial_out: ``(P, H, D)`` float32 partial outputs.
        partial_lse: ``(P, H)`` float32 LSEs.
        partial_rows: ``(P,)`` int64, the query row each partial belongs to.
        num_rows: ``R``, the number of query rows.
        sinks: optional ``(H,)`` float32 sink logits, one more state per (row, head) with a zero
            output (module docstring): every row's maximum starts at its head's sink and its weight
            sum at ``exp(sink - m)``.

    Returns:
        ``(out, lse)``: ``(R, H, D)`` and ``(R, H)`` float32; rows without a visible key are
        0 with LSE ``-inf`` (with sinks: 0 with LSE ``sinks[h]``).
    """
    num_heads, dim = partial_out.shape[1], partial_out.shape[2]
    if sinks is None:
        start = torch.full((num_rows, num_heads), float("-inf"), device=partial_lse.device)
    else:
        start = sinks.float().to(partial_lse.device).expand(num_rows, num_heads).clone()
    if partial_rows.numel() == 0:
        return partial_out.new_zeros(num_rows, num_heads, dim), start
    index = partial_rows.unsqueeze(1).expand_as(partial_lse)
    m = start.scatter_reduce(0, index, partial_lse, reduce="amax", include_self=True)
    empty = torch.isneginf(m)
    m_safe = torch.where(empty, 0.0, m)
    dead = torch.isneginf(partial_lse)
    weights = torch.where(dead, 0.0, torch.exp(partial_lse - m_safe[partial_rows]))
    weighted = weights.unsqueeze(-1) * torch.where(dead.unsqueeze(-1), 0.0, partial_out)
    # the sink's own weight (0 where the sink is -inf or no state is live), then the partials'
    total = torch.where(empty, 0.0, torch.exp(start - m_safe)).index_add_(0, partial_rows, weights)
    acc = partial_out.new_zeros(num_rows, num_heads, dim).index_add_(0, partial_rows, weighted)
    denom = torch.where(empty, 1.0, total)
    out = acc / denom.unsqueeze(-1)
    lse = torch.where(empty, float("-inf"), m_safe + torch.log(denom))
    return out, lse
