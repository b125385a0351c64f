"""The sessions HTTP API: turns, fork and restore at a turn, files, errors, streaming."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from model_helpers import build_model_dir
from server_helpers import live_server, slow_engine_steps
from segkv.engine import LLM, AsyncEngine
from segkv.sampling_params import SamplingParams
from segkv.server.app import create_app

TURN = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sessions-api-model")
    build_model_dir(directory, "qwen3")
    llm = LLM(directory, page_size=8, num_pages=600)
    engine = AsyncEngine(llm)
    app = create_app(engine, model_name="m", snapshot_dir=tmp_path_factory.mktemp("snapshots"))
    with live_server(app) as base:
        yield llm, httpx.Client(base_url=base, timeout=60)
    engine.shutdown()


def fresh(llm, messages) -> str:
    ids = llm.tokenizer.encode_chat(messages, add_generation_prompt=True)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    return out.outputs[0].text


def test_turns_forks_restores_and_files(server):
    llm, http = server
    pool = llm.cache.pool
    sid = http.post("/v1/sessions", json={"system": "Be brief."}).json()["id"]
    first = http.post(f"/v1/sessions/{sid}/turns", json={"content": "one", **TURN}).json()
    second = http.post(f"/v1/sessions/{sid}/turns", json={"content": "two", **TURN}).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    history = http.get(f"/v1/sessions/{sid}").json()["messages"]
    assert [m["role"] for m in history] == ["system", "user", "assistant", "user", "assistant"]
    assert second["message"]["content"] == fresh(llm, history[:3] + [{"role": "user", "content": "two"}])

    allocated = pool.pages_allocated_total
    child = http.post(f"/v1/sessions/{sid}/fork", json={"turn": 1}).json()
    restored = http.post(f"/v1/sessions/{sid}/restore", json={"turn": 1}).json()
    assert pool.pages_allocated_total == allocated  # no pages until they write
    metrics = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
               for line in http.get("/metrics").text.splitlines() if line.startswith("segkv:")}
    assert metrics["segkv:forks_total"] == 1 and metrics["segkv:restores_total"] == 1
    assert metrics["segkv:shared_segments"] >= 1  # the pinned history is shared by both sessions
    assert child["turns"] == 1 and restored["turns"] == 1
    branch = http.post(f"/v1/sessions/{child['id']}/turns", json={"content": "three", **TURN}).json()
    assert branch["message"]["content"] == fresh(llm, history[:3] + [{"role": "user", "content": "three"}])
    assert branch["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert first["finish_reason"] == "length"

    assert http.post(f"/v1/sessions/{sid}/save", json={"name": "s1"}).status_code == 200
    loaded = http.post("/v1/sessions/load", json={"name": "s1"}).json()
    assert loaded["messages"] == http.get(f"/v1/sessions/{sid}").json()["messages"]
    a = http.post(f"/v1/sessions/{sid}/turns", json={"content": "four", **TURN}).json()
    b = http.post(f"/v1/sessions/{loaded['id']}/turns", json={"content": "four", **TURN}).json()
    assert a["message"] == b["message"]


def test_streamed_turn_and_errors(server):
    llm, http = server
    sid = http.post("/v1/sessions", json={}).json()["id"]
    with http.stream("POST", f"/v1/sessions/{sid}/turns", json={"content": "hi", "stream": True, **TURN}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["finish_reason"] == "length" and "usage" in chunks[-1]
    text = "".join(c["delta"] for c in chunks)
    assert text == http.get(f"/v1/sessions/{sid}").json()["messages"][-1]["content"]

    assert http.post("/v1/sessions/nope/turns", json={"content": "x"}).status_code == 404
    assert http.post(f"/v1/sessions/{sid}/restore", json={"turn": 7}).status_code == 400
    assert http.post(f"/v1/sessions/{sid}/turns", json={"content": "x", "temperature": -1}).status_code == 400
    assert http.post(f"/v1/sessions/{sid}/turns", json={"content": "x" * 3000}).status_code == 400
    assert http.post(f"/v1/sessions/{sid}/save", json={"name": "../etc/x"}).status_code == 400
    assert http.post("/v1/sessions/load", json={"name": "missing"}).status_code == 404
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200
    assert http.delete(f"/v1/sessions/{sid}").status_code == 404


def test_a_turn_whose_client_leaves_is_aborted_and_not_recorded(server, monkeypatch):
    """A non-streaming turn whose client gives up (a read timeout) stops within a poll period:
    no turn is recorded, its pages go back, and the session takes the next turn."""
    llm, http = server
    slow_engine_steps(monkeypatch, 0.005)  # the turn's 448 steps outlast the client's patience
    sid = http.post("/v1/sessions", json={}).json()["id"]
    pages_before = llm.cache.pool.pages_in_use
    long_turn = {"content": "hi", "max_tokens": llm.max_model_len - 64, "temperature": 0, "ignore_eos": True}
    url = f"{str(http.base_url).rstrip('/')}/v1/sessions/{sid}/turns"
    with pytest.raises(httpx.ReadTimeout):  # a client of its own, whose connection closes as it gives up
        httpx.post(url, json=long_turn, timeout=httpx.Timeout(30, read=0.1))
    deadline = time.monotonic() + 5
    while http.get("/health").json()["running"] != 0 or llm.cache.pool.pages_in_use != pages_before:
        assert time.monotonic() < deadline, "the turn kept running (or its pages) after the client left"
        time.sleep(0.05)
    assert http.get(f"/v1/sessions/{sid}").json()["turns"] == 0
    assert llm.cache.pool.pages_in_use == pages_before
    reply = http.post(f"/v1/sessions/{sid}/turns", json={"content": "again", **TURN}).json()
    assert reply["turns"] == 1 and reply["finish_reason"] == "length"


def test_dashboard_is_served_with_sessions(server):
    _, http = server
    sid = http.post("/v1/sessions", json={}).json()["id"]
    page = http.get("/")
    assert page.status_code == 200 and 'id="tokens-per-s"' in page.text
    stats = http.get("/dashboard/stats").json()
    assert any(s["id"] == sid for s in stats["sessions"]) and stats["num_pages"] == 600
