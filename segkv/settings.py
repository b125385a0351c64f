"""Every environment variable segkv reads, typed and documented, read once into a frozen object."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

# How a variable's text becomes its value. INTEGER: surrounding blanks stripped, unset or empty is
# the default, anything else must be an integer. SWITCH: an INTEGER that is on when it equals 1.
# EXACT_ONE: on exactly when the text is "1" (unset: the default). TEXT: the text as given (unset: None).
INTEGER, SWITCH, EXACT_ONE, TEXT = "integer", "switch", "exact-one", "text"


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
    triton_interpret: bool = _setting("TRITON_INTERPRET", EXACT_ONE, False,
        "Triton kernels run in Triton's interpreter (the kernels branch on it)")
    # --- the engine's step loop
    lookahead: int | None = _setting("SEGKV_LOOKAHEAD", INTEGER, None,
        "launch decode steps ahead (nonzero: on; None: on CUDA, off on the CPU)")
    # --- attention planning
    attention_route: str | None = _setting("SEGKV_ATTENTION_ROUTE", TEXT, None,
        "force the attention route (auto, single, split, segments, cascade)")
    cuda_blocks_per_sm: int | None = _setting("SEGKV_CUDA_BLOCKS_PER_SM", INTEGER, None,
        "stage-1 programs per SM the CUDA planner assumes (None: 2)")
    cuda_min_partition_rows: int | None = _setting("SEGKV_CUDA_MIN_PARTITION_ROWS", INTEGER, None,
        "shortest GQA partition of the CUDA planner, KV rows (None: 64)")
    cuda_tall_blocks_per_sm: int | None = _setting("SEGKV_CUDA_TALL_BLOCKS_PER_SM", INTEGER, None,
        "tall decode programs per SM the CUDA planner assumes (None: 3)")
    cuda_min_latent_partition_rows: int | None = _setting(
        "SEGKV_CUDA_MIN_LATENT_PARTITION_ROWS", INTEGER, None,
        "shortest latent partition of the CUDA planner, KV rows (None: 32)")
    cuda_latent_merge_rows: int | None = _setting("SEGKV_CUDA_LATENT_MERGE_ROWS", INTEGER, None,
        "KV rows one more latent partition costs the merge in the planner (None: 1)")
    # --- GQA attention kernels
    triton_block_n: int | None = _setting("SEGKV_TRITON_BLOCK_N", INTEGER, None,
        "KV rows per GQA stage-1 tile (None: 64; 32 for head dims above 128)")
    triton_warps: int = _setting("SEGKV_TRITON_WARPS", INTEGER, 4, "warps per GQA stage-1 program")
    triton_stages: int = _setting("SEGKV_TRITON_STAGES", INTEGER, 3,
        "pipeline stages of the GQA stage-1 kernel")
    triton_block_m: int = _setting("SEGKV_TRITON_BLOCK_M", INTEGER, 64,
        "most (row, head) pairs per GQA stage-1 program")
    triton_tall_warps: int = _setting("SEGKV_TRITON_TALL_WARPS", INTEGER, 4, "warps of 64-pair GQA programs")
    triton_tall_block_n: int = _setting("SEGKV_TRITON_TALL_BLOCK_N", INTEGER, 32,
        "KV rows per tile of tall decode programs")
    triton_tall_maxnreg: int = _setting("SEGKV_TRITON_TALL_MAXNREG", INTEGER, 168,
        "register cap of tall decode programs (0: none)")
    merge_in_stage1_max: int = _setting("SEGKV_MERGE_IN_STAGE1_MAX", INTEGER, 8,
        "most partials per decode row that stage 1 merges itself")
    merge_block_dv: int | None = _setting("SEGKV_MERGE_BLOCK_DV", INTEGER, None,
        "value columns per merge program (None: 64 for GQA, 32 for latent values)")
    # --- latent (MLA) attention kernel
    mla_block_n: int = _setting("SEGKV_MLA_BLOCK_N", INTEGER, 32, "latent rows per tile of the latent kernel")
    mla_block_m: int | None = _setting("SEGKV_MLA_BLOCK_M", INTEGER, None,
        "(row, head) pairs per latent program (None: 16)")
    mla_warps: int = _setting("SEGKV_MLA_WARPS", INTEGER, 4, "warps per latent program")
    mla_stages: int = _setting("SEGKV_MLA_STAGES", INTEGER, 3, "pipeline stages of the latent kernel")
    mla_maxnreg: int | None = _setting("SEGKV_MLA_MAXNREG", INTEGER, None,
        "register cap of the latent kernel (None: Triton's choice)")
    mla_value_split: int = _setting("SEGKV_MLA_VALUE_SPLIT", INTEGER, 0,
        "latent programs per pair block (0: chosen per launch; 1, 2 or 4 forced)")
    mla_value_split_max_partials: int | None = _setting("SEGKV_MLA_VALUE_SPLIT_MAX_PARTIALS", INTEGER, None,
        "most partials for the value split (None: the SM count; 132 in the interpreter)")
    # --- mixture of experts
    gemv_unroll: int | None = _setting("SEGKV_GEMV_UNROLL", INTEGER, None,
        "unroll the expert GEMV's input loop (nonzero: on; None: for at most 8 pairs)")
    expert_block_i: int | None = _setting("SEGKV_EXPERT_BLOCK_I", INTEGER, None,
        "inputs per step of the expert GEMVs (None: 256 for few pairs, else 128)")
    expert_block_o: int | None = _setting("SEGKV_EXPERT_BLOCK_O", INTEGER, None,
        "outputs per expert GEMV program (None: 16)")
    expert_warps: int | None = _setting("SEGKV_EXPERT_WARPS", INTEGER, None,
        "warps per expert GEMV program (None: 4)")
    expert_mlp_block_i: int | None = _setting("SEGKV_EXPERT_MLP_BLOCK_I", INTEGER, None,
        "inputs per step of the one-launch expert MLP (None: 512)")
    expert_mlp_warps: int | None = _setting("SEGKV_EXPERT_MLP_WARPS", INTEGER, None,
        "warps per one-launch expert MLP program (None: 8)")
    expert_mlp_unroll: bool = _setting("SEGKV_EXPERT_MLP_UNROLL", SWITCH, True,
        "unroll the one-launch expert MLP's input loop")
    expert_mlp_stages: int = _setting("SEGKV_EXPERT_MLP_STAGES", INTEGER, 3,
        "pipeline stages of the one-launch expert MLP")


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
    return number == 1 if kind == SWITCH else number


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
