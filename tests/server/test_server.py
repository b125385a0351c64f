"""The OpenAI-compatible server over HTTP with the official client: outputs, usage, streams, errors."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from model_helpers import build_model_dir
from server_helpers import live_server, slow_engine_steps
from segkv.engine import LLM, AsyncEngine, QueueFullError
from segkv.sampling_params import SamplingParams
from segkv.server.app import create_app

MODEL = "tiny-qwen3"
GREEDY = dict(temperature=0, max_tokens=8, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("server-model")
    build_model_dir(directory, "qwen3")
    llm = LLM(directory, page_size=8, num_pages=600)
    llm.generator.lookahead = True  # as on a GPU: decode steps launched before the tokens are read
    engine = AsyncEngine(llm)
    app = create_app(engine, model_name=MODEL)
    with live_server(app) as base:
        yield llm, base
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key="x", max_retries=0)


def expected(llm, ids: list[int], max_tokens: int = 8) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([ids], params)[0].outputs[0].token_ids


def text_of(llm, token_ids: list[int]) -> str:
    return llm.tokenizer.decode(token_ids)


def metric(base: str, name: str) -> float:
    body = httpx.get(f"{base}/metrics").text
    lines = [line for line in body.splitlines() if line.startswith(name + "{") or line.startswith(name + " ")]
    assert lines, f"{name} missing from /metrics"
    return float(lines[0].rsplit(" ", 1)[1])


def test_completion_matches_llm_generate_and_reports_usage(server, client):
    llm, _ = server
    prompt = "pages segments forks chains"
    ids = llm.tokenizer.encode(prompt)
    out = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    assert out.choices[0].text == text_of(llm, expected(llm, ids))
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 8
    assert out.usage.total_tokens == len(ids) + 8
    by_ids = client.completions.create(model=MODEL, prompt=ids, **GREEDY)  # token-id prompts too
    assert by_ids.choices[0].text == out.choices[0].text


def test_streamed_completion_concatenates_to_the_same_text(server, client):
    llm, _ = server
    ids = llm.tokenizer.encode("merge split plans")
    chunks = list(client.completions.create(model=MODEL, prompt=ids, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == text_of(llm, expected(llm, ids))
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_chat_streaming_and_not_match_the_chat_template(server, client):
    llm, _ = server
    messages = [{"role": "user", "content": "tell me about pages"}]
    want = text_of(llm, expected(llm, llm.tokenizer.encode_chat(messages)))
    out = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert out.choices[0].message.content == want and out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(llm.tokenizer.encode_chat(messages))
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.total_tokens == out.usage.total_tokens


def test_multi_turn_chat_reuses_the_cached_history(server, client):
    llm, _ = server
    history = [{"role": "system", "content": "you plan pages and segments " * 4},
               {"role": "user", "content": "first question about chains"}]
    first = client.chat.completions.create(model=MODEL, messages=history, **GREEDY)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "and the second one"}]
    second = client.chat.completions.create(model=MODEL, messages=history, **GREEDY)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    fresh = text_of(llm, expected(llm, llm.tokenizer.encode_chat(history)))
    assert second.choices[0].message.content == fresh


def test_32_simultaneous_streams_match_one_at_a_time(server, client):
    llm, _ = server
    words = ["pages", "segments", "forks", "chains", "merge", "split", "plans", "turns"]
    prompts = [" ".join(words[(i + j) % 8] for j in range(3 + i % 5)) + f" {i}" for i in range(32)]
    alone = [text_of(llm, expected(llm, llm.tokenizer.encode(p), 12)) for p in prompts]

    def stream(prompt: str) -> str:
        chunks = client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                           **{**GREEDY, "max_tokens": 12})
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(32) as pool:
        assert list(pool.map(stream, prompts)) == alone


def test_models_health_and_metrics(server, client):
    llm, base = server
    assert [m.id for m in client.models.list().data] == [MODEL]
    client.completions.create(model=MODEL, prompt="plans turns", **GREEDY)
    health = httpx.get(f"{base}/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL and health["lse_api"] == "torch-reference"
    assert health["decode_route"] in {"single", "split", "segments", "cascade"}
    # the CPU runs every plan exact (fast pays only where the GPU's prefill programs measured faster)
    assert health["attention_precision"] == "exact" and health["precisions"]["exact"] == sum(health["routes"].values())
    assert sum(health["routes"].values()) > 0 and health["num_pages"] == 600
    assert health["running"] == 0 and health["waiting"] == 0 and health["cached_segments"] > 0
    # nothing runs and no session pins: every page in use is a cached prefix, and says so
    assert health["pages_requests"] == 0 and health["pages_cached_only"] == health["pages_in_use"] > 0
    assert health["peak_bytes_in_use"] >= health["bytes_in_use"] > 0
    body = httpx.get(f"{base}/metrics").text
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:time_per_output_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_sum", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "segkv:bytes_copied_total", "segkv:pages_in_use", 'segkv:route_steps_total{route="',
                 'segkv:decode_steps_ahead_total{model_name="'):
        assert name in body, name
    used = [line for line in body.splitlines()
            if line.startswith("segkv:decode_steps_ahead_total") and 'outcome="used"' in line]
    assert used and float(used[0].rsplit(" ", 1)[1]) > 0
    assert metric(base, "vllm:generation_tokens_total") >= 8
    assert metric(base, "vllm:e2e_request_latency_seconds_count") >= 1
    assert 0 < metric(base, "vllm:kv_cache_usage_perc") <= 1


def test_errors_are_openai_bodies_with_4xx_statuses(server, client):
    llm, base = server
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="other", prompt="x")
    assert err.value.status_code == 404 and "other" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert "temperature" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_p=0)
    assert "top_p" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[1] * (llm.max_model_len + 5))
    assert "maximum context length" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:  # streaming: rejected before the stream starts
        client.completions.create(model=MODEL, prompt=[1] * (llm.max_model_len + 5), stream=True)
    assert "maximum context length" in err.value.body["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for field, value in (("functions", [{"name": "f"}]), ("function_call", {"name": "f"})):
        response = httpx.post(f"{base}/v1/chat/completions", json={**chat, field: value})  # never ignored
        assert response.status_code == 400 and f"`{field}` is not supported" in response.text, response.text
    for field, value in (("suffix", "x"), ("best_of", 2)):
        response = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x", field: value})
        assert response.status_code == 400 and f"`{field}` is not supported" in response.text, response.text
    neutral = {"logit_bias": {}, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "user": "u"}
    assert httpx.post(f"{base}/v1/chat/completions", json={**chat, **neutral}).status_code == 200
    for n in (0, 129):  # samples per prompt: 1 to 128, as OpenAI allows
        response = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x", "n": n})
        assert response.status_code == 400 and response.json()["error"]["param"] == "n", response.text
    for body in ({"model": MODEL}, {"model": MODEL, "prompt": "x", "n": "many"},
                 {"model": MODEL, "prompt": [10 ** 9]}, {"model": MODEL, "messages": []}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        response = httpx.post(f"{base}{path}", json=body)
        assert response.status_code == 400, (body, response.text)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    response = httpx.post(f"{base}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("the request body is not valid JSON")
    for content in (b"{not json", b"[1, 2]"):  # not sent as JSON; a JSON array
        headers = {"content-type": "application/json"} if content.startswith(b"[") else {}
        response = httpx.post(f"{base}/v1/chat/completions", content=content, headers=headers)
        assert response.status_code == 400
        assert response.json()["error"]["message"].startswith("the request body must be a JSON object")


def test_client_disconnect_aborts_the_stream(server):
    llm, base = server
    body = {"model": MODEL, "prompt": "pages " * 10, "max_tokens": 480, "ignore_eos": True, "stream": True}
    finished_before = metric(base, "vllm:e2e_request_latency_seconds_count")
    pages_before = metric(base, "segkv:pages_in_use")
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{base}/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # keep a reference: dropping the iterator closes the socket
            assert next(lines).startswith("data: {")
            assert metric(base, "vllm:num_requests_running") == 1
    deadline = time.monotonic() + 5
    while metric(base, "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the request kept running after the client left"
        time.sleep(0.05)
    health = httpx.get(f"{base}/health").json()
    assert health["running"] == 0 and health["waiting"] == 0
    assert metric(base, "vllm:e2e_request_latency_seconds_count") == finished_before  # aborted, not finished
    assert metric(base, "segkv:pages_in_use") == pages_before  # its pages went back to the pool


def test_a_non_streaming_request_is_aborted_when_its_client_leaves(server, monkeypatch):
    """A client that gives up on a non-streaming answer (here: a read timeout) frees the engine:
    the request's sequences stop within a poll period, its pages go back, and nothing counts as
    finished."""
    llm, base = server
    slow_engine_steps(monkeypatch, 0.005)  # the request's 480 steps outlast the client's patience
    body = {"model": MODEL, "prompt": "pages " * 10, "n": 8, "max_tokens": 480, "ignore_eos": True}
    finished_before = metric(base, "vllm:e2e_request_latency_seconds_count")
    pages_before = metric(base, "segkv:pages_in_use")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    deadline = time.monotonic() + 5
    while metric(base, "vllm:num_requests_running") != 0 or metric(base, "segkv:pages_in_use") != pages_before:
        assert time.monotonic() < deadline, "the request kept running (or its pages) after the client left"
        time.sleep(0.05)
    assert metric(base, "vllm:e2e_request_latency_seconds_count") == finished_before  # aborted, not finished
    assert metric(base, "segkv:pages_in_use") == pages_before


def test_logprobs_n_and_several_prompts(server, client):
    llm, _ = server
    out = client.completions.create(model=MODEL, prompt=["plans", "turns pages"], n=2, logprobs=2,
                                    temperature=0, max_tokens=4, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3] and out.usage.completion_tokens == 16
    assert out.choices[0].text == out.choices[1].text  # greedy samples agree
    assert out.choices[2].text == text_of(llm, expected(llm, llm.tokenizer.encode("turns pages"), 4))
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(len(top) <= 2 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)


def test_a_full_queue_answers_503(server):
    llm, _ = server

    class FullEngine:  # the AsyncEngine surface the app uses, with a queue that is always full
        def __init__(self) -> None:
            self.llm, self.error = llm, None

        def stats(self) -> dict:
            return {}

        def add_pressure_hook(self, hook) -> None:  # sessions register here
            pass

        async def generate(self, prompt_ids, params, *, request_id=None):
            raise QueueFullError("the queue holds 1024 requests; try again later")
            yield  # an async generator, like AsyncEngine.generate

    with TestClient(create_app(FullEngine(), model_name=MODEL)) as http:
        for stream in (False, True):
            response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": stream})
            assert response.status_code == 503 and "try again" in response.json()["error"]["message"]
