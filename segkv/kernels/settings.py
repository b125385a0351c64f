"""Integer settings from the environment (launch overrides, device settings); imports only os."""

from __future__ import annotations

import os


def env_int(name: str, default: int | None) -> int | None:
    """The integer in environment variable ``name``, or ``default`` when it is unset or empty;
    anything else is a clear error naming the variable."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
