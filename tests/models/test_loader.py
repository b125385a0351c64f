"""Loading model directories: sharded checkpoints, dtypes, and clear errors for bad ones."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_helpers import build_model_dir
from segkv.models.loader import fingerprint, load_model


def test_sharded_checkpoint_loads_identically(tmp_path):
    hf = build_model_dir(tmp_path / "one", "qwen3")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a, b = load_model(tmp_path / "one"), load_model(tmp_path / "sharded")
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_dtypes(tmp_path, dtype):
    build_model_dir(tmp_path, "llama")
    model = load_model(tmp_path, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.kv_layout(dtype).dtype == dtype


def test_fingerprint_tells_models_apart(tmp_path):
    build_model_dir(tmp_path / "a", "qwen3", seed=0)
    build_model_dir(tmp_path / "b", "qwen3", seed=1)
    assert fingerprint(tmp_path / "a") == fingerprint(tmp_path / "a")
    assert fingerprint(tmp_path / "a") != fingerprint(tmp_path / "b")


def _edit_config(directory, **changes):
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_unsupported_architecture(tmp_path):
    build_model_dir(tmp_path, "llama")
    _edit_config(tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported architecture GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(tmp_path)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    build_model_dir(tmp_path, "llama")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)


def test_shape_mismatch_missing_and_unexpected_tensors(tmp_path):
    build_model_dir(tmp_path, "llama")
    weights = load_file(tmp_path / "model.safetensors")
    _edit_config(tmp_path, intermediate_size=96)
    with pytest.raises(ValueError, match=r"mlp.*has shape .*128.*expects .*96"):
        load_model(tmp_path)
    _edit_config(tmp_path, intermediate_size=128)
    broken = dict(weights)
    broken.pop("model.norm.weight")
    save_file(broken, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks 1 tensors: model.norm.weight"):
        load_model(tmp_path)
    save_file({**weights, "model.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected tensor 'model.extra.weight'"):
        load_model(tmp_path)


def test_bad_config_json(tmp_path):
    build_model_dir(tmp_path, "llama")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(tmp_path)


def test_missing_model_directory_is_named(tmp_path, monkeypatch):
    from segkv.engine import LLM

    monkeypatch.chdir(tmp_path)
    hint = "give a Hugging Face model directory or a built-in model: default, default-mla"
    with pytest.raises(FileNotFoundError, match=f"model directory 'path/to/missing' does not exist; {hint}"):
        LLM("path/to/missing")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="model path 'weights.bin' is not a directory"):
        LLM("weights.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=f"model directory 'empty' has no config.json; {hint}"):
        LLM("empty")
