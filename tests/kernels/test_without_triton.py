"""A CPU-only install has no Triton (`make run` installs the runtime dependencies only):
the package still imports, loads the built-in models, generates and serves."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def _run_without_triton(code: str) -> str:
    """Run ``code`` in a fresh interpreter where ``import triton`` fails, as where it is absent."""
    script = "import sys\nsys.modules['triton'] = None\n" + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_built_in_models_generate_and_serve_without_triton():
    code = """
        from segkv.engine import LLM, AsyncEngine
        from segkv.kernels.triton_import import HAS_TRITON
        from segkv.sampling_params import SamplingParams
        from segkv.server.app import create_app
        assert not HAS_TRITON
        for name in ("default", "default-mla"):
            llm = LLM(name)
            llm.warm_up()
            out = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
            print(name, out.token_ids)
        engine = AsyncEngine(llm)
        create_app(engine, model_name="m")
        engine.shutdown()
    """
    without = _run_without_triton(code).splitlines()
    with_triton = subprocess.run([sys.executable, "-c", textwrap.dedent(code).replace(
        "assert not HAS_TRITON", "assert HAS_TRITON")], capture_output=True, text=True, timeout=300)
    assert with_triton.returncode == 0, with_triton.stderr[-3000:]
    # the same greedy tokens: on the CPU the kernels were never what ran
    assert without == with_triton.stdout.splitlines() and len(without) == 2


def test_a_kernel_launched_without_triton_says_so():
    out = _run_without_triton("""
        from segkv.kernels.fused.fused_ops import rms_norm
        from segkv.kernels.fused import fused_ops
        kernels = [v for v in vars(fused_ops).values() if type(v).__name__ == "_UnavailableKernel"]
        assert kernels, "no kernel was defined"
        try:
            kernels[0][(1,)]()
        except RuntimeError as exc:
            print(exc)
    """)
    assert "Triton is not installed" in out


def test_the_host_helpers_without_triton_match_triton():
    triton = pytest.importorskip("triton")
    out = _run_without_triton("""
        from segkv.kernels.triton_import import triton
        print([triton.next_power_of_2(n) for n in range(0, 300)])
        print([triton.cdiv(a, b) for a in range(0, 70) for b in range(1, 9)])
    """).splitlines()
    assert out[0] == str([triton.next_power_of_2(n) for n in range(0, 300)])
    assert out[1] == str([triton.cdiv(a, b) for a in range(0, 70) for b in range(1, 9)])
