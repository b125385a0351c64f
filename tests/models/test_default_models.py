"""The built-in default models: their training (``tools.default_models``, tiny, on the CPU), its
checkpoints, the names."""

from __future__ import annotations

import ast
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from segkv.cache import PagedKVCache
from segkv.config import CacheConfig
from segkv.models import default_models, placeholder
from segkv.models.default_models import (
    GQA_NAME, MLA_NAME, PACKAGED, is_complete, packaged_dir, resolve_model_dir,
)
from segkv.models.loader import load_model
from segkv.models.registry import model_class
from segkv.models.stdlib_corpus import read_corpus
from segkv.runner.model_runner import ModelRunner
from tools.default_models.corpus import corpus_sha256, split_corpus
from tools.default_models.training import causal_hidden, lm_losses

TOLERANCE = 1e-4
TEXT = "def add(a, b):\n    \"\"\"Return the sum.\"\"\"\n    return a + b\n\nclass Point:\n    x = 0\n"


def _train(out: Path, *extra: str) -> dict:
    """``python -m tools.default_models.train`` run in this process (no second interpreter and torch
    import); imported here, as its import sets ``CUBLAS_WORKSPACE_CONFIG``."""
    from tools.default_models import train as train_command

    argv = ["--preset", "tiny", "--device", "cpu", "--out-dir", str(out), "--no-plot", *extra]
    return train_command.run(train_command.parse_args(argv))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("default-models")
    return out, _train(out)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _ids(directory: Path) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(directory / "tokenizer.json")).encode(TEXT).ids


@pytest.mark.parametrize("name", [GQA_NAME, MLA_NAME])
def test_checkpoints_load_in_segkv_and_transformers_with_matching_logits(trained, name):
    from transformers import AutoModelForCausalLM

    directory = trained[0] / PACKAGED[name]
    ids = _ids(directory)
    assert len(ids) > 20
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers does not know the MTP layer's tensors
        hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        model = load_model(directory)
        modes = ("absorbed", "naive") if name == MLA_NAME else ("absorbed",)
        for mode in modes:  # the inference path, over the paged cache in chunks
            cache = PagedKVCache(model.kv_layout(torch.float32), CacheConfig(page_size=8, num_pages=32))
            runner = ModelRunner(model, cache, mla_mode=mode, prefill_chunk=9)
            err = _rel_err(runner.prompt_logits(cache.new_chain(), ids), ref)
            assert err < TOLERANCE, f"{name} {mode}: relative error {err:.2e} against transformers"
        dense = model.compute_logits(causal_hidden(model, torch.tensor([ids])))  # the training path
        assert _rel_err(dense, ref) < TOLERANCE


def test_directories_are_complete_and_small(trained):
    for name, sub in PACKAGED.items():
        directory = trained[0] / sub
        assert is_complete(directory)
        assert (directory / "model.safetensors").stat().st_size <= 16_000_000
        config = json.loads((directory / "tokenizer_config.json").read_text())
        assert "<|im_start|>" in config["chat_template"] and config["eos_token"] == "<|im_end|>"
        assert json.loads((directory / "generation_config.json").read_text())["eos_token_id"] == [0, 2]
        with safe_open(directory / "model.safetensors", "pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys() if "mlp.gate." not in k}
        assert dtypes == {"BF16"}


def test_metrics_report_perplexity_below_unigram(trained):
    out, metrics = trained
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["models"].keys() == {"qwen3-gqa", "deepseek-mla"}
    docs = read_corpus(limit_bytes=400_000)
    assert saved["corpus"]["sha256"] == corpus_sha256(docs)
    assert saved["corpus"]["files"] == {k: len(v) for k, v in split_corpus(docs, every=7).items()}
    for key in ("python_version", "torch_version", "seed", "wall_time_s"):
        assert key in saved
    for sub, m in saved["models"].items():
        ppl, unigram = m["test"]["perplexity"], m["unigram_test_perplexity"]
        assert math.isfinite(ppl) and ppl < unigram, f"{sub}: perplexity {ppl:.1f} vs unigram {unigram:.1f}"
        assert len(m["curve"]) >= 5 and m["curve"][-1]["step"] == m["steps"]
        assert m["valid"] and m["selected_step"] in {p["step"] for p in m["valid"]}
    mla = saved["models"]["deepseek-mla"]["test"]
    assert mla["mtp_perplexity"] < saved["models"]["deepseek-mla"]["unigram_test_perplexity"]


def test_mtp_layer_is_saved_and_loaded(trained):
    directory = trained[0] / PACKAGED[MLA_NAME]
    config = json.loads((directory / "config.json").read_text())
    mtp = f"model.layers.{config['num_hidden_layers']}."
    model = load_model(directory)
    assert len(model.mtp) == config["num_nextn_predict_layers"] == 1
    params = dict(model.named_parameters())
    with safe_open(directory / "model.safetensors", "pt") as f:
        names = [k for k in f.keys() if k.startswith(mtp)]
        for rest in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                     "self_attn.kv_b_proj.weight", "mlp.experts.0.up_proj.weight",
                     "mlp.shared_experts.up_proj.weight"):
            assert mtp + rest in names
        for name in names:
            expected = f.get_tensor(name).float()
            torch.testing.assert_close(params[model.param_name(name)], expected, rtol=0, atol=0)
    assert all(model.param_name(n).startswith("mtp.0.") for n in names)
    # No copies of the embeddings and the head: the MTP layer shares the main model's.
    assert mtp + "embed_tokens.weight" not in names and mtp + "shared_head.head.weight" not in names
    with torch.no_grad():  # the draft: from the hidden state at t and token t+1, logits for t+2
        out = lm_losses(model, torch.tensor([_ids(directory)]))
    assert out.mtp is not None and math.isfinite(float(out.mtp))


