"""``triton`` and ``triton.language``, or stand-ins where Triton is not installed.

A CUDA build of torch brings Triton; a CPU build does not, and serving on the CPU needs none of
the kernels. The kernel modules import ``triton`` and ``tl`` from here, so they still import
without Triton: their kernels are then defined but not launchable (a launch raises a clear
error), and the host-side helpers they use (``cdiv``, ``next_power_of_2``) stay exact. The
stand-ins live only in this module, never in ``sys.modules``, so other libraries (torch's
compiler) still see that Triton is absent.
"""

from __future__ import annotations

from typing import Any

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # a CPU-only install
    HAS_TRITON = False

    MISSING = ("Triton is not installed: the GPU kernels need it (a CUDA build of torch brings it; "
               "`pip install triton` on Linux)")

    class _Stub:
        """Any attribute, call or annotation of the Triton API, at definition time only."""

        def __init__(self, name: str) -> None:
            self._name = name

        def __getattr__(self, attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Stub(f"{self._name}.{attr}")

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if len(args) == 1 and callable(args[0]) and not kwargs and not isinstance(args[0], _Stub):
                return _UnavailableKernel(args[0])  # @triton.jit, @triton.autotune(...)(fn)
            return _Stub(f"{self._name}(...)")  # a decorator factory, tl.constexpr(value), ...

        def __repr__(self) -> str:
            return f"<{self._name}: {MISSING}>"

    class _UnavailableKernel:
        """A kernel defined without Triton: launching it raises."""

        def __init__(self, fn: Any) -> None:
            self.fn = fn
            self.__name__ = getattr(fn, "__name__", "kernel")
            self.__doc__ = getattr(fn, "__doc__", None)

        def __getitem__(self, grid: Any) -> Any:
            raise RuntimeError(f"kernel {self.__name__}: {MISSING}")

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"kernel {self.__name__}: {MISSING}")

    class _TritonStub(_Stub):
        """``triton`` with its exact host-side helpers."""

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()

    triton = _TritonStub("triton")  # type: ignore[assignment]
    tl = _Stub("triton.language")  # type: ignore[assignment]

__all__ = ["HAS_TRITON", "tl", "triton"]
