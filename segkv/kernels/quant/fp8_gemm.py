"""Triton kernel: ``x @ dequantize(W_fp8)^T`` with the weight dequantized tile by tile in registers.

Weight-only FP8 (W8A16): the weight is stored as float8 e4m3 (read as its bytes, ``uint8``) with
float32 scales over ``(bn, bk)`` blocks of it (one block per tensor, one row per output channel,
or DeepSeek's 128 x 128 tiles). Each program loads a ``BLOCK_N x BLOCK_K`` tile of bytes, widens
it to the activation dtype exactly (every e4m3 value is a float16 and a bfloat16 value) and
multiplies the activation tile by it with float32 accumulation; the activations are never
quantized, so the product equals the dequantized weight's within float32 summation order. The
bytes are decoded with integer operations (sign, exponent and mantissa moved into a float16 bit
pattern, times 2^8), not a float8 type, so the same kernel runs on GPUs without FP8 conversion
instructions and in Triton's interpreter.

Up to :data:`GEMV_MAX_ROWS` rows (decode) the product is a GEMV instead (:func:`fp8_gemv_kernel`):
each program streams whole weight rows with float32 multiply-adds and no tensor-core tile, whose
16-row minimum would waste 15/16 of its work on one row, and decodes the bytes with the GPU's
FP8 conversion where it has one (sm_89 and newer; the integer decode elsewhere).
"""

from __future__ import annotations

import dataclasses

import torch
import segkv.settings as settings
from segkv.kernels.triton_import import tl, triton

# Triton's interpreter mis-rounds bfloat16 tiles and truncates float32 -> bf16/fp16 stores: there
# the products run in float32 (exact for these operands) and torch rounds the output once
_INTERPRET = settings.SETTINGS.triton_interpret