def test_training_is_reproducible(tmp_path):
    for run in ("a", "b"):
        _train(tmp_path / run, "--steps", "6")
    assert not torch.are_deterministic_algorithms_enabled()  # the caller's setting is restored
    for sub in PACKAGED.values():
        for file in ("model.safetensors", "tokenizer.json", "config.json"):
            first, second = (tmp_path / run / sub / file for run in ("a", "b"))
            assert first.read_bytes() == second.read_bytes(), f"{sub}/{file} differs between two runs"


def test_names_resolve_to_packaged_models_or_placeholders(trained, monkeypatch, tmp_path):
    monkeypatch.setattr(default_models, "PACKAGE_ROOT", trained[0])
    assert resolve_model_dir("default") == trained[0] / "qwen3-gqa"
    assert resolve_model_dir("default-mla") == trained[0] / "deepseek-mla"
    assert resolve_model_dir("./some/dir") == Path("some/dir")  # "some/dir" reads as a Hugging Face id
    monkeypatch.setattr(default_models, "PACKAGE_ROOT", tmp_path)  # not trained yet
    built = []
    monkeypatch.setattr(placeholder, "ensure_placeholder", lambda name: built.append(name) or tmp_path / name)
    with pytest.warns(UserWarning, match="UNTRAINED placeholder"):
        assert resolve_model_dir("default-mla") == tmp_path / "default-mla"
    assert built == ["default-mla"]
    with pytest.raises(ValueError, match="built-in models"):
        packaged_dir("default-xl")


@pytest.mark.parametrize("name", [GQA_NAME, MLA_NAME])
def test_placeholder_configs_build(name):
    config = placeholder.placeholder_config(name, 300)
    model = model_class(config).from_hf_config(config)
    assert model.cfg.vocab_size == 300 and len(getattr(model, "mtp", ())) == 0


def test_cli_generates_with_default_mla(trained, monkeypatch, capsys):
    from segkv.cli import main

    monkeypatch.setattr(default_models, "PACKAGE_ROOT", trained[0])
    assert main(["generate", "--model", "default-mla", "--prompt", "def f(x):", "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()


def _python_like(text: str) -> bool:
    """Contains ``return``, or some first lines (at least two) parse as Python, as they are or
    with a docstring left open at the cut closed (a function that starts with its docstring)."""
    lines = text.split("\n")
    for k in range(len(lines), 1, -1):
        head = "\n".join(lines[:k])
        for candidate in (head, head + '"""', head + '\n    """'):
            try:
                ast.parse(candidate)
                return True
            except SyntaxError:
                continue
    return "return" in text


def test_python_like_check_rejects_prose_and_broken_code():
    assert _python_like('def f(n):\n    """Add one.\n\n    >>> f(1)')
    assert _python_like("def f(n):\n    x = n + 1\n    y = (")
    assert not _python_like("def f(n):\nthe cat sat on the mat and")
    assert not _python_like("def f(n):\n    x = = 1\n    y = (")


@pytest.mark.parametrize("name", [GQA_NAME, MLA_NAME])
def test_packaged_model_continues_python(name):
    if not is_complete(packaged_dir(name)):
        pytest.skip(f"the trained {name!r} model is not packaged yet: python -m tools.default_models.train "
                    "writes it (docs/default-models.md)")
    from segkv.engine import LLM
    from segkv.sampling_params import SamplingParams

    llm = LLM(packaged_dir(name))
    params = SamplingParams(temperature=0, max_tokens=64)
    text = llm.generate(["def fibonacci(n):"], params)[0].outputs[0].text
    assert _python_like("def fibonacci(n):" + text), text
