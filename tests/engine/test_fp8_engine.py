"""``LLM(quantization="fp8")`` and ``--quantization fp8``: the engine loads FP8 weights, reports
their bytes, keeps their KV snapshots apart, and generates what the dequantized model generates."""

from __future__ import annotations

import pytest
import torch

from fp8_helpers import write_dtype_checkpoint
from gpu_helpers import DEVICE, GRAPHS
from model_helpers import build_model_dir
from segkv.cli import build_parser
from segkv.engine import LLM
from segkv.layers.fp8 import Fp8Linear
from segkv.sampling_params import SamplingParams

SETTINGS = {"device": "cpu", "dtype": "float32", "page_size": 8, "num_pages": 64}


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-engine")
    build_model_dir(root / "src", "qwen3")
    write_dtype_checkpoint(root / "src", root / "bf16", torch.bfloat16)
    return root / "bf16"


def test_llm_quantization_fp8_reports_fp8_weight_bytes(bf16_dir, gen):
    plain = LLM(bf16_dir, **SETTINGS)
    fp8 = LLM(bf16_dir, quantization="fp8", **SETTINGS)
    layers = [m for m in fp8.model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 14 and fp8.quantization == "fp8"
    summary = fp8.summary()
    assert summary["quantization"] == "fp8: 14 layers quantized at load per channel"
    assert plain.summary()["quantization"] is None
    # one byte a weight and a float32 scale a row, in place of four bytes a weight
    saved = sum(3 * m.weight.numel() - 4 * m.weight_scale.numel() for m in layers)
    assert summary["weight_bytes"] == plain.weight_bytes - saved
    assert "fp8: 14 layers" in fp8.describe_summary()
    assert fp8.fingerprint != plain.fingerprint  # snapshots of one do not restore into the other
    prompt = torch.randint(0, fp8.model.cfg.vocab_size, (12,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = fp8.generate([prompt], params)[0]
    assert len(out.outputs[0].token_ids) == 6


def test_llm_refuses_unknown_quantization_before_loading(bf16_dir):
    with pytest.raises(ValueError, match="quantization 'int4' is not implemented"):
        LLM(bf16_dir, quantization="int4", **SETTINGS)


def test_cli_quantization_flag():
    parser = build_parser()
    for command in (["generate", "--prompt", "x"], ["chat"], ["serve"]):
        assert parser.parse_args(command).quantization is None
        assert parser.parse_args(command + ["--quantization", "fp8"]).quantization == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--quantization", "int8"])


def test_fp8_with_fused_ops_and_emulated_graphs_decodes_as_unfused(bf16_dir, gen):
    """Fused ops stack the FP8 q/k/v and gate/up projections (Triton's interpreter runs the
    stacked products, the RoPE-and-write kernel and the emulated graph step): greedy decode gives
    the tokens of the unfused FP8 model."""
    settings = {**SETTINGS, "device": DEVICE}  # on the GPU where there is one (the interpreter otherwise)
    fused = LLM(bf16_dir, quantization="fp8", fused_ops=True, cuda_graphs=GRAPHS, backend="triton", **settings)
    plain = LLM(bf16_dir, quantization="fp8", fused_ops=False, **settings)
    attn, mlp = fused.model.model.layers[0].self_attn, fused.model.model.layers[0].mlp
    assert isinstance(attn._qkv_fp8, Fp8Linear) and isinstance(mlp._gate_up_fp8, Fp8Linear)
    assert plain.model.model.layers[0].self_attn._qkv_fp8 is None
    prompts = [torch.randint(0, plain.model.cfg.vocab_size, (n,), generator=gen).tolist() for n in (9, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in fused.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert got == want and all(len(t) == 6 for t in got)


@pytest.mark.gpu
def test_fp8_on_cuda_with_graphs_matches_the_dequantized_model(bf16_dir, tmp_path, gen):
    """On CUDA in bfloat16 with CUDA graphs and fused ops (the FP8 projections stacked, their
    Triton product inside the graphs): prompt logits close to the same model with the dequantized
    weights in bfloat16, and decode runs."""
    from segkv.layers.fp8 import fp8_modules

    cuda = {"device": "cuda", "dtype": "bfloat16", "page_size": 16, "num_pages": 64, "cuda_graphs": True}
    fp8 = LLM(bf16_dir, quantization="fp8", **cuda)
    reference = LLM(bf16_dir, **cuda)
    with torch.no_grad():
        for name, module in fp8.model.named_modules():
            if module in fp8_modules(fp8.model):
                reference.model.get_submodule(name).weight.copy_(module.dequantized(torch.bfloat16))
    prompt = torch.randint(0, fp8.model.cfg.vocab_size, (40,), generator=gen).tolist()
    logits = [llm.runner.prompt_logits(llm.cache.new_chain(), prompt) for llm in (fp8, reference)]
    assert torch.isfinite(logits[0]).all()
    torch.testing.assert_close(logits[0], logits[1], rtol=0.02, atol=0.02 * logits[1].abs().max().item())
    out = fp8.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert len(out.outputs[0].token_ids) == 16
