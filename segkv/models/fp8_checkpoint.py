"""FP8 checkpoints' ``quantization_config``: which format, which modules, which scale layouts.

Formats read (``docs/configuration.md``, "Quantization"):

- ``quant_method: "fp8"`` with ``weight_block_size`` (DeepSeek-V3/R1, transformers'
  FineGrainedFP8): e4m3 weights, float32 ``<module>.weight_scale_inv`` of shape
  ``(ceil(out / b0), ceil(in / b1))``; the dequantized block is ``fp8 * scale_inv``.
- ``quant_method: "fp8"`` without blocks (vLLM's FP8 checkpoints for Llama/Qwen): one
  ``<module>.weight_scale`` per tensor (a scalar) or per output channel ``(out, 1)``.
- ``quant_method: "fbgemm_fp8"``: per-channel ``weight_scale (out, 1)``.
- ``quant_method: "compressed-tensors"`` with float quantization (``format`` ``float-quantized``
  or ``naive-quantized``): each ``config_groups`` entry's ``weights`` of ``num_bits: 8,
  type: "float"`` and ``strategy`` ``tensor``, ``channel`` or ``block`` (``block_structure``);
  ``weight_scale`` multiplies.

Static activation scales (``activation_scheme: "static"``, ``input_activations.dynamic: false``)
must be present as ``<module>.input_scale``; they are read and not used, since segkv keeps the
activations in the model dtype (weight-only FP8). Anything else (another method, integer or
4-bit weights, e5m2 weights, asymmetric or grouped scales, FP8 KV-cache scales) is refused with
a message naming it. Module names are matched against the checkpoint's names: ``ignore``,
``ignored_layers`` and ``modules_to_not_convert`` entries are exact names, ``re:`` regular
expressions (matched from the start) or dotted suffixes/infixes such as ``lm_head`` or
``mlp.gate``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# The linear projections of attention and MLPs/experts that load (or are quantized) as FP8; every
# other linear (lm_head, MLA's kv_b_proj read as per-head views, DeepSeek's MTP eh_proj) stays in
# the model dtype, dequantized at load if the checkpoint stores it in FP8.
FP8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
INPUT_SCALE_SUFFIX = "input_scale"
SCHEMES = ("tensor", "channel", "block")
_FLOAT_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(slots=True, frozen=True)
class WeightFormat:
    """How one module's weight is stored: ``scheme`` ``tensor``, ``channel``, ``block`` or
    ``tensor_or_channel`` (told apart by the scale's shape), ``block (b0, b1)`` for ``block``, and
    whether an ``input_scale`` comes with it (static activations)."""

    scheme: str
    block: tuple[int, int] | None = None
    static_input: bool = False


@dataclass(slots=True, frozen=True)
class Fp8Checkpoint:
    """A checkpoint's FP8 format: ``method``, ``groups`` of ``(targets, WeightFormat)`` (the
    first group whose targets match a module gives its format) and the ``ignore`` list."""

    method: str
    groups: tuple[tuple[tuple[str, ...], WeightFormat], ...]
    ignore: tuple[str, ...] = ()

    def format_for(self, module: str) -> WeightFormat | None:
        """The format of the linear ``module`` (a checkpoint name), or None where it is ignored or
        no group targets it."""
        if listed(module, self.ignore):
            return None
        for targets, fmt in self.groups:
            if any(t == "Linear" or listed(module, (t,)) for t in targets):
                return fmt
        return None

    def block_for(self, fmt: WeightFormat, scale_name: str, scale_shape: tuple[int, ...],
                  weight_shape: tuple[int, int]) -> tuple[int, int]:
        """The scale grid's block ``(bn, bk)`` for a weight of ``weight_shape`` whose scale tensor
        ``scale_name`` has ``scale_shape``; a ValueError naming the tensor if the shape does not fit
        the format."""
        out, inp = weight_shape
        numel = 1
        for size in scale_shape:
            numel *= size
        if fmt.scheme in ("tensor", "tensor_or_channel") and numel == 1:
            return out, inp
        if fmt.scheme in ("channel", "tensor_or_channel") and tuple(scale_shape) in ((out, 1), (out,)):
            return 1, inp
        if fmt.scheme == "block" and fmt.block is not None:
            b0, b1 = fmt.block
            want = (-(-out // b0), -(-inp // b1))
            if tuple(scale_shape) == want:
                return b0, b1
            expected = f"{want} ({b0}x{b1} blocks)"
        else:
            expected = {"tensor": "one value", "channel": f"({out}, 1)",
                        "tensor_or_channel": f"one value or ({out}, 1)"}[fmt.scheme]
        raise ValueError(f"tensor {scale_name!r} has shape {tuple(scale_shape)}; quant_method {self.method!r} "
                         f"({fmt.scheme} scales) over a {tuple(weight_shape)} weight expects {expected}")


def listed(name: str, entries) -> bool:
    """Whether module ``name`` matches one of ``entries``: ``re:`` patterns matched from the start,
    else the name itself or a dotted part of it (``mlp.gate`` matches ``model.layers.3.mlp.gate``)."""
    for entry in entries:
        entry = str(entry)
        if entry.startswith("re:"):
            if re.match(entry[3:], name):
                return True
        elif f".{entry}." in f".{name}.":
            return True
    return False


def _refuse(method: str, what: str) -> ValueError:
    return ValueError(f"quantization_config (quant_method {method!r}): {what}")


def parse_quantization(cfg: dict[str, Any]) -> Fp8Checkpoint | None:
    """The FP8 format of ``cfg``'s ``quantization_config`` (None without one); a ValueError naming
    what is not supported."""
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise ValueError(f"quantization_config must be an object, got {quant!r}")
    method = str(quant.get("quant_method", "?"))
    if method == "fp8":
        return _parse_fp8(quant)
    if method == "fbgemm_fp8":
        return Fp8Checkpoint(method, ((("Linear",), WeightFormat("channel")),),
                             tuple(quant.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        return _parse_compressed_tensors(quant)
    raise _refuse(method, "segkv loads FP8 weights only (quant_method 'fp8', 'fbgemm_fp8' or "
                          "'compressed-tensors' float quantization); use the unquantized (bf16/fp16/fp32) "
                          "weights, or --quantization fp8 on them")


def _parse_fp8(quant: dict[str, Any]) -> Fp8Checkpoint:
    method = "fp8"
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(method, f"fmt {fmt!r}: segkv loads e4m3 FP8 weights only")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _refuse(method, f"activation_scheme {scheme!r}: 'dynamic' or 'static' expected")
    block = quant.get("weight_block_size")
    if block is not None:
        fmt_ = WeightFormat("block", _block(method, block, "weight_block_size"), scheme == "static")
    else:
        fmt_ = WeightFormat("tensor_or_channel", None, scheme == "static")
    ignore = tuple(quant.get("ignored_layers") or ()) + tuple(quant.get("modules_to_not_convert") or ())
    return Fp8Checkpoint(method, ((("Linear",), fmt_),), ignore)


def _block(method: str, value: Any, field: str) -> tuple[int, int]:
    if isinstance(value, str) and re.fullmatch(r"\d+x\d+", value):
        value = [int(v) for v in value.split("x")]
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise _refuse(method, f"{field} {value!r}: two positive block sizes expected")
    return int(value[0]), int(value[1])


def _parse_compressed_tensors(quant: dict[str, Any]) -> Fp8Checkpoint:
    method = "compressed-tensors"
    if quant.get("kv_cache_scheme"):
        raise _refuse(method, "kv_cache_scheme: FP8 KV-cache scales in checkpoints are not implemented")
    sparsity = quant.get("sparsity_config")
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise _refuse(method, f"sparsity_config format {sparsity.get('format')!r}: sparse weights are not implemented")
    groups = quant.get("config_groups") or {}
    if not groups:
        raise _refuse(method, "no config_groups: nothing says how the weights are quantized")
    parsed = []
    for name, group in groups.items():
        fmt = group.get("format") or quant.get("format")
        if fmt not in _FLOAT_FORMATS:
            raise _refuse(method, f"config_groups.{name} format {fmt!r}: segkv loads "
                                  f"{' / '.join(_FLOAT_FORMATS)} FP8 weights only")
        parsed.append((_targets(method, name, group), _group_format(method, name, group)))
    return Fp8Checkpoint(method, tuple(parsed), tuple(quant.get("ignore") or ()))


def _targets(method: str, name: str, group: dict[str, Any]) -> tuple[str, ...]:
    targets = tuple(str(t) for t in group.get("targets") or ())
    # layer classes other than Linear (Embedding, ...) are not quantized in segkv
    odd = [t for t in targets if t != "Linear" and not t.startswith("re:") and t[:1].isupper() and "." not in t]
    if not targets or odd:
        raise _refuse(method, f"config_groups.{name} targets {list(targets)}: segkv quantizes Linear layers only")
    return targets


def _group_format(method: str, name: str, group: dict[str, Any]) -> WeightFormat:
    weights = group.get("weights") or {}
    where = f"config_groups.{name}.weights"
    if weights.get("num_bits") != 8 or weights.get("type") != "float":
        raise _refuse(method, f"{where} num_bits {weights.get('num_bits')!r} type {weights.get('type')!r}: "
                              "segkv loads 8-bit float (FP8 e4m3) weights only")
    if weights.get("symmetric", True) is not True:
        raise _refuse(method, f"{where} symmetric false: zero points are not implemented")
    if weights.get("dynamic", False):
        raise _refuse(method, f"{where} dynamic true: weights quantized at run time are not a checkpoint format")
    strategy = weights.get("strategy", "tensor")
    if strategy not in SCHEMES:
        raise _refuse(method, f"{where} strategy {strategy!r}: segkv loads {', '.join(SCHEMES)} scales")
    block = _block(method, weights.get("block_structure"), f"{where}.block_structure") if strategy == "block" else None
    if group.get("output_activations"):
        raise _refuse(method, f"config_groups.{name}.output_activations: output quantization is not implemented")
    acts = group.get("input_activations")
    static = False
    if acts:
        if acts.get("num_bits") != 8 or acts.get("type") != "float":
            raise _refuse(method, f"config_groups.{name}.input_activations num_bits {acts.get('num_bits')!r} "
                                  f"type {acts.get('type')!r}: only FP8 activation schemes are accepted")
        static = not acts.get("dynamic", False)
    return WeightFormat(strategy, block, static)
