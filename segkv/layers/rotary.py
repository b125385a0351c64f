"""Rotary position embeddings with the scalings checkpoints use (linear, llama3, yarn, dynamic, longrope)."""

from __future__ import annotations

import math

import torch
from torch import nn

# What every family takes. ``dynamic`` (dynamic NTK) rescales the base only for sequences longer
# than ``max_position_embeddings``; segkv's table and model length stop there, so within it the
# frequencies are the plain ones, exactly as transformers computes them for those lengths.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
# Types whose frequencies depend on the step's positions: the family's attention must map positions
# to table rows (:meth:`RotaryEmbedding.table_positions`), so only families that do accept them.
POSITION_DEPENDENT_ROPE_TYPES = ("longrope",)


def rope_inv_freq(dim: int, base: float, scaling: dict | None, max_position: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``(dim // 2,)`` float32 and the cos/sin attention factor.

    ``scaling`` is the checkpoint's rope scaling dict (``rope_type`` or ``type`` key), or None.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = rope_type_of(scaling)
    known = SUPPORTED_ROPE_TYPES + POSITION_DEPENDENT_ROPE_TYPES
    if rope_type not in known:
        raise ValueError(f"unsupported rope scaling {rope_type!r}; supported: {', '.join(known)}")
    if rope_type in ("default", "dynamic"):  # dynamic: the same up to max_position (see SUPPORTED_ROPE_TYPES)
        return inv_freq, 1.0
    if rope_type == "longrope":
        short, _, attention = longrope_inv_freq(dim, base, scaling, max_position)
        return short, attention
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    return _yarn(dim, base, scaling, max_position)


def rope_type_of(scaling: dict | None) -> str:
    """The RoPE type of a scaling dict (``rope_type``, or the older ``type``); "default" for None."""
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def longrope_inv_freq(dim: int, base: float, s: dict, max_position: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """LongRoPE (Phi-3): ``(short (dim // 2,), long (dim // 2,), attention factor)``, float32.

    The inverse frequencies are divided per dimension by ``short_factor`` (sequences up to
    ``original_max_position_embeddings``) or ``long_factor`` (longer ones). The attention factor
    multiplies cos and sin: ``attention_factor`` if given, else ``sqrt(1 + ln(factor) / ln(original))``
    with ``factor`` defaulting to ``max_position / original`` (1 when ``factor <= 1``), as transformers.
    """
    original = int(s["original_max_position_embeddings"])
    factor = s.get("factor")
    factor = float(factor) if factor is not None else max_position / original
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    sets = []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor([float(f) for f in s[key]], dtype=torch.float32)
        if ext.shape != (dim // 2,):
            raise ValueError(f"longrope {key} has {ext.numel()} entries; the rotary dimension {dim} needs {dim // 2}")
        sets.append(1.0 / (ext * base**exponents))  # transformers' order of operations (bit-identical)
    return sets[0], sets[1], float(attention)


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

    LongRoPE keeps two frequency sets. Its table has ``2 * max_position`` rows: row ``p`` is
    position ``p`` at the short factors, row ``max_position + p`` position ``p`` at the long ones.
    :meth:`forward`, :meth:`cos_sin` and :meth:`cos_sin_table` take such rows; callers map the
    step's positions to rows with :meth:`table_positions` (the identity for other types).
    """

    def __init__(self, dim: int, *, base: float, max_position: int, scaling: dict | None = None,
                 interleaved: bool = False) -> None:
        super().__init__()
        self._args = (dim, base, scaling, max_position)
        inv_freq, self.attention_factor = rope_inv_freq(*self._args)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.longrope = rope_type_of(scaling) == "longrope"
        if self.longrope:
            self.register_buffer("long_inv_freq", longrope_inv_freq(*self._args)[1], persistent=False)
            self.switch_length = int(scaling["original_max_position_embeddings"])
        self.interleaved = interleaved
        self._tables: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # see cos_sin_table

    def init_buffers(self, device: str | torch.device) -> None:
        """Recompute the frequencies on ``device`` (after building the model on 'meta')."""
        with torch.device("cpu"):
            inv_freq, _ = rope_inv_freq(*self._args)
            if self.longrope:
                self.long_inv_freq = longrope_inv_freq(*self._args)[1].to(device)
        self.inv_freq = inv_freq.to(device)
        self._tables.clear()

    def table_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Positions ``(T,)`` int -> table rows ``(T,)`` for :meth:`forward` / :meth:`cos_sin_table`.

        LongRoPE, as transformers applies it per forward: when the step's largest position is
        ``original_max_position_embeddings`` or more (a sequence longer than the original length),
        every row of the step takes the long factors, else the short ones. The choice is a
        device-side select, with no host synchronization. Other types: ``positions`` itself.

        Keys already cached keep the factors of the step that wrote them. transformers' Phi-3
        ``generate`` instead recomputes the whole cache at the long factors the first time a
        sequence grows past the original length, so a sequence whose first step stays within it and
        a later step (a decode step or a further prefill chunk) crosses it differs from transformers
        from that step on. A sequence prefilled in one step, below or above, matches.
        """
        if not self.longrope or positions.numel() == 0:
            return positions
        long = (positions.max() >= self.switch_length).to(positions.dtype)
        return positions + long * self._args[3]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(T, dim // 2)`` cos and sin in ``dtype`` (angles computed in float32) of table rows
        ``positions (T,)`` (positions themselves except for LongRoPE, see :meth:`table_positions`)."""
        if self.longrope:
            rows = self._args[3]
            long = positions >= rows
            positions = torch.where(long, positions - rows, positions)
            inv_freq = torch.where(long.unsqueeze(-1), self.long_inv_freq.float().unsqueeze(0),
                                   self.inv_freq.float().unsqueeze(0))
            freqs = positions.float().unsqueeze(-1) * inv_freq
        else:
            freqs = positions.float().unsqueeze(-1) * self.inv_freq.float().unsqueeze(0)
        return (freqs.cos() * self.attention_factor).to(dtype), (freqs.sin() * self.attention_factor).to(dtype)

    def cos_sin_table(self, dtype: torch.dtype) -> torch.Tensor:
        """``(rows, dim)`` table ``[cos | sin]`` of every row in ``dtype`` (``max_position`` rows, twice
        that for LongRoPE: see the class docstring), made by
        :meth:`cos_sin` itself (so a kernel reading it gets the values ``forward`` uses, bit for
        bit); built on first use per dtype and kept (not saved)."""
        key = (dtype, self.inv_freq.device)
        if key not in self._tables:
            rows = self._args[3] * (2 if self.longrope else 1)
            cos, sin = self.cos_sin(torch.arange(rows, device=self.inv_freq.device), dtype)
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
