"""Sessions as a state machine: turns left running while sessions are created, forked,
restored, deleted, expired, saved and loaded; no pin ever outlives its session.

Invariants after every step (under the engine lock, so the engine thread stands still):
  * the store's sessions are the model's, with the turn counts the model expects;
  * a deleted or expired session holds no live pin (its running turn, ended later, adds none);
  * every page's reference count is exactly what its holders account for: the prefix index,
    the pins of live sessions, and the chains of requests still in the engine (a pin leaked by
    a deleted session is a count nobody accounts for); the free list has the pages at 0.
At teardown, with every turn ended and every session deleted, the pool is back at baseline:
after evicting every unreferenced cached segment no page is in use and the index is empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.errors import FlakyFailure, FlakyStrategyDefinition
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from model_helpers import build_model_dir
from segkv.cache import OutOfPagesError
from segkv.engine import LLM, AsyncEngine
from segkv.sessions.store import SessionStore
from segkv.sampling_params import SamplingParams

WORDS = ["hi", "fork here", "tell me more", "ok", "pages and segments", "why?"]
MAX_RUNNING = 3  # turns in flight at once
TIMEOUT = 30.0  # seconds for a turn to end: far above the few milliseconds one takes
INDEX = st.integers(0, 50)  # an index into the sessions (or turns) there are, modulo their number
ACTIONS = {
    "create": st.fixed_dictionaries({"system": st.sampled_from([None, "Be brief."])}),
    "start_turn": st.fixed_dictionaries({"index": INDEX, "text": st.sampled_from(WORDS),
                                         "max_tokens": st.integers(1, 3), "leave_early": st.booleans()}),
    "let_the_loop_run": st.fixed_dictionaries({"index": INDEX}),
    "finish_turn": st.fixed_dictionaries({"index": INDEX}),
    "cancel_turn": st.fixed_dictionaries({"index": INDEX}),
    "fail_the_next_engine_step": st.just({}),
    "fork": st.fixed_dictionaries({"index": INDEX, "busy": st.booleans(),
                                   "turn": st.none() | st.integers(0, 6)}),
    "restore": st.fixed_dictionaries({"index": INDEX, "busy": st.booleans(), "turn": st.integers(0, 6)}),
    "delete": st.fixed_dictionaries({"index": INDEX, "busy": st.booleans()}),
    "expire": st.fixed_dictionaries({"index": INDEX, "busy": st.booleans()}),
    "save": st.fixed_dictionaries({"index": INDEX, "busy": st.booleans()}),
    "load": st.fixed_dictionaries({"index": INDEX}),
    "load_what_is_no_file": st.fixed_dictionaries({"what": st.sampled_from(["dir", "missing"])}),
}
# how often each action is drawn (turns most: they are what the other actions race with)
WEIGHTS = {"create": 3, "start_turn": 5, "let_the_loop_run": 2, "finish_turn": 3, "cancel_turn": 1,
           "fail_the_next_engine_step": 1, "fork": 2, "restore": 2, "delete": 2, "expire": 1,
           "save": 2, "load": 2, "load_what_is_no_file": 1}
SCHEDULE = [name for name, weight in WEIGHTS.items() for _ in range(weight)]


@dataclass
class RunLog:
    """What the runs of one test did: how turns ended, and every check that failed (hypothesis
    replays a failing run to print it; when the replay goes another way it reports that, so the
    first failure is kept here too)."""

    outcomes: Counter = field(default_factory=Counter)
    failures: list[AssertionError] = field(default_factory=list)

    def first_failure(self, exc: BaseException) -> BaseException:
        return self.failures[0] if self.failures else exc


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("stateful-sessions-model")
    build_model_dir(directory, "qwen3")
    return directory


def idle_pages(engine: AsyncEngine) -> int:
    """The baseline measure: pages in use after evicting every unreferenced cached segment."""
    with engine._lock:
        engine.core.prefix.evict(engine.core.pool.num_pages)
        return engine.core.pool.pages_in_use


async def consume(store: SessionStore, session_id: str, text: str, params: SamplingParams,
                  started: asyncio.Event, gate: asyncio.Event, *, leave_early: bool) -> str:
    """Run one turn as a slow client would: after each update wait for ``gate`` (the turn
    stays in flight, unrecorded, until a rule opens it); return how it ended (a cancel
    propagates). The stream is closed on the way out, as the server's handlers do."""
    stream = store.say(session_id, text, params)
    try:
        async for update in stream:
            started.set()
            if leave_early and not update.finished:
                return "left"  # the client left mid-reply
            await gate.wait()
        return "done"
    except RuntimeError:  # the engine step failed (injected, or out of pages)
        return "failed"
    except ValueError:  # refused: the history grew too long for the model or the cache
        return "refused"
    finally:
        started.set()
        await stream.aclose()


