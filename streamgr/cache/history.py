"""Per-user event histories the engine has seen, so requests can come in the delta form.

A delta request says "``base_len`` events you already have, plus these". The engine answers it
only if it still holds exactly ``base_len`` events of that user; otherwise ``HistoryRequired``
tells the client to resend the full history. Bounded by a total event budget, LRU, in which
every user also costs ``USER_COST`` events (its entry's own memory), so many users with short
or empty histories are bounded too.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

import numpy as np

from ..errors import HistoryRequired


USER_COST = 32  # events' worth of memory per user entry (dict slot, two arrays' headers)


class HistoryStore:
    def __init__(self, capacity_events: int) -> None:
        self.capacity = capacity_events
        self._users: OrderedDict[Hashable, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._events = 0

    def __len__(self) -> int:
        return len(self._users)

    def known(self, user: Hashable) -> int | None:
        h = self._users.get(user)
        return None if h is None else len(h[0])

    def resolve(self, user: Hashable, base_len: int | None, items: np.ndarray,
                actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The full history of a request (delta or full)."""
        if base_len is None:
            return items, actions
        h = self._users.get(user)
        if h is None or len(h[0]) != base_len:
            have = "nothing" if h is None else f"{len(h[0])} events"
            raise HistoryRequired(f"user {user!r}: request extends {base_len} events, the engine "
                                  f"holds {have}; resend the full history")
        return np.concatenate([h[0], items]), np.concatenate([h[1], actions])

    def remember(self, user: Hashable, items: np.ndarray, actions: np.ndarray) -> None:
        old = self._users.pop(user, None)
        if old is not None:
            self._events -= len(old[0]) + USER_COST
        if len(items) + USER_COST > self.capacity:
            return
        self._users[user] = (items.astype(np.int32), actions.astype(np.int32))
        self._events += len(items) + USER_COST
        while self._events > self.capacity:
            _, (i, _) = self._users.popitem(last=False)
            self._events -= len(i) + USER_COST
