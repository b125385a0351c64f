"""Speculative decoding over HTTP: the same greedy outputs as a server without it (streamed or not,
stops, lengths, logprobs, mixed with requests that opt out), /health, /metrics and the dashboard."""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from server_helpers import live_server
from segkv.engine import LLM, AsyncEngine
from segkv.server.app import create_app

MODEL = "default"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Prompts whose continuations repeat what came before, so the n-gram proposer finds drafts
PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor i in",
    "import os\nimport sys\nimport os\nimport sys\nimport",
]
GREEDY = dict(temperature=0, max_tokens=24)
IGNORE_EOS = {"ignore_eos": True}
SPEC_METRICS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                "vllm:spec_decode_num_accepted_tokens_total")


def _serve(**kw):
    llm = LLM(MODEL, dtype="float32", device="cpu", **kw)
    engine = AsyncEngine(llm)
    return llm, engine, create_app(engine, model_name=MODEL)


@pytest.fixture(scope="module")
def servers():
    """A speculative server and a plain one on the same model: (spec llm, spec url, plain url)."""
    spec_llm, spec_engine, spec_app = _serve(speculative_config=NGRAM)
    _, plain_engine, plain_app = _serve()
    with live_server(spec_app) as spec_base, live_server(plain_app) as plain_base:
        yield spec_llm, spec_base, plain_base
    spec_engine.shutdown()
    plain_engine.shutdown()


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def spec(servers):
    return _client(servers[1])


@pytest.fixture(scope="module")
def plain(servers):
    return _client(servers[2])


def metrics_of(base: str) -> dict[str, float]:
    """Every sample of /metrics: ``name{labels}`` (or ``name``) -> value."""
    samples = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def sample(samples: dict[str, float], name: str) -> float:
    (value,) = [v for k, v in samples.items() if k == name or k.startswith(name + "{")]
    return value


def drafts(llm) -> int:
    return llm.generator.spec_stats.drafts


def test_completions_streamed_and_not_equal_the_plain_server_with_usage(servers, spec, plain):
    llm, _, _ = servers
    before = drafts(llm)
    for prompt in PROMPTS:
        expected = plain.completions.create(model=MODEL, prompt=prompt, extra_body=IGNORE_EOS, **GREEDY)
        whole = spec.completions.create(model=MODEL, prompt=prompt, extra_body=IGNORE_EOS, **GREEDY)
        chunks = list(spec.completions.create(model=MODEL, prompt=prompt, stream=True, extra_body=IGNORE_EOS,
                                              stream_options={"include_usage": True}, **GREEDY))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert streamed == whole.choices[0].text == expected.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] \
            == ["length"]
        usage = chunks[-1].usage
        assert usage is not None and not chunks[-1].choices
        assert usage.prompt_tokens == len(llm.tokenizer.encode(prompt)) == whole.usage.prompt_tokens
        assert usage.completion_tokens == whole.usage.completion_tokens == GREEDY["max_tokens"]
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert drafts(llm) > before, "the prompts repeat themselves: the proposer must have drafted"


