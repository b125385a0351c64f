"""FP8 linear layers (``layers.fp8``) and their Triton product (``kernels.quant.fp8_gemm``, in
Triton's interpreter without a GPU) against float64 products of the dequantized weights."""

from __future__ import annotations

import pytest
import torch

from fp8_helpers import reference_dequantize, reference_quantize
from gpu_helpers import DEVICE
from segkv.layers.fp8 import FP8_DTYPE, Fp8Linear, dequantize, quantize_per_channel, scale_shape


def fp8_layer(out_dim: int, in_dim: int, block: tuple[int, int], gen, *, bias: bool = False,
              device: str = "cpu") -> tuple[Fp8Linear, torch.Tensor]:
    """A random FP8 layer quantized by the reference quantizer, and its float64 dequantized weight."""
    w = torch.randn(out_dim, in_dim, generator=gen) / in_dim**0.5
    q, scale = reference_quantize(w, block)
    layer = Fp8Linear(in_dim, out_dim, bias=bias, block=block, device=device)
    with torch.no_grad():
        layer.weight.copy_(q.to(device))
        layer.weight_scale.copy_(scale.to(device))
        if bias:
            layer.bias.copy_(torch.randn(out_dim, generator=gen).to(device))
    return layer, reference_dequantize(q, scale, block).double()


BLOCKS = {"tensor": lambda n, k: (n, k), "channel": lambda n, k: (1, k), "block128": lambda n, k: (128, 128),
          "block-odd": lambda n, k: (24, 40)}


