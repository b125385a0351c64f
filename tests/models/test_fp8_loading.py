"""FP8 checkpoints in their published formats, and ``quantization="fp8"``: the loaded model
computes what the same model with the dequantized weights computes, close to the unquantized one."""

from __future__ import annotations

import re

import pytest
import torch

from fp8_helpers import edit_config, reference_dequantize, reference_quantize, rewrite_tensors, \
    write_dtype_checkpoint, write_fp8_checkpoint
from gpu_helpers import DEVICE
from model_helpers import build_deepseek_dir, build_model_dir
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig
from segkv.layers.fp8 import Fp8Linear, fp8_modules
from segkv.models.loader import load_model
from segkv.runner.model_runner import ModelRunner

# e4m3 rounds each weight by up to 2^-4 of its scale's range: through these small random models
# (sharp logits) the logits move by about 3-10% relative; a wrong scale or layout moves them far more
QUANTIZATION_ERROR = 0.2
DEEPSEEK_MOE = dict(first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2)

# (name, family, write_fp8_checkpoint keywords); every config is a published layout
FORMATS = {
    "deepseek-block": ("llama", dict(
        scheme="block", block=(32, 48), scale_name="weight_scale_inv",
        config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [32, 48]})),
    "vllm-fp8-tensor-static": ("qwen3", dict(
        scheme="tensor", input_scales=True, config={"quant_method": "fp8", "activation_scheme": "static"})),
    "vllm-fp8-channel": ("qwen2", dict(
        scheme="channel", scalar_scale_shape=(1,), config={"quant_method": "fp8", "activation_scheme": "dynamic"})),
    "fbgemm-fp8": ("llama", dict(
        scheme="channel", config={"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                  "modules_to_not_convert": ["lm_head"]})),
    "ct-channel-bf16-scales": ("mistral", dict(
        scheme="channel", scale_dtype=torch.bfloat16, config={
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                   "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}})),
    "ct-block": ("llama3.1", dict(
        scheme="block", block=(16, 32), config={
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [16, 32],
                "symmetric": True, "dynamic": False}}}})),
    "ct-tensor-static-ignore": ("qwen3", dict(
        scheme="tensor", scalar_scale_shape=(1,), input_scales=True,
        skip=lambda m: re.match(r".*layers\.1\.mlp\.down_proj$", m) is not None, config={
            "quant_method": "compressed-tensors", "format": "naive-quantized",
            "ignore": ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj$"],
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
                                          "input_activations": {"num_bits": 8, "type": "float",
                                                                "strategy": "tensor", "dynamic": False}}}})),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def prompt_logits(model, prompt: list[int], dtype=torch.float32) -> torch.Tensor:
    """``(len(prompt), vocab)`` float32 logits of ``model`` over ``prompt`` (chunks of 7 rows)."""
    device = model.lm_head.weight.device
    cache = PagedKVCache(model.kv_layout(dtype), CacheConfig(page_size=16, num_pages=32), device=device)
    chain = cache.new_chain()
    logits = ModelRunner(model, cache, device=device, prefill_chunk=7).prompt_logits(chain, prompt).cpu()
    chain.release()
    assert torch.isfinite(logits).all()
    return logits


def random_prompt(model, gen, n: int = 20) -> list[int]:
    return torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist()


def weight_bytes(model, but: str | None = None) -> int:
    """The bytes of ``model``'s parameters (``but``: those whose name ends so left out)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not (but and n.endswith(but)))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp8_checkpoint_equals_its_dequantized_weights(fmt, tmp_path, gen):
    family, kwargs = FORMATS[fmt]
    build_model_dir(tmp_path / "src", family)
    quantized = write_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "deq", **kwargs)
    model, reference = load_model(tmp_path / "fp8"), load_model(tmp_path / "deq")
    layers = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert layers == set(quantized) and len(layers) >= 13
    assert all(not isinstance(m, Fp8Linear) for m in (model.lm_head, model.model.embed_tokens))
    assert model.quantization == f"fp8: {len(layers)} layers from the checkpoint"
    prompt = random_prompt(model, gen)
    logits = prompt_logits(model, prompt)
    torch.testing.assert_close(logits, prompt_logits(reference, prompt), rtol=1e-5, atol=1e-5)
    original = prompt_logits(load_model(tmp_path / "src"), prompt)
    assert 0 < rel_err(logits, original) < QUANTIZATION_ERROR
    # one byte a weight plus float32 scales, against four bytes
    fp8_bytes = sum(m.weight.numel() + 4 * m.weight_scale.numel() + (4 * m.bias.numel() if m.bias is not None else 0)
                    for m in fp8_modules(model))
    plain = weight_bytes(reference)
    dense = plain - sum(4 * m.weight.numel() + (4 * m.bias.numel() if m.bias is not None else 0)
                        for m in fp8_modules(model))
    assert weight_bytes(model) == dense + fp8_bytes < plain


def test_fp8_checkpoint_in_bfloat16(tmp_path, gen):
    """Loaded in bfloat16: the FP8 weights dequantize (in the product) to exactly the bfloat16
    dequantized checkpoint's weights; scales stay float32."""
    family, kwargs = FORMATS["deepseek-block"]
    build_model_dir(tmp_path / "src", family)
    write_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "deq", **kwargs)
    model = load_model(tmp_path / "fp8", dtype=torch.bfloat16)
    reference = load_model(tmp_path / "deq", dtype=torch.bfloat16)
    layer = model.model.layers[0].mlp.down_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
    assert torch.equal(layer.dequantized(), reference.model.layers[0].mlp.down_proj.weight)
    prompt = random_prompt(model, gen)
    torch.testing.assert_close(prompt_logits(model, prompt, torch.bfloat16),
                               prompt_logits(reference, prompt, torch.bfloat16), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("block", [(128, 128), (16, 24)])
def test_deepseek_v3_block_fp8_with_experts(block, tmp_path, gen):
    """DeepSeek-V3's format: attention, dense MLP, routed and shared experts in FP8 with
    ``weight_scale_inv``; ``kv_b_proj`` (FP8 in the checkpoint) dequantized at load, since absorbed
    attention reads it as per-head views; the router stays float32."""
    build_deepseek_dir(tmp_path / "src", **DEEPSEEK_MOE)
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    write_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "deq", scheme="block", block=block,
                         scale_name="weight_scale_inv", config=config)
    model, reference = load_model(tmp_path / "fp8"), load_model(tmp_path / "deq")
    moe, attn = model.model.layers[1].mlp, model.model.layers[0].self_attn
    assert isinstance(moe.experts[3].down_proj, Fp8Linear) and isinstance(moe.shared_experts.up_proj, Fp8Linear)
    assert isinstance(attn.q_proj, Fp8Linear) and isinstance(attn.kv_a_proj_with_mqa, Fp8Linear)
    assert type(attn.kv_b_proj) is torch.nn.Linear and moe.gate.weight.dtype == torch.float32
    assert model.quantization.endswith(", 2 layers dequantized at load")
    torch.testing.assert_close(attn.kv_b_proj.weight, reference.model.layers[0].self_attn.kv_b_proj.weight,
                               rtol=0, atol=0)
    prompt = random_prompt(model, gen)
    logits = prompt_logits(model, prompt)
    torch.testing.assert_close(logits, prompt_logits(reference, prompt), rtol=1e-5, atol=1e-5)
    assert 0 < rel_err(logits, prompt_logits(load_model(tmp_path / "src"), prompt)) < QUANTIZATION_ERROR
    assert weight_bytes(model) < weight_bytes(reference)


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_quantization_fp8_of_a_bf16_checkpoint(family, tmp_path, gen):
    """``quantization="fp8"``: every attention and MLP/expert projection quantized per output
    channel from the bf16 values; embeddings, norms, lm_head, the router and MLA's kv_b_proj not."""
    if family == "deepseek":
        build_deepseek_dir(tmp_path / "src", **DEEPSEEK_MOE)
    else:
        build_model_dir(tmp_path / "src", family, attention_bias=True)
    write_dtype_checkpoint(tmp_path / "src", tmp_path / "bf16", torch.bfloat16)
    model = load_model(tmp_path / "bf16", quantization="fp8")
    plain = load_model(tmp_path / "bf16")
    layers = dict((n, m) for n, m in model.named_modules() if isinstance(m, Fp8Linear))
    names = {n.rsplit(".", 1)[-1] for n in layers}
    assert "kv_b_proj" not in names and "lm_head" not in names and len(layers) >= 14
    assert model.quantization == f"fp8: {len(layers)} layers quantized at load per channel"
    # the reference: each weight quantized per channel by the independent quantizer, dequantized
    reference = load_model(tmp_path / "bf16")
    with torch.no_grad():
        for name in layers:
            linear = reference.get_submodule(name)
            q, scale = reference_quantize(linear.weight, (1, linear.in_features))
            assert torch.equal(layers[name].weight.view(torch.uint8), q.view(torch.uint8)), name
            torch.testing.assert_close(layers[name].weight_scale, scale, rtol=1e-6, atol=0)
            linear.weight.copy_(reference_dequantize(q, scale, (1, linear.in_features)))
    prompt = random_prompt(model, gen)
    logits = prompt_logits(model, prompt)
    torch.testing.assert_close(logits, prompt_logits(reference, prompt), rtol=1e-5, atol=1e-5)
    assert 0 < rel_err(logits, prompt_logits(plain, prompt)) < QUANTIZATION_ERROR
    assert weight_bytes(model) < 0.5 * weight_bytes(plain) + 4 * sum(
        p.numel() for n, p in plain.named_parameters() if "embed" in n or "lm_head" in n)


