"""One-row products for batch-1 decode through the split-K Triton GEMV (``kernels.dense_gemv``).

cuBLAS streams a small model's projections at one row far below the memory bandwidth (2048 x
2048 in about 6 us on the H200); the split-K GEMV spreads the weight over hundreds of programs
and, launched with programmatic dependent launch, loads its weight block while the kernel before
it finishes. Used where a layer opts in (the MLA layer's x and o products: DeepSeek-V2-Lite batch
1 / 1K 415-417 -> 428-429 tok/s on the H200), for one row on CUDA without a bias
(``SEGKV_BATCH1_GEMV=0``: never); everything else takes ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from segkv.kernels.settings import env_int

BATCH1_GEMV = env_int("SEGKV_BATCH1_GEMV", 1) == 1
# split-K launch measured best on the H200 for 2048-wide inputs (scripts/dense_gemv_sweep.py:
# DeepSeek-V2-Lite o 5.7 us against cuBLAS's 6.5, q + kv_a 6.9 against 6.8)
BLOCK_N, BLOCK_K = 32, 256


class RowProduct:
    """``F.linear(x, weight, bias)``, through the split-K GEMV for one row on CUDA (no bias), with
    a workspace (float32 partials, zeroed tickets) kept per weight shape for the next call."""

    def __init__(self) -> None:
        self._workspace: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not (BATCH1_GEMV and bias is None and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
                and x.is_contiguous() and weight.stride(-1) == 1 and x.dtype == weight.dtype):
            return F.linear(x, weight, bias)
        from segkv.kernels.dense_gemv import splitk_gemv

        return splitk_gemv(x, weight, block_n=BLOCK_N, block_k=BLOCK_K, workspace=self._buffers(weight))

    def _buffers(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out_dim, in_dim = weight.shape
        key = (out_dim, in_dim, weight.device)
        if key not in self._workspace:
            split = -(-in_dim // BLOCK_K)
            self._workspace[key] = (torch.empty(split * out_dim, dtype=torch.float32, device=weight.device),
                                    torch.zeros(-(-out_dim // BLOCK_N), dtype=torch.int32, device=weight.device))
        return self._workspace[key]
