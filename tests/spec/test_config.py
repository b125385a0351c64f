"""SpeculativeConfig: vLLM's --speculative-config keys, their defaults, a clear error for each bad input."""

from __future__ import annotations

import dataclasses
import json

import pytest

from segkv.spec.config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
EAGLE3 = {"method": "eagle3", "model": "default", "num_speculative_tokens": 3}


def test_off():
    for value in (None, "null", '{"method": "none"}', {"method": "none"}):
        assert SpeculativeConfig.parse(value) is None


def test_ngram_defaults_follow_vllm():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert config == SpeculativeConfig("ngram", 3, 5, 5)
    assert config.model is None and config.disable_by_batch_size is None
    # one size given: the other takes its value
    assert SpeculativeConfig.parse({**NGRAM, "prompt_lookup_max": 4}) == SpeculativeConfig("ngram", 3, 4, 4)
    assert SpeculativeConfig.parse({**NGRAM, "prompt_lookup_min": 2}) == SpeculativeConfig("ngram", 3, 2, 2)
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 16, "prompt_lookup_min": 1,
                                      "prompt_lookup_max": 3, "disable_by_batch_size": 8})
    assert (config.prompt_lookup_min, config.prompt_lookup_max, config.disable_by_batch_size) == (1, 3, 8)


def test_mtp_and_draft_model():
    assert SpeculativeConfig.parse({"method": "mtp"}).num_speculative_tokens == 1  # DeepSeek's one MTP layer
    assert SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 2}).num_speculative_tokens == 2
    config = SpeculativeConfig.parse({"method": "draft_model", "model": "/m/small",
                                      "num_speculative_tokens": 4})
    assert (config.model, config.num_speculative_tokens) == ("/m/small", 4)
    assert config.prompt_lookup_min is None and config.prompt_lookup_max is None


def test_a_config_parses_to_itself_and_is_frozen():
    config = SpeculativeConfig("mtp", 2)
    assert SpeculativeConfig.parse(config) is config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_speculative_tokens = 3


@pytest.mark.parametrize("config", [
    SpeculativeConfig("ngram", 3),
    SpeculativeConfig("ngram", 1, 2, 4, disable_by_batch_size=16),
    SpeculativeConfig("mtp"),
    SpeculativeConfig("mtp", 3, disable_by_batch_size=1),
    SpeculativeConfig("draft_model", 5, model="/models/draft"),
    SpeculativeConfig("eagle3", 3, model="default"),
    SpeculativeConfig("eagle3", 5, model="/heads/h", topk=8, num_draft_tokens=33),
    SpeculativeConfig("eagle3", 1, model="default", topk=16),
])
def test_describe_round_trips(config):
    described = config.describe()
    assert described["method"] == config.method
    assert described["num_speculative_tokens"] == config.num_speculative_tokens
    assert SpeculativeConfig.parse(described) == config
    assert SpeculativeConfig.parse(json.dumps(described)) == config


def test_describe_names_only_what_applies():
    assert SpeculativeConfig("mtp").describe() == {"method": "mtp", "num_speculative_tokens": 1}
    assert SpeculativeConfig("ngram", 3).describe() == {"method": "ngram", "num_speculative_tokens": 3,
                                                        "prompt_lookup_min": 5, "prompt_lookup_max": 5}


