"""gpt-oss against transformers (float32): prompt logits and greedy tokens on two tiny configurations
(sliding and full layers with YaRN RoPE, attention sinks, biased routers and clamped-SwiGLU experts;
then MQA, an odd vocabulary, a tight SwiGLU clamp and a window shorter than the prompts, read from
the older config.json layout), windows over chunked prefill, follow-up turns and a fork, an MXFP4
checkpoint dequantized at load, and the settings refused at load."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_helpers import GPT_OSS, assert_greedy_agrees, build_gpt_oss_dir, mxfp4_quantize
from segkv.engine import LLM
from segkv.models.gpt_oss import GptOssConfig, layer_types, rope_parameters
from segkv.models.loader import checkpoint_weight_bytes, load_model
from segkv.models.mxfp4 import dequantize
from segkv.sampling_params import SamplingParams

from parity_helpers import cpu_llm as _llm, greedy as _greedy, hf_greedy as _reference, rel_err
from parity_helpers import prompt_logits as _prompt_logits

TOLERANCE = 1e-4
WINDOW = 10  # the unusual config's: shorter than every prompt below


def test_gpt_oss_matches_transformers(tmp_path, gen):
    """Sliding, full, sliding layers (window 12, shorter than the prompt), YaRN RoPE, sinks: logits
    prefilled in chunks of 7 and in one step, and 32 greedy tokens."""
    hf = build_gpt_oss_dir(tmp_path)
    model = load_model(tmp_path)
    assert model.layer_windows == (12, None, 12) and model.sliding_window is None
    assert [layer.self_attn.attn.window for layer in model.model.layers] == [12, None, 12]
    assert model.model.layers[0].self_attn.rotary.attention_factor == pytest.approx(0.1 * math.log(4) + 1)
    assert torch.equal(model.model.layers[1].self_attn.attn.sinks, hf.model.layers[1].self_attn.sinks)
    prompt = torch.randint(0, hf.config.vocab_size, (40,), generator=gen)
    with torch.no_grad():
        reference = hf(prompt[None]).logits[0]
    for chunk in (7, 512):  # chunks shorter than the window, and the prompt in one step
        assert rel_err(_prompt_logits(model, prompt, prefill_chunk=chunk), reference) < TOLERANCE
    prompt = torch.randint(0, hf.config.vocab_size, (12,), generator=gen).tolist()
    tokens = _greedy(_llm(tmp_path), [prompt])[0]
    assert_greedy_agrees(hf, prompt, tokens, _reference(hf, prompt), TOLERANCE)


def test_the_sinks_matter(tmp_path, gen):
    """The tolerance sees the sinks: transformers without them (a logit of -inf) and segkv with its
    sinks at 0 are both far from transformers with them."""
    hf = build_gpt_oss_dir(tmp_path)
    model = load_model(tmp_path)
    prompt = torch.randint(0, hf.config.vocab_size, (30,), generator=gen)
    with torch.no_grad():
        reference = hf(prompt[None]).logits[0]
        saved = [layer.self_attn.sinks.clone() for layer in hf.model.layers]
        for layer in hf.model.layers:
            layer.self_attn.sinks.fill_(-math.inf)
        without = hf(prompt[None]).logits[0]
        for layer, sinks in zip(hf.model.layers, saved):
            layer.self_attn.sinks.copy_(sinks)
        for layer in model.model.layers:
            layer.self_attn.attn.sinks.zero_()
    assert rel_err(without, reference) > 100 * TOLERANCE
    assert rel_err(_prompt_logits(model, prompt, prefill_chunk=512), reference) > 100 * TOLERANCE


def _unusual(directory):
    """MQA, an odd vocabulary, head size 20, no attention biases, the SwiGLU clamped at 0.5 with
    alpha 2, a window of 10; the config.json rewritten in the older layout (``rope_scaling`` and
    ``rope_theta``, no ``layer_types``: sliding and full layers alternate from a sliding one)."""
    from transformers import GptOssForCausalLM

    build_gpt_oss_dir(directory, odd_vocab=True, num_key_value_heads=1, head_dim=20, attention_bias=False,
                      swiglu_limit=0.5, swiglu_alpha=2.0, sliding_window=WINDOW)
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    cfg.pop("layer_types")
    cfg.update(rope_theta=rope.pop("rope_theta") / 3, rope_scaling=rope)
    path.write_text(json.dumps(cfg))
    return GptOssForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def test_gpt_oss_unusual_config_past_its_window(tmp_path, gen):
    hf = _unusual(tmp_path)
    assert hf.config.layer_types == GPT_OSS["layer_types"] and hf.config.vocab_size % 2 == 1
    assert hf.config.rope_parameters["rope_theta"] == 50_000.0
    model = load_model(tmp_path)
    assert model.layer_windows == (WINDOW, None, WINDOW) and model.cfg.num_kv_heads == 1
    assert model.model.layers[0].self_attn.q_proj.bias is None
    prompt = torch.randint(0, hf.config.vocab_size, (44,), generator=gen)
    with torch.no_grad():
        reference = hf(prompt[None]).logits[0]
        for layer in hf.model.layers:
            layer.mlp.experts.limit = 1e9
        unclamped = hf(prompt[None]).logits[0]
        for layer in hf.model.layers:
            layer.mlp.experts.limit = 0.5
    assert rel_err(unclamped, reference) > 100 * TOLERANCE  # the clamp matters
    for chunk in (7, 512):
        assert rel_err(_prompt_logits(model, prompt, prefill_chunk=chunk), reference) < TOLERANCE
    prompt = torch.randint(0, hf.config.vocab_size, (20,), generator=gen).tolist()
    tokens = _greedy(_llm(tmp_path), [prompt])[0]
    assert_greedy_agrees(hf, prompt, tokens, _reference(hf, prompt), TOLERANCE)


def test_gpt_oss_windows_over_turns_and_a_fork(tmp_path):
    """A conversation's two turns and a fork's own turn, with prefill chunks of 7 (shorter than the
    window of 10): each reply is transformers' greedy reply to the turn's whole prompt."""
    hf = _unusual(tmp_path)
    llm = _llm(tmp_path, prefill_chunk=7)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    conv = llm.conversation()
    turns = [(conv, "hello there, a first turn of the conversation"), (conv, "and a follow-up")]
    for i, (who, text) in enumerate(turns + [(None, "a fork's own turn")]):
        who = who or conv.fork()
        ids = llm.tokenizer.encode_chat(who.messages + [{"role": "user", "content": text}],
                                        add_generation_prompt=True)
        reply = who.say(text, params)
        assert reply.stats.cached_tokens > (WINDOW if i else -1)  # later turns reuse the history
        assert_greedy_agrees(hf, ids, reply.output.token_ids, _reference(hf, ids, 8), TOLERANCE)


def _mxfp4_checkpoint(directory):
    """A gpt-oss checkpoint whose experts are stored in MXFP4 (``mxfp4_quantize``), and the HF model
    holding the same weights dequantized by transformers' own converter."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = build_gpt_oss_dir(directory)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    experts = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4_quantize(tensors.pop(name))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        experts[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    cfg = json.loads((directory / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(cfg))
    with torch.no_grad():
        for name, weight in experts.items():
            hf.get_parameter(name).copy_(weight)
    return hf, experts