def test_fp8_moe_layers_packed_for_device_dispatch_match_the_looped_experts(tmp_path, gen):
    """CUDA graphs pack a MoE layer's experts; FP8 experts are dequantized into the packed stacks
    (the expert kernels read plain weights) and give the same logits."""
    build_deepseek_dir(tmp_path / "src", **DEEPSEEK_MOE)
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    write_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "deq", scheme="block", block=(16, 16),
                         scale_name="weight_scale_inv", config=config)
    model = load_model(tmp_path / "fp8", device=DEVICE)
    prompt = random_prompt(model, gen)
    looped = prompt_logits(model, prompt)
    moe = model.model.layers[1].mlp
    moe.pack_experts()
    assert moe.packed and not isinstance(moe.experts[0].gate_proj, Fp8Linear)
    torch.testing.assert_close(prompt_logits(model, prompt), looped, rtol=1e-5, atol=1e-5)


def _stackable(pieces) -> bool:
    """Whether ``stack_fp8`` can stack these FP8 layers (computed from their scale grids)."""
    if all(m.scheme in ("tensor", "channel") for m in pieces):
        return True
    return (len({m.block for m in pieces}) == 1 and all(m.scheme == "block" for m in pieces)
            and all(m.out_features % m.block[0] == 0 for m in pieces[:-1]))