@pytest.mark.parametrize("scheme", list(BLOCKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_on_the_cpu_is_the_dequantized_product(scheme, dtype, gen):
    out_dim, in_dim = 200, 136  # partial blocks in both directions
    layer, w = fp8_layer(out_dim, in_dim, BLOCKS[scheme](out_dim, in_dim), gen, bias=True)
    layer.bias.data = layer.bias.data.to(dtype)
    x = torch.randn(3, 5, in_dim, generator=gen).to(dtype)
    y = layer(x)
    assert y.shape == (3, 5, out_dim) and y.dtype == dtype and torch.isfinite(y).all()
    ref = torch.nn.functional.linear(x, w.to(dtype), layer.bias)  # the model with the dequantized weight
    torch.testing.assert_close(y, ref, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
    assert layer.scheme == ("block" if scheme.startswith("block") else scheme)


@pytest.mark.parametrize("scheme", list(BLOCKS))
@pytest.mark.parametrize("rows", [1, 3, 5, 40])  # 1 and 3: the GEMV (3 padded to 4 rows)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_gemm_kernel_is_the_dequantized_product(scheme, rows, dtype, gen):
    from segkv.kernels.quant.fp8_gemm import fp8_linear

    out_dim, in_dim = 150, 264
    block = BLOCKS[scheme](out_dim, in_dim)
    layer, w = fp8_layer(out_dim, in_dim, block, gen, bias=rows == 5, device=DEVICE)
    x = torch.randn(rows, in_dim, generator=gen).to(dtype).to(DEVICE)
    bias = layer.bias.to(dtype) if layer.bias is not None else None
    y = fp8_linear(x, layer.weight, layer.weight_scale, block, bias)
    ref = x.double().cpu() @ w.T + (bias.double().cpu() if bias is not None else 0)
    assert y.shape == (rows, out_dim) and y.dtype == dtype and torch.isfinite(y).all()
    # float32 sums rounded once to the output dtype
    tol = {torch.float32: 1e-5, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
    torch.testing.assert_close(y.double().cpu(), ref, rtol=tol, atol=tol)


def test_every_e4m3_value_decodes_exactly(gen):
    """The kernel's integer decoding of e4m3 bytes, over all 254 finite values (subnormals, zeros
    of both signs, 448), against torch's conversion."""
    from segkv.kernels.quant.fp8_gemm import fp8_linear

    values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
    finite = values[~values.float().isnan()]
    weight = finite.reshape(-1, 1).to(DEVICE)  # one input: each output is one value
    x = torch.ones(1, 1, dtype=torch.float32, device=DEVICE)
    y = fp8_linear(x, weight, torch.ones(1, 1, device=DEVICE), (weight.shape[0], 1))
    assert torch.equal(y[0].cpu(), finite.float())


def test_fp8_linear_rejects_what_it_cannot_compute():
    from segkv.kernels.quant.fp8_gemm import fp8_linear

    w = torch.zeros(8, 16, dtype=FP8_DTYPE, device=DEVICE)
    x = torch.randn(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="rows"):
        fp8_linear(x[:, :8], w, torch.ones(8, 1, device=DEVICE), (1, 16))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(x, w.float(), torch.ones(8, 1, device=DEVICE), (1, 16))
    with pytest.raises(ValueError, match=r"scale must be float32 of shape \(8, 1\)"):
        fp8_linear(x, w, torch.ones(1, 8, device=DEVICE), (1, 16))


def test_quantize_per_channel():
    w = torch.randn(33, 70)
    w[5] = 0  # an all-zero row: scale 1, zeros
    w[7, 3] = 1e4  # one large entry sets its row's scale alone
    q, scale = quantize_per_channel(w.to(torch.bfloat16))
    assert q.dtype == FP8_DTYPE and scale.shape == (33, 1) and scale.dtype == torch.float32
    assert scale[5].item() == 1 and not q[5].float().any()
    back = dequantize(q, scale, (1, 70))
    assert back.abs().amax(dim=1).sub(w.to(torch.bfloat16).float().abs().amax(dim=1)).abs().max() < 1e-6 * 1e4
    # e4m3 rounding: at most 2^-4 relative for normal values, 2^-9 of the scale below them
    err = (back - w.to(torch.bfloat16).float()).abs()
    assert (err <= w.to(torch.bfloat16).float().abs() * 2.0**-4 + scale * 2.0**-9).all()


def test_model_dtype_casts_keep_fp8_weights_and_float32_scales(gen):
    layer, _ = fp8_layer(16, 32, (8, 8), gen, bias=True)
    scale = layer.weight_scale.clone()
    weight = layer.weight.view(torch.uint8).clone()
    layer.to(torch.bfloat16)
    assert layer.weight.dtype == FP8_DTYPE and layer.bias.dtype == torch.bfloat16
    assert torch.equal(layer.weight_scale, scale) and torch.equal(layer.weight.view(torch.uint8), weight)
    assert layer.weight_scale.shape == scale_shape(16, 32, (8, 8)) == (2, 4)
    with pytest.raises(ValueError, match="two positive sizes"):
        Fp8Linear(4, 4, block=(0, 4))


@pytest.mark.gpu
def test_fp8_linear_takes_the_kernel_on_cuda(gen, monkeypatch):
    """On CUDA the layer's forward is the Triton product (not a dequantized copy)."""
    from segkv.kernels.quant import fp8_gemm

    calls = []
    real = fp8_gemm.fp8_linear
    monkeypatch.setattr(fp8_gemm, "fp8_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    layer, w = fp8_layer(96, 128, (1, 128), gen, device="cuda")
    x = torch.randn(4, 128, device="cuda", dtype=torch.bfloat16)
    y = layer(x)
    assert calls and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double().cpu(), x.double().cpu() @ w.T, rtol=2.0**-7, atol=2.0**-7)


def test_launch_shapes():
    from segkv.kernels.quant.fp8_gemm import (MIN_PROGRAMS, SCALE_PER_CHUNK, SCALE_PER_ELEMENT, SCALE_PER_INPUT,
                                              GemvLaunch, gemv_launch, launch_for)


    # decode rows: the GEMV (one program per row and weight block). Where scale blocks split K:
    # wide chunks with the activations scaled when a program's 8 weight rows share their blocks;
    # else chunks inside a block, or each element scaled
    assert gemv_launch(4096, (1, 4096)) == (1024, SCALE_PER_CHUNK)
    assert gemv_launch(4096, (128, 128)) == (1024, SCALE_PER_INPUT)
    assert gemv_launch(4096, (4, 128)) == (128, SCALE_PER_CHUNK)  # 8 rows span two block rows
    assert gemv_launch(14336, (1, 14336)) == (1024, SCALE_PER_CHUNK)
    assert gemv_launch(4096, (1, 40)) == (1024, SCALE_PER_ELEMENT)
    assert gemv_launch(4096, (4, 128), GemvLaunch(block_n=4, acc_elements=1024)) == (256, SCALE_PER_INPUT)

    assert launch_for(1, 4096, 4096, 128) == (16, 32, 128, 4)  # a step stays inside its 128-wide block
    assert launch_for(1, 28672, 4096, 4096) == (16, 32, 512, 4)  # per channel: the widest step
    assert launch_for(16, 14336, 4096, 256)[2] == 256
    m, n, _, _ = launch_for(512, 4096, 4096, 128)
    assert (m, n) == (64, 64) and (512 // m) * (4096 // n) >= MIN_PROGRAMS
    assert launch_for(40, 4096, 4096, 128)[:2] == (64, 16)  # one row tile: narrower columns fill the device


COMPILE_SCRIPT = """
import json
from segkv.kernels.offline_compile import compile_offline
from segkv.kernels.quant.fp8_gemm import fp8_linear_kernel, launch_for
out = []
cases = [(1, 4096, 4096, 128), (1, 28672, 4096, 4096), (16, 6144, 4096, 4096), (512, 4096, 14336, 128),
         (1, 4096, 4096, 48), (512, 4096, 4096, 48)]  # 48-wide scale blocks: each element scaled
for m, n, k, bk in cases:
        bm, bn, bkk, stages = launch_for(m, n, k, bk)
        per_tile = bk % bkk == 0 or bk >= k  # as fp8_linear launches it
        c = compile_offline(fp8_linear_kernel, {"HAS_BIAS": False, "SCALE_PER_TILE": per_tile, "EXACT_FP32": False,
                            "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bkk, "num_warps": 4, "num_stages": stages},
                            pointers={"X": "*bf16", "W": "*u8", "S": "*fp32", "B": "*fp32", "Y": "*bf16"})
        out.append({"launch": [bm, bn, bkk], "shared": c.shared, "spills": c.spill_bytes, "mma": "mma" in c.ptx})
from segkv.kernels.quant.fp8_gemm import GEMV_LAUNCH, fp8_gemv_kernel, gemv_launch
gemv = []
for k, block in [(4096, (1, 4096)), (14336, (128, 128)), (4096, (4, 128)), (4096, (1, 48))]:
    bkk, mode = gemv_launch(k, block)
    c = compile_offline(fp8_gemv_kernel,
                        {"HAS_BIAS": False, "SCALE": mode, "NATIVE_FP8": True,
                         "BLOCK_N": GEMV_LAUNCH.block_n, "BLOCK_K": bkk,
                         "num_warps": GEMV_LAUNCH.num_warps, "num_stages": GEMV_LAUNCH.num_stages},
                        pointers={"X": "*bf16", "W": "*u8", "S": "*fp32", "B": "*fp32", "Y": "*bf16"})
    gemv.append({"launch": [bkk, mode], "shared": c.shared, "spills": c.spill_bytes, "cvt": "e4m3" in c.ptx})
print(json.dumps({"gemm": out, "gemv": gemv}))
"""


def test_the_fp8_product_compiles_for_hopper_without_spills():
    """The launches ``launch_for`` makes, compiled for sm_90a without a GPU (``kernels.offline_compile``,
    in a subprocess without the interpreter): tensor-core products, no register spills, shared
    memory within a program's limit; the decode GEMV's launches without spills, converting the
    bytes with the GPU's e4m3 instructions."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia", reason="Triton without its CUDA backend cannot compile for sm_90a")
    from segkv.kernels.offline_compile import MAX_SHARED_PER_PROGRAM

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.splitlines()[-1])
    for case in report["gemm"]:
        assert case["mma"] and case["spills"] == 0 and case["shared"] <= MAX_SHARED_PER_PROGRAM, case
    for case in report["gemv"]:
        assert case["cvt"] and case["spills"] == 0 and case["shared"] <= MAX_SHARED_PER_PROGRAM, case


@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_launches_of_the_sweep_give_the_dequantized_product(rows, gen):
    """The launches ``benchmarks/fp8_linear.py --sweep gemv`` times (other tile sizes), each way of
    applying the scales, against the float64 product."""
    from segkv.kernels.quant.fp8_gemm import GemvLaunch, launch_gemv

    # one scale per row (per chunk); scale blocks narrower than a chunk, each element scaled;
    # blocks of 16 rows, the activations scaled; blocks of 4 rows, chunks narrowed to a block
    for block in ((1, 264), (1, 40), (16, 40), (4, 32)):
        layer, w = fp8_layer(50, 264, block, gen, device=DEVICE)
        x = torch.randn(rows, 264, generator=gen).to(DEVICE)
        y = torch.empty(rows, 50, device=DEVICE)
        launch_gemv(x, layer.weight, layer.weight_scale, block, None, y, GemvLaunch(block_n=8, acc_elements=1024))
        torch.testing.assert_close(y.double().cpu(), x.double().cpu() @ w.T, rtol=1e-5, atol=1e-5)


STACKS = {  # pieces' (out, block) and whether they stack
    "tensor+channel": ([(64, "tensor"), (32, "channel"), (32, "tensor")], True),
    "block": ([(64, (32, 48)), (32, (32, 48)), (40, (32, 48))], True),  # the last fills part of a block
    "block-straddling": ([(40, (32, 48)), (32, (32, 48))], False),
    "mixed-blocks": ([(64, (32, 48)), (64, (32, 32))], False),
    "block+channel": ([(64, (32, 48)), (64, "channel")], False),
}


@pytest.mark.parametrize("case", list(STACKS))
def test_stack_fp8_is_the_pieces_outputs_concatenated(case, gen):
    from segkv.layers.fp8 import stack_fp8

    specs, stacks = STACKS[case]
    in_dim = 96
    pieces, weights = [], []
    for out_dim, block in specs:
        block = {"tensor": (out_dim, in_dim), "channel": (1, in_dim)}.get(block, block)
        layer, w = fp8_layer(out_dim, in_dim, block, gen, bias=True)
        pieces.append(layer)
        weights.append(w)
    x = torch.randn(5, in_dim, generator=gen)
    separate = [p(x) for p in pieces]
    stacked = stack_fp8(*pieces)
    if not stacks:
        assert stacked is None
        return
    y = stacked(x)
    assert y.shape == (5, sum(o for o, _ in specs)) and torch.isfinite(y).all()
    torch.testing.assert_close(y, torch.cat(separate, dim=-1), rtol=0, atol=0)
    ref = torch.nn.functional.linear(x.double(), torch.cat(weights), stacked.bias.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    # each piece is now a view of the stacked layer and still computes its own output
    row = 0
    for piece, out in zip(pieces, separate):
        assert piece.weight.data_ptr() == stacked.weight[row].data_ptr()
        torch.testing.assert_close(piece(x), out, rtol=0, atol=0)
        row += piece.out_features


def test_stack_fp8_refuses_biases_on_some_pieces(gen):
    from segkv.layers.fp8 import stack_fp8

    a, _ = fp8_layer(32, 64, (1, 64), gen, bias=True)
    b, _ = fp8_layer(32, 64, (1, 64), gen, bias=False)
    assert stack_fp8(a, b) is None