def test_mxfp4_checkpoint_dequantized_at_load(tmp_path, gen):
    hf, experts = _mxfp4_checkpoint(tmp_path)
    model = load_model(tmp_path)
    params = dict(model.named_parameters())
    for name, weight in experts.items():
        assert torch.equal(params[name], weight), name  # exactly transformers' dequantized values
    loaded = sum(p.numel() * 4 for p in model.parameters())
    assert checkpoint_weight_bytes(tmp_path, dtype="float32") == loaded  # the blocks count dequantized
    prompt = torch.randint(0, hf.config.vocab_size, (30,), generator=gen)
    with torch.no_grad():
        reference = hf(prompt[None]).logits[0]
    assert rel_err(_prompt_logits(model, prompt, prefill_chunk=7), reference) < TOLERANCE
    bf16 = load_model(tmp_path, dtype="bfloat16")  # FP4 values times powers of two: exact in bfloat16
    for name, weight in experts.items():
        assert torch.equal(dict(bf16.named_parameters())[name].float(), weight), name


def test_mxfp4_dequantize_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (3, 5, 2), dtype=torch.uint8, generator=g)
    assert torch.equal(dequantize(blocks, scales, torch.float32),
                       convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))


def test_config_layouts_read_as_transformers_reads_them():
    """Layer types and RoPE from new and older config.json layouts, as transformers' GptOssConfig
    reads them (its defaults where a field is left out)."""
    from transformers import GptOssConfig as HFConfig

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                num_attention_heads=2)
    layouts = [
        {},  # defaults: YaRN factor 32 over 4096 positions, base 150000; alternating layers
        {"rope_theta": 1000.0, "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16.0,
                                                "beta_slow": 2.0, "original_max_position_embeddings": 256}},
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 300,
         "layer_types": ["full_attention"] * 5},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 7.0}},
    ]
    for layout in layouts:
        cfg = {**base, **layout}
        theirs = HFConfig.from_dict(cfg)
        assert layer_types(cfg) == theirs.layer_types
        assert rope_parameters(cfg) == theirs.rope_parameters, layout
        parsed = GptOssConfig.from_hf(cfg)
        assert (parsed.head_dim, parsed.num_kv_heads, parsed.num_experts, parsed.top_k) == (
            theirs.head_dim, theirs.num_key_value_heads, theirs.num_local_experts, theirs.num_experts_per_tok)


@pytest.mark.parametrize(("changes", "message"), [
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
     r"layer_types with 'chunked_attention'"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, r"layer_types has 2 entries for 3 layers"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
     r"rope_parameters with rope_type 'longrope'"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor = 0\.5"),
    ({"quantization_config": {"quant_method": "mxfp4", "block_size": 16}},
     r"quantization_config \(quant_method 'mxfp4'\) with block_size"),
])
def test_unimplemented_settings_are_refused_naming_the_field(tmp_path, changes, message):
    build_gpt_oss_dir(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    with pytest.raises(ValueError, match=f"GptOssForCausalLM: .*{message}"):
        load_model(tmp_path)


def test_mxfp4_stays_refused_for_other_families():
    from segkv.models.qwen3 import Qwen3ForCausalLM

    cfg = {"architectures": ["Qwen3ForCausalLM"], "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(ValueError, match="mxfp4"):
        Qwen3ForCausalLM.check_config(cfg)


def test_decode_runs_eagerly_not_in_cuda_graphs(tmp_path):
    """The experts' group sizes reach the host every layer: forced graphs are a clear error naming
    why, and "auto" turns them off with that reason."""
    build_gpt_oss_dir(tmp_path)
    with pytest.raises(ValueError, match="gpt-oss experts run as a host-synchronising loop"):
        LLM(tmp_path, device="cpu", dtype="float32", num_pages=32, backend="triton", cuda_graphs="emulate")
    auto = LLM(tmp_path, device="cpu", dtype="float32", num_pages=32, cuda_graphs="auto")
    assert auto.runner.graphs is None and "gpt-oss experts" in auto.runner.graphs_off_reason
