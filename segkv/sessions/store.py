"""Server-side sessions: turns, forks at a turn, restores, files, lifetimes and idle eviction."""

from __future__ import annotations

import copy
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from segkv.cache.chain import ChainSnapshot
from segkv.sampling_params import SamplingParams


class SessionEngine(Protocol):
    """What a session store uses of its engine (``AsyncEngine`` is one): streaming generation,
    pins on cached rows, snapshot files, memory statistics and the pressure hook. ``llm`` gives
    the tokenizer; ``core`` the page pool and prefix index the pressure hook checks."""

    llm: Any
    core: Any

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Any]: ...
    def stats(self) -> dict[str, object]: ...
    def pin(self, token_ids: list[int]) -> tuple[ChainSnapshot, int]: ...
    def share(self, snapshot: ChainSnapshot) -> ChainSnapshot: ...
    def release(self, snapshot: ChainSnapshot) -> None: ...
    def save_snapshot(self, snapshot: ChainSnapshot, path, *, metadata: dict) -> None: ...
    def load_snapshot(self, path) -> tuple[ChainSnapshot, list[int], dict]: ...
    def add_pressure_hook(self, hook: Callable[[int], Any]) -> None: ...


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
    """One session's turns. ``closed`` is set once, when it is deleted or expires: a turn
    still generating then records nothing and pins nothing."""

    session_id: str
    system: str | None
    created: float
    last_used: float
    turns: list[SessionTurn] = field(default_factory=list)
    busy: bool = False
    closed: bool = False

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
    """Sessions over an engine (a :class:`SessionEngine`); each turn is a request whose history is pinned.

    A turn's prompt (the chat template over the session's messages) is served from the
    prefix index, where the previous turn's rows were pinned, so only new tokens are
    computed. ``fork(turn)`` and ``restore(turn)`` share or drop pins: they allocate no
    pages. Sessions idle longer than ``ttl_seconds`` expire; under memory pressure the
    least recently used idle sessions lose their pins first.

    Pins are held only by live sessions. Every change of a session's pins happens under the
    store lock, which the pressure hook (engine thread) also takes, so a pin is never shared
    or saved after another thread released it. Deleting a session releases its pins at once;
    a turn it was generating finishes unrecorded.
    """

    def __init__(self, engine: SessionEngine, *, ttl_seconds: float = 3600.0,
                 max_sessions: int = 10_000) -> None:
        self.engine = engine
        self.ttl_seconds = ttl_seconds
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}
        # Lock order: the engine's lock may be taken while holding this one, never the other way
        # round (the pressure hook, called under the engine lock, only tries this one).
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.num_evicted_pins = 0
        self.num_forks = 0
        self.num_restores = 0
        engine.add_pressure_hook(self._on_pressure)

    # -- lifecycle --------------------------------------------------------------------
    def create(self, system: str | None = None) -> Session:
        self.expire()
        return self._register(system, [])

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
        """Forget the session and release its pins now (a turn it is generating records nothing)."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                raise KeyError(f"no session {session_id!r}")
            pins = self._close(session)
        self._release(pins)

    def expire(self) -> int:
        """Delete sessions idle for longer than the lifetime; returns how many."""
        now = time.monotonic()
        with self._lock:
            old = [s for s in self._sessions.values() if not s.busy and now - s.last_used > self.ttl_seconds]
            pins = []
            for s in old:
                del self._sessions[s.session_id]
                pins += self._close(s)
        self._release(pins)
        return len(old)

    # -- turns ------------------------------------------------------------------------
    async def say(self, session_id: str, text: str, params: SamplingParams, *,
                  prompt_ids: list[int] | None = None) -> AsyncIterator[Any]:
        """Add a user message and stream the reply; the turn is recorded when it finishes.

        ``prompt_ids`` is the chat template over the session's messages and ``text``, when the
        caller has built it already (the server does, to check its length); else it is built here.

        A turn whose stream is closed or cancelled before the end (a client that left), whose
        request fails, or whose session was deleted meanwhile records and pins nothing.
        """
        session = self.get(session_id)
        if not isinstance(text, str):
            raise ValueError("a turn needs a string message")
        with self._lock:
            self._check_open(session)
            if session.busy:
                raise ValueError(f"session {session_id!r} is already generating a turn")
            messages = copy.deepcopy(session.messages) + [{"role": "user", "content": text}]
            session.busy = True
        try:
            ids = prompt_ids if prompt_ids is not None else \
                self.engine.llm.tokenizer.encode_chat(messages, add_generation_prompt=True)
            before = self.engine.stats()["bytes_in_use"]
            last = None
            stream = self.engine.generate(ids, params)
            try:
                async for update in stream:
                    last = update
                    yield update
            finally:  # closed here, not when collected: a client that left aborts the request now
                await stream.aclose()
            if last is None or not last.finished or last.output.outputs[0].finish_reason == "abort":
                return
            out = last.output.outputs[0]
            self._record(session, SessionTurn(
                messages + [{"role": "assistant", "content": out.text}], ids + out.token_ids, None,
                cached_tokens=last.output.num_cached_tokens,
                bytes_added=max(0, self.engine.stats()["bytes_in_use"] - before),
            ))
        finally:
            session.busy = False
            session.last_used = time.monotonic()

    def _record(self, session: Session, turn: SessionTurn) -> None:
        """Pin the finished turn's history and append it, unless the session closed meanwhile."""
        pin, _ = self.engine.pin(turn.tokens)
        with self._lock:
            if not session.closed:
                turn.pin = pin
                session.turns.append(turn)
                return
        self.engine.release(pin)  # deleted or expired during the turn: nobody may hold this

    def fork(self, session_id: str, turn: int | None = None) -> Session:
        """A new session holding this one's first ``turn`` turns (default: all); no pages.

        A turn the source is generating is not part of the fork.
        """
        source = self.get(session_id)
        self.expire()
        with self._lock:
            self._check_open(source)
            turns = self._turns_upto(source, turn)
            # shared under the store lock: the pressure hook cannot release a pin in between
            copies = [SessionTurn(copy.deepcopy(t.messages), list(t.tokens),
                                  self.engine.share(t.pin) if t.pin is not None else None,
                                  t.cached_tokens, t.bytes_added) for t in turns]
        try:
            child = self._register(source.system, copies)
        except BaseException:
            self._release(t.pin for t in copies)
            raise
        self.num_forks += 1
        return child

    def restore(self, session_id: str, turn: int) -> Session:
        """Go back to the state after ``turn`` turns (0: before the first); no pages."""
        session = self.get(session_id)
        with self._lock:
            self._check_open(session)
            if session.busy:
                raise ValueError(f"session {session_id!r} is generating a turn")
            keep = self._turns_upto(session, turn)
            pins = self._take_pins(session.turns[len(keep):])
            session.turns = keep
            session.last_used = time.monotonic()
        self._release(pins)
        self.num_restores += 1
        return session

    # -- files ------------------------------------------------------------------------
    def save(self, session_id: str, path: str | Path) -> None:
        """Write the session's last turn (rows, tokens, messages) to a snapshot file atomically."""
        session = self.get(session_id)
        with self._lock:
            self._check_open(session)
            if not session.turns or session.turns[-1].pin is None:
                raise ValueError("nothing cached to save: the session has no turn (or it was evicted)")
            last = session.turns[-1]
            pin = self.engine.share(last.pin)  # our own reference: eviction may drop the turn's pin
            metadata = {"system": session.system, "messages": copy.deepcopy(last.messages),
                        "tokens": list(last.tokens)}
        try:
            self.engine.save_snapshot(pin, path, metadata=metadata)
        finally:
            self.engine.release(pin)

    def load(self, path: str | Path) -> Session:
        """A new session from a saved file (missing: FileNotFoundError; a directory, another
        model's file or a damaged one: ValueError; the store changes only on success)."""
        pin, tokens, meta = self.engine.load_snapshot(path)
        try:
            system, messages, saved = _saved_state(meta, tokens)
            self.expire()
            return self._register(system, [SessionTurn(messages, saved, pin)])
        except BaseException:
            self.engine.release(pin)
            raise

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

    # -- helpers (the ones named for the lock expect it held) ---------------------------
    def _register(self, system: str | None, turns: list[SessionTurn]) -> Session:
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise ValueError(f"too many sessions ({self.max_sessions}); delete some first")
            now = time.monotonic()
            session = Session(f"sess-{next(self._ids)}", system, now, now, turns)
            self._sessions[session.session_id] = session
            return session

    @staticmethod
    def _check_open(session: Session) -> None:
        """KeyError for a session deleted (or expired) after it was looked up; lock held."""
        if session.closed:
            raise KeyError(f"no session {session.session_id!r}")

    def _close(self, session: Session) -> list[ChainSnapshot]:
        """Mark a session removed from the store and take its pins; lock held."""
        session.closed = True
        return self._take_pins(session.turns)

    @staticmethod
    def _take_pins(turns: list[SessionTurn]) -> list[ChainSnapshot]:
        """Detach the turns' pins (to release after the lock is dropped); lock held."""
        pins = [t.pin for t in turns if t.pin is not None]
        for t in turns:
            t.pin = None
        return pins

    def _release(self, pins) -> None:
        for pin in pins:
            if pin is not None:
                self.engine.release(pin)

    def _turns_upto(self, session: Session, turn: int | None) -> list[SessionTurn]:
        if turn is None:
            return list(session.turns)
        if not isinstance(turn, int) or isinstance(turn, bool) or not 0 <= turn <= len(session.turns):
            raise ValueError(f"turn must be between 0 and {len(session.turns)}, got {turn!r}")
        return list(session.turns[:turn])


def _saved_state(meta: dict, tokens: list[int]) -> tuple[str | None, list[dict], list[int]]:
    """(system, messages, token ids) from a snapshot file's metadata, checked (ValueError)."""
    system, messages = meta.get("system"), meta.get("messages", [])
    saved = meta.get("tokens", tokens)
    if system is not None and not isinstance(system, str):
        raise ValueError("snapshot metadata: 'system' must be a string or null")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError("snapshot metadata: 'messages' must be a list of objects")
    if not isinstance(saved, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in saved):
        raise ValueError("snapshot metadata: 'tokens' must be a list of integers")
    if saved[:len(tokens)] != tokens:
        raise ValueError("snapshot metadata: 'tokens' does not begin with the file's cached token ids")
    return system, messages, list(saved)
