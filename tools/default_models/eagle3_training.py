"""Training-time test (EAGLE-3) for a draft head over a frozen segkv target, without the paged cache.

One training step unrolls the head ``num_steps`` times over ``B`` sequences of ``S`` tokens.
Step 0 feeds the fused target states ``fc(aux_t)`` and the embedding of token ``t + 1`` at
position ``t``; step ``j`` feeds the head's own step ``j - 1`` output at row ``t`` and the
embedding of token ``t + j + 1`` at position ``t + j``. Every step predicts the target's
next-token distribution at position ``t + j + 1`` (soft cross-entropy over the draft
vocabulary). Attention follows inference: step ``j``'s row ``t`` sees step 0's rows ``0..t``
(the history the target verified) and its own rows of steps ``1..j`` (the tokens drafted after
it), as EAGLE-3's training mask does; :class:`TTTAttention` keeps every step's K/V rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from segkv.attention.metadata import AttentionMetadata
from segkv.models.eagle3 import Eagle3Head
from tools.default_models.training import dense_metadata


class TTTAttention:
    """Storage and backend for the head's one layer over ``batch`` sequences of ``seq_len`` rows.

    Each ``write`` is one unrolled step's K/V ``(B * S, Hkv, D)``; ``run`` attends the last
    step's queries over step 0 causally and over steps ``1..j`` on the diagonal."""

    def __init__(self, batch: int, seq_len: int) -> None:
        self.batch, self.seq_len = batch, seq_len
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
              trusted_slots: bool = False) -> None:
        self.keys.append(key)
        self.values.append(value)

    def key_cache(self, layer: int) -> torch.Tensor:
        return torch.stack(self.keys)  # (steps, T, Hkv, D)

    def value_cache(self, layer: int) -> torch.Tensor:
        return torch.stack(self.values)

    def mask(self, steps: int, device: torch.device) -> torch.Tensor:
        """``(S, steps * S)`` bool: which keys each query row of the last step sees."""
        s = self.seq_len
        causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
        eye = torch.eye(s, dtype=torch.bool, device=device)
        return torch.cat([causal] + [eye] * (steps - 1), dim=1)

    def kv_scales(self, layer: int) -> None:
        """Rows are kept in the model's dtype: no FP8 scales."""
        return None

    def run(self, prepared, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float,
            kv_transform=None, kv_scales=None) -> tuple[torch.Tensor, None]:
        b, s, steps, heads = self.batch, self.seq_len, key.shape[0], query.shape[1]

        def per_sequence(x: torch.Tensor) -> torch.Tensor:  # (steps, B*S, H, D) -> (B, Hq, steps*S, D)
            x = x.view(x.shape[0], b, s, x.shape[2], x.shape[3]).permute(1, 3, 0, 2, 4)
            x = x.reshape(b, x.shape[1], -1, x.shape[-1])
            return x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x

        q = query.view(b, s, heads, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, per_sequence(key), per_sequence(value),
                                             attn_mask=self.mask(steps, query.device), scale=scale)
        return out.transpose(1, 2).reshape(b * s, heads, -1), None


@dataclass(slots=True)
class TargetBatch:
    """What the frozen target gives one batch: fused-layer inputs and next-token logits."""

    aux: torch.Tensor  # (B * S, 3 * target_hidden)
    logits: torch.Tensor  # (B, S, vocab) float32


@torch.no_grad()
def target_batch(target: nn.Module, input_ids: torch.Tensor) -> TargetBatch:
    """Run the target once over ``input_ids (B, S)`` with its aux hidden states captured."""
    b, s = input_ids.shape
    positions = torch.arange(s, device=input_ids.device).repeat(b)
    hidden, aux = target(input_ids.reshape(-1), positions, dense_metadata(target, b, s, input_ids.device))
    return TargetBatch(aux=aux, logits=target.compute_logits(hidden).view(b, s, -1))


@dataclass(slots=True)
class TTTResult:
    losses: list[torch.Tensor]  # per step: mean soft cross-entropy (nats)
    correct: list[torch.Tensor]  # per step: (n,) bool, head argmax == target argmax


def ttt_losses(head: Eagle3Head, input_ids: torch.Tensor, batch: TargetBatch, *, num_steps: int = 3
               ) -> TTTResult:
    """Unroll ``head`` ``num_steps`` times over ``input_ids (B, S)`` (see the module docstring)."""
    b, s = input_ids.shape
    device = input_ids.device
    draft_ids = head.draft_to_target(torch.arange(head.cfg.draft_vocab_size, device=device))
    target_argmax = batch.logits.argmax(-1)  # (B, S)
    target_p = torch.softmax(batch.logits[..., draft_ids], dim=-1)  # (B, S, Vd): over the draft vocabulary
    # tokens shifted left by one; the last column is padding (its rows carry no loss)
    next_ids = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
    store = TTTAttention(b, s)
    meta = AttentionMetadata(backend=store, prepared=None, storage=store,
                             slots=torch.arange(b * s, device=device))
    hidden = head.fuse(batch.aux)
    base = torch.arange(s, device=device)
    losses, correct = [], []
    for j in range(num_steps):
        valid = s - 1 - j  # rows t <= S - 2 - j have a label at t + j + 1
        hidden = head(hidden, next_ids.reshape(-1), (base + j).repeat(b), meta)
        logits = head.compute_logits(hidden).view(b, s, -1)[:, :valid]
        label = target_p[:, j + 1: j + 1 + valid]
        losses.append(-(label * torch.log_softmax(logits, dim=-1)).sum(-1).mean())
        predicted = draft_ids[logits.argmax(-1)]
        correct.append((predicted == target_argmax[:, j + 1: j + 1 + valid]).reshape(-1))
        next_ids = torch.cat([next_ids[:, 1:], next_ids[:, -1:]], dim=1)
    return TTTResult(losses, correct)


def init_head(head: Eagle3Head, *, std: float = 0.02) -> None:
    """Normal(0, std) matrices (the output projections scaled down), norms 1."""
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, std / 2**0.5)
            else:
                p.normal_(0.0, std)
