"""The built-in models: their names, their packaged directories, and their architectures
(defined in ``default_configs``, below the untrained placeholder that builds on them).

``--model default`` is a small Qwen3-style GQA model and ``--model default-mla`` a small
DeepSeek-V3-style MLA/MoE model with one multi-token-prediction layer, both trained on the
Python standard library by ``python -m tools.default_models.train`` (in the repository, outside
the package) and shipped in ``segkv/default_models/``. Where the packaged weights are absent (a
checkout where the training has not been run yet), an untrained placeholder of the same family
stands in, with a warning.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from segkv.models.default_configs import EOS_TOKEN_IDS, GQA_NAME, MLA_NAME, gqa_config, mla_config

__all__ = ["EOS_TOKEN_IDS", "GQA_NAME", "MLA_NAME", "PACKAGED", "PACKAGE_ROOT", "check_model_dir", "gqa_config",
           "is_complete", "is_default_name", "mla_config", "packaged_dir", "resolve_model_dir"]

# name -> directory under segkv/default_models/
PACKAGED = {GQA_NAME: "qwen3-gqa", MLA_NAME: "deepseek-mla"}
PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "default_models"


def is_default_name(name: str) -> bool:
    return name in PACKAGED


def packaged_dir(name: str) -> Path:
    """Where the trained model ``name`` ships: ``segkv/default_models/<dir>``."""
    if name not in PACKAGED:
        raise ValueError(f"no built-in model {name!r}; built-in models: {', '.join(PACKAGED)}")
    return PACKAGE_ROOT / PACKAGED[name]


def is_complete(directory: Path) -> bool:
    """Whether ``directory`` holds a loadable model (config, weights and tokenizer)."""
    return all((directory / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def resolve_model_dir(name: str | Path) -> Path:
    """``default`` / ``default-mla`` -> the packaged trained model (or the placeholder); else a path."""
    if isinstance(name, Path) or not is_default_name(name):
        return Path(name)
    directory = packaged_dir(name)
    if is_complete(directory):
        return directory
    from segkv.models.placeholder import ensure_placeholder

    warnings.warn(
        f"the trained built-in model {name!r} is not in this installation ({directory} has no weights); "
        "using an UNTRAINED placeholder with random weights: its text is not meaningful. "
        "Build the trained models with python -m tools.default_models.train (docs/default-models.md).",
        stacklevel=2,
    )
    return ensure_placeholder(name)


def check_model_dir(directory: str | Path) -> Path:
    """``directory`` as a Path if it can be a model directory (a folder with ``config.json``);
    FileNotFoundError saying what is wrong otherwise (a typo'd path used to surface as a missing
    ``tokenizer.json``)."""
    path = Path(directory)
    hint = f"give a Hugging Face model directory or a built-in model: {', '.join(PACKAGED)}"
    if not path.exists():
        raise FileNotFoundError(f"model directory '{directory}' does not exist; {hint}")
    if not path.is_dir():
        raise FileNotFoundError(f"model path '{directory}' is not a directory; {hint}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory '{directory}' has no config.json; {hint}")
    return path
