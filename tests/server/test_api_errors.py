"""HTTP API errors: OpenAI error bodies for every failure, strict types, context limits, no paths."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from model_helpers import build_model_dir
from server_helpers import live_server
from segkv.engine import LLM, AsyncEngine, EngineStopped, QueueFullError, SessionStore
from segkv.server.app import DEFAULT_MAX_REQUEST_BYTES, create_app
from segkv.server.errors import echo, engine_error, safe_message

MODEL = "m"
MAX_LEN = 128
SMALL_LIMIT = 2048
JSON_TYPE = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A live app (default limits) and a second one on the same engine with a 2 KiB body limit and
    a snapshot directory the tests may remove."""
    directory = tmp_path_factory.mktemp("errors-model")
    build_model_dir(directory, "qwen3")
    llm = LLM(directory, page_size=8, num_pages=400, max_model_len=MAX_LEN)
    engine = AsyncEngine(llm)
    snapshots = tmp_path_factory.mktemp("errors-snapshots")
    fragile = tmp_path_factory.mktemp("errors-fragile")
    app = create_app(engine, model_name=MODEL, snapshot_dir=snapshots)
    small = create_app(engine, model_name=MODEL, snapshot_dir=fragile, max_request_bytes=SMALL_LIMIT)
    with live_server(app) as base, live_server(small) as small_base:
        with httpx.Client(base_url=base, timeout=30) as http, httpx.Client(base_url=small_base, timeout=30) as tiny:
            yield {"llm": llm, "engine": engine, "http": http, "small": tiny, "snapshots": snapshots,
                   "fragile": fragile, "model_dir": directory}
    engine.shutdown()


def post_raw(http: httpx.Client, path: str, content: bytes) -> httpx.Response:
    return http.post(path, content=content, headers=JSON_TYPE)


