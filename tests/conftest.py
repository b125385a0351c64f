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

# Test tensors are small; one intra-op thread per process avoids oversubscribing the cores
# when pytest-xdist runs a worker per core (spinning thread pools slow small ops 100x).
torch.set_num_threads(1)

# Without a GPU the Triton kernels run in Triton's interpreter (set before triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