@pytest.mark.parametrize("fmt", ["deepseek-block", "vllm-fp8-tensor-static", "vllm-fp8-channel", "ct-block",
                                 "ct-tensor-static-ignore", "mla-block"])
def test_fused_ops_stack_fp8_projections(fmt, tmp_path, gen):
    """``use_fused_ops`` stacks FP8 q/k/v, gate/up and MLA's x projections into one FP8 layer
    each where their scale grids stack (the pieces' parameters become views of it), and leaves
    them separate where they do not (a layer kept unquantized, block scales straddling pieces);
    the logits do not change."""
    if fmt == "mla-block":
        build_deepseek_dir(tmp_path / "src", **DEEPSEEK_MOE)
        config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
        write_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "deq", scheme="block", block=(16, 16),
                             scale_name="weight_scale_inv", config=config)
    else:
        family, kwargs = FORMATS[fmt]
        build_model_dir(tmp_path / "src", family)
        write_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "deq", **kwargs)
    model = load_model(tmp_path / "fp8", device=DEVICE)  # the fused kernels on the GPU where there is one
    prompt = random_prompt(model, gen)
    before = prompt_logits(model, prompt)
    keys, nbytes = set(model.state_dict()), weight_bytes(model, but="weight_scale")
    model.use_fused_ops()
    # the stacks are views, not saved (per-tensor scales of stacked pieces become per-channel views)
    assert set(model.state_dict()) == keys and weight_bytes(model, but="weight_scale") == nbytes
    groups = []  # (stacked layer or None, its pieces)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if fmt == "mla-block":
            first = attn.q_proj if attn.dims.q_lora_rank is None else attn.q_a_proj
            groups.append((attn._x_proj_fp8, (first, attn.kv_a_proj_with_mqa)))
            assert attn._x_proj is None
        else:
            groups.append((attn._qkv_fp8, (attn.q_proj, attn.k_proj, attn.v_proj)))
            assert attn._qkv is None
        if hasattr(mlp, "gate_proj"):  # a dense MLP (MoE layers keep their experts' own packing)
            groups.append((mlp._gate_up_fp8, (mlp.gate_proj, mlp.up_proj)))
        assert layer.input_layernorm.fused  # the norms fuse either way
    stacked = 0
    for fused, pieces in groups:
        if not all(isinstance(m, Fp8Linear) for m in pieces):
            assert fused is None  # one piece kept unquantized: nothing to stack
            continue
        assert (fused is not None) == _stackable(pieces), [m.block for m in pieces]
        if fused is not None:
            stacked += 1
            assert fused.weight.data_ptr() == pieces[0].weight.data_ptr()
            assert sum(m.out_features for m in pieces) == fused.out_features
            assert pieces[-1].weight.data_ptr() == fused.weight[-pieces[-1].out_features:].data_ptr()
    assert stacked > 0
    after = prompt_logits(model, prompt)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


