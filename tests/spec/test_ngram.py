"""N-gram prompt lookup: the rule at each size, and the incremental index against brute force."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from segkv.spec.ngram import NgramIndex, NgramProposer


def brute_force(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule spelled out: for n from max_n down, the latest start i < len - n whose n tokens
    equal the last n; the up to k tokens after it."""
    length = len(token_ids)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = token_ids[length - n:]
        for i in range(length - n - 1, -1, -1):
            if token_ids[i: i + n] == suffix:
                return token_ids[i + n: i + n + k]
    return []


def both(min_n: int, max_n: int, k: int, token_ids: list[int]) -> list[int]:
    """The stateless proposal, checked equal to the index's."""
    proposed = NgramProposer(min_n, max_n, k).propose(token_ids)
    assert NgramIndex(min_n, max_n, token_ids).propose(k) == proposed
    return proposed


def test_docstring_examples():
    assert both(1, 3, 3, [1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2]
    assert both(1, 3, 3, [5, 6, 5, 7, 5]) == [7, 5]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_a_match_at_each_size(n):
    """Only an n-gram of size n recurs: sizes above n find nothing, n finds it."""
    head = list(range(100, 100 + n))
    tokens = head + [7, 8, 9] + [50, 51, 52] + head
    assert both(1, 4, 3, tokens) == [7, 8, 9]
    assert both(n, n, 3, tokens) == [7, 8, 9]
    if n > 1:  # a shorter suffix (the head's last n - 1 tokens) matches at the same place
        assert both(1, n - 1, 2, tokens) == [7, 8]


def test_the_longest_size_wins_over_a_more_recent_shorter_match():
    tokens = [1, 2, 3, 10, 11, 9, 3, 20, 1, 2, 3]
    assert both(1, 3, 2, tokens) == [10, 11]  # the 3-gram at 0, not the 1-gram "3" at 6
    assert both(1, 1, 2, tokens) == [20, 1]


def test_the_most_recent_occurrence_wins():
    tokens = [1, 2, 10, 1, 2, 20, 1, 2, 30, 1, 2]
    assert both(2, 2, 1, tokens) == [30]
    assert both(1, 2, 3, tokens) == [30, 1, 2]


def test_k_caps_the_proposal():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert both(2, 2, 1, tokens) == [3]
    assert both(2, 2, 4, tokens) == [3, 4, 5, 6]
    assert both(2, 2, 16, tokens) == [3, 4, 5, 6, 7, 8, 1, 2]  # up to the sequence's end


def test_proposals_near_the_end_are_shorter():
    """An occurrence overlapping the suffix counts; only the tokens that exist after it are proposed."""
    assert both(2, 2, 5, [9, 4, 4, 4]) == [4]  # "4 4" at 1, followed by the last token only
    assert both(1, 1, 5, [9, 4, 4]) == [4]
    assert both(1, 3, 5, [7, 1, 7, 1, 7]) == [1, 7]  # "7 1 7" at 0


def test_no_match_is_empty():
    assert both(1, 3, 3, [1, 2, 3, 4, 5]) == []
    assert both(2, 3, 3, [1, 2, 1, 3]) == []  # only a 1-gram recurs
    assert both(1, 3, 3, []) == []
    assert both(1, 3, 3, [5]) == []
    assert both(3, 3, 3, [5, 5, 5]) == []  # the suffix itself is no match


def test_bad_sizes_are_errors():
    for args in [(0, 2, 1), (3, 2, 1), (1, 2, 0), (1, True, 1)]:
        with pytest.raises(ValueError):
            NgramProposer(*args)
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(2, 1)
    with pytest.raises(ValueError, match="k must be"):
        NgramIndex(1, 2, [1, 2]).propose(0)
    with pytest.raises(ValueError, match="num_tokens must be between 0 and 2"):
        NgramIndex(1, 2, [1, 2]).truncate(3)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=40), min_n=st.integers(1, 4), extra=st.integers(0, 3),
       k=st.integers(1, 6))
def test_stateless_proposer_equals_the_rule(tokens, min_n, extra, k):
    expected = brute_force(tokens, min_n, min_n + extra, k)
    assert NgramProposer(min_n, min_n + extra, k).propose(tokens) == expected


@settings(max_examples=200, deadline=None)
@given(data=st.data(), min_n=st.integers(1, 3), extra=st.integers(0, 3), k=st.integers(1, 5))
def test_incremental_index_equals_the_rule(data, min_n, extra, k):
    """Random appends (one or many tokens) and truncations (rejected drafts): after each, the
    index proposes what the rule gives for the sequence so far."""
    max_n = min_n + extra
    index = NgramIndex(min_n, max_n)
    tokens: list[int] = []
    for _ in range(data.draw(st.integers(1, 12))):
        if tokens and data.draw(st.booleans()):
            keep = data.draw(st.integers(0, len(tokens)))
            index.truncate(keep)
            del tokens[keep:]
        else:
            more = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=10))
            if len(more) == 1 and data.draw(st.booleans()):
                index.append(more[0])
            else:
                index.extend(more)
            tokens += more
        assert index.token_ids == tokens and len(index) == len(tokens)
        assert index.propose(k) == brute_force(tokens, min_n, max_n, k)
    # rebuilt from scratch: the same tables as after the appends and truncations
    assert index._starts == NgramIndex(min_n, max_n, tokens)._starts


def test_proposer_makes_an_index_of_its_sizes():
    proposer = NgramProposer(2, 3, 2)
    index = proposer.new_index([1, 2, 3, 1, 2])
    assert (index.min_n, index.max_n) == (2, 3)
    assert index.propose(proposer.k) == proposer.propose([1, 2, 3, 1, 2]) == [3, 1]
