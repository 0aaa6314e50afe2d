"""The delta-request history store: exact prefixes only, LRU over a budget that counts every
user (a flood of ids with empty histories is bounded too)."""

from __future__ import annotations

import numpy as np
import pytest

from streamgr.cache.history import USER_COST, HistoryStore
from streamgr.errors import HistoryRequired


def arr(*x):
    return np.asarray(x, dtype=np.int64)


def test_delta_extends_exactly_the_prefix_held():
    h = HistoryStore(1000)
    h.remember("u", arr(1, 2, 3), arr(0, 1, 0))
    res = h.resolve("u", 3, arr(4), arr(1))
    assert res.items.tolist() == [1, 2, 3, 4] and res.actions.tolist() == [0, 1, 0, 1]
    assert res.tokens.tolist() == [1, 0, 2, 1, 3, 0, 4, 1] and res.events == 4
    with pytest.raises(HistoryRequired):
        h.resolve("u", 2, arr(9), arr(0))
    with pytest.raises(HistoryRequired):
        h.resolve("someone else", 0, arr(9), arr(0))


def test_users_with_empty_histories_are_bounded():
    cap = 100 * USER_COST
    h = HistoryStore(cap)
    for u in range(40_000):
        h.remember(u, arr(), arr())
    assert len(h) == 100  # not 40,000: each entry costs its own memory
    assert h.known(39_999) == 0 and h.known(0) is None  # the oldest went first


def test_budget_counts_events_and_users():
    h = HistoryStore(2 * (10 + USER_COST))
    for u in range(5):
        h.remember(u, np.arange(10), np.zeros(10, dtype=np.int64))
    assert len(h) == 2 and h.known(4) == 10 and h.known(2) is None
    h.remember("big", np.arange(10_000), np.zeros(10_000, dtype=np.int64))  # over the budget
    assert h.known("big") is None and len(h) == 2


def test_resolved_histories_name_the_held_history_they_extend():
    h = HistoryStore(1000)
    first = h.resolve("u", None, arr(1, 2), arr(0, 1), match_full=True)
    assert first.base is None  # nothing held yet
    h.keep("u", first)
    full = h.resolve("u", None, arr(1, 2, 3), arr(0, 1, 1), match_full=True)
    assert full.base == (first.stamp, 2) and full.stamp != first.stamp
    assert h.resolve("u", None, arr(1, 2, 3), arr(0, 1, 1)).base is None  # not asked to match
    assert h.resolve("u", None, arr(1, 9, 3), arr(0, 1, 1), match_full=True).base is None
    assert h.resolve("u", None, arr(1, 2), arr(0, 0), match_full=True).base is None  # an action
    assert h.resolve("u", None, arr(1), arr(0), match_full=True).base is None  # shorter
    delta = h.resolve("u", 2, arr(3), arr(1))
    assert delta.base == (first.stamp, 2) and list(delta.items) == [1, 2, 3]
    stamps = {first.stamp, full.stamp, delta.stamp}
    assert len(stamps) == 3


def test_extending_a_held_history_appends_in_place_and_never_moves_what_was_handed_out():
    """A request that extends the held history appends its events into the held buffer (no
    copy of the history, amortized), a grown buffer leaves earlier views intact, tokens that
    a failed batch appended are written over by the next request, and kept histories count
    their buffers' spare room against the budget."""
    h = HistoryStore(10_000)
    first = h.resolve("u", None, np.arange(100), np.zeros(100, dtype=np.int64))
    h.keep("u", first)
    old = first.tokens.copy()
    nxt = h.resolve("u", 100, arr(7, 8), arr(1, 1))  # grows: the first buffer had no room
    assert nxt.buf is not first.buf and np.array_equal(first.tokens, old)
    assert nxt.base == (first.stamp, 100) and nxt.tokens[-4:].tolist() == [7, 1, 8, 1]
    h.keep("u", nxt)
    assert len(nxt.buf) > 2 * 102 and h._events == len(nxt.buf) // 2 + USER_COST
    failed = h.resolve("u", 102, arr(5), arr(0))  # its batch fails: never kept
    assert failed.buf is nxt.buf  # appended in place, into the spare room
    again = h.resolve("u", None, np.r_[np.arange(100), 7, 8, 9], np.r_[np.zeros(100, int), 1, 1, 1],
                      match_full=True)  # a full request extending the held 102 events
    assert again.buf is nxt.buf and again.base == (nxt.stamp, 102)
    assert again.tokens[-2:].tolist() == [9, 1] and np.array_equal(nxt.tokens, again.tokens[:-2])
    other = h.resolve("u", None, arr(1, 2), arr(0, 0), match_full=True)  # a rewrite: fresh
    assert other.buf is not nxt.buf and other.base is None
    assert np.array_equal(again.tokens[:-2], nxt.tokens)  # untouched by the rewrite
