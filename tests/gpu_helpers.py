"""Where the tests run, decided once: ``GPU`` (a CUDA device is present), ``DEVICE`` (``"cuda"``
or ``"cpu"``) and ``GRAPHS`` (real CUDA graphs, else emulated). Tests that run on both pick their
device and sizes from these (without a GPU the Triton kernels run in Triton's interpreter); a
test that needs CUDA carries the ``gpu`` marker instead, which tests/conftest.py skips without a
device."""

from __future__ import annotations

import torch

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
GRAPHS = True if GPU else "emulate"  # the LLM's ``cuda_graphs``: replayed on a GPU, emulated on the CPU
