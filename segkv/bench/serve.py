"""Serving benchmark: a load generator for an OpenAI-compatible server (and segkv's sessions API).

It measures what ``vllm bench serve`` measures, as vllm defines them, over streamed (SSE) requests:

* TTFT: from sending a request to the first streamed chunk that carries generated tokens (a chat
  stream's opening chunk, which only names the role, is not a token).
* TPOT: ``(e2e - ttft) / (output_tokens - 1)`` per request with more than one output token.
* ITL: the gaps between successive token chunks, pooled over all requests.
* E2EL: from sending a request to its last data chunk.
* Request, output token and total token throughput over the benchmark's duration.

Token counts come from the final ``usage`` chunk (``stream_options.include_usage``), as do the
cached prompt tokens (``usage.prompt_tokens_details.cached_tokens``).

Workloads (``--workload``):

* ``single``: ``--num-prompts`` independent requests (``--endpoint completions`` or ``chat``),
  each ``--input-len`` words of random text.
* ``multi-turn``: ``--num-prompts`` conversations over the stateless chat API; each sends
  ``--turns`` requests, every one repeating the whole history plus a new user message of
  ``--input-len`` words, as OpenAI clients do. Reports TTFT and cached tokens per turn.
* ``fork``: ``--num-prompts`` session trees over the sessions API: create a session, run one long
  first turn (``--input-len`` words), fork it ``--forks`` times at turn 1 and run one turn
  (``--fork-input-len`` words) on each fork concurrently. Reports the forks' TTFT separately.

``--max-concurrency`` bounds the units in flight (a request, a conversation, a session tree; a
tree runs its forks' turns at once); ``--request-rate`` is the rate at which units start (``inf``:
all at once, else Poisson arrivals seeded by ``--seed``). Every request sends ``ignore_eos`` and
``max_tokens = --output-len``; ``--num-warmups`` unmeasured requests go first.

Run ``python -m segkv.bench.serve --help`` (or ``segkv bench serve``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime

try:
    import httpx
except ImportError:  # pragma: no cover - httpx is a test/bench dependency, not a runtime one
    httpx = None

WORKLOADS = ("single", "multi-turn", "fork")
ENDPOINTS = ("completions", "chat")
METRICS = (("ttft", "Time to First Token", "TTFT"),
           ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
           ("itl", "Inter-token Latency", "ITL"),
           ("e2el", "End-to-end Latency", "E2EL"))

_WORDS = (
    "the of and to in is was for on are with as be at by this had not but from or have an they "
    "which one you were her all she there would their we him been has when who will more no if out "
    "so said what up its about into than them can only other new some could time these two may then "
    "do first any my now such like our over man me even most made after also did many before must "
    "through back years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both life being "
    "under never day same another know while last might us great old year off come since against go "
    "came right used take three page segment cache chain fork session token kernel model server"
).split()


@dataclass
class BenchConfig:
    """What to run; field names match the command-line options (``--max-concurrency`` etc.)."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first id of GET /v1/models
    workload: str = "single"
    endpoint: str = "completions"  # the single workload's API: /v1/completions or /v1/chat/completions
    num_prompts: int = 100  # requests (single), conversations (multi-turn), session trees (fork)
    max_concurrency: int | None = None
    request_rate: float = math.inf
    seed: int = 0
    input_len: int = 256  # words of random text per prompt / user message / first session turn
    output_len: int = 128  # max_tokens, with ignore_eos
    turns: int = 4
    forks: int = 4
    fork_input_len: int = 16  # words of each fork's message
    temperature: float = 0.0
    num_warmups: int = 1
    metric_percentiles: tuple[float, ...] = (99.0,)
    timeout: float = 6 * 3600.0  # seconds per request, as vllm's client
    keep_sessions: bool = False  # fork workload: leave the sessions on the server

    def check(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.workload!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        for name in ("num_prompts", "input_len", "output_len", "turns", "forks", "fork_input_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1 (or None: unbounded)")
        if not self.request_rate > 0:
            raise ValueError("request_rate must be positive (inf: all at once)")
        if self.num_warmups < 0:
            raise ValueError("num_warmups must be at least 0")
        if any(not 0 <= p <= 100 for p in self.metric_percentiles):
            raise ValueError("metric percentiles must be in 0..100")


@dataclass
class RequestRecord:
    """One streamed generation request and what was measured on it (times in seconds)."""

    group: str  # "request" (single), "turn" (multi-turn), "first_turn" / "fork" (fork)
    unit: int  # the request, conversation or session tree it belongs to
    turn: int  # 1-based turn of its conversation or session
    success: bool = False
    error: str = ""
    start: float = 0.0  # perf_counter when sent
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    chunks: int = 0  # token chunks streamed
    usage_reported: bool = False
    text: str = ""
    setup: float | None = None  # fork workload: latency of the POST .../fork that made this session


# -- measuring one streamed request ---------------------------------------------------------------
def _token_piece(style: str, chunk: dict) -> str | None:
    """The generated text of a token chunk, or None when ``chunk`` carries no tokens."""
    if style == "session":
        return (chunk["delta"] or "") if "delta" in chunk else None
    choices = chunk.get("choices")
    if not choices:
        return None  # the usage chunk
    choice = choices[0]
    if style == "completions":
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    content = delta.get("content")
    if "role" in delta and not content and choice.get("finish_reason") is None:
        return None  # the opening chunk names the role; it is sent before any token exists
    return content or ""


def _error_text(body: str) -> str:
    try:
        return str(json.loads(body)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return body[:300]


async def _stream(client, path: str, payload: dict, style: str, rec: RequestRecord) -> RequestRecord:
    """POST ``payload`` with streaming and fill ``rec``: SSE ``data:`` lines until ``[DONE]``."""
    start = time.perf_counter()
    rec.start = start
    first = last_token = last_chunk = None
    usage = None
    done = False
    try:
        async with client.stream("POST", path, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                rec.error = f"HTTP {response.status_code}: {_error_text(body)}"
                return rec
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, ": comments" (pings), other SSE fields
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if isinstance(chunk, dict) and chunk.get("error"):
                    error = chunk["error"]
                    message = error.get("message", error) if isinstance(error, dict) else error
                    rec.error = f"stream error: {message}"
                    return rec
                if chunk.get("usage"):
                    usage = chunk["usage"]
                piece = _token_piece(style, chunk)
                if piece is not None:
                    if first is None:
                        first = now
                    else:
                        rec.itl.append(now - last_token)
                    last_token = now
                    rec.chunks += 1
                    rec.text += piece
                last_chunk = now
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        rec.error = f"{type(exc).__name__}: {exc}"
        return rec
    if not done:
        rec.error = "the stream ended before [DONE]"
        return rec
    if first is None:
        rec.error = "no token was streamed"
        return rec
    rec.ttft, rec.latency = first - start, last_chunk - start
    if usage:
        rec.usage_reported = True
        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = int(details.get("cached_tokens") or 0)
    else:  # no usage: one token per chunk, the best guess
        rec.output_tokens = rec.chunks
    rec.success = True
    return rec


# -- the workloads --------------------------------------------------------------------------------
class _Runner:
    def __init__(self, config: BenchConfig, client, model: str) -> None:
        self.config, self.client, self.model = config, client, model

    def words(self, *key, n: int) -> str:
        rng = random.Random(f"{self.config.seed}:{':'.join(map(str, key))}")
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    def _sampling(self) -> dict:
        return {"model": self.model, "max_tokens": self.config.output_len,
                "temperature": self.config.temperature, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}

    async def completion(self, prompt: str, rec: RequestRecord) -> RequestRecord:
        payload = {**self._sampling(), "prompt": prompt}
        return await _stream(self.client, "/v1/completions", payload, "completions", rec)

    async def chat(self, messages: list[dict], rec: RequestRecord) -> RequestRecord:
        payload = {**self._sampling(), "messages": messages}
        return await _stream(self.client, "/v1/chat/completions", payload, "chat", rec)

    async def turn(self, session_id: str, content: str, rec: RequestRecord) -> RequestRecord:
        payload = {**self._sampling(), "content": content}
        return await _stream(self.client, f"/v1/sessions/{session_id}/turns", payload, "session", rec)

    async def warmup(self, k: int) -> RequestRecord:
        rec = RequestRecord("warmup", k, 1)
        text = self.words("warmup", k, n=self.config.input_len)
        if self.config.workload == "single" and self.config.endpoint == "completions":
            return await self.completion(text, rec)
        return await self.chat([{"role": "user", "content": text}], rec)

    async def single(self, i: int) -> list[RequestRecord]:
        rec = RequestRecord("request", i, 1)
        text = self.words("single", i, n=self.config.input_len)
        if self.config.endpoint == "chat":
            await self.chat([{"role": "user", "content": text}], rec)
        else:
            await self.completion(text, rec)
        return [rec]

    async def conversation(self, i: int) -> list[RequestRecord]:
        messages: list[dict] = []
        records = [RequestRecord("turn", i, t) for t in range(1, self.config.turns + 1)]
        for rec in records:
            if messages is None:
                rec.error = "skipped: an earlier turn of the conversation failed"
                continue
            text = self.words("turn", i, rec.turn, n=self.config.input_len)
            messages.append({"role": "user", "content": text})
            await self.chat(list(messages), rec)
            if rec.success:
                messages.append({"role": "assistant", "content": rec.text})
            else:
                messages = None
        return records

    async def fork_tree(self, i: int) -> list[RequestRecord]:
        first = RequestRecord("first_turn", i, 1)
        forks = [RequestRecord("fork", i, 2) for _ in range(self.config.forks)]
        created: list[str] = []

        def skip(reason: str) -> list[RequestRecord]:
            for rec in forks:
                rec.error = rec.error or reason
            return [first, *forks]

        try:
            try:
                response = await self.client.post("/v1/sessions", json={})
                if response.status_code != 200:
                    first.error = f"create session: HTTP {response.status_code}: {_error_text(response.text)}"
                    return skip("skipped: the session was not created")
                session_id = response.json()["id"]
            except Exception as exc:  # noqa: BLE001
                first.error = f"create session: {type(exc).__name__}: {exc}"
                return skip("skipped: the session was not created")
            created.append(session_id)
            await self.turn(session_id, self.words("first", i, n=self.config.input_len), first)
            if not first.success:
                return skip("skipped: the first turn failed")

            async def fork(rec: RequestRecord) -> str | None:
                started = time.perf_counter()
                try:
                    response = await self.client.post(f"/v1/sessions/{session_id}/fork", json={"turn": 1})
                except Exception as exc:  # noqa: BLE001
                    rec.error = f"fork: {type(exc).__name__}: {exc}"
                    return None
                rec.setup = time.perf_counter() - started
                if response.status_code != 200:
                    rec.error = f"fork: HTTP {response.status_code}: {_error_text(response.text)}"
                    return None
                created.append(response.json()["id"])
                return created[-1]

            children = await asyncio.gather(*(fork(rec) for rec in forks))
            n = self.config.fork_input_len
            pairs = [(j, child, rec) for j, (child, rec) in enumerate(zip(children, forks)) if child]
            await asyncio.gather(*(self.turn(child, self.words("fork", i, j, n=n), rec)
                                   for j, child, rec in pairs))
            return [first, *forks]
        finally:
            if not self.config.keep_sessions:
                for session_id in created:
                    try:
                        await self.client.delete(f"/v1/sessions/{session_id}")
                    except Exception:  # noqa: BLE001 - cleanup only
                        pass


async def _run_units(config: BenchConfig, unit) -> tuple[list[RequestRecord], float]:
    """Start ``num_prompts`` units at the configured rate, at most ``max_concurrency`` at once."""
    semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    rng = random.Random(config.seed)

    async def guarded(i: int) -> list[RequestRecord]:
        if semaphore is None:
            return await unit(i)
        async with semaphore:
            return await unit(i)

    started = time.perf_counter()
    tasks = []
    for i in range(config.num_prompts):
        tasks.append(asyncio.create_task(guarded(i)))
        if math.isfinite(config.request_rate) and i + 1 < config.num_prompts:
            await asyncio.sleep(rng.expovariate(config.request_rate))  # Poisson arrivals
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - started
    return [rec for records in results for rec in records], duration


# -- metrics ----------------------------------------------------------------------------------------
def _percentile(values: list[float], p: float) -> float:
    """numpy's default (linear) percentile."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _pname(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def _stats(name: str, seconds: list[float], percentiles) -> dict[str, float]:
    """mean, median, std, min, max and percentiles of ``seconds``, in ms (0 when empty, as vllm)."""
    ms = [s * 1000 for s in seconds] or [0.0]
    out = {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms),
           f"std_{name}_ms": statistics.pstdev(ms), f"min_{name}_ms": min(ms), f"max_{name}_ms": max(ms)}
    out.update({f"{_pname(p)}_{name}_ms": _percentile(ms, p) for p in percentiles})
    return out


def _tpot(rec: RequestRecord) -> float | None:
    return (rec.latency - rec.ttft) / (rec.output_tokens - 1) if rec.output_tokens > 1 else None


def _group(records: list[RequestRecord], percentiles) -> dict:
    ok = [r for r in records if r.success]
    out = {"completed": len(ok), "failed": len(records) - len(ok),
           "total_input_tokens": sum(r.prompt_tokens for r in ok),
           "total_output_tokens": sum(r.output_tokens for r in ok),
           "total_cached_tokens": sum(r.cached_tokens for r in ok)}
    out.update(_stats("ttft", [r.ttft for r in ok], percentiles))
    out.update(_stats("tpot", [t for r in ok if (t := _tpot(r)) is not None], percentiles))
    out.update(_stats("itl", [gap for r in ok for gap in r.itl], percentiles))
    out.update(_stats("e2el", [r.latency for r in ok], percentiles))
    return out


def summarize(config: BenchConfig, model: str, records: list[RequestRecord], duration: float) -> dict:
    """The result dictionary (vllm's result-JSON keys, plus segkv's per-turn and fork sections)."""
    percentiles = config.metric_percentiles
    overall = _group(records, percentiles)
    tokens = overall["total_input_tokens"] + overall["total_output_tokens"]
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai" if config.workload == "single" and config.endpoint == "completions" else
                   "openai-chat" if config.workload != "fork" else "segkv-sessions",
        "workload": config.workload,
        "endpoint": config.endpoint if config.workload == "single" else
                    "chat" if config.workload == "multi-turn" else "sessions",
        "base_url": config.base_url,
        "model_id": model,
        "num_prompts": config.num_prompts,
        "num_requests": len(records),
        "max_concurrency": config.max_concurrency,
        "request_rate": config.request_rate if math.isfinite(config.request_rate) else "inf",
        "seed": config.seed,
        "input_len": config.input_len,
        "output_len": config.output_len,
        "turns": config.turns if config.workload == "multi-turn" else None,
        "forks": config.forks if config.workload == "fork" else None,
        "fork_input_len": config.fork_input_len if config.workload == "fork" else None,
        "metric_percentiles": list(percentiles),
        "duration": duration,
        **overall,
        "request_throughput": overall["completed"] / duration if duration > 0 else 0.0,
        "output_throughput": overall["total_output_tokens"] / duration if duration > 0 else 0.0,
        "total_token_throughput": tokens / duration if duration > 0 else 0.0,
        "usage_missing": sum(1 for r in records if r.success and not r.usage_reported),
        "input_lens": [r.prompt_tokens for r in records],
        "output_lens": [r.output_tokens for r in records],
        "cached_lens": [r.cached_tokens for r in records],
        "ttfts": [r.ttft for r in records],
        "e2els": [r.latency for r in records],
        "itls": [r.itl for r in records],
        "groups": [r.group for r in records],
        "turn_indices": [r.turn for r in records],
        "errors": [r.error for r in records],
    }
    if config.workload == "multi-turn":
        result["per_turn"] = [{"turn": t, **_group([r for r in records if r.turn == t], percentiles)}
                              for t in range(1, config.turns + 1)]
    if config.workload == "fork":
        forks = [r for r in records if r.group == "fork"]
        result["first_turn"] = _group([r for r in records if r.group == "first_turn"], percentiles)
        creates = [r.setup for r in forks if r.setup is not None]
        result["fork"] = {**_group(forks, percentiles), **_stats("fork_create", creates, percentiles)}
    return result


# -- the report ---------------------------------------------------------------------------------------
def _line(label: str, value) -> str:
    if isinstance(value, float):
        return "{:<40} {:<10.2f}".format(label, value)
    return "{:<40} {:<10}".format(label, "-" if value is None else value)


def _rule(title: str, char: str = "-") -> str:
    return "{s:{c}^{n}}".format(s=title, n=50, c=char)


def _latency_lines(section: dict, name: str, short: str, percentiles, prefix: str = "") -> list[str]:
    lines = [_line(f"{prefix}Mean {short} (ms):", section[f"mean_{name}_ms"]),
             _line(f"{prefix}Median {short} (ms):", section[f"median_{name}_ms"])]
    lines += [_line(f"{prefix}{_pname(p).upper()} {short} (ms):", section[f"{_pname(p)}_{name}_ms"])
              for p in percentiles]
    lines += [_line(f"{prefix}Min {short} (ms):", section[f"min_{name}_ms"]),
              _line(f"{prefix}Max {short} (ms):", section[f"max_{name}_ms"])]
    return lines


def format_result(result: dict) -> str:
    """A readable table like ``vllm bench serve``'s."""
    percentiles = result["metric_percentiles"]
    rate = result["request_rate"]
    lines = [_rule(" Serving Benchmark Result ", "="),
             _line("Workload:", f"{result['workload']} ({result['endpoint']})"),
             _line("Successful requests:", result["completed"]),
             _line("Failed requests:", result["failed"]),
             _line("Maximum request concurrency:", result["max_concurrency"]),
             _line("Request rate configured (RPS):", rate if rate == "inf" else float(rate)),
             _line("Benchmark duration (s):", float(result["duration"])),
             _line("Total input tokens:", result["total_input_tokens"]),
             _line("Total cached prompt tokens:", result["total_cached_tokens"]),
             _line("Total generated tokens:", result["total_output_tokens"]),
             _line("Request throughput (req/s):", float(result["request_throughput"])),
             _line("Output token throughput (tok/s):", float(result["output_throughput"])),
             _line("Total Token throughput (tok/s):", float(result["total_token_throughput"]))]
    for name, title, short in METRICS:
        lines.append(_rule(title))
        lines += _latency_lines(result, name, short, percentiles)
    for turn in result.get("per_turn", []):
        lines.append(_rule(f"Turn {turn['turn']}"))
        lines += [_line(f"Turn {turn['turn']} successful requests:", turn["completed"]),
                  _line(f"Turn {turn['turn']} input tokens:", turn["total_input_tokens"]),
                  _line(f"Turn {turn['turn']} cached prompt tokens:", turn["total_cached_tokens"]),
                  _line(f"Turn {turn['turn']} mean TTFT (ms):", turn["mean_ttft_ms"]),
                  _line(f"Turn {turn['turn']} median TTFT (ms):", turn["median_ttft_ms"]),
                  _line(f"Turn {turn['turn']} mean TPOT (ms):", turn["mean_tpot_ms"])]
    if "fork" in result:
        first, fork = result["first_turn"], result["fork"]
        lines.append(_rule("First Turn (before forking)"))
        lines += [_line("First turns successful:", first["completed"]),
                  _line("First turn cached prompt tokens:", first["total_cached_tokens"])]
        lines += _latency_lines(first, "ttft", "TTFT", percentiles, "First turn ")
        lines.append(_rule("Fork Turns"))
        lines += [_line("Fork turns successful:", fork["completed"]),
                  _line("Fork turn input tokens:", fork["total_input_tokens"]),
                  _line("Fork turn cached prompt tokens:", fork["total_cached_tokens"])]
        lines += _latency_lines(fork, "ttft", "TTFT", percentiles, "Fork ")
        lines += [_line("Fork mean TPOT (ms):", fork["mean_tpot_ms"]),
                  _line("Mean fork create (ms):", fork["mean_fork_create_ms"]),
                  _line("Max fork create (ms):", fork["max_fork_create_ms"])]
    lines.append("=" * 50)
    return "\n".join(lines)


# -- entry points -------------------------------------------------------------------------------------
def _as_config(config) -> BenchConfig:
    if isinstance(config, BenchConfig):
        return config
    values = dict(config) if isinstance(config, Mapping) else vars(config)
    names = {f.name for f in fields(BenchConfig)}
    cfg = BenchConfig(**{k: v for k, v in values.items() if k in names})
    cfg.metric_percentiles = tuple(float(p) for p in cfg.metric_percentiles)
    return cfg


async def _model_id(client) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    data = response.json().get("data") or []
    if not data:
        raise RuntimeError("GET /v1/models lists no model; pass --model")
    return data[0]["id"]


async def run_benchmark(config) -> dict:
    """Run the benchmark ``config`` describes (a :class:`BenchConfig`, a mapping or an argparse
    namespace with its field names) and return the result dictionary; prints nothing.

    Raises RuntimeError if a warmup request fails (the server is unreachable or refuses the
    requests), ValueError for an invalid configuration.
    """
    if httpx is None:
        raise RuntimeError("the serving benchmark needs httpx: pip install httpx")
    cfg = _as_config(config)
    cfg.check()
    timeout = httpx.Timeout(cfg.timeout, connect=min(cfg.timeout, 60.0))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), timeout=timeout, limits=limits) as client:
        model = cfg.model or await _model_id(client)
        runner = _Runner(cfg, client, model)
        for k in range(cfg.num_warmups):
            rec = await runner.warmup(k)
            if not rec.success:
                raise RuntimeError(f"the warmup request failed: {rec.error}")
        unit = {"single": runner.single, "multi-turn": runner.conversation, "fork": runner.fork_tree}
        records, duration = await _run_units(cfg, unit[cfg.workload])
    return summarize(cfg, model, records, duration)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The options of ``segkv bench serve`` (added to ``parser`` when given)."""
    d = BenchConfig()
    p = parser or argparse.ArgumentParser(
        prog="python -m segkv.bench.serve",
        description="Benchmark an OpenAI-compatible server (TTFT, TPOT, ITL, E2EL, throughput) "
                    "with single requests, multi-turn chats or session forks.")
    p.add_argument("--base-url", default=d.base_url, help="server URL (default: %(default)s)")
    p.add_argument("--model", default=None, help="model name (default: the first id of GET /v1/models)")
    p.add_argument("--workload", choices=WORKLOADS, default=d.workload)
    p.add_argument("--endpoint", choices=ENDPOINTS, default=d.endpoint,
                   help="single workload: /v1/completions or /v1/chat/completions (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts,
                   help="requests (single), conversations (multi-turn) or session trees (fork)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="units (requests, conversations, session trees) in flight at most "
                        "(default: no bound)")
    p.add_argument("--request-rate", type=float, default=d.request_rate,
                   help="units started per second, Poisson arrivals; inf starts all at once (default)")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds the arrivals and the random text")
    p.add_argument("--input-len", type=int, default=d.input_len,
                   help="words of random text per prompt, user message or first session turn")
    p.add_argument("--output-len", type=int, default=d.output_len,
                   help="max_tokens of each request (ignore_eos)")
    p.add_argument("--turns", type=int, default=d.turns, help="multi-turn: requests per conversation")
    p.add_argument("--forks", type=int, default=d.forks, help="fork: forks of each session at turn 1")
    p.add_argument("--fork-input-len", type=int, default=d.fork_input_len,
                   help="fork: words of each fork's turn")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--num-warmups", type=int, default=d.num_warmups, help="unmeasured requests sent first")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles (default: 99)")
    p.add_argument("--timeout", type=float, default=d.timeout, help="seconds per request")
    p.add_argument("--keep-sessions", action="store_true", help="fork: do not delete the sessions afterwards")
    p.add_argument("--result-json", default=None, metavar="PATH", help="write the result dictionary here")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run from the command line; 0 if every request succeeded, 1 otherwise (or on errors)."""
    args = build_parser().parse_args(argv)
    try:
        args.metric_percentiles = tuple(float(p) for p in args.metric_percentiles.split(",") if p.strip())
        result = asyncio.run(run_benchmark(args))
    except (RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - e.g. GET /v1/models failed: the server is unreachable
        print(f"error: {args.base_url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(format_result(result))
    errors = sorted({e for e in result["errors"] if e})
    if errors:
        print(f"{result['failed']} requests failed; errors:", file=sys.stderr)
        for error in errors[:10]:
            print(f"  {error}", file=sys.stderr)
    if result["usage_missing"]:
        print(f"warning: {result['usage_missing']} streams sent no usage; "
              "their output tokens are chunk counts",
              file=sys.stderr)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.result_json}")
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
