"""Constrained output and the other sampling extras over HTTP on the built-in default model:
response_format (json_schema, json_object), vLLM's guided choice and regex, sessions,
logit_bias, and completions' echo with prompt logprobs (prompt scoring, max_tokens 0)."""

from __future__ import annotations

import json
import math
import re

import httpx
import jsonschema
import openai
import pytest

from server_helpers import live_server
from segkv.engine import LLM, AsyncEngine
from segkv.sampling_params import SamplingParams
from segkv.server.app import create_app

MODEL = "default"
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "address": {"type": "object",
                                                  "properties": {"city": {"type": "string", "maxLength": 10},
                                                                 "zip": {"type": "integer", "minimum": 0,
                                                                         "maximum": 99999}},
                                                  "required": ["city", "zip"], "additionalProperties": False}},
     "required": ["name", "address"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": -5, "maximum": 5},
                                      "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["score"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 1000},
                                      "items": {"type": "array", "maxItems": 2,
                                                "items": {"type": "object",
                                                          "properties": {"k": {"enum": ["a", "b"]}},
                                                          "required": ["k"], "additionalProperties": False}}},
     "required": ["id", "items"], "additionalProperties": False},
]
MESSAGES = [{"role": "user", "content": "Describe a record as JSON."}]


@pytest.fixture(scope="module")
def server():
    llm = LLM(MODEL, page_size=16, num_pages=400)
    engine = AsyncEngine(llm)
    with live_server(create_app(engine, model_name=MODEL)) as base:
        yield llm, base, openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    engine.shutdown()


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_outputs_validate_at_temperature_1(server, index):
    _, _, client = server
    schema = SCHEMAS[index]
    fmt = {"type": "json_schema", "json_schema": {"name": f"s{index}", "schema": schema, "strict": True}}
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt, temperature=1,
                                         n=4, seed=index, max_tokens=200)
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
    chunks = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt,
                                            temperature=1, seed=index, max_tokens=200, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_json_object_outputs_are_json_objects(server):
    """Every output parses as an object and ends by itself: JSON mode closes what is open before
    the length limit, whatever this prose-trained model would write."""
    _, _, client = server
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1, n=8, seed=3,
                                         max_tokens=40, response_format={"type": "json_object"})
    for choice in out.choices:
        assert isinstance(json.loads(choice.message.content), dict) and choice.finish_reason == "stop"
    out = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=40, temperature=1, n=8, seed=4,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert all(isinstance(json.loads(c.text), dict) and c.finish_reason == "stop" for c in out.choices)


def test_vllm_choice_regex_and_structured_outputs(server):
    _, _, client = server
    choices = ["alpha", "beta gamma"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1, n=4, seed=1,
                                             max_tokens=20, extra_body=extra)
        assert all(c.message.content in choices for c in out.choices)
    out = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, temperature=1, n=4, seed=2,
                                    extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}"})
    assert all(re.fullmatch(r"[A-Z]{2}-[0-9]{3}", c.text) for c in out.choices)


def test_a_session_turn_takes_response_format(server):
    _, base, _ = server
    sid = httpx.post(f"{base}/v1/sessions", json={}).json()["id"]
    turn = httpx.post(f"{base}/v1/sessions/{sid}/turns", timeout=60,
                      json={"content": "JSON please", "max_tokens": 200,
                            "response_format": {"type": "json_object"}})
    assert turn.status_code == 200, turn.text
    assert isinstance(json.loads(turn.json()["message"]["content"]), dict)


def test_logit_bias_forces_and_bans_tokens(server):
    llm, _, client = server
    prompt = "The cache holds"
    token = llm.tokenizer.encode(" page", add_special_tokens=False)[0]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1, seed=0,
                                    logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert out.choices[0].text == llm.tokenizer.decode([token] * 6)
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    first = llm.tokenizer.encode(prompt)
    top = llm.generate([first], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    assert greedy.choices[0].text == llm.tokenizer.decode([top])
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                       logit_bias={str(top): -100})
    assert banned.choices[0].text != greedy.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(server):
    llm, _, client = server
    prompt = "pages segments forks"
    ids = llm.tokenizer.encode(prompt)
    expected = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=2))[0].prompt_logprobs
    out = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    choice = out.choices[0]
    assert choice.text == prompt and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == [llm.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(math.isclose(a, e.logprob, abs_tol=1e-4) for a, e in zip(lp.token_logprobs[1:], expected[1:]))
    assert all(len(top) <= 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]

    # echo and generated tokens: the prompt first, the output's tokens after it
    both = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=3,
                                     temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert both.choices[0].text == prompt + plain.choices[0].text
    assert len(both.choices[0].logprobs.tokens) == len(ids) + 3
    assert both.choices[0].logprobs.text_offset[len(ids)] == len(prompt)
    streamed = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=3, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == both.choices[0].text


def test_required_tool_calls_are_always_valid_calls(server):
    """The default model (Qwen3's family: hermes calls) at temperature 1, forced to call."""
    _, _, client = server
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": SCHEMAS[2]}},
             {"type": "function", "function": {"name": "score", "parameters": SCHEMAS[3]}}]
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=tools, tool_choice="required",
                                         temperature=1, n=8, seed=5, max_tokens=100)
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for choice in out.choices:
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
