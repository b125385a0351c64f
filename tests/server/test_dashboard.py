"""The live dashboard in a real browser: self-contained page, numbers that follow the engine."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest
from fastapi import FastAPI

from model_helpers import build_model_dir
from server_helpers import live_server, slow_engine_steps
from segkv.engine import LLM, AsyncEngine
from segkv.sampling_params import SamplingParams
from segkv.server.dashboard import dashboard_router

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
STATS_KEYS = {"num_pages", "page_size", "pages_in_use", "bytes_in_use", "peak_pages_in_use",
              "peak_bytes_in_use", "bytes_copied", "running", "waiting", "preemptions", "prefix", "routes",
              "decode_tokens_per_s", "ttft_seconds_p50", "requests_finished", "steps", "pages_requests",
              "pages_cached_only", "model", "max_model_len", "uptime_seconds"}
MODEL_NAME = "tiny-qwen3-for-the-dashboard"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dashboard-model")
    build_model_dir(directory, "qwen3")
    engine = AsyncEngine(LLM(directory, page_size=8, num_pages=600))
    app = FastAPI()
    app.include_router(dashboard_router(engine.live_stats, model_name=MODEL_NAME,
                                        max_model_len=engine.llm.max_model_len, started=time.time() - 3725))
    with live_server(app) as base:
        yield engine, base
    engine.shutdown()


def run_requests(engine: AsyncEngine, prompts: list[list[int]], max_tokens: int) -> list[int]:
    """Generate ``prompts`` concurrently on a fresh event loop; return each one's token count."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    async def one(ids: list[int]) -> int:
        last = None
        async for update in engine.generate(ids, params):
            last = update
        assert last is not None and last.finished
        return len(last.output.outputs[0].token_ids)

    async def all_of() -> list[int]:
        return list(await asyncio.gather(*(one(p) for p in prompts)))

    return asyncio.run(all_of())


