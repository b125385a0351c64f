"""Untrained stand-ins for the built-in models, built on first use where the trained ones are absent.

The weights are random (seeded) and the byte-level BPE tokenizer is trained on a slice of the
Python standard library's sources: the server, the API and the cache all work end to end, but
the text is not meaningful. ``segkv.models.default_models.resolve_model_dir`` uses these only
when the packaged trained models are missing.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from segkv.models.default_configs import GQA_NAME, MLA_NAME, gqa_config, mla_config
from segkv.models.registry import model_class
from segkv.models.stdlib_corpus import read_corpus, save_tokenizer, train_tokenizer
import segkv.settings as settings

DEFAULT_NAME = GQA_NAME
_DIRS = {GQA_NAME: "default-untrained", MLA_NAME: "default-mla-untrained"}
_VOCAB = 2048
_CORPUS_BYTES = 3_000_000


def default_model_dir(name: str = GQA_NAME) -> Path:
    """Where a placeholder lives: ``$SEGKV_HOME/<name>-untrained`` (default ``~/.cache/segkv``)."""
    home = Path(settings.or_default(settings.SETTINGS.home, Path.home() / ".cache" / "segkv"))
    return home / _DIRS[name]


def placeholder_config(name: str, vocab_size: int) -> dict:
    """The small architecture of each placeholder (float32 weights)."""
    if name == GQA_NAME:
        cfg = gqa_config(vocab_size, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                         intermediate_size=256, max_position_embeddings=4096)
    elif name == MLA_NAME:
        cfg = mla_config(vocab_size, hidden_size=128, num_layers=2, num_heads=4, q_lora_rank=None,
                         kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                         intermediate_size=256, moe_intermediate_size=64, num_mtp_layers=0,
                         max_position_embeddings=4096)
    else:
        raise ValueError(f"no placeholder for {name!r}; placeholders: {', '.join(_DIRS)}")
    return {**cfg, "torch_dtype": "float32"}


def ensure_placeholder(name: str = GQA_NAME, directory: Path | None = None, *, seed: int = 0) -> Path:
    """Build the placeholder directory for built-in model ``name`` if it is not there yet; return it."""
    directory = directory or default_model_dir(name)
    if (directory / "model.safetensors").is_file():
        return directory
    tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    docs = read_corpus(limit_bytes=_CORPUS_BYTES)
    tok = train_tokenizer((d.text for d in docs), vocab_size=_VOCAB)
    save_tokenizer(tok, tmp, model_max_length=4096)
    config = placeholder_config(name, tok.get_vocab_size())
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(seed)
    model = model_class(config).from_hf_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, tmp / "model.safetensors")
    if directory.exists():  # another process built it meanwhile
        shutil.rmtree(tmp)
    else:
        tmp.replace(directory)
    return directory


def ensure_default_model(directory: Path | None = None, *, seed: int = 0) -> Path:
    """The GQA placeholder (kept for callers of the earlier name)."""
    return ensure_placeholder(GQA_NAME, directory, seed=seed)
