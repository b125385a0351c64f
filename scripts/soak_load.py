"""The soak test's load: request kinds, their mix, and a recorder of outcomes and latencies."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter, defaultdict
from contextlib import suppress

import httpx

WORDS = ("pages segments forks chains merge split plans turns cache prefix token stream session restore "
         "decode attention latency memory sample batch queue model engine").split()
OVERSIZE_BYTES = 20 * 1024 * 1024
OVERSIZE_EVERY_S = 20.0  # a 20 MB body costs the server a read (today, a parse): now and then only
LEAVE_MAX_TOKENS = 200  # long enough that the client leaves while the request is still running
MAX_FAILURES = 50  # failures kept with their details for the report

# (weight, kind): the mix of operations one worker draws from
MIX = [(3, "completion"), (3, "chat"), (2, "completion_stream"), (2, "chat_stream"), (3, "session"),
       (1, "leave_stream"), (1, "leave_plain"), (3, "bad")]


def _json(body: str) -> tuple[bytes, dict]:
    return body.encode(), {"content-type": "application/json"}


# name -> (method, path, body maker taking the model name) of each bad input; every one should be a 4xx
BAD_INPUTS = {
    "malformed_json": ("POST", "/v1/completions", lambda m: _json('{"model": "%s", "prompt": "hi",' % m)),
    "not_an_object": ("POST", "/v1/completions", lambda m: _json("[1, 2, 3]")),
    "wrong_type_max_tokens": ("POST", "/v1/completions",
                              lambda m: _json(json.dumps({"model": m, "prompt": "hi", "max_tokens": "ten"}))),
    "wrong_type_messages": ("POST", "/v1/chat/completions",
                            lambda m: _json(json.dumps({"model": m, "messages": "hello", "max_tokens": 2}))),
    "unknown_model": ("POST", "/v1/completions",
                      lambda m: _json(json.dumps({"model": "no-such-model", "prompt": "hi", "max_tokens": 2}))),
    # json.dumps writes a lone surrogate as the escape \ud800: valid JSON, text no UTF-8 can hold
    "lone_surrogate_prompt": ("POST", "/v1/completions",
                              lambda m: _json(json.dumps({"model": m, "prompt": "a \ud800 b", "max_tokens": 2}))),
    "lone_surrogate_chat": ("POST", "/v1/chat/completions", lambda m: _json(json.dumps(
        {"model": m, "messages": [{"role": "user", "content": "x\udc00y"}], "max_tokens": 2}))),
    "huge_max_tokens": ("POST", "/v1/completions",
                        lambda m: _json(json.dumps({"model": m, "prompt": "hi", "max_tokens": 10**12}))),
    "negative_max_tokens": ("POST", "/v1/completions",
                            lambda m: _json(json.dumps({"model": m, "prompt": "hi", "max_tokens": -1}))),
    "empty_prompt": ("POST", "/v1/completions", lambda m: _json(json.dumps({"model": m, "prompt": ""}))),
    "deep_nesting": ("POST", "/v1/completions", lambda m: _json("[" * 100_000 + "]" * 100_000)),
    "oversize_body": ("POST", "/v1/completions", None),  # made once, see Load.oversize
    "unknown_route_get": ("GET", "/v1/no-such-route", None),
    "unknown_route_post": ("POST", "/v2/completions", lambda m: _json("{}")),
    "wrong_method": ("DELETE", "/v1/models", None),
    "missing_session_turn": ("POST", "/v1/sessions/sess-missing/turns",
                             lambda m: _json(json.dumps({"content": "hi", "max_tokens": 2}))),
    "missing_session_get": ("GET", "/v1/sessions/sess-missing", None),
}


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return sorted_values[min(len(sorted_values) - 1, max(0, round(q * len(sorted_values) + 0.5) - 1))]


class Recorder:
    """Every request's kind, outcome and latency; an outcome is a status code or a word for no
    answer: timeout (a hang), connection_error, client_left (left on purpose), stream_error."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.outcomes: list[tuple[str, int | str, float]] = []
        self.failures: list[dict] = []  # 5xx, hangs, connection and stream errors, with details
        self.accepted_bad: Counter[str] = Counter()  # bad inputs answered 2xx
        self.refusals: list[dict] = []  # 4xx answers to requests that were meant to be fine

    async def call(self, kind: str, make):
        """Await ``make()`` within the deadline; it returns an httpx.Response, or an outcome."""
        t0 = time.monotonic()
        result, detail = None, None
        try:
            result = await asyncio.wait_for(make(), self.timeout)
            outcome = result.status_code if isinstance(result, httpx.Response) else result
            if isinstance(result, tuple):  # (outcome, detail) from a stream
                outcome, detail = result
        except (asyncio.TimeoutError, httpx.TimeoutException) as exc:
            outcome, detail = "timeout", f"{type(exc).__name__}: {exc}"
        except httpx.TransportError as exc:
            outcome, detail = "connection_error", f"{type(exc).__name__}: {exc}"
        latency = time.monotonic() - t0
        self.outcomes.append((kind, outcome, latency))
        if isinstance(result, httpx.Response) and result.status_code >= 500:
            detail = result.text[:300]
        if outcome in ("timeout", "connection_error", "stream_error") or isinstance(outcome, int) and outcome >= 500:
            if len(self.failures) < MAX_FAILURES:
                self.failures.append({"kind": kind, "outcome": outcome, "latency_s": round(latency, 3),
                                      "detail": detail})
        if kind.startswith("bad:") and isinstance(outcome, int) and outcome < 300:
            self.accepted_bad[kind] += 1
        if not kind.startswith("bad:") and isinstance(outcome, int) and 400 <= outcome < 500:
            if len(self.refusals) < MAX_FAILURES:
                self.refusals.append({"kind": kind, "outcome": outcome, "detail": result.text[:300]})
        return result if isinstance(result, httpx.Response) else None

    def counts(self) -> dict:
        by_code: Counter[str] = Counter()
        by_class: Counter[str] = Counter()
        latencies: dict[str, list[float]] = defaultdict(list)
        kinds: dict[str, Counter] = defaultdict(Counter)
        for kind, outcome, latency in self.outcomes:
            by_code[str(outcome)] += 1
            by_class[f"{outcome // 100}xx" if isinstance(outcome, int) else outcome] += 1
            kinds[kind][str(outcome)] += 1
            latencies[kind].append(latency)
        per_kind = {}
        for kind in sorted(kinds):
            values = sorted(latencies[kind])
            per_kind[kind] = {"n": len(values), "p50_ms": round(1000 * _percentile(values, 0.5), 1),
                              "p99_ms": round(1000 * _percentile(values, 0.99), 1), "outcomes": dict(kinds[kind])}
        return {"requests": {"sent": len(self.outcomes), "by_class": dict(sorted(by_class.items())),
                             "by_code": dict(sorted(by_code.items())), "by_kind": per_kind},
                "errors": {"5xx": by_class["5xx"], "connection_errors": by_class["connection_error"],
                           "timeouts": by_class["timeout"], "stream_errors": by_class["stream_error"]},
                "bad_inputs_accepted": dict(self.accepted_bad),
                "good_requests_refused": sum(1 for kind, outcome, _ in self.outcomes if not kind.startswith("bad:")
                                             and isinstance(outcome, int) and 400 <= outcome < 500)}