@triton.jit
def e4m3_bits_to_float(bits):
    """``bits`` (int32 holding the bytes 0..255 of e4m3 values) -> float32 values. e4m3's NaN
    patterns (0x7F, 0xFF) decode as +-480: no quantizer writes them. Also the attention kernels'
    decoder of FP8 KV caches (``attention_tiles.fp8_values``)."""
    half_bits = ((bits & 0x80) << 8) | ((bits & 0x7F) << 7)
    return half_bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def fp8_linear_kernel(X, W, S, B, Y, M, N, K, stride_xm, stride_wn, stride_ym, scale_cols,
                       scale_bn, scale_bk, HAS_BIAS: tl.constexpr, SCALE_PER_TILE: tl.constexpr,
                       EXACT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """Program ``(m, n)``: ``Y[m block, n block] = X[m block] @ dequant(W[n block])^T (+ B)``.

    ``SCALE_PER_TILE``: the ``BLOCK_K`` columns of a tile lie in one scale block (``BLOCK_K``
    divides ``scale_bk``, or one block spans all of K): the tile's product is taken on the unscaled
    values (exact in ``X``'s dtype) and scaled per output row in float32. Otherwise each element is
    scaled before the product. ``EXACT_FP32``: operands widened to float32 and multiplied as IEEE
    float32 (float32 activations, and the interpreter)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    scale_rows = (offs_n // scale_bn) * scale_cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        bits = tl.load(W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                       mask=n_ok[:, None] & k_ok[None, :], other=0).to(tl.int32)
        w = e4m3_bits_to_float(bits)
        if not SCALE_PER_TILE:
            w = w * tl.load(S + scale_rows[:, None] + offs_k[None, :] // scale_bk,
                            mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if EXACT_FP32:
            part = tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            part = tl.dot(x, tl.trans(w.to(x.dtype)))
        if SCALE_PER_TILE:
            part = part * tl.load(S + scale_rows + k0 // scale_bk, mask=n_ok, other=0.0)[None, :]
        acc += part
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


# how the GEMVs apply the scales (their SCALE constexpr), chosen by gemv_launch
SCALE_PER_CHUNK = 0  # a chunk lies in one scale block: each weight row's scale for the chunk
SCALE_PER_INPUT = 1  # a program's weight rows share their scale blocks: the activations take the scales
SCALE_PER_ELEMENT = 2  # each weight element its own block's scale


@triton.jit
def _dequantized_chunk(w_rows, S, scale_rows, n_ok, offs_k, k_ok, k0, scale_bk, SCALE: tl.constexpr,
                       NATIVE_FP8: tl.constexpr):
    """The GEMVs' ``(rows, BLOCK_K)`` float32 weight chunk at ``offs_k``: bytes decoded (the GPU's
    e4m3 conversion or :func:`e4m3_bits_to_float`, both exact) and scaled as ``SCALE`` says
    (:data:`SCALE_PER_INPUT`: not here, the activations are, by :func:`_scaled_inputs`)."""
    bits = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
    if NATIVE_FP8:
        w = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        w = e4m3_bits_to_float(bits.to(tl.int32))
    if SCALE == 0:  # SCALE_PER_CHUNK
        return w * tl.load(S + scale_rows + k0 // scale_bk, mask=n_ok, other=0.0)[:, None]
    if SCALE == 2:  # SCALE_PER_ELEMENT
        return w * tl.load(S + scale_rows[:, None] + offs_k[None, :] // scale_bk,
                           mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    return w


@triton.jit
def _scaled_inputs(x, S, scale_row, offs_k, k_ok, scale_bk, SCALE: tl.constexpr):
    """The float32 activation chunk ``x`` (``(..., BLOCK_K)``) times the program's weight rows'
    scales at ``offs_k`` (their one scale row ``scale_row``) when ``SCALE`` is
    :data:`SCALE_PER_INPUT`: a block-scaled weight read in chunks wider than its blocks, with one
    scale load per input instead of one per weight element."""
    if SCALE == 1:
        return x * tl.load(S + scale_row + offs_k // scale_bk, mask=k_ok, other=0.0)
    return x


@triton.jit
def fp8_gemv_kernel(X, W, S, B, Y, M, N, K, stride_xm, stride_wn, stride_ym, scale_cols, scale_bn, scale_bk,
                        HAS_BIAS: tl.constexpr, SCALE: tl.constexpr, NATIVE_FP8: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``(m, n)``: ``Y[m, n block] = X[m] @ dequant(W[n block])^T (+ B)``, one row: the
    products accumulate element by element in a ``(BLOCK_N, BLOCK_K)`` float32 tile, the
    activation chunk broadcast along the weight rows, and are summed across K once, after the loop
    (a sum at every step would put a cross-lane reduction between each load and the next). The
    programs of one weight block are adjacent in the grid, so a block read for one row is in L2
    for the next (one program for all rows, with a 3-d accumulator, measured slower at 1, 2 and 4
    rows). ``SCALE``: how the scales apply (:data:`SCALE_PER_CHUNK`, :data:`SCALE_PER_INPUT`,
    :data:`SCALE_PER_ELEMENT`). ``NATIVE_FP8``: the bytes convert with the GPU's e4m3 instructions
    (sm_89+), else with :func:`e4m3_bits_to_float`; both exact."""
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    scale_rows = (offs_n // scale_bn) * scale_cols
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    x_row = X + row.to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w = _dequantized_chunk(w_rows, S, scale_rows, n_ok, offs_k, k_ok, k0, scale_bk, SCALE, NATIVE_FP8)
        x = tl.load(x_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        x = _scaled_inputs(x, S, (tl.program_id(1) * BLOCK_N // scale_bn) * scale_cols, offs_k, k_ok, scale_bk, SCALE)
        acc += w * x[None, :]
    out = tl.sum(acc, axis=1)  # (BLOCK_N,)
    if HAS_BIAS:
        out += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(Y + row.to(tl.int64) * stride_ym + offs_n, out.to(Y.dtype.element_ty), mask=n_ok)


# rows up to which fp8_linear runs the GEMV (decode batches)
GEMV_MAX_ROWS = 4


@dataclasses.dataclass(frozen=True)
class GemvLaunch:
    """The GEMV's launch: weight rows per program, the float32 accumulator's elements (weight rows
    x inputs; at 4 warps, 4096 is 32 registers a thread), the widest input chunk, warps and
    pipeline stages. ``benchmarks/fp8_linear.py --sweep gemv`` times alternatives."""

    block_n: int = 8
    acc_elements: int = 8192
    max_block_k: int = 2048
    num_warps: int = 4
    num_stages: int = 3


GEMV_LAUNCH = GemvLaunch()


def gemv_launch(k: int, scale_block: tuple[int, int], launch: GemvLaunch = GEMV_LAUNCH) -> tuple[int, int]:
    """``(BLOCK_K, SCALE)`` of the GEMV for ``(bn, bk)`` scale blocks: the widest chunk (at most
    ``launch.max_block_k`` inputs) whose accumulator fits ``launch.acc_elements``. Where the blocks
    split K, the activations take the scales when a program's weight rows lie in one block row
    (wide chunks: 128 x 128 blocks then run as fast as per-channel scales, where chunks narrowed to
    a block ran at 0.3-0.7x); else the chunk is narrowed to lie inside one block, or, when no
    chunk of 16 or more does, each element is scaled."""
    bn, bk = scale_block
    block_k = max(16, min(launch.max_block_k, launch.acc_elements // launch.block_n))
    if bk >= k:
        return block_k, SCALE_PER_CHUNK
    if bn % launch.block_n == 0:
        return block_k, SCALE_PER_INPUT
    inside = block_k
    while inside > 16 and bk % inside:
        inside //= 2
    return (inside, SCALE_PER_CHUNK) if bk % inside == 0 else (block_k, SCALE_PER_ELEMENT)


def launch_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                bias: torch.Tensor | None, y: torch.Tensor, launch: GemvLaunch = GEMV_LAUNCH) -> None:
    """:func:`fp8_gemv_kernel` over ``x (M, K)`` (M <= :data:`GEMV_MAX_ROWS`) into ``y (M, N)``."""
    (m, k), n = x.shape, weight.shape[0]
    bn, bk = block
    block_k, mode = gemv_launch(k, block, launch)
    fp8_gemv_kernel[(m, triton.cdiv(n, launch.block_n))](
        x, weight.view(torch.uint8), scale, bias if bias is not None else scale, y, m, n, k, x.stride(0),
        weight.stride(0), y.stride(0), scale.shape[1], bn, bk, HAS_BIAS=bias is not None,
        SCALE=mode, NATIVE_FP8=native_fp8(x.device), BLOCK_N=launch.block_n, BLOCK_K=block_k,
        num_warps=launch.num_warps, num_stages=launch.num_stages)


def native_fp8(device: torch.device) -> bool:
    """Whether the GPU converts e4m3 with its own instructions (sm_89 and newer; never in the interpreter)."""
    return (not _INTERPRET and device.type == "cuda"
            and torch.cuda.get_device_capability(device) >= (8, 9))


# programs a launch of many rows should have at least (about two per multiprocessor of an H100):
# below it, the output tiles narrow
MIN_PROGRAMS = 264


def launch_for(m: int, n: int, k: int, scale_bk: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_stages)`` for an ``(m, k) x (n, k)^T`` product with scale
    blocks ``scale_bk`` wide. Up to 16 rows: 16 x 32 output tiles, the widest input step (512,
    256 or 128) that stays inside one scale block, 4 stages (the fastest of a sweep of tiles,
    steps, warps and stages at 8B shapes on an H100: ``benchmarks/fp8_linear.py --sweep``). More
    rows: 32- or 64-row tiles, 64 output columns a program, fewer (down to 16) until the launch
    has :data:`MIN_PROGRAMS` programs, 128 inputs a step, 3 stages."""
    if m <= 16:
        inside = [step for step in (512, 256) if scale_bk % step == 0 or scale_bk >= k]
        return 16, 32, (inside[0] if inside else 128), 4
    block_m = 32 if m <= 32 else 64
    block_n = 64
    while block_n > 16 and triton.cdiv(m, block_m) * triton.cdiv(n, block_n) < MIN_PROGRAMS:
        block_n //= 2
    return block_m, block_n, 128, 3


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x (M, K)`` (float16, bfloat16 or float32; unit stride on K) times the FP8 weight
    ``weight (N, K)`` (float8_e4m3fn, unit stride on K) with float32 ``scale (ceil(N/bn), ceil(K/bk))``
    for ``block = (bn, bk)``, plus ``bias (N,)``: ``(M, N)`` in ``x``'s dtype, float32 sums rounded
    once. Equal to ``F.linear(x, dequantized weight)`` within float32 summation order (each scale
    is applied before or after its tile's product)."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"fp8_linear: rows (M, K) and a weight (N, K) expected, got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_linear: the weight must be float8_e4m3fn, got {weight.dtype}")
    n, k = weight.shape
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if scale.dtype != torch.float32 or tuple(scale.shape) != want:
        raise ValueError(f"fp8_linear: scale must be float32 of shape {want} for blocks {tuple(block)}, "
                         f"got {scale.dtype} {tuple(scale.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("fp8_linear: x and the weight need unit stride along K")
    scale = scale.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32 if _INTERPRET else x.dtype, device=x.device)
    if m == 0:
        return y.to(x.dtype)
    (launch_gemv if m <= GEMV_MAX_ROWS else launch_tiles)(x, weight, scale, block, bias, y)
    return y.to(x.dtype)


def launch_tiles(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                 bias: torch.Tensor | None, y: torch.Tensor) -> None:
    """:func:`fp8_linear_kernel` over ``x (M, K)`` into ``y (M, N)``, tiles by :func:`launch_for`."""
    (m, k), n = x.shape, weight.shape[0]
    bn, bk = block
    block_m, block_n, block_k, stages = launch_for(m, n, k, bk)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    fp8_linear_kernel[grid](
        x, weight.view(torch.uint8), scale, bias if bias is not None else scale, y, m, n, k, x.stride(0),
        weight.stride(0), y.stride(0), scale.shape[1], bn, bk, HAS_BIAS=bias is not None,
        SCALE_PER_TILE=bk % block_k == 0 or bk >= k, EXACT_FP32=x.dtype == torch.float32 or _INTERPRET,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=stages)
