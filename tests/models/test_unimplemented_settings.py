"""config.json settings that change the computation and are not implemented are refused at load."""

from __future__ import annotations

import json

import pytest
import torch

from model_helpers import build_model_dir
from segkv.models.loader import load_model


def _edit_config(directory, **changes):
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        cfg.pop(key)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_windows_over_some_layers_are_per_layer_windows(tmp_path, family):
    # windows layers 1.. of 2 in transformers (max_window_layers 1, window 16 < 512 positions)
    build_model_dir(tmp_path, family, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["use_sliding_window"] is True and saved["sliding_window"] == 16
    model = load_model(tmp_path)
    assert model.layer_windows == (None, 16) and model.sliding_window is None
    assert [layer.self_attn.attn.window for layer in model.model.layers] == [None, 16]
    _edit_config(tmp_path, layer_types=None)  # an older file: the layers come from max_window_layers
    assert load_model(tmp_path).layer_windows == (None, 16)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_settings_that_window_nothing_load(tmp_path, family):
    hf = build_model_dir(tmp_path, family, use_sliding_window=False, sliding_window=16, max_window_layers=0)
    model = load_model(tmp_path)
    assert model.cfg.num_layers == 2
    # set, but no layer from max_window_layers on: transformers windows none of them either
    _edit_config(tmp_path, use_sliding_window=True, max_window_layers=2, layer_types=None)
    load_model(tmp_path)
    # a window as long as the model: no sequence can see past it
    _edit_config(tmp_path, max_window_layers=0, sliding_window=hf.config.max_position_embeddings)
    load_model(tmp_path)
    # a shorter window over every layer is attended as a window (test_sliding_window_models)
    _edit_config(tmp_path, sliding_window=hf.config.max_position_embeddings - 1)
    assert load_model(tmp_path).sliding_window == hf.config.max_position_embeddings - 1
    # over some layers only: per layer
    _edit_config(tmp_path, max_window_layers=1)
    assert load_model(tmp_path).layer_windows == (None, hf.config.max_position_embeddings - 1)


def test_layer_types_other_than_full_attention_are_refused(tmp_path):
    build_model_dir(tmp_path, "qwen3")
    _edit_config(tmp_path, use_sliding_window=False, layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="layer_types marks layers 1 as 'sliding_attention'"):
        load_model(tmp_path)
    _edit_config(tmp_path, layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(ValueError, match="layer_types with 'chunked_attention'"):
        load_model(tmp_path)
    _edit_config(tmp_path, layer_types=["full_attention", "full_attention"])
    load_model(tmp_path)


@pytest.mark.parametrize("field", ["rope_scaling", "rope_parameters"])
def test_unimplemented_rope_types_are_refused(tmp_path, field):
    build_model_dir(tmp_path, "llama")
    rope = {"rope_type": "mrope", "mrope_section": [8, 12, 12]}  # Qwen2-VL's multimodal RoPE
    if field == "rope_parameters":
        rope["rope_theta"] = 10000.0
    _edit_config(tmp_path, **{"rope_parameters": None, field: rope})
    with pytest.raises(ValueError, match=f"LlamaForCausalLM.*{field} with rope_type 'mrope'"):
        load_model(tmp_path)


def test_partial_rotary_and_quantization_are_refused(tmp_path):
    build_model_dir(tmp_path, "llama")
    _edit_config(tmp_path, partial_rotary_factor=0.5,
                 quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 128})
    with pytest.raises(ValueError) as err:
        load_model(tmp_path)
    assert "partial_rotary_factor = 0.5" in str(err.value)
    assert "quantization_config (quant_method 'gptq')" in str(err.value)  # every problem is named


def test_settings_that_are_implemented_or_ignored_load(tmp_path):
    # biases (Llama's attention_bias and mlp_bias), and pretraining_tp, which only slices the
    # reference's products (transformers no longer reads it)
    hf = build_model_dir(tmp_path, "llama", attention_bias=True, mlp_bias=True)
    _edit_config(tmp_path, pretraining_tp=2, partial_rotary_factor=1.0)
    model = load_model(tmp_path)
    layer = model.model.layers[0]
    assert layer.self_attn.o_proj.bias is not None and layer.mlp.down_proj.bias is not None
    ref = hf.model.layers[0]
    assert torch.equal(layer.self_attn.o_proj.bias, ref.self_attn.o_proj.bias)
    assert torch.equal(layer.mlp.down_proj.bias, ref.mlp.down_proj.bias)
