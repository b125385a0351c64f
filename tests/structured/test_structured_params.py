"""StructuredOutput and the new SamplingParams fields: validation on construction, clear messages."""

from __future__ import annotations

import pickle

import pytest

from segkv.sampling_params import SamplingParams, StructuredOutput

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("kwargs", [
    {"json_schema": SCHEMA}, {"json_object": True}, {"regex": r"[a-z]{3}"}, {"choice": ["yes", "no"]},
    {"grammar": 'root ::= "a" | "b"'}, {"json_schema": SCHEMA, "prefix": "<json>", "suffix": "</json>"},
])
def test_each_kind_builds_a_grammar(kwargs):
    s = StructuredOutput(**kwargs)
    assert s.kind == next(k for k in kwargs if k not in ("prefix", "suffix"))
    assert s.to_grammar() is s.to_grammar()  # cached
    params = SamplingParams(structured=s)
    assert params.constrained and params.replace(n=2).structured == s
    assert pickle.loads(pickle.dumps(params)) == params


def test_equal_constraints_share_a_key_and_property_order_is_kept():
    a = StructuredOutput(json_schema=dict(SCHEMA))
    assert a.key == StructuredOutput(json_schema=SCHEMA).key and hash(a) == hash(StructuredOutput(json_schema=SCHEMA))
    two = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}, "required": ["b", "a"]}
    assert StructuredOutput(json_schema=two).key[1].index('"b"') < StructuredOutput(json_schema=two).key[1].index('"a"')
    assert StructuredOutput(choice=["x", "y"]).choice == ("x", "y")


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({"json_schema": {"type": "objectx"}}, "invalid json_schema"),
    ({"json_schema": "not a dict"}, "JSON schema object"),
    ({"regex": "a(b"}, "invalid regex: .*parenthesis"),
    ({"regex": ""}, "non-empty"),
    ({"grammar": "root ::= undefined_rule"}, "invalid grammar: .*undefined_rule"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 3]}, "every choice"),
    ({"json_object": "yes"}, "json_object must be a bool"),
    ({"regex": "a", "prefix": 5}, "prefix must be a str"),
])
def test_bad_constraints_raise_value_error_naming_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutput(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"logit_bias": {5: 101}}, r"logit_bias\[5\] must be in \[-100, 100\]"),
    ({"logit_bias": {-1: 1}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {3: float("nan")}}, "finite"),
    ({"logit_bias": [1, 2]}, "mapping"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"prompt_logprobs": 0, "max_tokens": -1}, "max_tokens must be an integer >= 0"),
    ({"structured": {"json_object": True}}, "StructuredOutput"),
])
def test_bad_sampling_fields_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_logit_bias_is_normalised_and_checked_against_the_vocabulary():
    params = SamplingParams(logit_bias={"7": 2, 3: -100})
    assert dict(params.logit_bias) == {7: 2.0, 3: -100.0}
    params.check_vocab(8)
    with pytest.raises(ValueError, match="logit_bias token id 7 is out of the vocabulary"):
        params.check_vocab(7)
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(max_tokens=0, prompt_logprobs=3).max_tokens == 0
