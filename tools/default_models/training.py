"""Full-sequence causal forward of segkv models without the paged cache: training and evaluation.

The models' layers take an ``AttentionMetadata`` whose storage receives each layer's new K/V
(or MLA latent) rows and whose backend attends them. :class:`DenseCausalAttention` plays both
parts for ``B`` independent sequences of ``S`` tokens: the rows a layer writes are the whole
history, attended causally by ``scaled_dot_product_attention`` with autograd. The layers,
and so the weights' meaning, are exactly those of inference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from segkv.attention.metadata import AttentionMetadata


class DenseCausalAttention:
    """Storage and backend of one forward over ``batch`` sequences of ``seq_len`` tokens each.

    Rows are numbered ``b * seq_len + s``. ``write(layer, slots, key (T, Hkv, D), value)`` keeps
    the rows (``value`` None: MLA latent rows ``(T, r + rope)``); ``run`` attends ``query
    (T, Hq, Dk)`` causally within each sequence and returns ``((T, Hq, Dv), None)``.
    """

    def __init__(self, batch: int, seq_len: int, *, kv_lora_rank: int | None = None) -> None:
        self.batch, self.seq_len, self.kv_lora_rank = batch, seq_len, kv_lora_rank
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    # -- the storage's part ----------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor | None = None, *, trusted_slots: bool = False) -> None:
        self._rows[layer] = (key, value)

    def key_cache(self, layer: int) -> torch.Tensor:
        key, value = self._rows[layer]
        return key if value is not None else key.unsqueeze(1)  # MLA: (T, 1, r + rope)

    def value_cache(self, layer: int) -> torch.Tensor:
        key, value = self._rows[layer]
        if value is not None:
            return value
        assert self.kv_lora_rank is not None, "MLA rows need kv_lora_rank"
        return key[:, : self.kv_lora_rank].unsqueeze(1)  # MLA: the latent columns are the values

    # -- the backend's part ----------------------------------------------------------
    def kv_scales(self, layer: int) -> None:
        """Rows are kept in the model's dtype: no FP8 scales."""
        return None

    def run(self, prepared, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float,
            kv_transform=None, kv_scales=None) -> tuple[torch.Tensor, None]:
        if kv_transform is not None:
            key, value = kv_transform(key, value)
        b, s = self.batch, self.seq_len
        heads = query.shape[1]

        def per_sequence(x: torch.Tensor) -> torch.Tensor:  # (T, H, D) -> (B, Hq, S, D)
            x = x.view(b, s, x.shape[1], x.shape[2]).transpose(1, 2)
            return x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x

        out = F.scaled_dot_product_attention(per_sequence(query), per_sequence(key), per_sequence(value),
                                             is_causal=True, scale=scale)
        return out.transpose(1, 2).reshape(b * s, heads, -1), None


def dense_metadata(model: nn.Module, batch: int, seq_len: int, device: torch.device) -> AttentionMetadata:
    """Metadata for a full-sequence forward of ``model`` (MLA takes the naive, decompressed path)."""
    mla = getattr(getattr(model.cfg, "mla", None), "kv_lora_rank", None)
    dense = DenseCausalAttention(batch, seq_len, kv_lora_rank=mla)
    slots = torch.arange(batch * seq_len, device=device)
    return AttentionMetadata(backend=dense, prepared=None, storage=dense, slots=slots, mla_mode="naive")


def causal_hidden(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """``input_ids (B, S)`` int64 -> final hidden states ``(B * S, hidden)`` (positions 0..S-1)."""
    b, s = input_ids.shape
    positions = torch.arange(s, device=input_ids.device).repeat(b)
    return model(input_ids.reshape(-1), positions, dense_metadata(model, b, s, input_ids.device))


@dataclass(slots=True)
class LMLosses:
    """Mean next-token cross-entropy (nats) and, for models with MTP layers, the depth-1 MTP one
    (predicting token ``t + 2`` from position ``t``); ``mtp`` is None without MTP layers."""

    main: torch.Tensor
    mtp: torch.Tensor | None
    mtp_correct: torch.Tensor | None = None  # (B * (S - 2),) bool: MTP argmax == token t + 2


def lm_losses(model: nn.Module, input_ids: torch.Tensor, *, with_mtp: bool = True) -> LMLosses:
    """Losses over ``input_ids (B, S)``: targets are the inputs shifted by one (and by two for MTP).

    The MTP layer sees the main model's hidden state at ``t`` and the embedding of token ``t + 1``
    (DeepSeek-V3's MTP objective); its gradient flows into the main model too.
    """
    b, s = input_ids.shape
    hidden = causal_hidden(model, input_ids)  # (B * S, hidden)
    logits = model.compute_logits(hidden).view(b, s, -1)
    main = cross_entropy(logits[:, :-1], input_ids[:, 1:])
    if not with_mtp or not len(getattr(model, "mtp", ())):
        return LMLosses(main, None)
    # Depth 1: inputs at positions 0..S-2 (hidden h_t, token t + 1); targets t + 2 exist for t <= S-3.
    h = hidden.view(b, s, -1)[:, :-1].reshape(b * (s - 1), -1)
    positions = torch.arange(s - 1, device=input_ids.device).repeat(b)
    meta = dense_metadata(model, b, s - 1, input_ids.device)
    mtp_hidden = model.mtp_forward(h, input_ids[:, 1:].reshape(-1), positions, meta)
    mtp_logits = model.compute_mtp_logits(mtp_hidden).view(b, s - 1, -1)[:, :-1]
    targets = input_ids[:, 2:]
    mtp = cross_entropy(mtp_logits, targets)
    correct = (mtp_logits.argmax(-1) == targets).reshape(-1)
    return LMLosses(main, mtp, correct)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean of ``logsumexp(logits) - logits[target]`` over ``logits (..., V)`` float32, ``targets (...)``.

    Written out rather than ``F.cross_entropy``: CUDA's NLL loss has no deterministic mode, and
    training runs under ``torch.use_deterministic_algorithms(True)``.
    """
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (torch.logsumexp(logits, dim=-1) - picked).mean()


def init_weights(model: nn.Module, *, std: float = 0.02) -> None:
    """GPT-style initialisation: normal(0, std) matrices and embeddings, output projections
    (``o_proj``, ``down_proj``) scaled by ``1 / sqrt(2 * layers)``, norms 1, biases 0."""
    num_layers = model.cfg.num_layers + len(getattr(model, "mtp", ()))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias") or p.dim() == 1:
                p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.zeros_like(p))
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, std / (2 * num_layers) ** 0.5)
            else:
                p.normal_(0.0, std)