# -- refusals ------------------------------------------------------------------------------------

UNSUPPORTED = [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
     "format 'int-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
     "num_bits 8 type 'int'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
     "format 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "group"}}}},
     "strategy 'group'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "kv_cache_scheme": {"num_bits": 8},
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}}},
     "kv_cache_scheme"),
]


@pytest.mark.parametrize("config,message", UNSUPPORTED, ids=[m for _, m in UNSUPPORTED])
def test_unsupported_quantization_formats_are_refused_by_name(config, message, tmp_path):
    build_model_dir(tmp_path, "llama")
    edit_config(tmp_path, quantization_config=config)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM: config.json asks for .*quantization_config") as err:
        load_model(tmp_path)
    assert message in str(err.value)


def _fp8_dir(tmp_path, **kwargs):
    family, base = FORMATS["deepseek-block"]
    build_model_dir(tmp_path / "src", family)
    write_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "deq", **{**base, **kwargs})
    return tmp_path / "fp8"


def test_mismatched_scale_shapes_are_refused_naming_the_tensor(tmp_path):
    directory = _fp8_dir(tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight_scale_inv"
    rewrite_tensors(directory, lambda s: s.update({name: s[name][:, :1].contiguous()}))
    with pytest.raises(ValueError, match=re.escape(f"tensor {name!r} has shape (1, 1)") + ".*expects \\(1, 2\\)"):
        load_model(directory)


def test_channel_scales_of_the_wrong_length_are_refused(tmp_path):
    build_model_dir(tmp_path / "src", "qwen2")
    family, kwargs = FORMATS["vllm-fp8-channel"]
    write_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "deq", **kwargs)
    name = "model.layers.0.mlp.up_proj.weight_scale"
    rewrite_tensors(tmp_path / "fp8", lambda s: s.update({name: s[name][:5].contiguous()}))
    with pytest.raises(ValueError, match=re.escape(f"tensor {name!r} has shape (5, 1)")):
        load_model(tmp_path / "fp8")


def test_missing_scales_and_static_input_scales_are_refused(tmp_path):
    directory = _fp8_dir(tmp_path)
    name = "model.layers.0.mlp.gate_proj.weight_scale_inv"
    rewrite_tensors(directory, lambda s: s.pop(name))
    with pytest.raises(ValueError, match="tensor 'model.layers.0.mlp.gate_proj.weight' is FP8 and needs one scale"):
        load_model(directory)
    directory = _fp8_dir(tmp_path / "static")
    edit_config(directory, quantization_config={"quant_method": "fp8", "activation_scheme": "static",
                                                "weight_block_size": [32, 48]})
    with pytest.raises(ValueError, match=r"static activation scales but the checkpoint lacks tensor "
                                         r"'model\.layers\.\d\.\w+\.\w+_proj\.input_scale'"):
        load_model(directory)


def test_fp8_weights_the_config_does_not_describe_are_refused(tmp_path):
    directory = _fp8_dir(tmp_path)
    name = "model.layers.0.self_attn.o_proj.weight"
    rewrite_tensors(directory, lambda s: s.update({name: s[name].view(torch.uint8).view(torch.float8_e5m2)}))
    with pytest.raises(ValueError, match=f"tensor {name!r} is F8_E5M2: segkv loads float8_e4m3fn"):
        load_model(directory)
    directory = _fp8_dir(tmp_path / "no-config")
    edit_config(directory, quantization_config=None)
    with pytest.raises(ValueError, match="is FP8 but config.json has no quantization_config"):
        load_model(directory)
    edit_config(directory, quantization_config={"quant_method": "fp8", "weight_block_size": [32, 48],
                                                "modules_to_not_convert": ["self_attn.q_proj"]})
    with pytest.raises(ValueError, match="ignores or does not target 'model.layers.0.self_attn.q_proj'"):
        load_model(directory)


def test_unknown_quantization_argument_is_refused(tmp_path):
    build_model_dir(tmp_path, "llama")
    with pytest.raises(ValueError, match="quantization 'int8' is not implemented; segkv implements 'fp8'"):
        load_model(tmp_path, quantization="int8")
