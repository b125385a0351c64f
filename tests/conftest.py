"""Test configuration: a fresh random seed per session (reproducible with SEGKV_TEST_SEED)."""

from __future__ import annotations

import os
import random
import sys
import zlib
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # shared helpers next to the tests

from gpu_helpers import GPU  # noqa: E402

# Test tensors are small; one intra-op thread per process avoids oversubscribing the cores
# when pytest-xdist runs a worker per core (spinning thread pools slow small ops 100x).
torch.set_num_threads(1)

# Without a GPU the Triton kernels run in Triton's interpreter (set before triton is imported).
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` (they need CUDA) are skipped where there is no CUDA device; tests
    that also run on the CPU pick their device from ``gpu_helpers`` and carry no marker."""
    if GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def _patch_language_once_per_launch() -> None:
    """Triton's interpreter maps ``triton.language`` onto its own ops when a launch starts, and
    again at every call of a ``@triton.jit`` helper inside it (``_patch_lang``: an
    ``inspect.getmembers`` walk of the language modules, about 40% of an interpreted model step).
    Within a launch, a helper whose globals see only language modules the launch has already
    mapped gets nothing new from it, so that call is skipped; any other call is mapped as before.
    Only where this Triton has the interpreter internals it relies on."""
    import inspect

    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    grid_call = getattr(getattr(interpreter, "GridExecutor", None), "__call__", None)
    patch = getattr(interpreter, "_patch_lang", None)
    if grid_call is None or patch is None or not hasattr(interpreter, "InterpretedFunction"):
        return
    language = (tl, tl.core)
    mapped: list = []  # per running launch: ids of the language modules mapped (None: not yet)
    seen: dict = {}  # id(globals) -> (globals, ids of the language modules it holds)

    class _Nothing:
        def restore(self) -> None:
            pass

    def langs(fn) -> frozenset:
        g = fn.__globals__
        entry = seen.get(id(g))
        if entry is None or entry[0] is not g:
            entry = seen[id(g)] = (g, frozenset(id(v) for v in g.values()
                                                if inspect.ismodule(v) and any(v is m for m in language)))
        return entry[1]

    def patch_once(fn):
        needed = langs(fn)
        if mapped and mapped[-1] is not None and needed <= mapped[-1]:
            return _Nothing()
        scope = patch(fn)
        if mapped:
            mapped[-1] = needed | (mapped[-1] or frozenset())
        return scope

    def launch(self, *args, **kwargs):
        mapped.append(None)
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            mapped.pop()

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch


def _skip_interpreted_overflow_checks() -> None:
    """Triton's interpreter checks every int32 add, sub and mul of a kernel for overflow by
    redoing it in int64 with two comparisons and an assert: about a quarter of an interpreted
    model step. The test shapes keep every offset far below 2**31 (the kernels' int64 offsets,
    ``WIDE_OFFSETS``, are tested by their own cases), so the interpreter runs without it."""
    import dataclasses

    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is not None and getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def _cache_interpreted_dtypes() -> None:
    """The interpreter's ``_get_np_dtype`` builds a 20-entry dict of Triton dtypes on every call
    (hundreds of thousands per model step): the same answers, looked up once per dtype."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None:
        return
    cache: dict = {}
    pointer = np.dtype(np.uint64)

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        found = cache.get(tt_dtype)
        if found is None:
            found = cache[tt_dtype] = original(tt_dtype)
        return found

    interpreter._get_np_dtype = np_dtype


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_language_once_per_launch()
    _skip_interpreted_overflow_checks()
    _cache_interpreted_dtypes()


def _session_seed(config) -> int:
    worker = getattr(config, "workerinput", None)
    if worker is not None:
        return int(worker["segkv_seed"])
    if not hasattr(config, "_segkv_seed"):
        config._segkv_seed = int(os.environ.get("SEGKV_TEST_SEED", random.randrange(2**31)))
    return config._segkv_seed


def pytest_configure_node(node):  # xdist: every worker draws from the same session seed
    node.workerinput["segkv_seed"] = _session_seed(node.config)


def pytest_report_header(config):
    return f"segkv test seed: {_session_seed(config)} (rerun with SEGKV_TEST_SEED={_session_seed(config)})"


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the session seed and the test id: fresh inputs per case."""
    seed = (_session_seed(request.config) + zlib.crc32(request.node.nodeid.encode())) % 2**63
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The session seed again at the end of a failed run (``-q`` hides the header)."""
    if exitstatus != 0:
        seed = _session_seed(config)
        terminalreporter.write_line(f"segkv test seed: {seed} (rerun with SEGKV_TEST_SEED={seed})")
