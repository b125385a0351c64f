"""Server-side sessions: turns, forks at a turn, restores, files, lifetimes and idle eviction."""

from __future__ import annotations

import copy
import itertools
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from segkv.cache.chain import ChainSnapshot
from segkv.engine.async_engine import AsyncEngine, StreamUpdate
from segkv.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class SessionTurn:
    """The state after one turn: messages, the history's token ids, and a pin on its rows.

    ``pin`` holds references to the cached rows of ``tokens`` (None once evicted under
    memory pressure; the next turn then recomputes them).
    """

    messages: list[dict]
    tokens: list[int]
    pin: ChainSnapshot | None
    cached_tokens: int = 0
    bytes_added: int = 0

    @property
    def segments(self) -> int:
        return len(self.pin.refs) if self.pin is not None else 0


@dataclass(slots=True, eq=False)
class Session:
    session_id: str
    system: str | None
    created: float
    last_used: float
    turns: list[SessionTurn] = field(default_factory=list)
    busy: bool = False

    @property
    def messages(self) -> list[dict]:
        if self.turns:
            return self.turns[-1].messages
        return [{"role": "system", "content": self.system}] if self.system is not None else []

    def describe(self) -> dict[str, object]:
        return {"id": self.session_id, "turns": len(self.turns), "messages": len(self.messages),
                "segments": self.turns[-1].segments if self.turns else 0,
                "peak_turn_bytes": max((t.bytes_added for t in self.turns), default=0),
                "idle_seconds": round(time.monotonic() - self.last_used, 3)}


