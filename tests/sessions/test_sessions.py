"""Sessions over the async engine: turns, fork and restore at a turn, files, lifetimes, pressure."""

from __future__ import annotations

import asyncio

import pytest

from model_helpers import build_model_dir
from segkv.engine import LLM, AsyncEngine
from segkv.sessions.store import SessionStore
from segkv.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sessions-model")
    build_model_dir(directory, "qwen3")
    return directory


@pytest.fixture
def store(model_dir):
    engine = AsyncEngine(LLM(model_dir, page_size=8, num_pages=600))
    yield SessionStore(engine)
    engine.shutdown()


def say(store, session_id, text):
    async def run():
        last = None
        async for update in store.say(session_id, text, GREEDY):
            last = update
        return last.output
    return asyncio.run(run())


def fresh(store, messages):
    ids = store.engine.llm.tokenizer.encode_chat(messages, add_generation_prompt=True)
    return store.engine.llm.generate([ids], GREEDY)[0].outputs[0].token_ids


def test_turns_fork_and_restore_match_fresh_histories(store):
    pool = store.engine.llm.cache.pool
    s = store.create(system="Be brief.")
    first = say(store, s.session_id, "one")
    second = say(store, s.session_id, "two")
    assert second.num_cached_tokens > 0  # the first turn's rows were reused
    assert second.outputs[0].token_ids == fresh(store, s.turns[0].messages + [{"role": "user", "content": "two"}])

    allocated = pool.pages_allocated_total
    child = store.fork(s.session_id, turn=1)
    store.restore(s.session_id, 1)
    assert pool.pages_allocated_total == allocated  # fork and restore allocate nothing
    assert len(child.turns) == 1 and len(s.turns) == 1

    branch = say(store, child.session_id, "three")
    expected = fresh(store, child.turns[0].messages + [{"role": "user", "content": "three"}])
    assert branch.outputs[0].token_ids == expected and branch.num_cached_tokens > 0
    redo = say(store, s.session_id, "two")
    assert redo.outputs[0].token_ids == second.outputs[0].token_ids
    assert first.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError):
        store.restore(s.session_id, 9)
    with pytest.raises(KeyError):
        store.get("sess-none")


def test_save_load_and_delete(store, tmp_path):
    s = store.create()
    say(store, s.session_id, "remember this")
    store.save(s.session_id, tmp_path / "s.segkv")
    loaded = store.load(tmp_path / "s.segkv")
    assert loaded.messages == s.messages
    a = say(store, s.session_id, "next")
    b = say(store, loaded.session_id, "next")
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and b.num_cached_tokens > 0
    for session in store.list():
        store.delete(session.session_id)
    store.engine.core.prefix.clear()
    assert store.engine.llm.cache.pool.pages_in_use == 0
    with pytest.raises(ValueError, match="nothing cached to save"):
        store.save(store.create().session_id, tmp_path / "x")
    with pytest.raises(FileNotFoundError):
        store.load(tmp_path / "missing.segkv")


def test_idle_sessions_are_evicted_under_pressure_and_expire(model_dir):
    engine = AsyncEngine(LLM(model_dir, page_size=4, num_pages=60))
    store = SessionStore(engine, ttl_seconds=3600)
    try:
        sessions = [store.create() for _ in range(6)]
        for i, s in enumerate(sessions):  # each pins its own history; together they exceed the cache
            say(store, s.session_id, f"{i} " + "a long message about segments, pages and forks " * 2)
        assert store.num_evicted_pins > 0
        assert sessions[0].turns[0].pin is None  # the least recently used lost its pin first
        again = say(store, sessions[0].session_id, "still there?")  # and still works (recompute)
        assert again.outputs[0].finish_reason == "length"
        store.ttl_seconds = 0
        assert store.expire() == 6 and store.list() == []
    finally:
        engine.shutdown()


# -- no pin outlives its session: deletes, expiry, cancels, failures and forks during a turn ----
def idle_pages(store) -> int:
    """Pages in use once every evictable cached segment is gone: with no session and no request
    left this is 0, and the prefix index is empty (nothing else holds a cached segment)."""
    with store.engine._lock:
        store.engine.core.prefix.evict(store.engine.core.pool.num_pages)
        return store.engine.core.pool.pages_in_use


def live_pins(session) -> int:
    return sum(t.pin is not None and t.pin.live for t in session.turns)


