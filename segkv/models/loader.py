"""Loading a Hugging Face model directory: config, safetensors shards, fingerprint."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from segkv.config import parse_dtype
from segkv.distributed.parallel import TensorParallel
from segkv.models.fp8_checkpoint import INPUT_SCALE_SUFFIX, SCALE_SUFFIXES, parse_quantization
from segkv.models.fp8_loading import Fp8Plan, check_quantization, stored_tensors
from segkv.models.mxfp4 import BLOCKS, SCALES, Mxfp4Tensors, is_mxfp4, without_mxfp4
from segkv.models.registry import model_class
from segkv.models.tensor_parallel import shard_model

INDEX_FILE = "model.safetensors.index.json"


def read_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


def weight_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: the index's shards, or the single file(s)."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} names shards missing from {root}: {', '.join(missing)}")
        return [root / s for s in shards]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {root}")
    return files


def fingerprint(model_dir: str | Path) -> str:
    """A model identity: config.json, every tensor's name/dtype/shape and samples of its bytes."""
    digest = hashlib.sha256(json.dumps(read_config(model_dir), sort_keys=True).encode())
    for path in weight_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in sorted(f.keys()):
                t = f.get_slice(name)
                digest.update(f"{name}:{t.get_dtype()}:{t.get_shape()}".encode())
        with open(path, "rb") as raw:  # start and end of the data: weights, not just shapes
            size = path.stat().st_size
            digest.update(raw.read(1 << 16))
            raw.seek(max(0, size - (1 << 16)))
            digest.update(raw.read())
    return digest.hexdigest()[:32]


# Static FP8 KV-cache scales as vLLM's checkpoints carry them: ``layers.{i}.self_attn.k_scale`` and
# ``v_scale`` (also under ``.attn.``), or one ``kv_scale`` for both (older FP8 checkpoints). Scalars
# or one per KV head. A stored value q means q * scale.
KV_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.)?(k|v|kv)_scale$")


# bytes per element of the safetensors dtypes that do not take the load dtype
_STORED_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "I32": 4,
                 "U32": 4, "I64": 8, "U64": 8}


def checkpoint_weight_bytes(model_dir: str | Path, *, dtype: str | torch.dtype) -> int:
    """The bytes the checkpoint in ``model_dir`` takes once loaded in ``dtype``, from its
    safetensors headers (shapes and dtypes; no tensor is read).

    It sizes a model before it loads: a speculative drafter is loaded after the target's KV
    pool, so the pool must leave its weights free. Floating tensors count at ``dtype``, or
    float32 where :func:`keep_fp32` keeps them so; FP8 tensors and their float32 scales as
    :func:`load_model` keeps them (an FP8 checkpoint loads as stored); integer and boolean
    tensors as stored (an EAGLE-3 head's vocabulary map). A tied ``lm_head.weight`` is the
    embeddings' tensor once loaded and static KV and activation scales stay off the model:
    neither counts. Tensors a
    family skips on load still count: the estimate errs towards reserving too much."""
    size = parse_dtype(dtype).itemsize
    cfg = read_config(model_dir)
    tied, mxfp4 = bool(cfg.get("tie_word_embeddings", False)), is_mxfp4(cfg)
    total = 0
    for path in weight_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                off_model = KV_SCALE_NAME.search(name) is not None or name.endswith(INPUT_SCALE_SUFFIX)
                if off_model or (tied and name == "lm_head.weight"):
                    continue
                piece = f.get_slice(name)
                float32 = name.endswith(SCALE_SUFFIXES) or keep_fp32(name)
                element = 4 if float32 else _STORED_BYTES.get(piece.get_dtype(), size)
                if mxfp4 and name.endswith((BLOCKS, SCALES)):  # dequantized at load: two values a byte
                    element = 2 * size if name.endswith(BLOCKS) else 0
                total += math.prod(piece.get_shape()) * element
    return total


