"""Gemma 3 text models against transformers (float32): prompt logits and greedy tokens on two tiny
configurations (local and global layers with their own RoPE; then MQA, an odd vocabulary, a head
size other than hidden / heads, attention biases, logit soft-capping and a window shorter than the
prompts, read from an older config.json layout), windows over chunked prefill, follow-up turns and
a fork, and the settings refused at load."""

from __future__ import annotations

import json

import pytest
import torch

from model_helpers import GEMMA3, assert_greedy_agrees, build_gemma3_dir
from segkv.models.gemma3 import Gemma3Config, layer_types, rope_parameters
from segkv.models.loader import load_model
from segkv.sampling_params import SamplingParams

from parity_helpers import cpu_llm as _llm, greedy as _greedy, hf_greedy as _reference, rel_err
from parity_helpers import prompt_logits as _prompt_logits

TOLERANCE = 1e-4
WINDOW = 10  # the unusual config's: shorter than every prompt below


def test_gemma3_matches_transformers(tmp_path, gen):
    """Local, global, local layers (window longer than the prompts), tied embeddings, linear RoPE
    scaling on the global layer: logits prefilled in chunks of 11, and 32 greedy tokens."""
    hf = build_gemma3_dir(tmp_path)
    model = load_model(tmp_path)
    assert model.layer_windows == (128, None, 128) and model.sliding_window is None
    assert [layer.self_attn.attn.window for layer in model.model.layers] == [128, None, 128]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    local, full = (model.model.layers[i].self_attn.rotary for i in (0, 1))
    assert local is not full and full.inv_freq[0].item() == pytest.approx(1 / 4)  # linear, factor 4
    prompt = torch.randint(0, hf.config.vocab_size, (40,), generator=gen)
    with torch.no_grad():
        reference = hf(prompt[None]).logits[0]
    assert rel_err(_prompt_logits(model, prompt, prefill_chunk=11), reference) < TOLERANCE
    prompt = torch.randint(0, hf.config.vocab_size, (12,), generator=gen).tolist()
    tokens = _greedy(_llm(tmp_path), [prompt])[0]
    assert_greedy_agrees(hf, prompt, tokens, _reference(hf, prompt), TOLERANCE)


def _unusual(directory):
    """MQA, an odd vocabulary, head size 24 (hidden 48 / 4 heads is 12), attention scaled by
    ``query_pre_attn_scalar`` 12 (hidden / heads, as Gemma 3 27B), Q/K/V/O biases, logits capped at
    2, a window of 10; the config.json rewritten in Gemma 3 1B's layout
    (``sliding_window_pattern``, ``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``)."""
    from transformers import Gemma3ForCausalLM

    build_gemma3_dir(directory, odd_vocab=True, hidden_size=48, num_key_value_heads=1, head_dim=24,
                     query_pre_attn_scalar=12, attention_bias=True, final_logit_softcapping=2.0,
                     sliding_window=WINDOW)
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    for key in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
        cfg.pop(key)
    cfg.update(sliding_window_pattern=2, rope_theta=50_000.0, rope_local_base_freq=5_000.0,
               rope_scaling={"rope_type": "linear", "factor": 2.0})
    path.write_text(json.dumps(cfg))
    return Gemma3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def test_gemma3_unusual_config_past_its_window(tmp_path, gen):
    hf = _unusual(tmp_path)
    assert hf.config.layer_types == GEMMA3["layer_types"] and hf.config.vocab_size % 2 == 1
    assert hf.config.rope_parameters["sliding_attention"]["rope_theta"] == 5_000.0
    model = load_model(tmp_path)
    assert model.layer_windows == (WINDOW, None, WINDOW) and model.cfg.num_kv_heads == 1
    prompt = torch.randint(0, hf.config.vocab_size, (44,), generator=gen)
    with torch.no_grad():
        reference = hf(prompt[None]).logits[0]
        hf.config.sliding_window = 1_000  # the same weights without a binding window
        full = hf(prompt[None]).logits[0]
        hf.config.final_logit_softcapping = None
        uncapped = hf(prompt[None]).logits[0]
        hf.config.sliding_window, hf.config.final_logit_softcapping = WINDOW, 2.0
    assert rel_err(full, reference) > 100 * TOLERANCE  # the window matters
    assert uncapped.abs().max() > 2 and rel_err(full, uncapped) > 100 * TOLERANCE  # so does the cap
    for chunk in (7, 512):  # chunks shorter than the window, and the prompt in one step
        assert rel_err(_prompt_logits(model, prompt, prefill_chunk=chunk), reference) < TOLERANCE
    prompt = torch.randint(0, hf.config.vocab_size, (20,), generator=gen).tolist()
    tokens = _greedy(_llm(tmp_path), [prompt])[0]
    assert_greedy_agrees(hf, prompt, tokens, _reference(hf, prompt), TOLERANCE)


