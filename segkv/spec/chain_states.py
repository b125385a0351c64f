"""A drafter's per-sequence states (its own cache chain for each target chain), keyed weakly.

A drafter with a cache of its own (a draft model, an EAGLE-3 head) keeps one state per live
sequence, keyed by the sequence's target chain through a weak reference: a state is released
when its target chain goes away (the request ended, was preempted, or the conversation holding it
was dropped). A new sequence may start by forking the live state that shares the longest token
prefix with it (siblings, conversation forks: pages shared, no copy). When the drafter's cache
is short of pages, the least recently used states of other sequences are released.

The key's death may come at any time (the cyclic collector runs anywhere): while a call holds
:attr:`ChainStates.lock`, the release is queued and done at the next call's :meth:`begin_call`.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from segkv.cache.chain import KVChain

# a new state forks a live one only when they share at least this many tokens
MIN_FORK_TOKENS = 16
FORK_CANDIDATES = 64  # most recent states a new sequence may fork from


class ChainState(Protocol):
    """What the registry reads of a state: its chain, its key, its tokens and when it was used."""

    chain: KVChain
    key: weakref.ref
    token_ids: list[int]
    last_used: int


S = TypeVar("S", bound=ChainState)


class ChainStates(Generic[S]):
    """States keyed by ``id(target chain)`` (see the module docstring). Callers hold :attr:`lock`
    for a whole call, starting it with :meth:`begin_call`; :attr:`clock` counts calls."""

    def __init__(self) -> None:
        self._states: dict[int, S] = {}
        self._dead: list[tuple[int, weakref.ref]] = []  # states whose key died while a call ran
        self.lock = threading.Lock()
        self.clock = 0
        self.evictions = 0  # states released to make room

    def __len__(self) -> int:
        return len(self._states)

    def begin_call(self) -> None:
        """Release the states whose keys died during the last call, and tick the clock."""
        while self._dead:
            self._forget(*self._dead.pop())
        self.clock += 1

    def get(self, key: Any) -> S | None:
        """``key``'s live state (marked used now), or None."""
        state = self._states.get(id(key))
        if state is not None and state.key() is key:
            state.last_used = self.clock
            return state
        return None

    def fork_source(self, ids: list[int]) -> S | None:
        """The recent state sharing the longest prefix (at least ``MIN_FORK_TOKENS``) with ``ids``.
        Only the newest states are scanned (a fork's parent was made or used just before):
        scanning every one would make a batch of N new sequences cost N^2 / 2 comparisons."""
        best, best_len = None, MIN_FORK_TOKENS - 1
        for other in itertools.islice(reversed(self._states.values()), FORK_CANDIDATES):
            if other.token_ids[:1] == ids[:1]:
                n = common_prefix(other.token_ids, ids)
                if n > best_len:
                    best, best_len = other, n
        return best

    def key_ref(self, key: Any) -> weakref.ref:
        """A weak reference to ``key`` whose death releases ``key``'s state."""
        this = weakref.ref(self)
        return weakref.ref(key, lambda r, k=id(key): (p := this()) is not None and p._key_died(k, r))

    def put(self, key: Any, state: S) -> S:
        """Make ``state`` ``key``'s (a dead key's state still queued under a reused id is released)."""
        old = self._states.get(id(key))
        if old is not None:
            old.chain.release()
        self._states[id(key)] = state
        return state

    def evict_idle(self, busy: set[int], fits: Callable[[], bool]) -> None:
        """Release least recently used states not in ``busy`` (``id(state)``s) until ``fits()``."""
        if fits():
            return
        idle = sorted((kv for kv in self._states.items() if id(kv[1]) not in busy),
                      key=lambda kv: kv[1].last_used)
        for key_id, state in idle:
            if fits():
                break
            state.chain.release()
            del self._states[key_id]
            self.evictions += 1

    def release_all(self) -> None:
        """Release every state (their caches' pages all go back)."""
        with self.lock:
            for state in self._states.values():
                state.chain.release()
            self._states.clear()
            self._dead.clear()

    def _key_died(self, key_id: int, ref: weakref.ref) -> None:
        """A target chain went away: release its state now, or at the next call if one runs."""
        if self.lock.acquire(blocking=False):
            try:
                self._forget(key_id, ref)
            finally:
                self.lock.release()
        else:
            self._dead.append((key_id, ref))

    def _forget(self, key_id: int, ref: weakref.ref) -> None:
        state = self._states.get(key_id)
        if state is not None and state.key is ref:
            state.chain.release()
            del self._states[key_id]


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (slice comparisons, so the
    work per call is a few list compares rather than a Python loop over every token)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid
    return low
