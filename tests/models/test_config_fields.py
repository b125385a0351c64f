"""Every config field of each supported family, as transformers defines it, is handled, inert or refused.

The walker enumerates a transformers config class's fields (dataclass fields, ``__init__``
parameters along the MRO, ``attribute_map`` aliases, a default instance's ``to_dict()``) and fails
on any the family's table (``segkv/models/config_fields.py``) does not account for.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging

import pytest
import transformers

from model_helpers import COMMON, build_model_dir
from segkv.models.config_fields import FIELD_TABLES, NO_TABLE, FieldTable, Refused
from segkv.models.default_configs import gqa_config, mla_config
from segkv.models.loader import load_model
from segkv.models.registry import ARCHITECTURES, model_class


def transformers_fields(config_cls: type) -> set[str]:
    """The fields a transformers config class defines (see the module docstring)."""
    names: set[str] = set()
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    for klass in config_cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None and klass is not object:
            names |= {p.name for p in inspect.signature(init).parameters.values() if p.kind not in skip}
    if dataclasses.is_dataclass(config_cls):
        names |= {f.name for f in dataclasses.fields(config_cls)}
    names |= set(getattr(config_cls, "attribute_map", {}))
    names |= set(config_cls().to_dict())
    return names - {"self"}


def unaccounted(table: FieldTable, config_cls: type | None = None) -> list[str]:
    """The fields of ``config_cls`` (default: the table's transformers class) in no category."""
    cls = config_cls or getattr(transformers, table.config_class)
    return sorted(transformers_fields(cls) - table.known())


def test_every_registered_architecture_has_a_table_or_a_listed_reason():
    missing = sorted(a for a in ARCHITECTURES if a not in FIELD_TABLES and a not in NO_TABLE)
    assert not missing, (f"registered without a field table: {missing}; add one to "
                         "segkv/models/config_fields.py FIELD_TABLES (or a reason to NO_TABLE)")
    assert set(FIELD_TABLES) <= set(ARCHITECTURES)
    assert not set(FIELD_TABLES) & set(NO_TABLE)


@pytest.mark.parametrize("arch", sorted(FIELD_TABLES))
def test_every_transformers_field_is_handled_inert_or_refused(arch):
    table = FIELD_TABLES[arch]
    missing = unaccounted(table)
    assert not missing, (f"{table.config_class} fields that {arch}'s table does not account for: {missing} "
                         "(segkv/models/config_fields.py)")
    assert not table.handled & table.inert
    assert not (table.handled | table.inert) & set(table.refused)


def test_the_walker_fails_on_an_unhandled_field(monkeypatch):
    table = FIELD_TABLES["LlamaForCausalLM"]
    assert unaccounted(table) == []

    @dataclasses.dataclass(repr=False)
    class LlamaWithTemperature(transformers.LlamaConfig):
        attention_temperature: float = 1.0  # a field that would change the attention

    assert unaccounted(table, LlamaWithTemperature) == ["attention_temperature"]
    # a table that forgets a known field fails too
    mistral = FIELD_TABLES["MistralForCausalLM"]
    forgetful = dataclasses.replace(mistral, handled=mistral.handled - {"sliding_window"})
    assert unaccounted(forgetful) == ["sliding_window"]
    monkeypatch.setitem(FIELD_TABLES, "MistralForCausalLM", forgetful)
    with pytest.raises(AssertionError, match="sliding_window"):
        test_every_transformers_field_is_handled_inert_or_refused("MistralForCausalLM")


def _tiny_config(arch: str) -> dict:
    """A tiny ``config.json`` dict of ``arch`` as transformers writes it (model_helpers' sizes)."""
    table = FIELD_TABLES[arch]
    if arch.startswith("Deepseek"):
        settings = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16,
                        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, moe_intermediate_size=32, max_position_embeddings=256,
                        n_group=1, topk_group=1)
    else:
        settings = dict(vocab_size=512, **COMMON)
    if arch == "Phi3ForCausalLM":  # its default token ids (32000) lie outside the tiny vocabulary
        settings.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "GptOssForCausalLM":  # its default YaRN's 4096 original positions exceed the tiny length
        settings.update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 150_000.0,
                                         "original_max_position_embeddings": 128})  # (transformers warns)
    cfg = getattr(transformers, table.config_class)(**settings).to_dict()
    cfg["architectures"] = [arch]
    return cfg


