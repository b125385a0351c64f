"""Reading Hugging Face ``config.json`` values that moved between format versions."""

from __future__ import annotations

from typing import Any


def rope_settings(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    """``(rope_theta, scaling)`` from either ``rope_parameters`` or ``rope_theta``/``rope_scaling``.

    ``scaling`` is None for plain RoPE, else a dict with a ``rope_type`` key (LongRoPE's always
    with ``original_max_position_embeddings``).
    """
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = dict(params)
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling["rope_type"] = kind
        scaling.pop("rope_theta", None)
        if kind == "default":
            scaling = None
        elif kind == "longrope":
            # transformers gives a top-level original_max_position_embeddings (where Phi-3 keeps it)
            # priority over the one inside the RoPE dict, and falls back to max_position_embeddings
            top = cfg.get("original_max_position_embeddings")
            if top is not None:
                scaling["original_max_position_embeddings"] = int(top)
            scaling.setdefault("original_max_position_embeddings", int(cfg.get("max_position_embeddings", 4096)))
    return theta, scaling


def require(cfg: dict[str, Any], *keys: str) -> None:
    """Raise a clear ValueError if ``config.json`` lacks any of ``keys``."""
    missing = [k for k in keys if k not in cfg]
    if missing:
        raise ValueError(f"config.json is missing {', '.join(missing)}")
