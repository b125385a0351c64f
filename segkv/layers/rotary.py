"""Rotary position embeddings with the scalings checkpoints use (linear, llama3, yarn)."""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(dim: int, base: float, scaling: dict | None, max_position: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``(dim // 2,)`` float32 and the cos/sin attention factor.

    ``scaling`` is the checkpoint's rope scaling dict (``rope_type`` or ``type`` key), or None.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    return _yarn(dim, base, scaling, max_position)


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: low frequencies divided by ``factor``, a smooth ramp in between."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, s: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN (as DeepSeek V2/V3 configure it): blend of interpolated and extrapolated frequencies."""
    original = float(s["original_max_position_embeddings"])
    factor = s.get("factor")
    factor = float(factor) if factor is not None else max_position / original
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attention = yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to ``(T, H, dim)`` tensors at positions ``(T,)``.

    ``interleaved=False`` rotates the halves ``(x[:d/2], x[d/2:])`` (Llama, Qwen);
    ``interleaved=True`` rotates adjacent pairs ``(x[2i], x[2i+1])`` (DeepSeek).
    """

    def __init__(self, dim: int, *, base: float, max_position: int, scaling: dict | None = None,
                 interleaved: bool = False) -> None:
        super().__init__()
        self._args = (dim, base, scaling, max_position)
        inv_freq, self.attention_factor = rope_inv_freq(*self._args)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleaved = interleaved
        self._tables: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # see cos_sin_table

    def init_buffers(self, device: str | torch.device) -> None:
        """Recompute the frequencies on ``device`` (after building the model on 'meta')."""
        with torch.device("cpu"):
            inv_freq, _ = rope_inv_freq(*self._args)
        self.inv_freq = inv_freq.to(device)
        self._tables.clear()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(T, dim // 2)`` cos and sin in ``dtype`` (angles computed in float32)."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.float().unsqueeze(0)
        return (freqs.cos() * self.attention_factor).to(dtype), (freqs.sin() * self.attention_factor).to(dtype)

    def cos_sin_table(self, dtype: torch.dtype) -> torch.Tensor:
        """``(max_position, dim)`` table ``[cos | sin]`` of every position in ``dtype``, made by
        :meth:`cos_sin` itself (so a kernel reading it gets the values ``forward`` uses, bit for
        bit); built on first use per dtype and kept (not saved)."""
        key = (dtype, self.inv_freq.device)
        if key not in self._tables:
            max_position = self._args[3]
            cos, sin = self.cos_sin(torch.arange(max_position, device=self.inv_freq.device), dtype)
            self._tables[key] = torch.cat((cos, sin), dim=-1).contiguous()
        return self._tables[key]

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin(positions, x.dtype)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
