"""Per-user event histories the engine has seen, so requests can come in the delta form.

A delta request says "``base_len`` events you already have, plus these". The engine answers it
only if it still holds exactly ``base_len`` events of that user; otherwise ``HistoryRequired``
tells the client to resend the full history. Bounded by a total event budget, LRU, in which
every user also costs ``USER_COST`` events (its entry's own memory), so many users with short
or empty histories are bounded too.

Every resolved history gets a *stamp* (a number never reused), kept with it when kept.
A history that extends the one held (a delta request, or a full request whose first events
equal the held ones) names the held history's stamp as its *base*: the K/V cache, which
records the stamp of the history it last committed, then knows its cached tokens are a prefix
of the request's without hashing them again (``KVCacheManager.plan_batch``).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Hashable, NamedTuple

import numpy as np

from ..errors import HistoryRequired
from ..kernels.host_loops import prefix_equal


USER_COST = 32  # events' worth of memory per user entry (dict slot, array header)
HEADROOM = 4  # a grown buffer gets 1/HEADROOM spare: appends copy the history O(1) times


def interleave_into(out: np.ndarray, at: int, items: np.ndarray, actions: np.ndarray) -> None:
    """Write events as tokens item_0, action_0, item_1, ... into ``out`` from event ``at``."""
    n = len(items)
    out[2 * at:2 * (at + n):2] = items
    out[2 * at + 1:2 * (at + n):2] = actions


def interleave(items: np.ndarray, actions: np.ndarray) -> np.ndarray:
    """History tokens (int64): item_0, action_0, item_1, action_1, ..."""
    out = np.empty(2 * len(items), dtype=np.int64)
    interleave_into(out, 0, items, actions)
    return out


class Resolved(NamedTuple):
    """A request's full history as interleaved tokens (``tokens``: a view, never to be written),
    its stamp, the (stamp, events) of the held history it extends (None: not known to extend
    one), and the buffer the tokens live in (what ``keep`` holds on to)."""

    tokens: np.ndarray
    stamp: int
    base: tuple[int, int] | None
    buf: np.ndarray

    @property
    def events(self) -> int:
        return len(self.tokens) // 2

    @property
    def items(self) -> np.ndarray:
        return self.tokens[0::2]

    @property
    def actions(self) -> np.ndarray:
        return self.tokens[1::2]


class _Held(NamedTuple):
    buf: np.ndarray  # int64 tokens; the first 2 * events are the history, the rest spare
    events: int
    stamp: int


class HistoryStore:
    """Histories kept as interleaved tokens in buffers with spare room: a request that extends
    the held history appends its new events in place, so neither resolving it nor keeping it
    afterwards copies or re-interleaves the whole history (a full request still compares its
    events with the held ones: the client sent them all). Only ``keep`` (after the batch)
    makes a resolved history the held one; tokens a failed batch appended past it are simply
    written over by the next request."""

    def __init__(self, capacity_events: int) -> None:
        self.capacity = capacity_events
        self._users: OrderedDict[Hashable, _Held] = OrderedDict()
        self._events = 0
        self._stamps = itertools.count(1)

    def __len__(self) -> int:
        return len(self._users)

    def known(self, user: Hashable) -> int | None:
        h = self._users.get(user)
        return None if h is None else h.events

    def resolve(self, user: Hashable, base_len: int | None, items: np.ndarray,
                actions: np.ndarray, match_full: bool = False) -> Resolved:
        """The full history of a request (delta or full). ``match_full``: for a full request,
        compare its first events with the held history's to name it as the base (a cached
        runner wants that; recompute does not)."""
        h = self._users.get(user)
        if base_len is None:
            if match_full and h is not None and h.events <= len(items):
                n = h.events
                if prefix_equal(h.buf, items, actions, n):
                    return self._extend(h, items[n:], actions[n:])
            buf = interleave(items, actions)
            return Resolved(buf, next(self._stamps), None, buf)
        if h is None or h.events != base_len:
            have = "nothing" if h is None else f"{h.events} events"
            raise HistoryRequired(f"user {user!r}: request extends {base_len} events, the engine "
                                  f"holds {have}; resend the full history")
        return self._extend(h, items, actions)

    def _extend(self, h: _Held, items: np.ndarray, actions: np.ndarray) -> Resolved:
        n, total = h.events, h.events + len(items)
        buf = h.buf
        if 2 * total > len(buf):  # grown with spare room; views of the old buffer stay valid
            buf = np.empty(2 * (total + total // HEADROOM), dtype=np.int64)
            buf[:2 * n] = h.buf[:2 * n]
        interleave_into(buf, n, items, actions)
        return Resolved(buf[:2 * total], next(self._stamps), (h.stamp, n), buf)

    def keep(self, user: Hashable, res: Resolved) -> None:
        """Hold ``res`` as the user's history (after its batch; no copy)."""
        self._hold(user, _Held(res.buf, res.events, res.stamp))

    def remember(self, user: Hashable, items: np.ndarray, actions: np.ndarray,
                 stamp: int = 0) -> None:
        """Hold these events as the user's history (a copy)."""
        self._hold(user, _Held(interleave(items, actions), len(items), stamp))

    def _hold(self, user: Hashable, held: _Held) -> None:
        old = self._users.pop(user, None)
        if old is not None:
            self._events -= len(old.buf) // 2 + USER_COST
        cost = len(held.buf) // 2 + USER_COST  # the buffer's spare room counts too
        if cost > self.capacity:
            return
        self._users[user] = held
        self._events += cost
        while self._events > self.capacity:
            _, gone = self._users.popitem(last=False)
            self._events -= len(gone.buf) // 2 + USER_COST