class SessionStore:
    """Sessions over an :class:`AsyncEngine`; each turn is a request whose history is pinned.

    A turn's prompt (the chat template over the session's messages) is served from the
    prefix index, where the previous turn's rows were pinned, so only new tokens are
    computed. ``fork(turn)`` and ``restore(turn)`` share or drop pins: they allocate no
    pages. Sessions idle longer than ``ttl_seconds`` expire; under memory pressure the
    least recently used idle sessions lose their pins first.
    """

    def __init__(self, engine: AsyncEngine, *, ttl_seconds: float = 3600.0, max_sessions: int = 10_000) -> None:
        self.engine = engine
        self.ttl_seconds = ttl_seconds
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.num_evicted_pins = 0
        self.num_forks = 0
        self.num_restores = 0
        engine.add_pressure_hook(self._on_pressure)

    # -- lifecycle --------------------------------------------------------------------
    def create(self, system: str | None = None) -> Session:
        self.expire()
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise ValueError(f"too many sessions ({self.max_sessions}); delete some first")
            now = time.monotonic()
            session = Session(f"sess-{next(self._ids)}", system, now, now)
            self._sessions[session.session_id] = session
            return session

    def get(self, session_id: str) -> Session:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise KeyError(f"no session {session_id!r}")
        return session

    def list(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def delete(self, session_id: str) -> None:
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            raise KeyError(f"no session {session_id!r}")
        self._release_turns(session.turns)

    def expire(self) -> int:
        """Delete sessions idle for longer than the lifetime; returns how many."""
        now = time.monotonic()
        with self._lock:
            old = [s for s in self._sessions.values() if not s.busy and now - s.last_used > self.ttl_seconds]
            for s in old:
                del self._sessions[s.session_id]
        for s in old:
            self._release_turns(s.turns)
        return len(old)

    # -- turns ------------------------------------------------------------------------
    async def say(self, session_id: str, text: str, params: SamplingParams) -> AsyncIterator[StreamUpdate]:
        """Add a user message and stream the reply; the turn is recorded when it finishes."""
        session = self.get(session_id)
        if session.busy:
            raise ValueError(f"session {session_id!r} is already generating a turn")
        if not isinstance(text, str):
            raise ValueError("a turn needs a string message")
        messages = copy.deepcopy(session.messages) + [{"role": "user", "content": text}]
        ids = self.engine.llm.tokenizer.encode_chat(messages, add_generation_prompt=True)
        session.busy = True
        before = self.engine.stats()["bytes_in_use"]
        try:
            last = None
            async for update in self.engine.generate(ids, params):
                last = update
                yield update
            out = last.output.outputs[0]
            pin, _ = self.engine.pin(ids + out.token_ids)
            session.turns.append(SessionTurn(
                messages + [{"role": "assistant", "content": out.text}], ids + out.token_ids, pin,
                cached_tokens=last.output.num_cached_tokens,
                bytes_added=max(0, self.engine.stats()["bytes_in_use"] - before),
            ))
        finally:
            session.busy = False
            session.last_used = time.monotonic()

    def fork(self, session_id: str, turn: int | None = None) -> Session:
        """A new session holding this one's first ``turn`` turns (default: all); no pages."""
        source = self.get(session_id)
        turns = self._turns_upto(source, turn)
        child = self.create(source.system)
        child.turns = [SessionTurn(copy.deepcopy(t.messages), list(t.tokens),
                                   self.engine.share(t.pin) if t.pin is not None else None,
                                   t.cached_tokens, t.bytes_added) for t in turns]
        self.num_forks += 1
        return child

    def restore(self, session_id: str, turn: int) -> Session:
        """Go back to the state after ``turn`` turns (0: before the first); no pages."""
        session = self.get(session_id)
        if session.busy:
            raise ValueError(f"session {session_id!r} is generating a turn")
        keep = self._turns_upto(session, turn)
        dropped = session.turns[len(keep):]
        session.turns = keep
        self._release_turns(dropped)
        self.num_restores += 1
        session.last_used = time.monotonic()
        return session

    # -- files ------------------------------------------------------------------------
    def save(self, session_id: str, path: str | Path) -> None:
        session = self.get(session_id)
        if not session.turns or session.turns[-1].pin is None:
            raise ValueError("nothing cached to save: the session has no turn (or it was evicted)")
        last = session.turns[-1]
        self.engine.save_snapshot(last.pin, path, metadata={"system": session.system, "messages": last.messages,
                                                            "tokens": last.tokens})

    def load(self, path: str | Path) -> Session:
        """A new session from a saved file (another model's file or a damaged one: ValueError)."""
        pin, tokens, meta = self.engine.load_snapshot(path)
        session = self.create(meta.get("system"))
        session.turns = [SessionTurn(list(meta.get("messages", [])), list(meta.get("tokens", tokens)), pin)]
        return session

    def stats(self) -> dict[str, int]:
        return {"sessions": len(self._sessions), "forks": self.num_forks, "restores": self.num_restores,
                "evicted_pins": self.num_evicted_pins}

    # -- memory pressure ----------------------------------------------------------------
    def _on_pressure(self, pages_short: int) -> int:
        """Called by the engine (holding its lock): drop pins of idle sessions, LRU first."""
        if not self._lock.acquire(blocking=False):
            return 0
        try:
            freed_pins = 0
            for session in sorted(self._sessions.values(), key=lambda s: s.last_used):
                if session.busy:
                    continue
                for t in session.turns:
                    if t.pin is not None:
                        t.pin.release()  # the engine lock is already held by the caller
                        t.pin = None
                        freed_pins += 1
                if freed_pins and self.engine.core.pool.num_free_pages + \
                        self.engine.core.prefix.num_evictable_pages() >= pages_short:
                    break
            self.num_evicted_pins += freed_pins
            return freed_pins
        finally:
            self._lock.release()

    def _turns_upto(self, session: Session, turn: int | None) -> list[SessionTurn]:
        if turn is None:
            return list(session.turns)
        if not isinstance(turn, int) or not 0 <= turn <= len(session.turns):
            raise ValueError(f"turn must be between 0 and {len(session.turns)}, got {turn!r}")
        return list(session.turns[:turn])

    def _release_turns(self, turns: list[SessionTurn]) -> None:
        for t in turns:
            if t.pin is not None:
                self.engine.release(t.pin)
                t.pin = None