class Load:
    """The operations of the mix, against one server; sessions it creates are remembered."""

    def __init__(self, client: httpx.AsyncClient, recorder: Recorder, *, model: str, max_tokens: int) -> None:
        self.client, self.rec, self.model, self.max_tokens = client, recorder, model, max_tokens
        self.sessions: set[str] = set()
        self.oversize = (b'{"model": "%s", "prompt": "' % model.encode() + b"a " * (OVERSIZE_BYTES // 2) + b'"}')
        self._last_oversize = 0.0
        self._bad: list[str] = []  # the current cycle through the bad inputs

    async def worker(self, rng: random.Random, deadline: float, *, index: int = 0, num_workers: int = 1) -> None:
        """Operations drawn from the mix until ``deadline``; first this worker's share of one sweep
        of every bad input, so that even a short run sends each of them."""
        for name in sorted(BAD_INPUTS)[index::num_workers]:
            await self.bad(name)
        weights, kinds = zip(*MIX)
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            await getattr(self, f"op_{kind}")(rng)

    # -- generation -------------------------------------------------------------------
    def _text(self, rng: random.Random, lo: int = 3, hi: int = 24) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    def _sampling(self, rng: random.Random) -> dict:
        body = {"max_tokens": rng.randint(1, self.max_tokens)}
        if rng.random() < 0.3:
            body.update(temperature=0.8, top_p=0.9, seed=rng.randrange(1 << 30))
        return body

    def _completion_body(self, rng: random.Random) -> dict:
        body = {"model": self.model, "prompt": self._text(rng), **self._sampling(rng)}
        roll = rng.random()
        if roll < 0.15:
            body["prompt"] = [self._text(rng), self._text(rng)]  # a batch of two prompts
        elif roll < 0.3:
            body["n"] = 2
        elif roll < 0.4:
            body["logprobs"] = 2
        return body

    def _chat_body(self, rng: random.Random) -> dict:
        messages = [{"role": "system", "content": "Answer briefly."}] if rng.random() < 0.5 else []
        messages.append({"role": "user", "content": self._text(rng)})
        return {"model": self.model, "messages": messages, **self._sampling(rng)}

    async def op_completion(self, rng):
        await self.rec.call("completion", lambda: self.client.post("/v1/completions", json=self._completion_body(rng)))

    async def op_chat(self, rng):
        await self.rec.call("chat", lambda: self.client.post("/v1/chat/completions", json=self._chat_body(rng)))

    async def _stream(self, path: str, body: dict):
        """Read an SSE stream to its end: the status, or (stream_error, why) for an error payload
        or a stream that ends without [DONE]."""
        async with self.client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return r
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return 200
                if line.startswith("data: ") and '"error"' in line[:20]:
                    return "stream_error", line[:300]
            return "stream_error", "the stream ended without [DONE]"

    async def op_completion_stream(self, rng):
        body = {**self._completion_body(rng), "stream": True, "include_usage": rng.random() < 0.5}
        await self.rec.call("completion_stream", lambda: self._stream("/v1/completions", body))

    async def op_chat_stream(self, rng):
        await self.rec.call("chat_stream", lambda: self._stream("/v1/chat/completions",
                                                                {**self._chat_body(rng), "stream": True}))

    # -- clients that leave -------------------------------------------------------------
    async def _leave_stream(self, path: str, body: dict):
        async with self.client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return r
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break  # leaving the block closes the connection mid-stream
        return "client_left"

    async def _leave_plain(self, rng, method: str, path: str, body: dict):
        task = asyncio.ensure_future(self.client.request(method, path, json=body))
        done, _ = await asyncio.wait({task}, timeout=rng.uniform(0.05, 0.5))
        if task in done:
            return task.result()  # answered before the client left (e.g. an error)
        task.cancel()  # cancelling the request closes its connection: the server sees the client go
        with suppress(asyncio.CancelledError):
            await task
        return "client_left"

    async def op_leave_stream(self, rng):
        body = {"model": self.model, "prompt": self._text(rng), "max_tokens": LEAVE_MAX_TOKENS, "ignore_eos": True,
                "stream": True}
        await self.rec.call("leave_stream", lambda: self._leave_stream("/v1/completions", body))

    async def op_leave_plain(self, rng):
        body = {"model": self.model, "prompt": self._text(rng), "max_tokens": LEAVE_MAX_TOKENS, "ignore_eos": True}
        await self.rec.call("leave_plain", lambda: self._leave_plain(rng, "POST", "/v1/completions", body))

    # -- sessions -----------------------------------------------------------------------
    async def _new_session(self, rng) -> str | None:
        body = {"system": "You are terse."} if rng.random() < 0.7 else {}
        r = await self.rec.call("session_create", lambda: self.client.post("/v1/sessions", json=body))
        if r is None or r.status_code != 200:
            return None
        self.sessions.add(r.json()["id"])
        return r.json()["id"]

    async def _turn(self, rng, sid: str) -> bool:
        """One turn (plain, streamed, or left before the answer); True when it was recorded."""
        body = {"content": self._text(rng, 2, 12), **self._sampling(rng)}
        path = f"/v1/sessions/{sid}/turns"
        roll = rng.random()
        if roll < 0.25:
            before = len(self.rec.outcomes)
            await self.rec.call("session_turn_stream", lambda: self._stream(path, {**body, "stream": True}))
            return self.rec.outcomes[before][1] == 200
        if roll < 0.33:  # leaves before the answer: the turn is not recorded, the session goes on
            long = {**body, "max_tokens": LEAVE_MAX_TOKENS, "ignore_eos": True}
            await self.rec.call("leave_turn", lambda: self._leave_plain(rng, "POST", path, long))
            await asyncio.sleep(1.0)  # the server notices the client left (it polls) and ends the turn:
            # until then the session is busy and a new turn is refused (400)
            return False
        r = await self.rec.call("session_turn", lambda: self.client.post(path, json=body))
        return r is not None and r.status_code == 200

    async def _delete(self, sid: str, kind: str = "session_delete") -> None:
        r = await self.rec.call(kind, lambda: self.client.delete(f"/v1/sessions/{sid}"))
        if r is not None and r.status_code in (200, 404):
            self.sessions.discard(sid)

    async def op_session(self, rng):
        """A session: 1-3 turns, maybe a fork (with a turn of its own), a restore, then deletes."""
        sid = await self._new_session(rng)
        if sid is None:
            return
        turns = 0
        for _ in range(rng.randint(1, 3)):
            turns += await self._turn(rng, sid)
        mine = [sid]
        if rng.random() < 0.5:
            at = rng.choice([None, rng.randint(0, turns)])
            r = await self.rec.call("session_fork", lambda: self.client.post(f"/v1/sessions/{sid}/fork",
                                                                             json={"turn": at}))
            if r is not None and r.status_code == 200:
                self.sessions.add(r.json()["id"])
                mine.append(r.json()["id"])
                await self._turn(rng, mine[-1])
        if rng.random() < 0.5:
            at = rng.randint(0, turns)
            await self.rec.call("session_restore", lambda: self.client.post(f"/v1/sessions/{sid}/restore",
                                                                            json={"turn": at}))
        if rng.random() < 0.1:  # a turn past the end: a 4xx
            await self.rec.call("bad:fork_past_end", lambda: self.client.post(f"/v1/sessions/{sid}/fork",
                                                                              json={"turn": 99}))
        for s in mine:
            if rng.random() < 0.85:  # the rest wait for the final clean-up
                await self._delete(s)

    async def delete_sessions(self) -> None:
        for sid in sorted(self.sessions):
            await self._delete(sid, "session_delete_final")

    # -- bad inputs ---------------------------------------------------------------------
    async def op_bad(self, rng):
        if not self._bad:
            self._bad = rng.sample(sorted(BAD_INPUTS), len(BAD_INPUTS))
        await self.bad(self._bad.pop())

    async def bad(self, name: str) -> None:
        method, path, make = BAD_INPUTS[name]
        if name == "oversize_body":
            if time.monotonic() - self._last_oversize < OVERSIZE_EVERY_S:
                name, (method, path, make) = "unknown_model", BAD_INPUTS["unknown_model"]
            else:
                self._last_oversize = time.monotonic()
                make = lambda m: (self.oversize, {"content-type": "application/json"})  # noqa: E731
        content, headers = make(self.model) if make is not None else (None, None)
        await self.rec.call(f"bad:{name}", lambda: self.client.request(method, path, content=content,
                                                                         headers=headers))
