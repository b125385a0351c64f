"""A schema fuzz of the HTTP API: random (valid, invalid and malformed) bodies never give a 5xx.

Every answer that is not a 2xx is a JSON body with an OpenAI ``error`` object; text with a lone
surrogate anywhere is a 400; no request hangs (the client's timeout fails the test).
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model_helpers import build_model_dir
from server_helpers import live_server
from segkv.engine import LLM, AsyncEngine
from segkv.server.app import create_app

MODEL = "fuzz"
MAX_REQUEST_BYTES = 16 * 1024  # small, so oversize bodies cost little
# text, sometimes with a lone surrogate (which json.dumps writes as a \udXXX escape)
SURROGATE_TEXT = st.builds(lambda a, code, b: a + chr(code) + b, st.text(max_size=4),
                           st.integers(0xD800, 0xDFFF), st.text(max_size=4))
TEXT = st.one_of(st.text(max_size=12), SURROGATE_TEXT)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=10)
SCHEMA = st.sampled_from([
    {"type": "object"}, {"type": "array"}, {"type": "nonsense"}, {"type": "string", "maxLength": 0},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["a"]},
    {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}},
])
TOOL = st.fixed_dictionaries(
    {"type": st.one_of(st.just("function"), SCALARS),
     "function": st.one_of(st.fixed_dictionaries({"name": st.one_of(st.sampled_from(["f", "g"]), TEXT)},
                                                 optional={"parameters": st.one_of(SCHEMA, JSON),
                                                           "description": st.one_of(TEXT, JSON)}), JSON)})
TOOL_CALL = st.fixed_dictionaries(
    {"id": st.one_of(TEXT, SCALARS), "type": st.just("function"),
     "function": st.one_of(st.fixed_dictionaries({"name": TEXT, "arguments": st.one_of(TEXT, JSON)}), JSON)})
FIELDS = {
    "model": st.one_of(st.just(MODEL), SCALARS),
    "max_tokens": st.one_of(st.integers(-5, 6), SCALARS),
    "max_completion_tokens": st.one_of(st.integers(-5, 6), SCALARS),
    "temperature": st.one_of(st.floats(-1, 3), SCALARS),
    "top_p": st.one_of(st.floats(-0.5, 1.5), SCALARS),
    "top_k": st.one_of(st.integers(-3, 50), SCALARS),
    "min_p": st.one_of(st.floats(-0.5, 1.5), SCALARS),
    "seed": st.one_of(st.integers(-2**65, 2**65), SCALARS),
    "n": st.one_of(st.integers(-1, 3), SCALARS),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), SCALARS),
    "stop_token_ids": st.one_of(st.lists(st.integers(-3, 10**6), max_size=3), SCALARS),
    "logprobs": st.one_of(st.integers(-2, 25), st.booleans(), SCALARS),
    "top_logprobs": st.one_of(st.integers(-2, 25), SCALARS),
    "presence_penalty": st.one_of(st.floats(-3, 3), SCALARS),
    "frequency_penalty": st.one_of(st.floats(-3, 3), SCALARS),
    "repetition_penalty": st.one_of(st.floats(-1, 3), SCALARS),
    "stream": st.one_of(st.booleans(), SCALARS),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), JSON),
    "prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(-5, 10**6), max_size=6),
                        st.lists(st.text(max_size=5), max_size=3), JSON),
    "messages": st.one_of(
        st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                         "content": st.one_of(st.text(max_size=20), JSON)}), max_size=3),
        st.lists(st.fixed_dictionaries({"role": st.sampled_from(["tool", "assistant"]),
                                         "content": st.one_of(st.none(), st.text(max_size=8), JSON)},
                                        optional={"tool_call_id": st.one_of(TEXT, SCALARS),
                                                  "tool_calls": st.one_of(st.lists(TOOL_CALL, max_size=2), JSON)}),
                 max_size=3),
        JSON),
    "content": st.one_of(st.text(max_size=20), SCALARS),
    "turn": st.one_of(st.integers(-2, 4), SCALARS),
    "name": st.one_of(st.text(max_size=10), SCALARS),
    "system": st.one_of(st.text(max_size=10), SCALARS),
    "user": st.one_of(TEXT, JSON),
    # tools, constraints and the sampling extras: any shape is a 200 or a 400
    "tools": st.one_of(st.lists(TOOL, max_size=3), JSON),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]),
                             st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
                                 {"name": st.one_of(st.sampled_from(["f", "g"]), TEXT)})}), JSON),
    "parallel_tool_calls": st.one_of(st.booleans(), SCALARS),
    "response_format": st.one_of(st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
                                 st.builds(lambda schema: {"type": "json_schema",
                                                           "json_schema": {"name": "x", "schema": schema}},
                                           st.one_of(SCHEMA, JSON)), JSON),
    "logit_bias": st.one_of(st.dictionaries(st.one_of(st.integers(-5, 10**6).map(str), TEXT),
                                            st.one_of(st.floats(-150, 150), SCALARS), max_size=3), JSON),
    "echo": st.one_of(st.booleans(), SCALARS),
    "guided_regex": st.one_of(st.sampled_from(["[a-c]{1,3}", "[unclosed", "(x|y)+", ""]), SCALARS),
    "guided_choice": st.one_of(st.lists(st.text(max_size=4), max_size=3), JSON),
    "structured_outputs": st.one_of(st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar"]),
                                                    st.one_of(SCHEMA, JSON), max_size=2), JSON),
}
BODY = st.one_of(st.fixed_dictionaries({}, optional=FIELDS), JSON)
# fields large enough to pass the body limit, or nearly
BIG = st.one_of(st.integers(1, 40_000).map(lambda n: "x" * n), st.integers(1, 8_000).map(lambda n: [7] * n),
                st.integers(1, 3_000).map(lambda n: [True] * n), st.integers(1, 3_000).map(lambda n: ["s"] * n))
ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/v1/sessions", "/v1/sessions/{sid}/turns",
             "/v1/sessions/{sid}/fork", "/v1/sessions/{sid}/restore", "/v1/sessions/{sid}/save",
             "/v1/sessions/load", "/v1/sessions/nope/turns"]


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz-model")
    build_model_dir(directory, "qwen3")
    engine = AsyncEngine(LLM(directory, page_size=8, num_pages=400, max_model_len=128))
    app = create_app(engine, model_name=MODEL, snapshot_dir=tmp_path_factory.mktemp("fuzz-snap"),
                     max_request_bytes=MAX_REQUEST_BYTES)
    with live_server(app) as base:
        client = httpx.Client(base_url=base, timeout=30)  # a hang fails the test
        client.sid = client.post("/v1/sessions", json={}).json()["id"]
        yield client
    engine.shutdown()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(endpoint=st.sampled_from(ENDPOINTS), body=BODY, raw=st.booleans())
def test_no_request_body_gives_a_server_error(http, endpoint, body, raw):
    url = endpoint.format(sid=http.sid)
    if isinstance(body, dict) and "max_tokens" not in body and "max_completion_tokens" not in body:
        body = {**body, "max_tokens": 2}  # keep valid requests short
    # raw: Python's repr (malformed JSON); else JSON, with NaN/Infinity where floats are not finite
    text = repr(body) if raw else json.dumps(body)
    response = http.post(url, content=text.encode(), headers={"Content-Type": "application/json"})
    check_answer(response, (url, body))
    if not raw and has_lone_surrogate(body):
        assert response.status_code == 400 and "lone surrogate" in response.json()["error"]["message"]


def has_lone_surrogate(value) -> bool:
    if isinstance(value, str):
        return any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, dict):
        return any(has_lone_surrogate(k) or has_lone_surrogate(v) for k, v in value.items())
    return isinstance(value, list) and any(has_lone_surrogate(v) for v in value)


def check_answer(response: httpx.Response, what) -> None:
    """Never a 5xx; a finished stream; an OpenAI error object for every answer that is not a 2xx."""
    if response.status_code == 200 and response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]")
    assert response.status_code < 500, (what, response.status_code, response.text[:300])
    if response.status_code >= 300:
        assert response.headers.get("content-type", "").startswith("application/json"), (what, response.text[:300])
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)


def _encode(body, how: str) -> bytes:
    """``body`` as bytes, well-formed or not: UTF-8 JSON, surrogates as raw (invalid) UTF-8, Latin-1,
    UTF-16 or nested in thousands of arrays or objects."""
    if how == "latin-1":
        return json.dumps(body, ensure_ascii=False).encode("latin-1", "replace")
    if how == "surrogatepass":
        return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    if how == "utf-16":
        return json.dumps(body).encode("utf-16")
    if how.startswith("nest"):
        depth = int(how[4:])
        return (b"[" * depth + json.dumps(body).encode() + b"]" * depth if depth % 2 else
                b'{"a":' * depth + json.dumps(body).encode() + b"}" * depth)
    return json.dumps(body).encode()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(endpoint=st.sampled_from(ENDPOINTS), body=BODY, field=st.sampled_from(sorted(FIELDS)), big=BIG,
       how=st.one_of(st.sampled_from(["utf-8", "latin-1", "surrogatepass", "utf-16", "big"]),
                     st.integers(1, 6000).map(lambda d: f"nest{d}")),
       junk=st.binary(max_size=64), chunked=st.booleans())
def test_malformed_and_oversize_bodies_give_openai_4xx_errors(http, endpoint, body, field, big, how, junk,
                                                               chunked):
    """Bytes that are not UTF-8, JSON nested past any limit, bodies over the limit (with a length
    or chunked) and fields of every size: a 4xx error body (or a 200), never a 5xx or a hang."""
    url = endpoint.format(sid=http.sid)
    if how == "big":
        body = {**(body if isinstance(body, dict) else {}), field: big, "max_tokens": 1}
    elif isinstance(body, dict):
        body = {**body, "max_tokens": 1}
    content = _encode(body, how) if how != "utf-8" or not junk else junk + _encode(body, how)
    if chunked:  # no content-length: the limit is checked as the body arrives
        def pieces(data=content):
            for start in range(0, len(data), 4096):
                yield data[start:start + 4096]
        response = http.post(url, content=pieces(), headers={"Content-Type": "application/json"})
    else:
        response = http.post(url, content=content, headers={"Content-Type": "application/json"})
    check_answer(response, (url, how, content[:200]))
    if len(content) > MAX_REQUEST_BYTES:
        assert response.status_code == 413
    elif how.startswith("nest") and int(how[4:]) >= 64:
        assert response.status_code == 400 and "levels deep" in response.json()["error"]["message"]


BAD = [  # (endpoint, extra fields, the field the 400 names): bad tool and constraint input
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                        "schema": {"type": "nonsense"}}}},
     "response_format"),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format"),
    ("chat", {"response_format": "json"}, "response_format"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "wrong"}}}}}]}, "tools"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tool_choice": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
              "response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"messages": [{"role": "tool", "content": "42"}]}, "messages"),
    ("chat", {"guided_regex": "[unclosed"}, "guided_regex"),
    ("chat", {"guided_choice": [], "max_tokens": 2}, "guided_choice"),
    ("chat", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("chat", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ("chat", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("chat", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
]


@pytest.mark.parametrize("endpoint,extra,param", BAD)
def test_bad_tools_and_constraints_are_400s_naming_the_field(http, endpoint, extra, param):
    body = {"model": MODEL, "max_tokens": 2, **({"messages": [{"role": "user", "content": "x"}]}
                                                if endpoint == "chat" else {"prompt": "x"}), **extra}
    response = http.post("/v1/chat/completions" if endpoint == "chat" else "/v1/completions", json=body)
    check_answer(response, body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