def _write(directory, cfg: dict, changes: dict):
    directory.mkdir(parents=True, exist_ok=True)
    cfg = {**cfg, **changes}
    for key in [k for k, v in changes.items() if v is None]:
        cfg.pop(key)
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


@pytest.mark.parametrize("arch", sorted(FIELD_TABLES))
def test_tiny_configs_pass_the_checks_without_unknown_fields(arch, caplog):
    cfg = _tiny_config(arch)
    with caplog.at_level(logging.WARNING, logger="segkv"):
        model_class(cfg).check_config(cfg)
    assert not caplog.records, caplog.text


@pytest.mark.parametrize("make", [gqa_config, mla_config], ids=["default", "default-mla"])
def test_default_model_configs_have_only_known_fields(make, caplog):
    cfg = make(512)
    with caplog.at_level(logging.WARNING, logger="segkv"):
        model_class(cfg).check_config(cfg)
    assert not caplog.records, caplog.text


REFUSALS = [(arch, name) for arch, table in sorted(FIELD_TABLES.items()) for name in sorted(table.refused)]


@pytest.mark.parametrize(("arch", "name"), REFUSALS, ids=[f"{a}-{n}" for a, n in REFUSALS])
def test_each_refused_field_is_a_load_error_naming_it(tmp_path, arch, name):
    refused: Refused = FIELD_TABLES[arch].refused[name]
    directory = _write(tmp_path, _tiny_config(arch), dict(refused.example))
    # the refusal comes before any weight is read: the directory holds only config.json
    with pytest.raises(ValueError, match=name) as err:
        load_model(directory)
    assert "config.json is missing" not in str(err.value)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_windows_over_some_layers_load_in_llm(tmp_path, family):
    from segkv.engine.llm import LLM

    build_model_dir(tmp_path, family, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    llm = LLM(tmp_path, device="cpu", dtype="float32", num_pages=32)
    assert llm.model.layer_windows == (None, 16)  # attended per layer (test_sliding_window_models)



def test_bias_flags_the_reference_ignores_are_refused_at_true_only(tmp_path):
    cfg = _tiny_config("Qwen2ForCausalLM")
    with pytest.raises(ValueError, match=r"attention_bias = True: Qwen2 has Q/K/V biases and none on o_proj"):
        load_model(_write(tmp_path / "a", cfg, {"attention_bias": True}))
    model_class(cfg).check_config({**cfg, "attention_bias": False, "mlp_bias": False})


def test_deepseek_kv_heads_other_than_heads_are_refused():
    cfg = _tiny_config("DeepseekV3ForCausalLM")
    cls = model_class(cfg)
    for inert in (None, cfg["num_attention_heads"], 3, 128):  # no grouping in transformers either
        cls.check_config({**cfg, "num_key_value_heads": inert})
    with pytest.raises(ValueError, match="num_key_value_heads = 2: grouping MLA heads"):
        cls.check_config({**cfg, "num_key_value_heads": 2})


def test_unknown_fields_are_logged_not_refused(caplog):
    cfg = {**_tiny_config("LlamaForCausalLM"), "some_future_metadata": 1}
    with caplog.at_level(logging.WARNING, logger="segkv"):
        model_class(cfg).check_config(cfg)
    assert "some_future_metadata" in caplog.text


def test_qwen3_moe_windows_every_layer_whatever_max_window_layers():
    # transformers' Qwen3-MoE windows every layer (it has no max_window_layers); a checkpoint that
    # carries Qwen3's max_window_layers equal to the layer count must not read as "no layer windowed"
    cfg = _tiny_config("Qwen3MoeForCausalLM")
    cls = model_class(cfg)
    windowed = {**cfg, "use_sliding_window": True, "sliding_window": 16,
                "max_window_layers": cfg["num_hidden_layers"]}
    cls.check_config(windowed)
    model = cls.from_hf_config(windowed)
    assert model.sliding_window == 16 and model.layer_windows is None
    assert cls.from_hf_config({**windowed, "use_sliding_window": False}).sliding_window is None