def test_stats_json_and_self_contained_page(served):
    engine, base = served
    stats = httpx.get(f"{base}/dashboard/stats").json()
    assert STATS_KEYS <= stats.keys()
    assert stats["num_pages"] == 600 and stats["page_size"] == 8
    assert stats["model"] == MODEL_NAME and stats["max_model_len"] == engine.llm.max_model_len > 0
    assert 3725 <= stats["uptime_seconds"] < 3725 + 600
    page = httpx.get(f"{base}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert not re.search(r"https?://", page.text), "the page must reference no other host"
    assert not re.search(r"<(link|script|img)[^>]+(src|href)=\"(?!data:)", page.text), "no external assets"
    for element_id in ("tokens-per-s", "ttft-ms", "requests-running", "requests-waiting", "requests-finished",
                       "pages-in-use", "num-pages", "bytes-in-use", "peak-bytes-in-use", "routes",
                       "preemptions", "prefix-hit-tokens", "sparkline", "sessions", "model", "max-model-len",
                       "uptime", "pages-requests", "pages-pinned", "pages-cached"):
        assert f'id="{element_id}"' in page.text, element_id


def _launch(playwright):
    try:
        return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
    except Exception as exc:  # noqa: BLE001 - a broken browser is a failure here, never a skip
        pytest.fail(f"Chromium could not start ({CHROMIUM}); the dashboard test needs a browser: {exc}")


def test_dashboard_updates_live_in_a_browser(served, monkeypatch):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        pytest.fail(f"the dashboard test needs the playwright package: {exc}")
    engine, base = served
    llm = engine.llm
    words = ["pages", "segments", "forks", "chains", "merge", "split", "plans", "turns"]
    prompts = [llm.tokenizer.encode(" ".join(words[(i + j) % 8] for j in range(4 + i))) for i in range(12)]
    finished_before = engine.live_stats()["requests_finished"]

    with sync_playwright() as p:
        browser = _launch(p)
        try:
            page = browser.new_page()
            foreign, failed, console_errors = [], [], []
            page.on("request", lambda r: None if r.url.startswith(base) else foreign.append(r.url))
            page.on("requestfailed", lambda r: failed.append(f"{r.url}: {r.failure}"))
            page.on("response", lambda r: failed.append(f"{r.url}: {r.status}") if r.status >= 400 else None)
            page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: console_errors.append(str(e)))
            page.goto(f"{base}/")
            page.wait_for_function("() => document.getElementById('num-pages').dataset.value === '600'",
                                   timeout=10_000)

            counts: list[int] = []
            slow_engine_steps(monkeypatch, 0.05)  # each wave spans polls, whatever the machine's speed
            waves = [prompts[i::3] for i in range(3)]  # three waves of concurrent requests: a few seconds
            worker = threading.Thread(
                target=lambda: [counts.extend(run_requests(engine, wave, 30)) for wave in waves])
            worker.start()
            seen_tps, seen_pages, seen_request_pages, stamps = 0.0, 0, 0, set()
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline and (worker.is_alive() or seen_tps <= 0 or len(stamps) < 3):
                seen_tps = max(seen_tps, float(page.get_attribute("#tokens-per-s", "data-value") or 0))
                seen_pages = max(seen_pages, int(page.get_attribute("#pages-in-use", "data-value") or 0))
                seen_request_pages = max(seen_request_pages,
                                         int(page.get_attribute("#pages-requests", "data-value") or 0))
                stamps.add(page.get_attribute("#tokens-per-s", "data-updated"))
                time.sleep(0.1)
            worker.join(timeout=30)
            assert not worker.is_alive(), "generation did not finish"
            assert counts == [30] * len(prompts)
            assert seen_tps > 0, "tokens/s never rose above zero while generating"
            assert seen_pages > 0, "pages in use never rose above zero while generating"
            assert seen_request_pages > 0, "pages of running requests never rose above zero while generating"
            assert len(stamps) >= 3, "the page did not refresh while generating"

            want = finished_before + len(prompts)
            page.wait_for_function("(n) => document.getElementById('requests-finished').textContent == n",
                                   arg=want, timeout=10_000)
            stats = engine.stats()  # nothing runs now: these numbers hold still
            t0 = page.evaluate("() => Date.now()")  # wait for a poll that began after the snapshot
            page.wait_for_function("(t0) => Number(document.getElementById('status').dataset.asked) > t0",
                                   arg=t0, timeout=10_000)
            assert page.text_content("#pages-in-use") == str(stats["pages_in_use"])
            assert page.text_content("#num-pages") == str(stats["num_pages"]) == "600"
            assert page.get_attribute("#bytes-in-use", "data-value") == str(stats["bytes_in_use"])
            assert page.get_attribute("#peak-bytes-in-use", "data-value") == str(stats["peak_bytes_in_use"])
            assert int(page.get_attribute("#peak-pages-in-use", "data-value")) >= seen_pages
            assert page.text_content("#requests-running") == "0"
            # nothing runs: every page in use is a cached prefix, labelled evictable, none a request's
            assert stats["pages_requests"] == 0 and stats["pages_cached_only"] == stats["pages_in_use"] > 0
            assert page.text_content("#pages-requests") == "0"
            assert page.text_content("#pages-pinned") == "0"
            assert page.text_content("#pages-cached") == str(stats["pages_in_use"])
            labels = page.text_content("#pages-cached").join(
                [page.text_content(f"#pages-{k} >> xpath=..") for k in ("requests", "cached")])
            assert "running requests" in labels and "cached prefixes (evictable)" in labels
            # the header: the model, its context length and the server's uptime (started 1h 02m 05s ago)
            assert page.text_content("#model") == MODEL_NAME
            assert page.get_attribute("#max-model-len", "data-value") == str(engine.llm.max_model_len)
            assert page.text_content("#max-model-len") == f"{engine.llm.max_model_len:,}"
            assert page.text_content("#uptime") in ("1h 02m", "1h 03m")
            assert page.text_content("#prefix-hit-tokens") == str(stats["prefix"]["num_hit_tokens"])
            single = page.text_content('#routes tr[data-key="single"] td:nth-child(2)')
            assert int(single) == stats["routes"]["single"] > 0
            assert float(page.get_attribute("#pages-bar", "data-value")) == pytest.approx(
                100 * stats["pages_in_use"] / stats["num_pages"], abs=0.05)
            points = page.get_attribute("#sparkline-line", "points").split()
            assert 3 <= len(points) <= 60
            assert not page.is_visible("#sessions-card"), "no sessions in the stats: no sessions table"
            sessions = page.evaluate("""() => {
                render({num_pages: 600, pages_in_use: 3, routes: {}, prefix: {}, decode_tokens_per_s: 0,
                        sessions: [{id: "s-1", turns: 4, messages: 9, segments: 2, peak_turn_bytes: 3 * 1024 * 1024,
                                    idle_seconds: 75.5},
                                   {id: "s-2", turns: 1, messages: 3, segments: 1, peak_turn_bytes: 1024,
                                    idle_seconds: 2}]},
                       Date.now());
                return [...document.querySelectorAll('#sessions tr')].map(
                    (tr) => [...tr.children].map((td) => td.textContent));
            }""")
            assert sessions == [["s-2", "1", "3", "1", "1.0 KiB", "2s"],  # most recently used first
                                ["s-1", "4", "9", "2", "3.0 MiB", "1m 15s"]]
            assert page.is_visible("#sessions-card")
            assert page.text_content("#sessions-count") == "2"
            # long ids and big numbers stay on one line each and inside the card (ellipsis, fixed columns)
            layout = page.evaluate("""() => {
                const long = "sess-" + "0123456789abcdef".repeat(8);
                render({num_pages: 600, pages_in_use: 3, routes: {}, prefix: {}, decode_tokens_per_s: 0,
                        sessions: Array.from({length: 30}, (_, i) => ({id: long + i, turns: 123456,
                            messages: 987654, segments: 55555, peak_turn_bytes: 1.5e15, idle_seconds: 9e6 + i}))},
                       Date.now());
                const card = document.getElementById("sessions-card"), trs = [...document.querySelectorAll("#sessions tr")];
                const cell = trs[0].children[0];
                return {heights: [...new Set(trs.map((tr) => tr.getBoundingClientRect().height))],
                        line: parseFloat(getComputedStyle(cell).lineHeight), rows: trs.length,
                        cardWidth: card.clientWidth, contentWidth: card.scrollWidth,
                        clipped: cell.scrollWidth > cell.clientWidth, cardHeight: card.getBoundingClientRect().height};
            }""")
            assert layout["rows"] == 30
            assert len(layout["heights"]) == 1 and layout["heights"][0] < 2 * layout["line"], layout
            assert layout["contentWidth"] <= layout["cardWidth"], "the sessions table overflows its card"
            assert layout["clipped"], "a long session id is cut with an ellipsis, not wrapped"
            assert layout["cardHeight"] < 400, "a long list scrolls inside the card"
            # the KV tiers' card: hidden without tiers, else segments, bytes and hits per tier and the rates
            assert not page.is_visible("#tiers-card"), "no KV tiers in the stats: no tiers card"
            tiers = page.evaluate("""() => {
                render({num_pages: 600, pages_in_use: 3, routes: {}, prefix: {}, decode_tokens_per_s: 0,
                        kv_tiers: {host_segments: 7, host_bytes: 3 * 1024 * 1024, host_capacity: 4 * 1024 ** 3,
                                   host_hits: 12, disk_segments: 2, disk_bytes: 2048, disk_capacity: 1024 ** 4,
                                   disk_hits: 1, misses: 3, recomputed_rows: 0, to_host_bytes_per_s: 5 * 1024 ** 3,
                                   from_host_bytes_per_s: 20 * 1024 ** 3, to_disk_bytes_per_s: 0,
                                   from_disk_bytes_per_s: 1536}},
                       Date.now());
                return [...document.querySelectorAll('#tiers tr')].map(
                    (tr) => [...tr.children].map((td) => td.textContent));
            }""")
            assert tiers == [["host", "7", "3.0 MiB / 4.0 GiB", "12"], ["disk", "2", "2.0 KiB / 1.0 TiB", "1"]]
            assert page.is_visible("#tiers-card")
            assert [page.text_content(f"#tiers-{k}") for k in ("misses", "recomputed", "rate-to-host",
                    "rate-from-host", "rate-to-disk", "rate-from-disk")] == [
                "3", "0", "5.0 GiB/s", "20.0 GiB/s", "\u2013", "1.5 KiB/s"]
            assert not foreign, f"requests to other hosts: {foreign}"
            assert not failed, f"failed requests: {failed}"
            assert not console_errors, f"console errors: {console_errors}"
        finally:
            browser.close()