def load_model(
    model_dir: str | Path, *, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
    progress: bool = False, quantization: str | None = None, tensor_parallel: TensorParallel | None = None,
) -> nn.Module:
    """Build the registered model for ``model_dir`` and load its weights.

    ``model.kv_scales``: the checkpoint's static FP8 KV scales, ``{"k": {layer: (1,) or (Hkv,)
    float32}, "v": {...}}`` (:data:`KV_SCALE_NAME`; empty without them).

    ``quantization``: None loads the checkpoint as stored (an FP8 checkpoint's projections as
    FP8, ``models/fp8_checkpoint.py``); ``"fp8"`` also quantizes the other linear projections to
    e4m3 with per-output-channel scales (``models/fp8_loading.py``). ``model.quantization`` then
    describes the FP8 layers (None without any).

    ``tensor_parallel``: this process's rank of a group over which the model is sharded
    (``models/tensor_parallel.py``); the rank reads only its slices of the checkpoint.

    Raises FileNotFoundError for missing files and ValueError for an unsupported
    architecture, config setting or quantization format, missing or unexpected tensors, and
    shape mismatches.
    """
    check_quantization(quantization)
    cfg = read_config(model_dir)
    cls = model_class(cfg)
    cls.check_config(cfg)  # settings that would load and then compute something else
    torch_dtype = parse_dtype(dtype)
    with torch.device("meta"):
        model = cls.from_hf_config(cfg)
    slices = {}
    if tensor_parallel is not None and tensor_parallel.size > 1:
        if quantization is not None or is_mxfp4(cfg) or parse_quantization(cfg) is not None:
            raise ValueError("tensor parallelism loads plain (bf16/fp16/fp32) checkpoints; FP8 and MXFP4 "
                             "weights are not sharded yet")
        slices = shard_model(model, tensor_parallel)
    files = weight_files(model_dir)
    # A family may keep some checkpoint tensors under other names (DeepSeek's MTP layers).
    param_name = getattr(model, "param_name", lambda name: name)
    ignores = getattr(model, "ignores_weight", lambda _: False)
    # an MXFP4 checkpoint's experts (gpt-oss) are dequantized as they load (models/mxfp4.py)
    mxfp4 = Mxfp4Tensors(torch_dtype) if is_mxfp4(cfg) else None
    # which layers load as FP8, from the tensor headers (FP8 tensors without a config are refused)
    plan = Fp8Plan.build(model, stored_tensors(files), parse_quantization(without_mxfp4(cfg)[0]),
                         quantize=quantization == "fp8", param_name=param_name, ignores=ignores)
    plan.install(model, torch_dtype)
    expected = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    tied = {n for n in expected if n == "lm_head.weight" and getattr(model.cfg, "tie_word_embeddings", False)}
    state: dict[str, torch.Tensor] = {}
    kv_scales: dict[str, dict[int, torch.Tensor]] = {"k": {}, "v": {}}
    for path in tqdm(files, desc="loading weights", unit="file", disable=not progress):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if plan.takes(name):  # an FP8 layer's scale
                    plan.take(name, f.get_tensor(name))
                    continue
                if mxfp4 is not None and mxfp4.takes(name):  # one half of an MXFP4 weight
                    weight = mxfp4.take(name, f.get_tensor(name))
                    if weight is not None:
                        name, tensor = weight
                        target = param_name(name)
                        if target not in expected:
                            raise ValueError(f"{path.name}: unexpected MXFP4 weight {name!r} for "
                                             f"{cls.__name__}")
                        _check_shape(path.name, name, tensor, expected[target])
                        state[target] = tensor
                    continue
                scale_of = KV_SCALE_NAME.search(name)
                if scale_of is not None:  # a static FP8 KV scale: used by kv_cache_dtype="fp8" only
                    layer, kind = int(scale_of.group(1)), scale_of.group(2)
                    for part in ("k", "v") if kind == "kv" else (kind,):
                        kv_scales[part][layer] = f.get_tensor(name).float().flatten()
                    continue
                target = param_name(name)
                if target not in expected:
                    if ignores(name):
                        continue  # e.g. the MTP layers' copies of the shared embeddings
                    raise ValueError(f"{path.name}: unexpected tensor {name!r} for {cls.__name__}")
                part = slices.get(target)
                tensor = f.get_tensor(name) if part is None else part.read(f.get_slice(name))
                _check_shape(path.name, name, tensor, expected[target])
                if plan.owns(target):  # FP8 as stored, or quantized from the checkpoint's values
                    state[target] = tensor
                else:
                    state[target] = tensor.to(torch.float32 if keep_fp32(target) else torch_dtype)
    if mxfp4 is not None:
        mxfp4.finish()
    plan.finish(state, torch_dtype)
    if hasattr(model, "drop_unloaded"):  # optional modules the checkpoint does not carry
        for name in model.drop_unloaded(set(state)):
            state.pop(name, None)
            expected.pop(name)
    missing = sorted(set(expected) - set(state) - tied)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors: {shown}")
    # cast on the meta device, then allocate: FP8 layers keep their FP8 weights and float32 scales
    model = model.to(torch_dtype)
    for name, param in model.named_parameters():
        if keep_fp32(name):  # routing decisions must not flip with the weights' dtype
            param.data = param.data.float()
    model = model.to_empty(device=device)
    model.load_state_dict(state, strict=False, assign=False)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    _init_buffers(model, device)
    model.quantization = plan.describe()
    model.kv_scales = kv_scales
    return model.eval()


def _check_shape(where: str, name: str, tensor: torch.Tensor, param: torch.Tensor) -> None:
    """A ValueError naming ``name`` unless ``tensor`` has the parameter's shape."""
    want = tuple(param.shape)
    if tuple(tensor.shape) != want:
        raise ValueError(f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                         f"the model expects {want}")


# MoE router weights stay float32 (as the reference implementation keeps them).
_FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


def keep_fp32(name: str) -> bool:
    """Whether the parameter ``name`` (a segkv state-dict key) stays float32 whatever dtype the
    model loads in: the MoE router's weight and score-correction bias."""
    return name.endswith(_FP32_SUFFIXES)


def _init_buffers(model: nn.Module, device: str | torch.device) -> None:
    """Buffers computed at construction were made on 'meta': recompute them on ``device``."""
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers(device)
