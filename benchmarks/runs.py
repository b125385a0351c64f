"""Small helpers the model benchmarks share: waiting for and freeing the device between cases,
marks of a run's steps, the median / min / max summary of repeated rate measurements, and the
integers of their command lines."""

from __future__ import annotations

import argparse
import gc
import statistics
import time

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


class StepTimes:
    """Marks of a run's steps: a CUDA event queued on the stream (no sync) on a GPU, the clock on
    the CPU; :meth:`seconds` times the span from one mark to the last."""

    def __init__(self, device: torch.device) -> None:
        self.cuda, self.marks = device.type == "cuda", []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self, first: int) -> float:
        """Time from mark ``first`` to the last mark."""
        if self.cuda:
            self.marks[-1].synchronize()
            return self.marks[first].elapsed_time(self.marks[-1]) / 1e3
        return self.marks[-1] - self.marks[first]


def int_list(text: str) -> list[int]:
    """A command-line list of positive integers, ``"1,8,32"`` or ``"1K,16K"`` (1K = 1024)."""
    out = []
    for item in filter(None, (x.strip().upper() for x in text.split(","))):
        out.append(int(item[:-1]) * 1024 if item.endswith("K") else int(item))
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers (1K = 1024), got {text!r}")
    return out