@pytest.mark.parametrize("value, message", [
    ("", "not valid JSON"),
    ("{method: ngram}", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ("3", "expected a JSON object"),
    (["ngram"], "expected a JSON object"),
    ({}, "method is required"),
    ({"num_speculative_tokens": 3}, "method is required"),
    ({"method": "eagle"}, "method must be one of mtp, ngram, draft_model"),
    ({"method": "[ngram]", "num_speculative_tokens": 3}, "method must be one of"),
    ({"method": 1}, "method must be a string"),
    ({"method": "none", "num_speculative_tokens": 3}, "method 'none' turns speculation off"),
    ({**NGRAM, "k": 3}, "unknown key(s) 'k'"),
    ({**NGRAM, "draft_tensor_parallel_size": 1}, "'draft_tensor_parallel_size'"),
    ({"method": "ngram"}, "num_speculative_tokens is required for method 'ngram'"),
    ({"method": "draft_model", "model": "/m"}, "num_speculative_tokens is required for method 'draft_model'"),
    ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens must be between 1 and 16, got 0"),
    ({**NGRAM, "num_speculative_tokens": 17}, "num_speculative_tokens must be between 1 and 16, got 17"),
    ({"method": "mtp", "num_speculative_tokens": -1}, "num_speculative_tokens must be between 1 and 16"),
    ({**NGRAM, "num_speculative_tokens": "3"}, "num_speculative_tokens must be an integer, got '3'"),
    ({**NGRAM, "num_speculative_tokens": 3.0}, "num_speculative_tokens must be an integer, got 3.0"),
    ({**NGRAM, "num_speculative_tokens": True}, "num_speculative_tokens must be an integer, got True"),
    ({**NGRAM, "prompt_lookup_min": 0}, "prompt_lookup_min must be >= 1"),
    ({**NGRAM, "prompt_lookup_max": 0}, "prompt_lookup_max must be >= 1"),
    ({**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min (4) must not exceed prompt_lookup_max (2)"),
    ({**NGRAM, "prompt_lookup_max": "5"}, "prompt_lookup_max must be an integer"),
    ({"method": "mtp", "prompt_lookup_min": 2}, "prompt_lookup_min applies to method 'ngram' only"),
    ({"method": "draft_model", "model": "/m", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
     "prompt_lookup_max applies to method 'ngram' only"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "method 'draft_model' needs model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": ""}, "method 'draft_model' needs model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": 7}, "model must be a string"),
    ({"method": "mtp", "model": "/m"}, "model applies to methods draft_model and eagle3 only, not 'mtp'"),
    ({**NGRAM, "model": "/m"}, "model applies to methods draft_model and eagle3 only"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "model": ""}, "method 'eagle3' needs model"),
    ({"method": "eagle3", "model": "default"}, "num_speculative_tokens is required for method 'eagle3'"),
    ({"method": "eagle3", "model": "default", "num_speculative_tokens": 2, "prompt_lookup_min": 2},
     "prompt_lookup_min applies to method 'ngram' only"),
    ({"method": "ngram", "num_speculative_tokens": 2, "topk": 2}, "topk applies to method 'eagle3' only, not 'ngram'"),
    ({"method": "mtp", "num_draft_tokens": 2}, "num_draft_tokens applies to method 'eagle3' only, not 'mtp'"),
    ({"method": "draft_model", "model": "/m", "num_speculative_tokens": 2, "topk": 1},
     "topk applies to method 'eagle3' only"),
    ({**EAGLE3, "topk": 0}, "topk must be between 1 and 16, got 0"),
    ({**EAGLE3, "topk": 17}, "topk must be between 1 and 16, got 17"),
    ({**EAGLE3, "topk": 2.0}, "topk must be an integer, got 2.0"),
    ({**EAGLE3, "topk": True}, "topk must be an integer, got True"),
    ({**EAGLE3, "num_draft_tokens": "8"}, "num_draft_tokens must be an integer, got '8'"),
    ({**EAGLE3, "num_draft_tokens": 3}, "num_draft_tokens must be num_speculative_tokens + 1 (4) with topk 1"),
    ({**EAGLE3, "topk": 1, "num_draft_tokens": 5}, "num_draft_tokens must be num_speculative_tokens + 1 (4)"),
    ({**EAGLE3, "topk": 4, "num_draft_tokens": 1}, "num_draft_tokens must be between 2 and 37"),
    ({**EAGLE3, "topk": 4, "num_draft_tokens": 38}, "num_draft_tokens must be between 2 and 37"),
    ({**EAGLE3, "num_speculative_tokens": 1, "topk": 4, "num_draft_tokens": 6},
     "num_draft_tokens must be between 2 and 5 (the pending token and at most 4 nodes"),
    ({**EAGLE3, "num_speculative_tokens": 5, "topk": 8, "num_draft_tokens": 66},
     "a tree of depth 5 and topk 8 has at most 264, and no tree more than 64), got 66"),
    ({**EAGLE3, "num_steps": 2}, "num_steps is another name for num_speculative_tokens; they differ (2 and 3)"),
    ({"method": "mtp", "disable_by_batch_size": 0}, "disable_by_batch_size must be >= 1, got 0"),
    ({"method": "mtp", "disable_by_batch_size": 2.5}, "disable_by_batch_size must be an integer"),
])
def test_bad_input_is_a_clear_error(value, message):
    with pytest.raises(ValueError, match="speculative config: ") as info:
        SpeculativeConfig.parse(value if not isinstance(value, dict) else json.dumps(value))
    assert message in str(info.value)
    if isinstance(value, dict):  # a dict is checked as its JSON text is
        with pytest.raises(ValueError) as info:
            SpeculativeConfig.parse(value)
        assert message in str(info.value)


def test_eagle3_takes_a_head_and_k():
    config = SpeculativeConfig.parse({"method": "eagle3", "model": "default", "num_speculative_tokens": 3})
    assert (config.method, config.model, config.num_speculative_tokens) == ("eagle3", "default", 3)
    assert (config.topk, config.num_draft_tokens) == (1, 4)  # a chain: k drafts and the pending token
    assert SpeculativeConfig.parse(config.describe()) == config


@pytest.mark.parametrize("k, topk, given, want", [
    (3, 1, 4, 4),
    (3, 4, None, 13),  # 1 + k * topk
    (1, 4, None, 5),  # one level: at most topk nodes
    (5, 8, None, 41),
    (6, 16, None, 65),  # capped: 64 nodes
    (16, 16, None, 65),
    (2, 2, 7, 7),  # 2 + 2 * 2 nodes: the whole tree
    (3, 4, 2, 2),  # one node: the best depth-1 token
    (5, 8, 65, 65),
])
def test_eagle3_tree_sizes(k, topk, given, want):
    value = {**EAGLE3, "num_speculative_tokens": k, "topk": topk}
    if given is not None:
        value["num_draft_tokens"] = given
    config = SpeculativeConfig.parse(value)
    assert (config.num_speculative_tokens, config.topk, config.num_draft_tokens) == (k, topk, want)
    assert config.describe() == {"method": "eagle3", "num_speculative_tokens": k, "topk": topk,
                                 "num_draft_tokens": want, "model": "default"}
    assert SpeculativeConfig.parse(json.dumps(config.describe())) == config


def test_num_steps_is_sglangs_name_for_k():
    config = SpeculativeConfig.parse({"method": "eagle3", "model": "default", "num_steps": 5, "topk": 8,
                                      "num_draft_tokens": 32})
    assert (config.num_speculative_tokens, config.topk, config.num_draft_tokens) == (5, 8, 32)
    assert SpeculativeConfig.parse({**EAGLE3, "num_steps": 3}) == SpeculativeConfig.parse(EAGLE3)
    assert SpeculativeConfig.parse({"method": "ngram", "num_steps": 2}).num_speculative_tokens == 2


def test_other_methods_have_no_tree_settings():
    for config in (SpeculativeConfig("ngram", 3), SpeculativeConfig("mtp"),
                   SpeculativeConfig("draft_model", 2, model="/m")):
        assert config.topk is None and config.num_draft_tokens is None
        assert "topk" not in config.describe() and "num_draft_tokens" not in config.describe()


def test_direct_construction_is_validated():
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig("none", 1)
    with pytest.raises(ValueError, match="num_speculative_tokens must be between 1 and 16"):
        SpeculativeConfig("ngram", 0)
