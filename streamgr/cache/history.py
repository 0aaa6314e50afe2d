"""Per-user event histories the engine has seen, so requests can come in the delta form.

A delta request says "``base_len`` events you already have, plus these". The engine answers it
only if it still holds exactly ``base_len`` events of that user; otherwise ``HistoryRequired``
tells the client to resend the full history. Bounded by a total event budget, LRU, in which
every user also costs ``USER_COST`` events (its entry's own memory), so many users with short
or empty histories are bounded too.

Every resolved history gets a *stamp* (a number never reused), kept with it when remembered.
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


USER_COST = 32  # events' worth of memory per user entry (dict slot, two arrays' headers)


class Resolved(NamedTuple):
    """A request's full history: its events, its stamp, and the (stamp, events) of the held
    history it extends (None: not known to extend one)."""

    items: np.ndarray
    actions: np.ndarray
    stamp: int
    base: tuple[int, int] | None


class HistoryStore:
    def __init__(self, capacity_events: int) -> None:
        self.capacity = capacity_events
        self._users: OrderedDict[Hashable, tuple[np.ndarray, np.ndarray, int]] = OrderedDict()
        self._events = 0
        self._stamps = itertools.count(1)

    def __len__(self) -> int:
        return len(self._users)

    def known(self, user: Hashable) -> int | None:
        h = self._users.get(user)
        return None if h is None else len(h[0])

    def resolve(self, user: Hashable, base_len: int | None, items: np.ndarray,
                actions: np.ndarray, match_full: bool = False) -> Resolved:
        """The full history of a request (delta or full). ``match_full``: for a full request,
        compare its first events with the held history's to name it as the base (a cached
        runner wants that; recompute does not)."""
        h = self._users.get(user)
        if base_len is None:
            base = None
            if match_full and h is not None and len(h[0]) <= len(items):
                n = len(h[0])
                if np.array_equal(items[:n], h[0]) and np.array_equal(actions[:n], h[1]):
                    base = (h[2], n)
            return Resolved(items, actions, next(self._stamps), base)
        if h is None or len(h[0]) != base_len:
            have = "nothing" if h is None else f"{len(h[0])} events"
            raise HistoryRequired(f"user {user!r}: request extends {base_len} events, the engine "
                                  f"holds {have}; resend the full history")
        return Resolved(np.concatenate([h[0], items]), np.concatenate([h[1], actions]),
                        next(self._stamps), (h[2], base_len))

    def remember(self, user: Hashable, items: np.ndarray, actions: np.ndarray,
                 stamp: int = 0) -> None:
        old = self._users.pop(user, None)
        if old is not None:
            self._events -= len(old[0]) + USER_COST
        if len(items) + USER_COST > self.capacity:
            return
        self._users[user] = (items.astype(np.int32), actions.astype(np.int32), stamp)
        self._events += len(items) + USER_COST
        while self._events > self.capacity:
            _, (i, _, _) = self._users.popitem(last=False)
            self._events -= len(i) + USER_COST
