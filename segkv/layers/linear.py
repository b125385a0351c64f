"""One-row products for batch-1 decode through the one-row Triton GEMV (``kernels.gemv.dense_gemv``).

cuBLAS streams a small model's projections at one row far below the memory bandwidth; the
split-K GEMV spreads the weight over hundreds of programs and, launched with programmatic
dependent launch, loads its weight block while the kernel before it finishes. The MLA layer's x
and o products take it. The grouped-query decoder's projections and gated MLPs take it with the
layer's residual add and RMSNorm, or its SiLU-and-mul, inside the product's launch. Both measured
faster end to end (docs/performance-notes.md). Products of up to 4096 inputs take whole weight
rows per program (:func:`launch_for`). The q/k/v product is such a plain whole-row GEMV, followed by one
RoPE-and-write launch that also applies Qwen3's q/k norms (``fused_ops.rope_and_write_kv``).
One row on CUDA without a bias; everything else takes ``F.linear`` and the separate kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from segkv.kernels.triton_import import triton

# Products of at most this many inputs take programs of whole weight rows, WHOLE_ROWS a program
WHOLE_ROW_MAX_INPUTS = 4096
WHOLE_ROWS = 4

def launch_for(in_dim: int, *, whole_rows: bool = False) -> tuple[int, int]:
    """``(BLOCK_N, BLOCK_K)`` of the one-row GEMV for a weight of ``in_dim`` inputs.

    ``whole_rows`` (launches whose output blocks need no partial sums meeting per head, unlike
    the q/k/v launch with RoPE and the MLA x launch): products of at most
    :data:`WHOLE_ROW_MAX_INPUTS` inputs take :data:`WHOLE_ROWS` whole rows a program (one split,
    so no partial sums and no ticket, whose release fence every split-K program waits for before
    it ends): a layer's products and whole-model decode measured faster than split-K, close to the
    copy rate (docs/benchmarks.md). Fewer rows a program measured no faster, whole rows of a much
    wider input (a 14336-input down product) slower.

    Otherwise split-K blocks, chosen by measurement against cuBLAS: 2048-wide inputs 32 x 256;
    wider inputs 16 x 512 (32 x 1024 spills registers when the weight block is loaded before the
    PDL wait). See docs/performance-notes.md."""
    if whole_rows and in_dim <= WHOLE_ROW_MAX_INPUTS:
        return WHOLE_ROWS, triton.next_power_of_2(in_dim)
    return (32, 256) if in_dim <= 2048 else (16, 512)


def one_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``x`` is one contiguous row on CUDA in ``weight``'s dtype, with no bias."""
    return (bias is None and x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous()
            and weight.stride(-1) == 1 and x.dtype == weight.dtype)


class RowProduct:
    """``F.linear(x, weight, bias)``, through the split-K GEMV for one row on CUDA (no bias), with
    a workspace (float32 partials, zeroed tickets) kept per weight shape for the next call.
    :meth:`after_norm` and :meth:`gated` form their row in the launch."""

    def __init__(self) -> None:
        self._workspace: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def applies(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
        """Whether a call with these arguments takes the split-K GEMV."""
        return one_row(x, weight, bias)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.applies(x, weight, bias):
            return F.linear(x, weight, bias)
        from segkv.kernels.gemv.dense_gemv import splitk_gemv

        return splitk_gemv(x, weight, **self._launch(weight))

    def gated(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``weight @ silu(gate) * up`` for one row ``gate_up (1, 2I)`` (``applies`` checked by
        the caller on the row's first half)."""
        from segkv.kernels.gemv.dense_gemv import gated_splitk_gemv

        return gated_splitk_gemv(gate_up, weight, **self._launch(weight))

    def after_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                   weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weight @ rms_norm(x + residual), x + residual)`` for one row (``kernels.gemv.dense_gemv.
        norm_splitk_gemv``; ``applies`` checked by the caller)."""
        from segkv.kernels.gemv.dense_gemv import norm_splitk_gemv

        return norm_splitk_gemv(x, residual, norm_weight, eps, weight, **self._launch(weight))

    def after_combine_norm(self, parts: torch.Tensor, expert_weights: torch.Tensor, shared: torch.Tensor | None,
                           residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`after_norm` of one token whose ``x`` is a MoE layer's output not formed yet
        (``kernels.gemv.dense_gemv.combine_norm_splitk_gemv``; ``applies`` checked by the caller on the
        residual)."""
        from segkv.kernels.gemv.dense_gemv import combine_norm_splitk_gemv

        return combine_norm_splitk_gemv(parts, expert_weights, shared, residual, norm_weight, eps, weight,
                                        **self._launch(weight))

    def after_norm_mla_rope(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                            eps: float, weight: torch.Tensor, **rope) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLA x product of one token with the query's RoPE and the latent cache write in its
        launch (``kernels.gemv.mla_x_gemv.mla_x_rope_gemv``, ``rope`` its keyword arguments): returns
        ``(q_nope (1, H, nope), x + residual)``."""
        from segkv.kernels.gemv.mla_x_gemv import mla_x_rope_gemv

        query_head = rope["nope_dim"] + rope["cos_sin"].shape[-1]
        return mla_x_rope_gemv(x, residual, norm_weight, eps, weight, **rope,
                               **self._launch(weight, whole=(query_head, rope["latent_rows"].shape[-1])))

    def _launch(self, weight: torch.Tensor, whole: tuple[int, ...] = ()) -> dict:
        """The launch arguments for ``weight``: ``launch_for``'s blocks (whole weight rows unless
        ``whole`` names row groups, heads, whose partial sums meet: then split-K blocks with
        ``BLOCK_N`` halved until each group is whole output blocks), and the workspace."""
        from segkv.kernels.gemv.dense_gemv import workspace_size

        out_dim, in_dim = weight.shape
        block_n, block_k = launch_for(in_dim, whole_rows=not whole)
        while any(rows % block_n for rows in whole):
            block_n //= 2
        key = (out_dim, in_dim, block_n, weight.device)
        if key not in self._workspace:
            floats, tickets = workspace_size(out_dim, in_dim, block_n, block_k)
            self._workspace[key] = (torch.empty(floats, dtype=torch.float32, device=weight.device),
                                    torch.zeros(tickets, dtype=torch.int32, device=weight.device))
        return {"block_n": block_n, "block_k": block_k, "workspace": self._workspace[key],
                "evict_first": True}


def float32_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden (N, H) @ weight (V, H)^T`` as float32 logits ``(N, V)``: ``F.linear`` then ``.float()``."""
    return F.linear(hidden, weight).float()
