"""The API key: a bearer token on /v1/* and the dashboard's data; health and metrics stay open."""

from __future__ import annotations

import httpx
import openai
import pytest

from model_helpers import build_model_dir
from server_helpers import live_server
from segkv.engine import LLM, AsyncEngine
from segkv.server.app import create_app

MODEL = "keyed"
KEY = "sk-test-7f3a9c"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    directory = tmp_path_factory.mktemp("api-key-model")
    build_model_dir(directory, "qwen3")
    engine = AsyncEngine(LLM(directory, page_size=8, num_pages=300, max_model_len=128))
    with live_server(create_app(engine, model_name=MODEL, api_key=KEY)) as url:
        yield url
    engine.shutdown()


def assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert KEY not in response.text


def test_the_openai_client_needs_the_right_key(base):
    right = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    out = right.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2)
    assert out.choices[0].message.role == "assistant" and out.usage.completion_tokens == 2
    assert [m.id for m in right.models.list().data] == [MODEL]
    for wrong in ("sk-wrong", KEY + "x", KEY[:-1]):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=wrong, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as err:
            client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2)
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"


def test_plain_http_without_or_with_a_wrong_key_is_refused(base):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": KEY}, {"Authorization": "Bearer"}, {"X-Api-Key": KEY}):
        for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                             ("GET", "/v1/models"), ("POST", "/v1/sessions"), ("GET", "/v1/sessions"),
                             ("POST", "/v1/sessions/load"), ("GET", "/v1/nope"), ("GET", "/dashboard/stats")):
            assert_refused(httpx.request(method, f"{base}{path}", json={}, headers=headers))
    # the key in the URL is not accepted on the API (it would end up in logs)
    assert_refused(httpx.get(f"{base}/v1/models?key={KEY}"))


def test_the_right_key_opens_the_api_and_the_sessions(base):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers=auth).status_code == 200
    lower = {"authorization": f"bearer {KEY}"}  # the scheme's case does not matter
    assert httpx.get(f"{base}/v1/models", headers=lower).status_code == 200
    sid = httpx.post(f"{base}/v1/sessions", json={}, headers=auth).json()["id"]
    turn = httpx.post(f"{base}/v1/sessions/{sid}/turns", json={"content": "hi", "max_tokens": 2}, headers=auth)
    assert turn.status_code == 200 and turn.json()["turns"] == 1
    assert_refused(httpx.get(f"{base}/v1/sessions/{sid}"))
    # with the key, other errors are answered as usual
    assert httpx.get(f"{base}/v1/nope", headers=auth).status_code == 404


def test_health_metrics_and_the_page_stay_open_but_the_dashboard_data_needs_the_key(base):
    assert httpx.get(f"{base}/health").json()["status"] == "ok"
    assert "vllm:num_requests_running" in httpx.get(f"{base}/metrics").text
    assert httpx.get(f"{base}/").status_code == 200
    assert_refused(httpx.get(f"{base}/dashboard/stats"))
    assert "num_pages" in httpx.get(f"{base}/dashboard/stats", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert "num_pages" in httpx.get(f"{base}/dashboard/stats", params={"key": KEY}).json()
    assert_refused(httpx.get(f"{base}/dashboard/stats", params={"key": "nope"}))


def test_the_dashboard_page_fetches_with_the_key_of_its_url(base):
    from playwright.sync_api import sync_playwright

    from test_dashboard import _launch

    with sync_playwright() as p:
        browser = _launch(p)
        try:
            page = browser.new_page()
            page.goto(f"{base}/?key={KEY}")
            page.wait_for_function("() => document.getElementById('num-pages').dataset.value === '300'",
                                   timeout=10_000)
            page.goto(f"{base}/")  # without the key the page says why it has no data
            page.wait_for_function("() => document.getElementById('status').textContent.includes('401')",
                                   timeout=10_000)
        finally:
            browser.close()


def test_an_empty_key_or_a_bad_limit_is_refused_at_startup():
    engine = object()  # create_app checks its arguments before it touches the engine
    for key in ("", "  "):
        with pytest.raises(ValueError, match="api_key must be a non-empty string"):
            create_app(engine, model_name=MODEL, api_key=key)
    for limit in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="max_request_bytes must be a positive integer"):
            create_app(engine, model_name=MODEL, max_request_bytes=limit)
