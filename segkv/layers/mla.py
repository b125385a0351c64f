"""Multi-head latent attention (DeepSeek V2/V3) over the latent paged cache, absorbed or naive."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from segkv.attention.metadata import AttentionMetadata
from segkv.attention.plan import AttentionShape
from segkv.kernels.fused.fused_ops import mla_rope_and_write_latent, mla_rope_fusable
from segkv.kernels.gemv.head_gemv import MAX_IN as HEAD_GEMV_MAX_IN
from segkv.kernels.gemv.head_gemv import head_gemv
from segkv.layers.activation import stack_linears
from segkv.layers.fp8 import Fp8Linear, set_stacked, stack_fp8
from segkv.layers.linear import RowProduct
from segkv.layers.parallel import RowParallelLinear
from segkv.layers.norm import PendingCombine, RMSNorm
from segkv.layers.rotary import RotaryEmbedding

MLA_MODES = ("absorbed", "naive")
LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the default eps, not rms_norm_eps


def one_token_on_cuda(rows: torch.Tensor) -> bool:
    """Whether ``rows (T, ...)`` are one token's, on a CUDA device (the per-head GEMVs' case)."""
    return rows.shape[0] == 1 and rows.is_cuda


@dataclass(slots=True, frozen=True)
class MLADims:
    """Widths of one MLA layer (``q_lora_rank`` None: a plain ``q_proj``)."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool = False

    def __post_init__(self) -> None:
        sizes = (self.hidden_size, self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim)
        if min(sizes) < 1 or self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
            raise ValueError(f"invalid MLA dimensions {self}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank must be >= 1 or null, got {self.q_lora_rank}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """One cached row: ``kv_lora_rank`` normalised latent columns, then the roped key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def attention_shape(self, mla_mode: str) -> AttentionShape:
        """What the backend attends: one latent head (absorbed) or ``H`` decompressed heads (naive)."""
        if mla_mode == "absorbed":
            return AttentionShape(self.num_heads, 1, self.latent_dim, self.kv_lora_rank)
        if mla_mode == "naive":
            return AttentionShape(self.num_heads, self.num_heads, self.qk_head_dim, self.v_head_dim)
        raise ValueError(f"mla_mode must be one of {MLA_MODES}, got {mla_mode!r}")


class MultiHeadLatentAttention(nn.Module):
    """``self_attn.*`` of a DeepSeek layer: ``x (T, hidden)`` at ``positions (T,)`` -> ``(T, hidden)``.

    Both modes write the same cache row ``concat(kv_a_layernorm(c_kv), rope(k_pe))`` and use
    the same explicit softmax ``scale``. ``kv_b_proj.weight`` viewed as ``(H, nope + v, r)``
    holds ``W_uk = [:, :nope]`` and ``W_uv = [:, nope:]``:

    - absorbed: ``q_nope @ W_uk`` gives a latent query, so ``q . k_nope == q_lat . c_kv``;
      attention over the latent rows yields ``(T, H, r)``, mapped by ``W_uv`` to ``(T, H, v)``;
    - naive: each piece's latent rows are decompressed by ``kv_b_proj`` into per-head keys
      ``[k_nope, k_pe]`` and values, attended with ``[q_nope, q_pe]``.
    """

    def __init__(self, dims: MLADims, layer_index: int, rotary: RotaryEmbedding, *, scale: float) -> None:
        super().__init__()
        d = self.dims = dims
        self.layer_index = layer_index
        self.scale = scale
        self.rotary = rotary
        bias = d.attention_bias
        if d.q_lora_rank is None:
            self.q_proj = nn.Linear(d.hidden_size, d.num_heads * d.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d.hidden_size, d.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(d.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(d.q_lora_rank, d.num_heads * d.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d.hidden_size, d.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, LORA_NORM_EPS)
        kv_b_width = d.num_heads * (d.qk_nope_head_dim + d.v_head_dim)
        self.kv_b_proj = nn.Linear(d.kv_lora_rank, kv_b_width, bias=False)
        self.o_proj = nn.Linear(d.num_heads * d.v_head_dim, d.hidden_size, bias=bias)
        self.fused = False  # see use_fused
        self._x_proj: tuple[torch.Tensor, torch.Tensor | None] | None = None  # see use_fused (not saved)
        self._x_proj_fp8: Fp8Linear | None = None  # the same for FP8 projections (not saved)
        self._row_product = RowProduct()  # batch-1 decode's x and o products (layers.linear)

    def use_fused(self) -> None:
        """RoPE of q and k and the latent cache write as one kernel (GPU decode), and the two
        projections of ``x`` (``q_proj`` or ``q_a_proj``, and ``kv_a_proj_with_mqa``) stacked into
        one weight: one GEMM instead of two (their parameters become views of it). FP8
        projections stack into one FP8 layer (``layers.fp8.stack_fp8``) where their scales allow."""
        self.fused = mla_rope_fusable(self.dims.qk_rope_head_dim)
        first = self.q_proj if self.dims.q_lora_rank is None else self.q_a_proj
        fp8 = [isinstance(p, Fp8Linear) for p in (first, self.kv_a_proj_with_mqa)]
        if all(fp8):
            if self._x_proj_fp8 is None:
                set_stacked(self, "_x_proj_fp8", stack_fp8(first, self.kv_a_proj_with_mqa))
        elif (self._x_proj is None and not any(fp8)
              and (first.bias is None) == (self.kv_a_proj_with_mqa.bias is None)):
            self._x_proj = stack_linears(first, self.kv_a_proj_with_mqa)

    stacks_fp8 = True  # use_fused also stacks FP8 projections (CausalLM.use_fused_ops)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x (T, hidden)`` -> ``q (T, H * qk_head_dim)`` and the latent ``(T, r + rope)`` (views of
        one GEMM's output when stacked)."""
        d = self.dims
        if self._x_proj_fp8 is not None:
            return self._split_product(self._x_proj_fp8(x))
        if self._x_proj is None:
            q_or_a = self.q_proj(x) if d.q_lora_rank is None else self.q_a_proj(x)
            latent = self.kv_a_proj_with_mqa(x)
        else:
            weight, bias = self._x_proj
            return self._split_product(self._row_product(x, weight, bias))
        q = q_or_a if d.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(q_or_a))
        return q, latent

    def _split_product(self, product: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacked x product ``(T, q or q_a + latent)`` -> ``q (T, H * qk_head_dim)`` and the latent."""
        d = self.dims
        q_or_a, latent = product.split([product.shape[-1] - d.latent_dim, d.latent_dim], -1)
        q = q_or_a if d.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(q_or_a))
        return q, latent

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self._attend(*self._project(x), positions, meta)

    def forward_after_norm(self, x: torch.Tensor | PendingCombine, residual: torch.Tensor | None, norm: RMSNorm,
                           positions: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """A pre-norm block's first half: ``(self(norm(x + residual)), x + residual)`` (``x``
        itself without a residual). ``x`` may be the previous MoE layer's output not formed yet
        (:class:`PendingCombine`). At one token on CUDA with the x projections stacked, the
        combine, the residual add and the norm run inside the x product's launch
        (``kernels.gemv.dense_gemv``): two launches become one. With absorbed attention and no q LoRA
        the same launch also rotates the query and writes the latent cache row
        (``kernels.gemv.mla_x_gemv``): one launch fewer again."""
        source = self._gemv_source(x, residual, norm)
        if source is None:
            if residual is None:
                h, residual = norm(x), x
            else:
                h, residual = norm.add_and_norm(x, residual)
            return self(h, positions, meta), residual
        d, weight, rows = self.dims, self._x_proj[0], self._row_product
        # an FP8 cache is written by storage.write, which quantizes (the fused kernel would not)
        if self.fused and meta.mla_mode == "absorbed" and d.q_lora_rank is None and not meta.storage.fp8:
            query = weight.new_empty(1, d.num_heads, d.kv_lora_rank + d.qk_rope_head_dim)
            kv_norm = self.kv_a_layernorm
            q_nope, residual = rows.after_norm_mla_rope(
                **source, norm_weight=norm.weight, eps=norm.eps, weight=weight, num_heads=d.num_heads,
                nope_dim=d.qk_nope_head_dim, kv_norm=(kv_norm.weight, kv_norm.eps), positions=positions,
                cos_sin=self.rotary.cos_sin_table(weight.dtype), slots=meta.slots,
                latent_rows=meta.storage.latent_rows_to_write(self.layer_index, meta.slots,
                                                              trusted_slots=meta.trusted_slots),
                q_rope_out=query[..., d.kv_lora_rank:], interleaved=self.rotary.interleaved)
            return self._output(self._absorbed(q_nope, query[..., d.kv_lora_rank:], meta, query)), residual
        if "expert_weights" in source:
            product, residual = rows.after_combine_norm(source["x"], source["expert_weights"], source["shared"],
                                                        source["residual"], norm.weight, norm.eps, weight)
        else:
            product, residual = rows.after_norm(source["x"], source["residual"], norm.weight, norm.eps, weight)
        return self._attend(*self._split_product(product), positions, meta), residual

    def _gemv_source(self, x: torch.Tensor | PendingCombine, residual: torch.Tensor | None, norm: RMSNorm
                     ) -> dict | None:
        """The one-row GEMVs' input (``x``, ``residual``, and for a :class:`PendingCombine` its
        ``expert_weights`` and ``shared``), or None where they do not apply (more tokens, no
        stacked weight, a bias, the CPU)."""
        if self._x_proj is None or self._x_proj[1] is not None or not norm.fused:
            return None
        weight, rows = self._x_proj[0], self._row_product
        if isinstance(x, PendingCombine):
            if residual is None or x.weights.shape[0] != 1 or not rows.applies(residual, weight):
                return None
            return {"x": x.parts, "residual": residual, "expert_weights": x.weights, "shared": x.shared}
        if not rows.applies(x, weight):
            return None
        return {"x": x, "residual": residual}

    def _attend(self, q: torch.Tensor, latent: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """``q (T, H * qk_head_dim)`` and ``latent (T, r + rope)`` of the new rows: RoPE, the
        latent cache write, attention and the output projection ``(T, hidden)``."""
        d, t = self.dims, q.shape[0]
        q = q.view(t, d.num_heads, d.qk_head_dim)
        q_nope, q_pe = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], -1)
        c_kv, k_pe = latent.split([d.kv_lora_rank, d.qk_rope_head_dim], -1)
        storage, layer = meta.storage, self.layer_index
        query = None  # the absorbed attention's query, filled in place by the fused path
        if self.fused and not storage.fp8:  # an FP8 cache's writes quantize: storage.write below
            rows = storage.latent_rows_to_write(layer, meta.slots, trusted_slots=meta.trusted_slots)
            norm = self.kv_a_layernorm  # folded into the write kernel: one launch fewer
            if meta.mla_mode == "absorbed":
                query = q.new_empty(t, d.num_heads, d.kv_lora_rank + d.qk_rope_head_dim)
            q_pe = mla_rope_and_write_latent(q_pe, k_pe, c_kv, positions, self.rotary.cos_sin_table(q.dtype),
                                             meta.slots, rows, interleaved=self.rotary.interleaved,
                                             norm=(norm.weight, norm.eps),
                                             out=None if query is None else query[..., d.kv_lora_rank:])
        else:
            q_pe = self.rotary(q_pe, positions)
            k_pe = self.rotary(k_pe.unsqueeze(1), positions).squeeze(1)
            latent = torch.cat((self.kv_a_layernorm(c_kv), k_pe), dim=-1)  # (T, r + rope)
            storage.write(layer, meta.slots, latent, trusted_slots=meta.trusted_slots)
        if meta.mla_mode == "absorbed":
            out = self._absorbed(q_nope, q_pe, meta, query)
        elif meta.mla_mode == "naive":
            query = torch.cat((q_nope, q_pe), dim=-1)  # (T, H, nope + rope)
            out, _ = meta.backend.run(meta.prepared, query, storage.key_cache(layer),
                                      storage.value_cache(layer), scale=self.scale,
                                      kv_transform=self._decompress, kv_scales=storage.kv_scales(layer))
        else:
            raise ValueError(f"mla_mode must be one of {MLA_MODES}, got {meta.mla_mode!r}")
        return self._output(out)

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's ``(T, H, v)`` -> the output projection ``(T, hidden)``."""
        out = out.reshape(out.shape[0], self.dims.num_heads * self.dims.v_head_dim)
        if not self.fused or isinstance(self.o_proj, Fp8Linear):  # an FP8 o_proj runs its own product
            return self.o_proj(out)
        if isinstance(self.o_proj, RowParallelLinear):  # a shard: the ranks' products summed, then the bias
            return self.o_proj.reduce(self._row_product(out, self.o_proj.weight, None))
        return self._row_product(out, self.o_proj.weight, self.o_proj.bias)

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_uk (H, nope, r)`` and ``W_uv (H, v, r)``: views of ``kv_b_proj.weight`` (no copy)."""
        d = self.dims
        w = self.kv_b_proj.weight.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
        return w[:, : d.qk_nope_head_dim], w[:, d.qk_nope_head_dim :]

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, meta: AttentionMetadata,
                  query: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over the latent rows: ``(T, H, r + rope)`` query -> ``(T, H, v)``. ``query``:
        a buffer whose rope columns already hold ``q_pe`` (the fused RoPE wrote them); the latent
        columns are computed into it, so no concatenation copies the query (one launch fewer). At
        one token on CUDA with such a buffer both per-head products are one-row GEMVs with PDL
        (``kernels.gemv.head_gemv``; ``W_uk`` read through its transpose ``(H, r, n)``) instead of
        batched GEMMs."""
        w_uk, w_uv = self._kv_b()
        rank = self.dims.kv_lora_rank
        per_head = (query is not None and one_token_on_cuda(q_nope)
                    and max(rank, self.dims.qk_nope_head_dim) <= HEAD_GEMV_MAX_IN)
        if per_head:
            head_gemv(q_nope[0], w_uk.transpose(1, 2), out=query[0, :, :rank])
        elif query is None:
            q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
            query = torch.cat((q_latent, q_pe), dim=-1)
        else:  # (H, T, n) @ (H, n, r) into the (H, T, r) view of the query's latent columns
            torch.bmm(q_nope.transpose(0, 1), w_uk, out=query[..., :rank].transpose(0, 1))
        storage, layer = meta.storage, self.layer_index
        out, _ = meta.backend.run(meta.prepared, query, storage.key_cache(layer), storage.value_cache(layer),
                                  scale=self.scale, kv_scales=storage.kv_scales(layer))  # (T, H, r)
        if per_head:
            return head_gemv(out[0], w_uv).unsqueeze(0)
        return torch.einsum("thr,hvr->thv", out, w_uv)

    def _decompress(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows ``(n, 1, r + rope)`` -> keys ``(n, H, nope + rope)`` and values ``(n, H, v)``."""
        d, n = self.dims, key.shape[0]
        c_kv, k_pe = key[:, 0].split([d.kv_lora_rank, d.qk_rope_head_dim], -1)
        kv = self.kv_b_proj(c_kv.to(self.kv_b_proj.weight.dtype)).view(n, d.num_heads, -1)
        k_nope, v = kv.split([d.qk_nope_head_dim, d.v_head_dim], -1)
        k_pe = k_pe.to(k_nope.dtype).unsqueeze(1).expand(n, d.num_heads, d.qk_rope_head_dim)
        return torch.cat((k_nope, k_pe), dim=-1), v