def error_of(response: httpx.Response, status: int) -> dict:
    """The OpenAI error object of ``response``, which must have ``status``."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# -- messages ------------------------------------------------------------------------------
def test_messages_drop_server_paths_and_long_echoes(tmp_path):
    assert echo("abc") == "abc" and echo("y" * 101) == "y" * 100 + "…" and echo(5) == "5"
    inside = tmp_path / "model" / "weights.safetensors"
    text = safe_message(f"cannot open {inside}: denied; see /home/someone/x.log and /usr/lib/x.so")
    assert text == "cannot open <path>: denied; see <path> and <path>"
    assert safe_message("/v1/completions and 3/4 stay") == "/v1/completions and 3/4 stay"
    assert len(safe_message("z" * 5000)) == 1001
    error = engine_error(RuntimeError(f"engine step failed: cannot read {inside}"))
    assert error.status == 500 and str(tmp_path) not in error.body["error"]["message"]
    assert engine_error(QueueFullError("full")).status == 503
    stopped = engine_error(EngineStopped("the server is shutting down"))
    assert stopped.status == 503 and stopped.body["error"]["code"] == "engine_stopped"
    assert engine_error(ValueError("bad")).body["error"] == {
        "message": "bad", "type": "invalid_request_error", "param": None, "code": None}


# -- lone surrogates ---------------------------------------------------------------------
def test_a_lone_surrogate_in_the_prompt_is_a_400(env):
    body = b'{"model":"m","prompt":"ab\\ud800cd","max_tokens":2}'
    error = error_of(post_raw(env["http"], "/v1/completions", body), 400)
    assert error["param"] == "prompt" and error["code"] == "invalid_unicode"
    assert "lone surrogate (\\ud800)" in error["message"] and "character 2" in error["message"]


def test_a_lone_surrogate_in_the_model_name_is_a_400_not_a_500(env):
    body = json.dumps({"model": "\ud800", "prompt": "x", "max_tokens": 2}).encode()
    error = error_of(post_raw(env["http"], "/v1/completions", body), 400)
    assert error["param"] == "model" and error["code"] == "invalid_unicode"


def test_a_lone_surrogate_in_a_session_system_creates_no_session(env):
    http = env["http"]
    before = len(http.get("/v1/sessions").json()["data"])
    error = error_of(post_raw(http, "/v1/sessions", json.dumps({"system": "\ud800"}).encode()), 400)
    assert error["param"] == "system"
    assert len(http.get("/v1/sessions").json()["data"]) == before


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a\udfffb"}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "\udc00"}]}]}, "messages.0.content.0.text"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x", "name": "\ud801"}]},
     "messages.0.name"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": "\ud800"}, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["ok", "\ud800"]}, "stop.1"),
    ("/v1/completions", {"model": MODEL, "prompt": ["fine", "x\ud800"]}, "prompt.1"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "user": "\ud800"}, "user"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "\ud800": 1}, "\\ud800"),
    ("/v1/sessions/{sid}/turns", {"content": "hi \ud800"}, "content"),
    ("/v1/sessions/{sid}/save", {"name": "\ud800"}, "name"),
    ("/v1/sessions/load", {"name": "\udbff"}, "name"),
])
def test_a_lone_surrogate_in_any_string_field_is_a_400_naming_it(env, path, body, param):
    http = env["http"]
    sid = http.post("/v1/sessions", json={}).json()["id"]
    response = post_raw(http, path.format(sid=sid), json.dumps({**body, "max_tokens": 2}).encode())
    error = error_of(response, 400)
    assert error["param"] == param and "lone surrogate" in error["message"]
    assert http.get(f"/v1/sessions/{sid}").json()["turns"] == 0


def test_a_surrogate_pair_is_valid_text(env):
    body = b'{"model":"m","prompt":"smile \\ud83d\\ude00","max_tokens":2}'
    assert post_raw(env["http"], "/v1/completions", body).status_code == 200


# -- echoes, bodies, routes ----------------------------------------------------------------
def test_a_megabyte_model_name_is_echoed_truncated(env):
    name = "x" * 1_000_000
    error = error_of(env["http"].post("/v1/completions", json={"model": name, "prompt": "x"}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert len(error["message"]) < 200 and "x" * 100 + "…" in error["message"]


@pytest.mark.parametrize("content, words", [
    (b'{"model":"m","prompt":"\xff\xfe\x80"}', "not valid UTF-8"),
    ('{"model": "m", "prompt": "café"}'.encode("latin-1"), "not valid UTF-8"),
    (b"[" * 5000 + b"]" * 5000, "nests JSON more than 64 levels"),
    (b'{"a":' * 5000 + b"1" + b"}" * 5000, "nests JSON more than 64 levels"),
    (b'{"model":"m","prompt":' + b"[" * 100 + b"]" * 100 + b"}", "nests JSON more than 64 levels"),
    (b'{"model":"m","prompt":"x","n":' + b"9" * 5000 + b"}", "not valid JSON"),
    (b'{"model":"m",', "not valid JSON"),
])
def test_bodies_that_are_not_utf8_json_are_400s(env, content, words):
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/sessions"):
        error = error_of(post_raw(env["http"], path, content), 400)
        assert words in error["message"], error


def test_unknown_routes_and_wrong_methods_get_openai_bodies(env):
    http = env["http"]
    error = error_of(http.post("/v1/nope", json={}), 404)
    assert error["message"] == "Invalid URL (POST /v1/nope)" and error["type"] == "invalid_request_error"
    response = http.get("/v1/completions")
    error = error_of(response, 405)
    assert error["code"] == "method_not_allowed" and response.headers["allow"] == "POST"
    assert error_of(http.put("/v1/models", json={}), 405)["message"].endswith("allowed: GET")


def test_an_unexpected_exception_is_a_json_500_without_its_text(env):
    app = create_app(env["engine"], model_name=MODEL)

    @app.get("/v1/boom")
    async def boom():
        raise RuntimeError(f"secret detail in {env['model_dir']}")

    with TestClient(app, raise_server_exceptions=False) as http:
        error = error_of(http.get("/v1/boom"), 500)
    assert error["type"] == "server_error" and "secret" not in error["message"]
    assert str(env["model_dir"]) not in error["message"]


# -- strict validation ----------------------------------------------------------------------
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize("base, field, value", [
    (CHAT, "stream", "yes"), (CHAT, "stream", 1), (COMPLETION, "max_tokens", True),
    (COMPLETION, "max_tokens", 2.0), (COMPLETION, "max_tokens", "2"), (COMPLETION, "prompt", [True, False]),
    (COMPLETION, "prompt", [[1, True]]), (COMPLETION, "prompt", [1, "x"]), (COMPLETION, "n", "2"),
    (COMPLETION, "n", True), (COMPLETION, "temperature", "1"), (COMPLETION, "temperature", True),
    (COMPLETION, "seed", 1.5), (COMPLETION, "ignore_eos", "true"), (COMPLETION, "logprobs", True),
    (COMPLETION, "stop_token_ids", [True]), (COMPLETION, "stop", [1]), (COMPLETION, "model", 7),
    (CHAT, "logprobs", 1), (CHAT, "stream_options", {"include_usage": "yes"}),
    (CHAT, "messages", [{"role": "user", "content": 5}]), (CHAT, "messages", ["hi"]),
    (CHAT, "messages", [{"role": "user", "content": [{"type": "text", "text": 5}]}]),
    (COMPLETION, "temperature", 2.5), (COMPLETION, "temperature", -0.1), (COMPLETION, "top_p", 0),
    (COMPLETION, "top_p", 1.5), (COMPLETION, "presence_penalty", 2.5), (COMPLETION, "frequency_penalty", -3),
    (COMPLETION, "min_p", 1.5), (COMPLETION, "top_k", -2), (COMPLETION, "logprobs", 21), (COMPLETION, "n", 0),
    (COMPLETION, "max_tokens", 0), (CHAT, "top_logprobs", 21),
])
def test_wrong_types_and_out_of_range_values_are_400s(env, base, field, value):
    path = "/v1/chat/completions" if "messages" in base else "/v1/completions"
    error = error_of(env["http"].post(path, json={**base, field: value}), 400)
    assert error["param"].split(".")[0] == field, error


def test_floats_take_integers_and_text_parts_join(env):
    http = env["http"]
    assert http.post("/v1/completions", json={**COMPLETION, "temperature": 1, "top_p": 1}).status_code == 200
    parts = [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]
    chat = {**CHAT, "messages": [{"role": "user", "content": parts}]}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200


def test_roles_are_checked(env):
    http = env["http"]
    robot = {**CHAT, "messages": [{"role": "robot", "content": "x"}]}
    assert error_of(http.post("/v1/chat/completions", json=robot), 400)["param"] == "messages.0.role"
    tool = {**CHAT, "messages": [{"role": "user", "content": "x"},
                                 {"role": "tool", "content": "42", "tool_call_id": "c1"}]}
    assert http.post("/v1/chat/completions", json=tool).status_code == 200  # tool results are history
    del tool["messages"][1]["tool_call_id"]
    error = error_of(http.post("/v1/chat/completions", json=tool), 400)
    assert error["param"] == "messages" and "tool_call_id" in error["message"]
    calls = {**CHAT, "messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}]}
    error = error_of(http.post("/v1/chat/completions", json=calls), 400)  # a call without a function
    assert error["param"] == "messages" and "tool_calls[0]" in error["message"]
    # developer is OpenAI's newer system role: templated as the system message
    llm = env["llm"]
    developer = {**CHAT, "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "x"}]}
    out = http.post("/v1/chat/completions", json=developer).json()
    system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}]
    assert out["usage"]["prompt_tokens"] == len(llm.tokenizer.encode_chat(system, add_generation_prompt=True))


def test_unsupported_fields_are_still_refused(env):
    response = env["http"].post("/v1/chat/completions", json={**CHAT, "functions": [{"name": "f"}]})
    error = error_of(response, 400)
    assert "`functions` is not supported" in error["message"] and error["param"] == "functions"
    response = env["http"].post("/v1/completions", json={"model": CHAT["model"], "prompt": "x",
                                                          "tools": [{"type": "function"}]})
    assert "`tools` is not supported" in error_of(response, 400)["message"]  # chat only


# -- the context length -----------------------------------------------------------------------
def test_max_tokens_beyond_the_context_is_a_400_in_vllm_words(env):
    llm, http = env["llm"], env["http"]
    messages = [{"role": "user", "content": "hello there"}]
    prompt = len(llm.tokenizer.encode_chat(messages, add_generation_prompt=True))
    error = error_of(http.post("/v1/chat/completions", json={**CHAT, "messages": messages,
                                                              "max_tokens": 10**9}), 400)
    assert error["message"] == (
        f"This model's maximum context length is {MAX_LEN} tokens. However, you requested {prompt + 10**9} "
        f"tokens ({prompt} in the messages, {10**9} in the completion). Please reduce the length of the "
        "messages or completion.")
    assert error["code"] == "context_length_exceeded"
    ids = [5] * 20
    error = error_of(http.post("/v1/completions", json={"model": MODEL, "prompt": ids,
                                                         "max_completion_tokens": MAX_LEN - 19}), 400)
    assert error["message"] == (
        f"This model's maximum context length is {MAX_LEN} tokens. However, you requested {MAX_LEN + 1} "
        f"tokens (20 in the prompt, {MAX_LEN - 19} in the completion). Please reduce the length of the "
        "prompt or completion.")
    exact = {"model": MODEL, "prompt": ids, "max_tokens": MAX_LEN - 20, "ignore_eos": True}
    out = http.post("/v1/completions", json=exact).json()  # exactly the context: allowed, all generated
    assert out["usage"]["completion_tokens"] == MAX_LEN - 20


def test_an_omitted_max_tokens_is_clamped_to_the_context(env):
    http = env["http"]
    near = {"model": MODEL, "prompt": [5] * (MAX_LEN - 5), "ignore_eos": True}
    out = http.post("/v1/completions", json=near).json()
    assert out["usage"]["completion_tokens"] == 5 and out["choices"][0]["finish_reason"] == "length"
    out = http.post("/v1/completions", json={**near, "prompt": [5] * 10}).json()
    assert out["usage"]["completion_tokens"] == 16  # the completions default
    messages = [{"role": "user", "content": "fill the context"}]
    out = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "ignore_eos": True}).json()
    assert out["usage"]["total_tokens"] == MAX_LEN and out["choices"][0]["finish_reason"] == "length"
    error = error_of(http.post("/v1/completions", json={**near, "prompt": [5] * MAX_LEN}), 400)
    assert error["message"].startswith(f"This model's maximum context length is {MAX_LEN} tokens.")


def test_a_session_turn_is_checked_against_the_context(env):
    http = env["http"]
    sid = http.post("/v1/sessions", json={}).json()["id"]
    error = error_of(http.post(f"/v1/sessions/{sid}/turns", json={"content": "x", "max_tokens": 10**9}), 400)
    assert error["message"].startswith(f"This model's maximum context length is {MAX_LEN} tokens.")
    assert "in the messages" in error["message"]
    reply = http.post(f"/v1/sessions/{sid}/turns", json={"content": "hi", "ignore_eos": True}).json()
    assert reply["usage"]["total_tokens"] == MAX_LEN  # the default 128 clamped to the room left
    assert reply["finish_reason"] == "length"


# -- size limits --------------------------------------------------------------------------------
def test_oversize_bodies_are_413s_with_and_without_a_length(env):
    assert DEFAULT_MAX_REQUEST_BYTES == 16 * 1024 * 1024
    small = env["small"]
    big = json.dumps({"model": MODEL, "prompt": "x" * SMALL_LIMIT}).encode()
    error = error_of(post_raw(small, "/v1/completions", big), 413)
    assert error["code"] == "request_too_large" and str(SMALL_LIMIT) in error["message"]

    def chunks():  # no content-length: a chunked body, counted as it arrives
        yield b'{"model": "m", "prompt": "'
        for _ in range(SMALL_LIMIT // 100 + 1):
            yield b"x" * 100
        yield b'"}'

    assert error_of(small.post("/v1/completions", content=chunks(), headers=JSON_TYPE), 413)
    fits = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1, "user": "u" * 1000}).encode()
    assert post_raw(small, "/v1/completions", fits).status_code == 200


def test_an_oversize_body_on_the_default_limit(env):
    body = b'{"model": "m", "prompt": "' + b"x" * DEFAULT_MAX_REQUEST_BYTES + b'"}'
    assert error_of(post_raw(env["http"], "/v1/completions", body), 413)["code"] == "request_too_large"


# -- sessions: files, streams, a stopping engine ---------------------------------------------
def test_loading_a_directory_name_is_a_4xx_without_a_path(env):
    http, snapshots = env["http"], env["snapshots"]
    (snapshots / "folder.segkv").mkdir()
    response = http.post("/v1/sessions/load", json={"name": "folder"})
    assert 400 <= response.status_code < 500
    assert str(snapshots) not in response.text and "'folder'" in error_of(response, 400)["message"]
    error = error_of(http.post("/v1/sessions/load", json={"name": "nothing"}), 404)
    assert error["message"] == "no saved session named 'nothing'"
    (snapshots / "junk.segkv").write_bytes(b"not a snapshot")
    response = http.post("/v1/sessions/load", json={"name": "junk"})
    assert str(snapshots) not in response.text and error_of(response, 400)["param"] == "name"


def test_saving_into_a_vanished_directory_is_a_json_error_without_a_path(env):
    small, fragile = env["small"], env["fragile"]
    sid = small.post("/v1/sessions", json={}).json()["id"]
    assert small.post(f"/v1/sessions/{sid}/turns", json={"content": "hi", "max_tokens": 2}).status_code == 200
    shutil.rmtree(fragile)
    response = small.post(f"/v1/sessions/{sid}/save", json={"name": "kept"})
    error = error_of(response, 500)
    assert error["type"] == "server_error" and "'kept'" in error["message"]
    assert str(fragile) not in response.text and "/tmp" not in response.text


def test_no_error_names_a_server_path(env):
    http = env["http"]
    sid = http.post("/v1/sessions", json={}).json()["id"]
    answers = [
        http.post("/v1/sessions/load", json={"name": "folder"}),
        http.post("/v1/sessions/load", json={"name": "missing"}),
        http.post("/v1/sessions/load", json={"name": "junk"}),
        http.post(f"/v1/sessions/{sid}/save", json={"name": "empty"}),  # no turn yet
        http.post(f"/v1/sessions/{sid}/save", json={"name": "../../etc/passwd"}),
        http.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]}),
    ]
    secrets = [str(env["snapshots"]), str(env["model_dir"]), str(Path.cwd()), os.path.expanduser("~")]
    for response in answers:
        assert 400 <= response.status_code < 500, response.text
        error_of(response, response.status_code)
        assert not [s for s in secrets if s in response.text], response.text
    assert "/etc/passwd" not in answers[-1].text


def test_a_failing_session_stream_ends_with_an_error_event(env, monkeypatch):
    http = env["http"]
    say = SessionStore.say

    async def failing_say(self, session_id, text, params, **kwargs):  # one real update, then the server stops
        stream = say(self, session_id, text, params, **kwargs)
        try:
            yield await stream.__anext__()
        finally:
            await stream.aclose()
        raise EngineStopped("the server is shutting down")

    monkeypatch.setattr(SessionStore, "say", failing_say)
    sid = http.post("/v1/sessions", json={}).json()["id"]
    with http.stream("POST", f"/v1/sessions/{sid}/turns",
                     json={"content": "hi", "stream": True, "max_tokens": 8, "ignore_eos": True}) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable_error" and error["code"] == "engine_stopped"
    assert "delta" in json.loads(events[0])


def test_a_stopped_engine_answers_503(env):
    llm = env["llm"]

    class StoppedEngine:  # the AsyncEngine surface the app uses, after shutdown began
        def __init__(self) -> None:
            self.llm, self.error = llm, None

        def stats(self) -> dict:
            return {"bytes_in_use": 0}

        def add_pressure_hook(self, hook) -> None:
            pass

        async def generate(self, prompt_ids, params, *, request_id=None):
            raise EngineStopped("the server is shutting down")
            yield  # an async generator, like AsyncEngine.generate

    with TestClient(create_app(StoppedEngine(), model_name=MODEL)) as http:
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            for stream in (False, True):
                error = error_of(http.post(path, json={**body, "stream": stream}), 503)
                assert error["type"] == "service_unavailable_error" and error["code"] == "engine_stopped"
        sid = http.post("/v1/sessions", json={}).json()["id"]
        error = error_of(http.post(f"/v1/sessions/{sid}/turns", json={"content": "hi"}), 503)
        assert error["code"] == "engine_stopped" and "shutting down" in error["message"]