class SessionMachine(RuleBasedStateMachine):
    """The store against a model of it: expected turn counts per live session."""

    store_class = SessionStore

    def __init__(self, model_dir, files_dir, log: RunLog) -> None:
        super().__init__()
        self.log = log
        self.engine = AsyncEngine(LLM(model_dir, page_size=8, num_pages=64))
        self.store = self.store_class(self.engine)
        self.baseline = idle_pages(self.engine)
        self.loop = asyncio.new_event_loop()
        self.files_dir = files_dir / f"run-{time.monotonic_ns()}"
        self.files_dir.mkdir()
        self.expected: dict[str, int] = {}  # live session id -> turns
        self.gone: list = []  # deleted or expired session objects
        self.running: dict[str, asyncio.Task] = {}  # session id -> its turn in flight
        self.gates: dict[str, asyncio.Event] = {}  # session id -> set: its client reads on
        self.files: dict[str, list[dict]] = {}  # saved file name -> messages
        self.fail_next_step = False
        core, real_step = self.engine.core, self.engine.core.step

        def step():
            if self.fail_next_step:
                self.fail_next_step = False
                raise RuntimeError("injected step failure")
            return real_step()

        core.step = step

    # -- helpers ----------------------------------------------------------------------
    # Rules have no preconditions and draw the same whatever the state: which turns ended by
    # when depends on the engine thread's timing, so the choices made must not.
    def pick(self, index: int, busy: bool = False) -> str | None:
        """A live session; with ``busy``, one with a turn in flight if there is one."""
        ids = sorted(set(self.running) & set(self.expected) if busy and self.running else self.expected)
        return ids[index % len(ids)] if ids else None

    def pick_running(self, index: int) -> str | None:
        ids = sorted(self.running)
        return ids[index % len(ids)] if ids else None

    def run_loop(self, until=None) -> None:
        """Let the loop run (until ``until`` is done, or briefly), then collect ended turns.

        Turns advance only here: between two calls no task runs, so the model and the
        store agree at every rule boundary (the engine thread only queues updates)."""
        until = until or asyncio.sleep(0.002)
        self.loop.run_until_complete(asyncio.wait_for(until, TIMEOUT))
        self.collect()

    def collect(self) -> None:
        for sid, task in list(self.running.items()):
            if not task.done():
                continue
            del self.running[sid]
            outcome = "cancelled" if task.cancelled() else task.result()
            self.log.outcomes[outcome] += 1
            if outcome == "done" and sid in self.expected:
                self.expected[sid] += 1

    def forget(self, session) -> None:
        del self.expected[session.session_id]
        self.gone.append(session)

    # -- actions (one rule draws which, and its arguments) ---------------------------
    @rule(data=st.data())
    def act(self, data):
        name = data.draw(st.sampled_from(SCHEDULE), label="action")
        with self.logged():
            getattr(self, name)(**data.draw(ACTIONS[name], label=name))

    @contextlib.contextmanager
    def logged(self):
        try:
            yield
        except AssertionError as exc:
            self.log.failures.append(exc)
            raise

    def create(self, system):
        self.expected[self.store.create(system).session_id] = 0

    def start_turn(self, index, text, max_tokens, leave_early):
        """Start a turn and leave it running (after its first update) for later rules."""
        sid = self.pick(index)
        if sid is None:
            return
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        if sid in self.running:  # one turn at a time per session
            try:
                with pytest.raises(ValueError, match="already generating"):
                    self.loop.run_until_complete(self.store.say(sid, text, params).__anext__())
            finally:
                self.collect()  # other turns may have advanced while the loop ran
            return
        if len(self.running) >= MAX_RUNNING:
            return
        started, self.gates[sid] = asyncio.Event(), asyncio.Event()
        coro = consume(self.store, sid, text, params, started, self.gates[sid], leave_early=leave_early)
        self.running[sid] = self.loop.create_task(coro)
        self.run_loop(started.wait())

    def let_the_loop_run(self, index):
        """One client reads on; the loop runs a moment (its turn may end now or later)."""
        sid = self.pick_running(index)
        if sid is not None:
            self.gates[sid].set()
        self.run_loop()

    def finish_turn(self, index):
        sid = self.pick_running(index)
        if sid is not None:
            self.gates[sid].set()
            self.run_loop(asyncio.wait([self.running[sid]]))

    def cancel_turn(self, index):
        """A client disconnect: the handler's task is cancelled while it waits."""
        sid = self.pick_running(index)
        if sid is not None:
            task = self.running[sid]
            task.cancel()
            self.run_loop(asyncio.wait([task]))

    def fail_the_next_engine_step(self):
        self.fail_next_step = bool(self.running)

    def fork(self, index, busy, turn):
        sid = self.pick(index, busy)
        if sid is None:
            return
        have = self.expected[sid]
        if turn is not None and turn > have:
            with pytest.raises(ValueError, match="turn must be between"):
                self.store.fork(sid, turn)
            return
        child = self.store.fork(sid, turn)  # a turn in flight is not part of the fork
        self.expected[child.session_id] = have if turn is None else turn

    def restore(self, index, busy, turn):
        sid = self.pick(index, busy)
        if sid is None:
            return
        if sid in self.running:
            with pytest.raises(ValueError, match="generating"):
                self.store.restore(sid, turn)
        elif turn > self.expected[sid]:
            with pytest.raises(ValueError, match="turn must be between"):
                self.store.restore(sid, turn)
        else:
            self.store.restore(sid, turn)
            self.expected[sid] = turn

    def delete(self, index, busy=False):
        sid = self.pick(index, busy)
        if sid is None:
            return
        session = self.store.get(sid)
        self.store.delete(sid)
        self.forget(session)

    def expire(self, index, busy):
        """Make one session look idle past its lifetime; a busy one is not expired."""
        sid = self.pick(index, busy)
        if sid is None:
            return
        session = self.store.get(sid)
        session.last_used = time.monotonic() - self.store.ttl_seconds - 1
        busy = sid in self.running
        assert self.store.expire() == (0 if busy else 1)
        if not busy:
            self.forget(session)

    def save(self, index, busy):
        sid = self.pick(index, busy)
        if sid is None:
            return
        session = self.store.get(sid)
        name = f"s{len(self.files)}.segkv"
        try:
            self.store.save(sid, self.files_dir / name)
        except ValueError as exc:  # no turn yet, or its pin was evicted under memory pressure
            assert "nothing cached" in str(exc)
            assert not session.turns or session.turns[-1].pin is None
            assert not (self.files_dir / name).exists()
            return
        self.files[name] = session.turns[-1].messages

    def load(self, index):
        if not self.files:
            return
        name = sorted(self.files)[index % len(self.files)]
        try:
            session = self.store.load(self.files_dir / name)
        except OutOfPagesError:  # pins of busy sessions and running turns fill the cache
            self.log.outcomes["load refused"] += 1
            return
        assert session.messages == self.files[name]
        self.expected[session.session_id] = 1

    def load_what_is_no_file(self, what):
        before = len(self.store.list())
        path = self.files_dir if what == "dir" else self.files_dir / "missing.segkv"
        with pytest.raises(ValueError if what == "dir" else FileNotFoundError):
            self.store.load(path)
        assert len(self.store.list()) == before

    # -- invariants -------------------------------------------------------------------
    @invariant()
    def check(self):
        with self.logged():
            self.sessions_match_the_model()
            self.no_pin_outlives_its_session()
            self.every_page_reference_is_accounted_for()

    def sessions_match_the_model(self):
        live = {s.session_id: s for s in self.store.list()}
        assert sorted(live) == sorted(self.expected)
        for sid, session in live.items():
            assert len(session.turns) == self.expected[sid], sid
            assert session.busy == (sid in self.running), sid

    def no_pin_outlives_its_session(self):
        for session in self.gone:
            leaked = [t for t in session.turns if t.pin is not None and t.pin.live]
            assert not leaked, f"leak: deleted session {session.session_id} holds {len(leaked)} pins"

    def every_page_reference_is_accounted_for(self):
        with self.engine._lock:
            core, pool = self.engine.core, self.engine.core.pool
            expected = core.prefix.page_holds()
            for session in self.store.list():
                for t in session.turns:
                    if t.pin is not None:
                        assert t.pin.live and all(ref.live for ref in t.pin.refs)
                        for ref in t.pin.refs:
                            expected.update(ref.page_ids)
            for seq in [*core.running, *core.waiting]:
                for ref in seq.chain.refs:
                    expected.update(ref.page_ids)
                if seq.chain.tail is not None:
                    expected.update(seq.chain.tail.page_ids)
            actual = Counter({p: pool.ref_count(p) for p in range(pool.num_pages) if pool.ref_count(p)})
            assert actual == expected, f"leak: page references nobody accounts for: {actual - expected}"
            assert pool.pages_in_use == len(actual) and pool.num_free_pages == pool.num_pages - len(actual)

    # -- the end ----------------------------------------------------------------------
    def teardown(self):
        try:
            with self.logged():
                self.end()
        finally:
            for task in self.running.values():
                task.cancel()
            self.loop.run_until_complete(asyncio.sleep(0))
            self.loop.close()
            self.engine.shutdown()

    def end(self):
        """Every turn ended, every session deleted: the pool is back at its baseline."""
        while self.running:  # each call ends at least one turn (others may end meanwhile)
            self.finish_turn(0)
        for session in self.store.list():
            self.store.delete(session.session_id)
            self.forget(session)
        self.no_pin_outlives_its_session()
        deadline = time.monotonic() + TIMEOUT
        while self.engine.core.requests:  # aborted and finished requests leave at once
            assert time.monotonic() < deadline, "the engine did not become idle"
            time.sleep(0.001)
        self.every_page_reference_is_accounted_for()
        assert idle_pages(self.engine) == self.baseline == 0
        assert len(self.engine.core.prefix) == 0  # nothing else held a cached segment