def test_chat_streamed_and_not_equal_the_plain_server_with_usage(servers, spec, plain):
    llm, _, _ = servers
    messages = [{"role": "user", "content": PROMPTS[0]}]
    before = drafts(llm)
    expected = plain.chat.completions.create(model=MODEL, messages=messages, extra_body=IGNORE_EOS, **GREEDY)
    whole = spec.chat.completions.create(model=MODEL, messages=messages, extra_body=IGNORE_EOS, **GREEDY)
    chunks = list(spec.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                               extra_body=IGNORE_EOS, stream_options={"include_usage": True},
                                               **GREEDY))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content == expected.choices[0].message.content
    usage = chunks[-1].usage
    assert usage.prompt_tokens == expected.usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens == GREEDY["max_tokens"]
    assert drafts(llm) > before


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 5, 7, 11])
def test_max_tokens_is_never_exceeded(spec, plain, max_tokens):
    for stream in (False, True):
        kw = dict(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=max_tokens, logprobs=0)
        expected = plain.completions.create(**kw)
        if stream:
            chunks = list(spec.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            tokens = [t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens]
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            used = chunks[-1].usage.completion_tokens
        else:
            out = spec.completions.create(**kw)
            tokens, text = out.choices[0].logprobs.tokens, out.choices[0].text
            used = out.usage.completion_tokens
        assert len(tokens) == used <= max_tokens
        assert text == expected.choices[0].text and used == expected.usage.completion_tokens


def test_a_stop_string_ends_the_text_as_without_speculation(spec, plain):
    unstopped = dict(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=40, extra_body=IGNORE_EOS)
    full = plain.completions.create(**unstopped).choices[0].text
    for stop in ("b\n", " -= b", ["zzz", "as"]):
        kw = {**unstopped, "stop": stop}
        expected = plain.completions.create(**kw)
        got = spec.completions.create(**kw)
        streamed = "".join(c.choices[0].text for c in spec.completions.create(stream=True, **kw) if c.choices)
        assert got.choices[0].text == streamed == expected.choices[0].text
        assert got.choices[0].finish_reason == expected.choices[0].finish_reason == "stop"
        stops = [stop] if isinstance(stop, str) else stop
        text = got.choices[0].text
        assert len(text) < len(full) and full.startswith(text) and not any(x in text for x in stops)


def test_logprobs_are_plain_decodings(spec, plain):
    kw = dict(model=MODEL, prompt=PROMPTS[1], temperature=0, max_tokens=20, logprobs=2,
              extra_body=IGNORE_EOS)
    expected = plain.completions.create(**kw).choices[0].logprobs
    got = spec.completions.create(**kw).choices[0].logprobs
    assert got.tokens == expected.tokens
    for a, b in zip(got.token_logprobs, expected.token_logprobs, strict=True):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4), (a, b)
    for a, b in zip(got.top_logprobs, expected.top_logprobs, strict=True):
        assert a.keys() == b.keys()
        assert all(math.isclose(a[t], b[t], rel_tol=1e-4, abs_tol=1e-4) for t in a)
    chat = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[2]}], temperature=0,
                max_tokens=16, logprobs=True, top_logprobs=2, extra_body=IGNORE_EOS)
    want = plain.chat.completions.create(**chat).choices[0].logprobs.content
    chunks = list(spec.chat.completions.create(stream=True, **chat))
    got = [item for c in chunks if c.choices and c.choices[0].logprobs
           for item in c.choices[0].logprobs.content]
    assert [x.token for x in got] == [x.token for x in want]
    assert all(math.isclose(x.logprob, y.logprob, rel_tol=1e-4, abs_tol=1e-4) for x, y in zip(got, want))


def test_speculative_and_opted_out_requests_in_one_batch_give_plain_greedy_tokens(servers, spec, plain):
    def kw(prompt: str, speculative: bool | None) -> dict:
        body = dict(IGNORE_EOS) if speculative is None else {**IGNORE_EOS, "speculative": speculative}
        return dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=32, extra_body=body)

    jobs = [(p, s) for p in PROMPTS for s in (None, False, True)]
    expected = {p: plain.completions.create(**kw(p, None)).choices[0].text for p in PROMPTS}
    start = threading.Barrier(len(jobs))

    def run(job):
        start.wait()
        return spec.completions.create(**kw(*job)).choices[0].text

    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(run, jobs))
    assert texts == [expected[p] for p, _ in jobs]


