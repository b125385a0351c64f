"""FP8 checkpoints for tests, written with a reference quantizer independent of segkv's.

:func:`write_fp8_checkpoint` turns an unquantized model directory into an FP8 one in a published
format, and a second directory holding the same weights dequantized to float32 (the same model
for segkv's unquantized loader), so a test can compare the two.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E4M3_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj",
               "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def reference_quantize(weight: torch.Tensor, block: tuple[int, int], scale_dtype=torch.float32
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight (N, K)`` -> e4m3 values and one scale per ``block`` tile ``(ceil(N/b0), ceil(K/b1))``:
    each tile's largest magnitude maps to 448 (the tile zero-padded to whole blocks)."""
    w = weight.double()
    n, k = w.shape
    b0, b1 = block
    rows, cols = math.ceil(n / b0), math.ceil(k / b1)
    padded = torch.zeros(rows * b0, cols * b1, dtype=torch.float64)
    padded[:n, :k] = w
    amax = padded.view(rows, b0, cols, b1).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).to(scale_dtype)
    full = scale.double()[:, None, :, None].expand(rows, b0, cols, b1).reshape(rows * b0, cols * b1)[:n, :k]
    q = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def reference_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = q.shape
    rows, cols = scale.shape
    full = scale.double()[:, None, :, None].expand(rows, block[0], cols, block[1])
    full = full.reshape(rows * block[0], cols * block[1])[:n, :k]
    return (q.double() * full).float()


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def _weights_file(directory: Path) -> Path:
    files = sorted(directory.glob("*.safetensors"))
    assert len(files) == 1, files
    return files[0]


def write_fp8_checkpoint(src: Path, fp8_dir: Path, dequant_dir: Path, *, scheme: str, config: dict,
                         block: tuple[int, int] | None = None, scale_name: str = "weight_scale",
                         scalar_scale_shape: tuple = (), scale_dtype=torch.float32,
                         input_scales: bool = False, skip=lambda name: False) -> list[str]:
    """Copy ``src`` to ``fp8_dir`` with the projections' weights quantized (``scheme``: ``tensor``,
    ``channel`` or ``block`` with ``block``), scales named ``<module>.<scale_name>``, and
    ``quantization_config = config``; and to ``dequant_dir`` with the same weights dequantized
    (float32, no quantization config). ``skip(module)``: modules left unquantized. Returns the
    quantized modules' names."""
    for d in (fp8_dir, dequant_dir):
        shutil.copytree(src, d)
    state = load_file(_weights_file(src))
    fp8_state, deq_state, done = {}, {}, []
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS and not skip(module)):
            fp8_state[name] = deq_state[name] = tensor
            continue
        n, k = tensor.shape
        tile = {"tensor": (n, k), "channel": (1, k), "block": block}[scheme]
        q, scale = reference_quantize(tensor, tile, scale_dtype)
        stored = scale.reshape(scalar_scale_shape) if scheme == "tensor" else scale
        fp8_state[name] = q
        fp8_state[f"{module}.{scale_name}"] = stored.contiguous()
        if input_scales:
            fp8_state[f"{module}.input_scale"] = torch.tensor(0.02, dtype=torch.float32)
        deq_state[name] = reference_dequantize(q, scale, tile)
        done.append(module)
    save_file(fp8_state, str(_weights_file(fp8_dir)), metadata={"format": "pt"})
    save_file(deq_state, str(_weights_file(dequant_dir)), metadata={"format": "pt"})
    _edit_config(fp8_dir, quantization_config=config)
    _edit_config(dequant_dir, quantization_config=None)
    return done


def write_dtype_checkpoint(src: Path, dst: Path, dtype: torch.dtype) -> None:
    """Copy ``src`` to ``dst`` with every tensor cast to ``dtype`` (``torch_dtype`` set to match)."""
    shutil.copytree(src, dst)
    state = {n: t.to(dtype).contiguous() for n, t in load_file(_weights_file(src)).items()}
    save_file(state, str(_weights_file(dst)), metadata={"format": "pt"})
    _edit_config(dst, torch_dtype=str(dtype).removeprefix("torch."))


def rewrite_tensors(directory: Path, change) -> None:
    """``change(state)`` edits the checkpoint's tensors in place (a dict of name -> tensor)."""
    path = _weights_file(directory)
    state = load_file(path)
    change(state)
    save_file(state, str(path), metadata={"format": "pt"})


def edit_config(directory: Path, **changes) -> None:
    """Set (or with None remove) top-level ``config.json`` fields."""
    _edit_config(directory, **changes)
