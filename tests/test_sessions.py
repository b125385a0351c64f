"""Sessions over the async engine: turns, fork and restore at a turn, files, lifetimes, pressure."""

from __future__ import annotations

import asyncio

import pytest

from model_helpers import build_model_dir
from segkv.engine import LLM, AsyncEngine
from segkv.engine.sessions import SessionStore
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