async def started(store, session_id, text):
    """A turn's stream after its first update (the turn is not recorded yet)."""
    stream = store.say(session_id, text, GREEDY)
    first = await stream.__anext__()
    assert not first.finished
    return stream


async def drain(stream):
    last = None
    async for update in stream:
        last = update
    return last


def test_a_session_deleted_during_a_turn_releases_every_pin(store):
    assert idle_pages(store) == 0

    async def run():
        s = store.create(system="Be brief.")
        await drain(store.say(s.session_id, "first", GREEDY))
        stream = await started(store, s.session_id, "second")
        store.delete(s.session_id)
        assert live_pins(s) == 0  # the finished turn's pin went with the session
        last = await drain(stream)  # the client still gets its reply ...
        assert last.finished and last.output.outputs[0].finish_reason == "length"
        return s

    s = asyncio.run(run())
    assert len(s.turns) == 1 and live_pins(s) == 0  # ... but the turn was not recorded or pinned
    assert store.list() == [] and not s.busy
    assert store.engine.stats()["prefix"]["num_shared_nodes"] == 0
    assert idle_pages(store) == 0 and len(store.engine.core.prefix) == 0
    with pytest.raises(KeyError):
        say(store, s.session_id, "again")


def test_expiry_skips_a_turn_in_flight_and_takes_the_session_after_it(store):
    async def run():
        s = store.create()
        await drain(store.say(s.session_id, "first", GREEDY))
        stream = await started(store, s.session_id, "second")
        store.ttl_seconds = 0
        assert store.expire() == 0 and store.get(s.session_id) is s  # busy: not expired
        await drain(stream)
        assert len(s.turns) == 2 and live_pins(s) == 2
        assert store.expire() == 1 and live_pins(s) == 0

    asyncio.run(run())
    assert store.list() == [] and idle_pages(store) == 0


def test_a_session_expired_by_another_call_during_a_turn_pins_nothing(store):
    """Expiry never takes a busy session; were the busy flag lost, the turn ending after the
    expiry would still pin nothing: the session's closed mark, not the flag, guards the pin."""
    async def run():
        s = store.create()
        stream = await started(store, s.session_id, "hello")
        s.busy = False
        store.ttl_seconds = 0
        assert store.expire() == 1
        await drain(stream)
        return s

    s = asyncio.run(run())
    assert s.turns == [] and idle_pages(store) == 0


@pytest.mark.parametrize("how", ["cancel", "aclose"])
def test_a_cancelled_turn_records_and_pins_nothing(store, how):
    async def run():
        s = store.create()
        await drain(store.say(s.session_id, "first", GREEDY))
        pins_before = [t.pin for t in s.turns]
        if how == "aclose":  # the client left between two updates
            stream = await started(store, s.session_id, "second")
            await stream.aclose()
        else:  # the handler's task was cancelled while waiting for the next update
            stream = await started(store, s.session_id, "second")
            task = asyncio.ensure_future(drain(stream))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert [t.pin for t in s.turns] == pins_before and not s.busy
        assert store.engine.core.requests == {}  # the request was aborted
        again = await drain(store.say(s.session_id, "third", GREEDY))  # the session goes on
        assert again.finished and len(s.turns) == 2 and live_pins(s) == 2
        return s

    s = asyncio.run(run())
    store.delete(s.session_id)
    assert idle_pages(store) == 0


def test_a_turn_whose_request_fails_records_and_pins_nothing(store, monkeypatch):
    core = store.engine.core
    real_step = core.step

    def failing_step():
        monkeypatch.setattr(core, "step", real_step)
        raise RuntimeError("device lost")

    s = store.create()
    say(store, s.session_id, "first")
    monkeypatch.setattr(core, "step", failing_step)
    with pytest.raises(RuntimeError, match="device lost"):
        say(store, s.session_id, "second")
    assert len(s.turns) == 1 and live_pins(s) == 1 and not s.busy
    with pytest.raises(ValueError):  # a prompt too long for the model: refused before any work
        say(store, s.session_id, "x" * 10_000)
    assert len(s.turns) == 1 and not s.busy
    store.delete(s.session_id)
    assert idle_pages(store) == 0


