"""Every environment variable segkv reads, typed and documented, read once into a frozen object."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

# How a variable's text becomes its value. INTEGER: surrounding blanks stripped, unset or empty is
# the default, anything else must be an integer. EXACT_ONE: on exactly when the text is "1" (unset:
# the default). TEXT: the text as given (unset: None).
INTEGER, EXACT_ONE, TEXT = "integer", "exact-one", "text"


def _setting(env: str, kind: str, default, help: str):
    """A field of :class:`Settings`: environment variable ``env`` read as ``kind``."""
    return field(default=default, metadata={"env": env, "kind": kind, "help": help})


@dataclass(frozen=True, slots=True)
class Settings:
    """The environment's overrides (``docs/configuration.md``, "Environment overrides"). A default of
    None means the code's own default (named in the help), which may depend on the device or shape."""

    # --- the command, the server and model files
    api_key: str | None = _setting("SEGKV_API_KEY", TEXT, None,
        "the API key `segkv serve` asks for without --api-key; unset or empty: none")
    home: str | None = _setting("SEGKV_HOME", TEXT, None,
        "where the untrained placeholder models are built (None: ~/.cache/segkv)")
    hf_hub_cache: str | None = _setting("HF_HUB_CACHE", TEXT, None,
        "the Hugging Face cache `--model org/name` is looked up in (None: $HF_HOME/hub)")
    hf_home: str | None = _setting("HF_HOME", TEXT, None,
        "Hugging Face's home; its hub/ is the cache when HF_HUB_CACHE is unset (None: ~/.cache/huggingface)")
    triton_interpret: bool = _setting("TRITON_INTERPRET", EXACT_ONE, False,
        "Triton kernels run in Triton's interpreter (the kernels branch on it)")
    # --- tensor parallelism across hosts: torchrun's own variables (torch reads its MASTER_ADDR/PORT)
    launcher_rank: int | None = _setting("RANK", INTEGER, None,
        "this process's rank when torchrun started it (rank 0 serves, the others follow; None: not launched)")
    launcher_world_size: int | None = _setting("WORLD_SIZE", INTEGER, None,
        "the ranks torchrun started: --tensor-parallel-size must equal it (None: not launched)")
    launcher_local_rank: int | None = _setting("LOCAL_RANK", INTEGER, None,
        "this process's rank on its host when torchrun started it: its GPU (None: not launched)")
    # --- the engine's step loop
    lookahead: int | None = _setting("SEGKV_LOOKAHEAD", INTEGER, None,
        "launch decode steps ahead (nonzero: on; None: on CUDA, off on the CPU)")
    # --- attention planning (the three CUDA numbers suit the H100 and H200; other GPUs may differ)
    attention_route: str | None = _setting("SEGKV_ATTENTION_ROUTE", TEXT, None,
        "force the attention route (auto, single, split, segments, cascade)")
    attention_precision: str | None = _setting("SEGKV_ATTENTION_PRECISION", TEXT, None,
        "force the precision mode inside attention pieces (auto, exact, fast; None: auto, the planner's)")
    cuda_blocks_per_sm: int | None = _setting("SEGKV_CUDA_BLOCKS_PER_SM", INTEGER, None,
        "stage-1 programs per SM the CUDA planner assumes (None: 2)")
    cuda_min_partition_rows: int | None = _setting("SEGKV_CUDA_MIN_PARTITION_ROWS", INTEGER, None,
        "shortest GQA partition of the CUDA planner, KV rows (None: 64)")
    cuda_min_latent_partition_rows: int | None = _setting(
        "SEGKV_CUDA_MIN_LATENT_PARTITION_ROWS", INTEGER, None,
        "shortest latent partition of the CUDA planner, KV rows (None: 32)")


def _parse(env: str, kind: str, text: str | None, default):
    if text is None:
        return default
    if kind == TEXT:
        return text
    if kind == EXACT_ONE:
        return text == "1"
    value = text.strip()
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{env} must be an integer, got {value!r}") from None
    return number


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings of ``environ`` (default ``os.environ``); a bad value is a ValueError naming its
    variable."""
    environ = os.environ if environ is None else environ
    values = {}
    for f in fields(Settings):
        env = f.metadata["env"]
        values[f.name] = _parse(env, f.metadata["kind"], environ.get(env), f.default)
    return Settings(**values)


def or_default(value, default):
    """``value``, or ``default`` where a setting left unset (None) means the code's own default."""
    return default if value is None else value


def declared() -> dict[str, tuple[str, object, str]]:
    """Every variable segkv reads: name -> (kind, default, help)."""
    return {f.metadata["env"]: (f.metadata["kind"], f.default, f.metadata["help"]) for f in fields(Settings)}


# Read once, when segkv is first imported. Tests that change a variable re-read it into this name
# (``monkeypatch.setattr(settings, "SETTINGS", settings.load_settings())``); code that reads it at
# call time goes through the module attribute so that they see it.
SETTINGS = load_settings()