def test_gemma3_windows_over_turns_and_a_fork(tmp_path):
    """Two prompts generated together, then a conversation's two turns and a fork's own turn, with
    prefill chunks of 7 (shorter than the window of 10): each reply is transformers' greedy reply
    to the turn's whole prompt."""
    hf = _unusual(tmp_path)
    llm = _llm(tmp_path, prefill_chunk=7)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 13, 40, 77, 21] * 5, [3, 1, 4, 1, 5, 9, 2, 6] * 3]
    for prompt, tokens in zip(prompts, _greedy(llm, prompts, tokens=8)):
        assert_greedy_agrees(hf, prompt, tokens, _reference(hf, prompt, 8), TOLERANCE)
    conv = llm.conversation()
    turns = [(conv, "hello there, a first turn of the conversation"), (conv, "and a follow-up")]
    for i, (who, text) in enumerate(turns + [(None, "a fork's own turn")]):
        who = who or conv.fork()
        ids = llm.tokenizer.encode_chat(who.messages + [{"role": "user", "content": text}],
                                        add_generation_prompt=True)
        reply = who.say(text, params)
        assert reply.stats.cached_tokens > (WINDOW if i else -1)  # later turns reuse the history
        assert_greedy_agrees(hf, ids, reply.output.token_ids, _reference(hf, ids, 8), TOLERANCE)


def test_config_layouts_read_as_transformers_reads_them():
    """Layer types and per-type RoPE from new and older config.json layouts, as transformers'
    Gemma3TextConfig reads them."""
    from transformers import Gemma3TextConfig

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=7,
                num_attention_heads=2)
    layouts = [
        {},  # defaults: pattern 6, bases 1e6 (global) and 1e4 (local)
        {"sliding_window_pattern": 3, "rope_theta": 2e5, "rope_local_base_freq": 3e3,
         "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
        {"layer_types": ["full_attention"] * 7, "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 7.0},
            "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 9e4}}},
    ]
    for layout in layouts:
        cfg = {**base, **layout}
        theirs = Gemma3TextConfig(**cfg)
        assert layer_types(cfg) == theirs.layer_types
        ours = rope_parameters(cfg)
        for kind in ("sliding_attention", "full_attention"):
            assert ours[kind] == theirs.rope_parameters[kind], (layout, kind)
        parsed = Gemma3Config.from_hf(cfg)
        assert parsed.rope_theta == theirs.rope_parameters["full_attention"]["rope_theta"]
        assert parsed.local_rope_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"]


def test_one_window_over_every_layer_is_the_model_window(tmp_path):
    """Local layers only (transformers' default pattern of 6 over 3 layers): one plan bound."""
    build_gemma3_dir(tmp_path, layer_types=None, sliding_window=WINDOW)
    model = load_model(tmp_path)
    assert model.sliding_window == WINDOW and model.layer_windows is None
    assert all(getattr(layer.self_attn.attn, "window", None) is None for layer in model.model.layers)


@pytest.mark.parametrize(("changes", "message"), [
    ({"attn_logit_softcapping": 50.0},
     r"attn_logit_softcapping = 50\.0: soft-capping of attention scores is not implemented"),
    ({"use_bidirectional_attention": True}, r"use_bidirectional_attention = True: only causal attention"),
    ({"hidden_activation": "gelu"}, r"hidden_activation = 'gelu': only the gelu_pytorch_tanh"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
     r"layer_types with 'chunked_attention'"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "longrope", "rope_theta": 1e6}}},
     r"rope_parameters\.full_attention with rope_type 'longrope'"),
])
def test_unimplemented_settings_are_refused_naming_the_field(tmp_path, changes, message):
    build_gemma3_dir(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    with pytest.raises(ValueError, match=f"Gemma3ForCausalLM: .*{message}"):
        load_model(tmp_path)