def test_fork_restore_and_save_during_a_turn(store, tmp_path):
    async def run():
        s = store.create(system="sys")
        await drain(store.say(s.session_id, "first", GREEDY))
        stream = await started(store, s.session_id, "second")
        child = store.fork(s.session_id)  # the turn in flight is not part of the fork
        with pytest.raises(ValueError, match="generating"):
            store.restore(s.session_id, 0)
        store.save(s.session_id, tmp_path / "s.segkv")  # saves the last finished turn
        store.delete(s.session_id)
        await drain(stream)
        return s, child

    s, child = asyncio.run(run())
    assert len(child.turns) == 1 and live_pins(child) == 1 and len(s.turns) == 1
    assert child.messages == s.turns[0].messages
    loaded = store.load(tmp_path / "s.segkv")
    assert loaded.messages == child.messages and loaded.turns[0].tokens == child.turns[0].tokens
    assert say(store, child.session_id, "next").outputs[0].token_ids == \
        say(store, loaded.session_id, "next").outputs[0].token_ids
    for session in store.list():
        store.delete(session.session_id)
    assert idle_pages(store) == 0


def test_loads_that_fail_change_nothing(store, tmp_path):
    s = store.create()
    say(store, s.session_id, "keep me")
    store.save(s.session_id, tmp_path / "s.segkv")
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="is a directory"):
        store.load(tmp_path / "folder")
    with pytest.raises(FileNotFoundError):
        store.load(tmp_path / "folder" / "missing.segkv")
    store.max_sessions = 1  # the file is read, then the store refuses: its rows go back
    with pytest.raises(ValueError, match="too many sessions"):
        store.load(tmp_path / "s.segkv")
    with pytest.raises(ValueError, match="too many sessions"):
        store.fork(s.session_id)
    assert store.list() == [s] and live_pins(s) == 1
    store.delete(s.session_id)
    assert idle_pages(store) == 0


def saved_and_deleted(store, path):
    """A one-turn session saved to ``path`` and deleted; returns it and the pages its file needs
    (pages of 4 rows)."""
    s = store.create()
    say(store, s.session_id, "a message worth saving " * 2)
    store.save(s.session_id, path)
    store.delete(s.session_id)
    return s, len(s.turns[0].tokens) // 4 + 1


def test_a_load_evicts_unreferenced_cached_segments_to_make_room(model_dir, tmp_path):
    engine = AsyncEngine(LLM(model_dir, page_size=4, num_pages=60))
    store = SessionStore(engine)
    try:
        s, need = saved_and_deleted(store, tmp_path / "s.segkv")
        for i in range(20):  # stateless requests: their rows stay cached (evictable) in the index
            ids = engine.llm.tokenizer.encode_chat([{"role": "user", "content": f"{i} filler text"}],
                                                   add_generation_prompt=True)
            asyncio.run(_generate(engine, ids))
            if engine.core.pool.num_free_pages < need:
                break
        assert engine.core.pool.num_free_pages < need and engine.core.prefix.num_evictable_pages() > 0
        loaded = store.load(tmp_path / "s.segkv")
        assert loaded.messages == s.turns[0].messages and live_pins(loaded) == 1
        store.delete(loaded.session_id)
        assert idle_pages(store) == 0
    finally:
        engine.shutdown()


async def _generate(engine, ids):
    async for _ in engine.generate(ids, GREEDY):
        pass


def test_a_load_takes_the_pins_of_idle_sessions_when_cached_segments_are_not_enough(model_dir, tmp_path):
    engine = AsyncEngine(LLM(model_dir, page_size=4, num_pages=60))
    store = SessionStore(engine)
    try:
        s, need = saved_and_deleted(store, tmp_path / "s.segkv")
        idle = []
        for i in range(20):  # idle sessions pin their histories: nothing is evictable by the index
            idle.append(store.create())
            say(store, idle[-1].session_id, f"{i} " + "filler text about pages " * 2)
            with engine._lock:
                engine.core.prefix.evict(engine.core.pool.num_pages)
                free = engine.core.pool.num_free_pages
            if free < need:
                break
        assert free < need and engine.core.prefix.num_evictable_pages() == 0
        evicted = store.num_evicted_pins
        loaded = store.load(tmp_path / "s.segkv")  # before: OutOfPagesError
        assert store.num_evicted_pins > evicted and idle[0].turns[0].pin is None  # LRU first
        assert loaded.messages == s.turns[0].messages and live_pins(loaded) == 1
        for session in [loaded, *idle]:
            store.delete(session.session_id)
        assert idle_pages(store) == 0
    finally:
        engine.shutdown()
