"""Small helpers the model benchmarks share: waiting for and freeing the device between cases,
and the median / min / max summary of repeated rate measurements."""

from __future__ import annotations

import gc
import statistics

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA; nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Return the memory of dropped tensors to the device (CUDA: collect, then empty torch's cache)."""
    if device.type == "cuda":  # (on the CPU reference counting frees enough; a collection costs 0.2 s)
        gc.collect()
        torch.cuda.empty_cache()


def summary(rates: list[float]) -> dict:
    """``{"tokens_per_s": median, "min", "max", "trials"}`` of repeated rates."""
    return {"tokens_per_s": statistics.median(rates), "min": min(rates), "max": max(rates), "trials": rates}
