"""The one-row GEMVs' look-ahead L2 prefetch (``SEGKV_GEMV_PREFETCH_AHEAD``): each program asks,
before its PDL wait, for the weight block of a program one wave later. Where it is launched,
where it sits in the compiled kernel, and (on the GPU) that it changes no result."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from segkv.kernels import dense_gemv

GPU = torch.cuda.is_available()


def test_look_ahead_is_launched_only_where_bulk_prefetches_run(monkeypatch):
    """Off by default; asked for, programs per multiprocessor times the GPU's multiprocessors, on a
    Hopper or later GPU outside the interpreter, for 16-byte aligned 16-bit weight rows only."""
    device = "cuda" if GPU else "cpu"
    x = torch.zeros(1, 64, dtype=torch.bfloat16, device=device)
    weight = torch.zeros(32, 64, dtype=torch.bfloat16, device=device)
    assert dense_gemv.PREFETCH_AHEAD_PER_SM == 0 and dense_gemv.prefetch_ahead(x, weight) == 0
    monkeypatch.setattr(dense_gemv, "PREFETCH_AHEAD_PER_SM", 8)
    runs = GPU and torch.cuda.get_device_capability()[0] >= 9 and os.environ.get("TRITON_INTERPRET") != "1"
    expected = 8 * torch.cuda.get_device_properties(0).multi_processor_count if runs else 0
    assert dense_gemv.prefetch_ahead(x, weight) == expected
    assert dense_gemv.prefetch_ahead(x.float(), weight.float()) == 0  # 32-bit weights
    assert dense_gemv.prefetch_ahead(x[:, :60], weight[:, :60]) == 0  # rows of 120 bytes


def test_look_ahead_compiles_before_the_wait():
    """Compiled for sm_90 (no GPU needed; outside the interpreter, in a subprocess): with a
    look-ahead each of the plain, gated and normed launches prefetches before
    ``griddepcontrol.wait``, with at most 2 more registers and no spills; without, none."""
    cases = [{"kernel": "gemv", "input": kind, "ahead": ahead, "block_n": 16, "block_k": 512, "in_dim": 4096}
             for kind in (0, 1, 2) for ahead in (0, 1056)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "segkv.kernels.offline_compile"], input=json.dumps(cases),
                         capture_output=True, text=True, env=env, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    reports = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(reports) == 6
    for off, on in zip(reports[::2], reports[1::2]):
        assert off["order"] == ["launch_dependents", "wait"]
        assert on["order"] == ["launch_dependents", "prefetch", "wait"]
        assert on["spill_bytes"] == off["spill_bytes"] == 0
        assert on["registers"] <= off["registers"] + 2


@pytest.mark.skipif(not GPU, reason="bulk prefetches need the GPU")
def test_look_ahead_changes_no_result(gen, monkeypatch):
    """Plain, gated and normed products (an 8B model's shapes, several waves of programs) are
    bit-equal with and without the look-ahead."""
    def products():
        return (dense_gemv.splitk_gemv(x, w_o, block_n=16, block_k=512),
                dense_gemv.gated_splitk_gemv(gate_up, w_down, block_n=16, block_k=512),
                *dense_gemv.norm_splitk_gemv(x, residual, norm, 1e-5, w_gate_up, block_n=16, block_k=512))

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(torch.bfloat16).cuda()

    x, residual, norm = rand(1, 4096), rand(1, 4096), rand(4096)
    gate_up = rand(1, 2 * 14336)
    w_o, w_down, w_gate_up = rand(4096, 4096, scale=0.02), rand(4096, 14336, scale=0.02), rand(8192, 4096, scale=0.02)
    base = products()
    monkeypatch.setattr(dense_gemv, "PREFETCH_AHEAD_PER_SM", 8)
    assert dense_gemv.prefetch_ahead(x, w_o) > 0
    ahead = products()
    for b, a in zip(base, ahead):
        assert not torch.isnan(b).any() and torch.equal(a, b)
