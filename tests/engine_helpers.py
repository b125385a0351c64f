"""Driving an engine core by hand in tests."""

from __future__ import annotations


def run_all(core, max_steps: int = 10_000) -> None:
    """Step ``core`` (an ``EngineCore``) until no request is unfinished; fail after ``max_steps``."""
    for _ in range(max_steps):
        if not core.has_unfinished():
            return
        core.step()
    raise AssertionError("requests did not finish")
