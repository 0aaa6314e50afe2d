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
    items, actions, _, _ = h.resolve("u", 3, arr(4), arr(1))
    assert items.tolist() == [1, 2, 3, 4] and actions.tolist() == [0, 1, 0, 1]
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
    h.remember("u", first.items, first.actions, first.stamp)
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