def test_an_opted_out_request_draws_no_drafts(servers, spec):
    llm, base, _ = servers
    before = drafts(llm)
    out = spec.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=16,
                                  extra_body={**IGNORE_EOS, "speculative": False})
    assert out.usage.completion_tokens == 16
    chat = spec.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                        temperature=0, max_tokens=16,
                                        extra_body={**IGNORE_EOS, "speculative": False})
    assert chat.usage.completion_tokens == 16
    session = httpx.post(f"{base}/v1/sessions", json={}).json()
    turn = httpx.post(f"{base}/v1/sessions/{session['id']}/turns",
                      json={"content": PROMPTS[0], "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                            "speculative": False}, timeout=60)
    assert turn.status_code == 200 and turn.json()["usage"]["completion_tokens"] == 16
    assert drafts(llm) == before
    turn = httpx.post(f"{base}/v1/sessions/{session['id']}/turns",
                      json={"content": PROMPTS[0], "max_tokens": 16, "temperature": 0, "ignore_eos": True},
                      timeout=60)
    assert turn.status_code == 200 and drafts(llm) > before  # a session turn speculates by default


def test_health_names_the_method_and_k(servers):
    _, spec_base, plain_base = servers
    health = httpx.get(f"{spec_base}/health").json()
    assert health["speculative"] == NGRAM
    assert health["speculative"]["method"] == "ngram" and health["speculative"]["num_speculative_tokens"] == 3
    assert httpx.get(f"{plain_base}/health").json()["speculative"] is None


def test_metrics_carry_vllms_spec_decode_counters(servers, spec):
    llm, spec_base, plain_base = servers
    spec.completions.create(model=MODEL, prompt=PROMPTS[2], extra_body=IGNORE_EOS, **GREEDY)
    samples = metrics_of(spec_base)
    num_drafts, draft_tokens, accepted = (sample(samples, name) for name in SPEC_METRICS)
    assert num_drafts > 0 and 0 < accepted <= draft_tokens <= 3 * num_drafts
    per_pos_name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    per_pos = {k: v for k, v in samples.items() if k.startswith(per_pos_name + "{")}
    assert sorted(per_pos) == [f'{per_pos_name}{{model_name="{MODEL}",position="{j}"}}' for j in range(3)]
    counts = [per_pos[k] for k in sorted(per_pos)]
    assert sum(counts) == accepted and counts == sorted(counts, reverse=True) and counts[0] <= num_drafts
    stats = llm.generator.spec_stats
    assert (stats.drafts, stats.draft_tokens, stats.accepted_tokens) == (num_drafts, draft_tokens, accepted)
    assert not any(k.startswith("vllm:spec_decode") for k in metrics_of(plain_base)), "off: no spec counters"
    dash = httpx.get(f"{spec_base}/dashboard/stats").json()["speculative"]
    assert dash["acceptance_rate"] == pytest.approx(accepted / draft_tokens)
    assert dash["mean_accepted_length"] == pytest.approx(1 + accepted / num_drafts)
    assert httpx.get(f"{plain_base}/dashboard/stats").json()["speculative"] is None


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": MODEL, "prompt": "x", "speculative": "yes"}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "speculative": 1}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "speculative": "false"}),
])
def test_a_speculative_value_that_is_not_a_bool_is_a_400(servers, path, body):
    response = httpx.post(f"{servers[1]}{path}", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == "speculative"


def test_a_session_turn_with_a_bad_speculative_value_is_a_400(servers):
    base = servers[1]
    session = httpx.post(f"{base}/v1/sessions", json={}).json()
    response = httpx.post(f"{base}/v1/sessions/{session['id']}/turns",
                          json={"content": "x", "speculative": "yes"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "speculative"


def test_the_dashboard_shows_the_acceptance_rate_in_a_browser(servers, spec):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        pytest.fail(f"the dashboard test needs the playwright package: {exc}")
    from test_dashboard import _launch

    _, spec_base, plain_base = servers
    spec.completions.create(model=MODEL, prompt=PROMPTS[0], extra_body=IGNORE_EOS, **GREEDY)
    with sync_playwright() as p:
        browser = _launch(p)
        try:
            page = browser.new_page()
            page.goto(f"{plain_base}/")
            page.wait_for_function("() => document.getElementById('status').dataset.updated !== ''")
            assert not page.is_visible("#spec-card"), "speculation off: no card"
            page.goto(f"{spec_base}/")
            page.wait_for_function("() => document.getElementById('spec-drafts').dataset.updated !== ''")
            stats = httpx.get(f"{spec_base}/dashboard/stats").json()["speculative"]
            assert page.is_visible("#spec-card")
            assert page.text_content("#spec-method") == "ngram (k=3)"
            rate = float(page.get_attribute("#spec-acceptance-rate", "data-value"))
            assert rate == pytest.approx(stats["acceptance_rate"]) and 0 < rate <= 1
            assert page.text_content("#spec-acceptance-rate") == f"{100 * rate:.1f}%"
            length = float(page.get_attribute("#spec-mean-accepted-length", "data-value"))
            assert length == pytest.approx(stats["mean_accepted_length"]) and 1 < length <= 4
        finally:
            browser.close()
