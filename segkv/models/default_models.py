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

import re
import warnings
from pathlib import Path

import segkv.settings as settings

from segkv.models.default_configs import EOS_TOKEN_IDS, GQA_NAME, MLA_NAME, gqa_config, mla_config

__all__ = ["EOS_TOKEN_IDS", "GQA_NAME", "MLA_NAME", "PACKAGED", "PACKAGE_ROOT", "check_model_dir", "gqa_config",
           "hf_hub_cache", "is_complete", "is_default_name", "is_hub_name", "mla_config", "packaged_dir",
           "resolve_hub_name", "resolve_model_dir"]

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


# a Hugging Face repository id: "org/name", no other slash, no leading dot or slash
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_name(name: str | Path) -> bool:
    """Whether ``name`` reads as a Hugging Face repository id (``org/name``) rather than a path:
    a string of that form that is not an existing file or directory."""
    return isinstance(name, str) and bool(_HUB_NAME.match(name)) and not Path(name).exists()


def hf_hub_cache() -> Path:
    """The Hugging Face cache directory: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    huggingface_hub's default (``~/.cache/huggingface/hub``)."""
    s = settings.SETTINGS
    if s.hf_hub_cache:
        return Path(s.hf_hub_cache).expanduser()
    if s.hf_home:
        return Path(s.hf_home).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def resolve_hub_name(repo_id: str) -> Path:
    """The snapshot directory of ``repo_id`` in the local Hugging Face cache, found offline
    (nothing is downloaded); FileNotFoundError naming the model and the cache otherwise."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hf_hub_cache()
    try:
        path = Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        path = None
    if path is None or not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {repo_id!r} is neither a directory nor in the local Hugging Face cache {cache} (looked for "
            f"{cache / ('models--' + repo_id.replace('/', '--'))}; set HF_HUB_CACHE or HF_HOME to "
            f"another cache); segkv does not download: fetch it first (huggingface-cli download "
            f"{repo_id}), or give a model directory")
    return path


def resolve_model_dir(name: str | Path) -> Path:
    """``default`` / ``default-mla`` -> the packaged trained model (or the placeholder); an
    ``org/name`` absent from disk -> its snapshot in the local Hugging Face cache; else a path."""
    if is_hub_name(name):
        return resolve_hub_name(name)
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