def test_app_names_the_model_and_tells_session_pins_from_cached_pages(served):
    from fastapi.testclient import TestClient

    from segkv.server.app import create_app

    engine, _ = served
    with TestClient(create_app(engine, model_name="served-name")) as client:
        before = client.get("/dashboard/stats").json()
        assert before["model"] == "served-name" and before["max_model_len"] == engine.llm.max_model_len
        assert 0 <= before["uptime_seconds"] < 60
        sid = client.post("/v1/sessions", json={"system": "Be brief."}).json()["id"]
        turn = client.post(f"/v1/sessions/{sid}/turns", json={"content": "pin these pages", "max_tokens": 4})
        assert turn.status_code == 200, turn.text
        held = client.get("/dashboard/stats").json()
        pinned = held["pages_in_use"] - held["pages_requests"] - held["pages_cached_only"]
        assert held["pages_requests"] == 0 and pinned > 0, "the session's turn pins pages outside requests"
        assert [s["id"] for s in held["sessions"]] == [sid]
        assert client.delete(f"/v1/sessions/{sid}").status_code == 200
        after = client.get("/dashboard/stats").json()
        # the session's pages stay cached (evictable) once it is gone: nothing is pinned any more
        assert after["pages_in_use"] == after["pages_cached_only"] and after["pages_requests"] == 0