# No shrinking: turns race the engine thread, so a replay may take other paths (hypothesis would
# then report a flaky test instead of the failure); the failing run is printed as it happened.
STEPS = settings(stateful_step_count=200, max_examples=5, deadline=None,
                 phases=[Phase.explicit, Phase.generate])


def test_sessions_never_leak_pins(model_dir, tmp_path):
    log = RunLog()
    try:
        run_state_machine_as_test(lambda: SessionMachine(model_dir, tmp_path, log), settings=STEPS)
    except (FlakyFailure, FlakyStrategyDefinition) as exc:  # the replay went another way
        raise log.first_failure(exc) from exc
    # the runs exercised the paths this test is about, not only the easy one
    outcomes = log.outcomes
    assert outcomes["done"] > 0 and outcomes["cancelled"] + outcomes["left"] > 0, outcomes


class LeakyStore(SessionStore):
    """The store as it was: a turn ending after its session was deleted still pins its history."""

    def _record(self, session, turn):
        turn.pin, _ = self.engine.pin(turn.tokens)
        session.turns.append(turn)


class LeakyMachine(SessionMachine):
    store_class = LeakyStore


def test_the_invariants_catch_a_turn_that_pins_after_its_session_was_deleted(model_dir, tmp_path):
    """The bug, driven by hand: the invariant check names the leak (and passes before it)."""
    m = LeakyMachine(model_dir, tmp_path, RunLog())
    try:
        m.create(system=None)
        m.start_turn(index=0, text="hi", max_tokens=3, leave_early=False)
        m.every_page_reference_is_accounted_for()
        m.no_pin_outlives_its_session()
        m.delete(index=0)
        m.let_the_loop_run(index=0)
        m.finish_turn(index=0)
        m.sessions_match_the_model()
        with pytest.raises(AssertionError, match="leak: deleted session"):
            m.no_pin_outlives_its_session()
        with pytest.raises(AssertionError, match="leak: page references nobody accounts for"):
            m.every_page_reference_is_accounted_for()
    finally:
        m.running.clear()
        m.loop.close()
        m.engine.shutdown()


def test_the_state_machine_finds_the_leak_by_itself(model_dir, tmp_path):
    """Hypothesis, not a script, finds the delete-during-a-turn leak in the old store."""
    quick = settings(stateful_step_count=200, max_examples=10, deadline=None, phases=[Phase.generate],
                     report_multiple_bugs=False)
    log = RunLog()
    with pytest.raises((AssertionError, FlakyFailure, FlakyStrategyDefinition)):
        run_state_machine_as_test(lambda: LeakyMachine(model_dir, tmp_path, log), settings=quick)
    assert str(log.failures[0]).startswith("leak: "), log.failures[0]
