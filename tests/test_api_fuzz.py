"""A schema fuzz of the HTTP API: random (valid, invalid and malformed) bodies never give a 5xx."""

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
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=12))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=10)
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
        JSON),
    "content": st.one_of(st.text(max_size=20), SCALARS),
    "turn": st.one_of(st.integers(-2, 4), SCALARS),
    "name": st.one_of(st.text(max_size=10), SCALARS),
    "system": st.one_of(st.text(max_size=10), SCALARS),
}
BODY = st.one_of(st.fixed_dictionaries({}, optional=FIELDS), JSON)
ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/v1/sessions", "/v1/sessions/{sid}/turns",
             "/v1/sessions/{sid}/fork", "/v1/sessions/{sid}/restore", "/v1/sessions/{sid}/save",
             "/v1/sessions/load", "/v1/sessions/nope/turns"]


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz-model")
    build_model_dir(directory, "qwen3")
    engine = AsyncEngine(LLM(directory, page_size=8, num_pages=400, max_model_len=128))
    app = create_app(engine, model_name=MODEL, snapshot_dir=tmp_path_factory.mktemp("fuzz-snap"))
    with live_server(app) as base:
        client = httpx.Client(base_url=base, timeout=60)
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
    if response.status_code == 200 and response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]")
    assert response.status_code < 500, (url, body, response.status_code, response.text[:300])
    if response.status_code >= 400:
        assert "error" in response.json() or "detail" in response.json()
