"""Loading and saving EAGLE-3 head directories, checked against the target they draft for."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from segkv.config import parse_dtype
from segkv.models.eagle3 import ARCHITECTURE, Eagle3Config, Eagle3Head, default_aux_layer_ids
from segkv.models.loader import read_config, weight_files

_VOCAB_MAP = ("d2t", "t2d")


def target_dims(target: nn.Module) -> tuple[int, int, int]:
    """``(hidden_size, vocab_size, num_layers)`` of a segkv causal LM."""
    cfg = target.cfg
    return int(cfg.hidden_size), int(cfg.vocab_size), len(target.model.layers)


def check_against_target(cfg: Eagle3Config, target: nn.Module) -> tuple[int, ...]:
    """ValueError naming the first field where ``cfg`` does not fit ``target``; else the aux layer ids."""
    hidden, vocab, layers = target_dims(target)
    if cfg.vocab_size != vocab:
        raise ValueError(f"EAGLE-3 head vocab_size {cfg.vocab_size} != the target's vocab_size {vocab}")
    if cfg.target_hidden_size != hidden:
        raise ValueError(f"EAGLE-3 head target_hidden_size {cfg.target_hidden_size} != the target's "
                         f"hidden_size {hidden}")
    ids = cfg.aux_layer_ids if cfg.aux_layer_ids is not None else default_aux_layer_ids(layers)
    if any(not 0 <= i < layers for i in ids):
        raise ValueError(f"EAGLE-3 head eagle_aux_hidden_state_layer_ids {list(ids)} must be within "
                         f"[0, {layers}) (the target has {layers} layers)")
    return tuple(ids)


def load_eagle3_head(directory: str | Path, target: nn.Module, *, dtype: str | torch.dtype = "float32",
                     device: str | torch.device = "cpu", layer_index: int = 0) -> Eagle3Head:
    """The EAGLE-3 head in ``directory`` (``config.json`` + safetensors), checked against ``target``.

    Raises FileNotFoundError for a missing directory or files and ValueError naming the problem
    for a config that does not fit the target (vocab_size, target_hidden_size, hidden_size, aux
    layer ids), a missing, unexpected or misshapen tensor, or an inconsistent ``d2t``/``t2d``.
    The head's ``aux_layer_ids`` attribute holds the target layers to capture
    (``target.set_aux_hidden_layers(head.aux_layer_ids)``).
    """
    raw = read_config(directory)
    cfg = Eagle3Config.from_hf(raw)
    aux_ids = check_against_target(cfg, target)
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    own_embeddings = "embed_tokens.weight" in tensors
    if not own_embeddings and cfg.hidden_size != target_dims(target)[0]:
        raise ValueError(f"EAGLE-3 head hidden_size {cfg.hidden_size} != the target's hidden_size "
                         f"{target_dims(target)[0]}, and the head has no embed_tokens of its own to use")
    with torch.device("meta"):
        head = Eagle3Head(cfg, layer_index=layer_index, own_embeddings=own_embeddings)
    expected = dict(head.named_parameters())
    unexpected = sorted(set(tensors) - set(expected) - set(_VOCAB_MAP))
    if unexpected:
        raise ValueError(f"EAGLE-3 head in {directory}: unexpected tensors {', '.join(unexpected[:5])}")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"EAGLE-3 head in {directory} lacks tensors: {', '.join(missing[:5])}")
    for name, param in expected.items():
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise ValueError(f"EAGLE-3 head tensor {name!r} has shape {tuple(tensors[name].shape)}, expected "
                             f"{tuple(param.shape)} from config.json (hidden_size {cfg.hidden_size}, "
                             f"target_hidden_size {cfg.target_hidden_size}, "
                             f"draft_vocab_size {cfg.draft_vocab_size})")
    draft_ids = _draft_to_target(cfg, tensors.get("d2t"), tensors.get("t2d"))
    torch_dtype = parse_dtype(dtype)
    head = head.to_empty(device=device)
    head.load_state_dict({n: tensors[n] for n in expected}, strict=False)
    head = head.to(torch_dtype)
    head.set_vocab_map(draft_ids)
    head.midlayer.self_attn.rotary.init_buffers(device)
    if not own_embeddings:
        head.share_embedding(target.model.embed_tokens)
    head.aux_layer_ids = aux_ids
    return head.eval()


def _draft_to_target(cfg: Eagle3Config, d2t: torch.Tensor | None, t2d: torch.Tensor | None) -> torch.Tensor:
    """The target id of each draft id, from ``d2t`` (and ``t2d`` checked against it)."""
    n, vocab = cfg.draft_vocab_size, cfg.vocab_size
    if d2t is None:
        if n != vocab:
            raise ValueError(f"EAGLE-3 head lacks tensor 'd2t', needed as draft_vocab_size {n} "
                             f"!= vocab_size {vocab}")
        ids = torch.arange(n)
    else:
        if tuple(d2t.shape) != (n,) or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
            raise ValueError(f"EAGLE-3 head tensor 'd2t' must be integer of shape ({n},) (draft_vocab_size), "
                             f"got {d2t.dtype} {tuple(d2t.shape)}")
        ids = torch.arange(n) + d2t.to(torch.int64)
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"EAGLE-3 head tensor 'd2t' maps draft ids outside the target vocabulary "
                             f"[0, {vocab})")
        if int(ids.unique().numel()) != n:
            raise ValueError("EAGLE-3 head tensor 'd2t' maps two draft ids to the same target id")
    if t2d is not None:
        if tuple(t2d.shape) != (vocab,):
            raise ValueError(f"EAGLE-3 head tensor 't2d' has shape {tuple(t2d.shape)}, "
                             f"expected ({vocab},) (vocab_size)")
        mask = t2d.to(torch.bool)
        if int(mask.sum()) != n or not bool(mask[ids].all()):
            raise ValueError(f"EAGLE-3 head tensor 't2d' disagrees with 'd2t': it marks "
                             f"{int(mask.sum())} target ids, draft_vocab_size is {n}")
    return ids


def head_config(target_config: dict[str, Any], *, draft_vocab_size: int, aux_layer_ids: list[int],
                hidden_size: int | None = None, intermediate_size: int | None = None,
                num_heads: int = 8, num_kv_heads: int = 2, head_dim: int | None = None) -> dict[str, Any]:
    """A ``config.json`` for a new head over a segkv target's ``config.json`` (vocabulary, RoPE)."""
    hidden = hidden_size or int(target_config["hidden_size"])
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
        "vocab_size": int(target_config["vocab_size"]), "draft_vocab_size": draft_vocab_size,
        "hidden_size": hidden, "target_hidden_size": int(target_config["hidden_size"]),
        "intermediate_size": intermediate_size or int(target_config["intermediate_size"]),
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim or hidden // num_heads, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": float(target_config.get("rope_theta", 10000.0)),
        "max_position_embeddings": int(target_config.get("max_position_embeddings", 4096)),
        "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)},
    }


def save_eagle3_head(head: Eagle3Head, config: dict[str, Any], directory: str | Path, *,
                     dtype: torch.dtype = torch.bfloat16) -> int:
    """Write ``directory/config.json`` and ``model.safetensors`` (weights in ``dtype``, ``d2t`` int64,
    ``t2d`` bool); return the weights file's size in bytes."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: p.detach().to("cpu", dtype).contiguous() for name, p in head.named_parameters()}
    state["d2t"] = head.d2t.detach().cpu().contiguous()
    state["t2d"] = head.t2d.detach().cpu().contiguous()
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return (directory / "model.safetensors").stat().st_size
