"""Linear projections of decode-sized inputs: cuBLAS (``F.linear``) or a Triton GEMV.

At batch 1 a projection is a matrix-vector product bound by reading its weight. cuBLAS streams
the small DeepSeek-V2-Lite projections (8-23 MB) at about 1.4 TB/s on an H200, where the expert
GEMV kernel streams expert weights at 2.5-3.1 TB/s (docs/benchmarks.md). ``SEGKV_GEMV_ROWS=N``
sends inputs of at most ``N`` rows (bf16/fp16, no bias, on a device the Triton kernels run on)
through :func:`segkv.kernels.expert_gemv.dense_gemv`; the default, 0, keeps ``F.linear``
everywhere until the GPU sweep (``scripts/expert_gemv_sweep.py --dense``) sets a policy.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from segkv.kernels.settings import env_int

GEMV_ROWS_ENV = "SEGKV_GEMV_ROWS"
# the Triton kernels run on CUDA tensors, or on any tensor in Triton's interpreter (tests)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def gemv_rows_from_env() -> int:
    """Most input rows sent to the Triton GEMV (``SEGKV_GEMV_ROWS``, default 0: never)."""
    rows = env_int(GEMV_ROWS_ENV, 0)
    if rows < 0:
        raise ValueError(f"{GEMV_ROWS_ENV} must be >= 0, got {rows}")
    return rows


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, gemv_rows: int = 0
            ) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x (T, In)``; with ``gemv_rows`` and at most that many
    rows, the Triton GEMV instead (same float32 accumulation, rounded once)."""
    if (gemv_rows and x.shape[0] <= gemv_rows and bias is None and x.dim() == 2
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and (x.is_cuda or _INTERPRET)):
        from segkv.kernels.expert_gemv import dense_gemv

        return dense_gemv(x.contiguous(), weight)
    return F.linear(x, weight, bias)
