"""Which users hold K/V where, in least-recently-used order (MTServe section 4.3).

Device-resident users are split into *clean* ones (every device token has a host copy: evicting
them loses nothing) and *dirty* ones (an un-persisted tail would be lost and recomputed); users
with a host copy are in ``host``; users whose un-persisted tokens fill a chunk are ``wanted`` by
the offload planner. Each is an ordered dict (hash map + linked list): O(1) touch and removal.
``victim`` picks the least recently used user outside a protected set (the batches in flight)
and the locked ones (an offload reads their pages). Pure bookkeeping, driven by the manager.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable


class Residency:
    def __init__(self, chunk_tokens: int, hierarchical: bool) -> None:
        self.C, self.hierarchical = chunk_tokens, hierarchical
        self.clean: OrderedDict[Hashable, None] = OrderedDict()
        self.dirty: OrderedDict[Hashable, None] = OrderedDict()
        self.host: OrderedDict[Hashable, None] = OrderedDict()
        self.wanted: OrderedDict[Hashable, None] = OrderedDict()

    def relist(self, e, touch: bool) -> None:
        """Put user entry ``e`` in the lists its state calls for; ``touch`` makes it most
        recently used."""
        key = e.key
        was = self.clean if key in self.clean else self.dirty if key in self.dirty else None
        now = None
        if e.device_len > 0:
            now = self.clean if (self.hierarchical and e.device_len == e.persisted_len(self.C)) \
                else self.dirty
        if was is not None and (was is not now or touch):
            del was[key]
        if now is not None and (key not in now):
            now[key] = None
        if self.hierarchical and e.chunks:
            if touch or key not in self.host:
                self.host[key] = None
                self.host.move_to_end(key)
        else:
            self.host.pop(key, None)
        if self.hierarchical and e.device_len - e.persisted_len(self.C) >= self.C:
            self.wanted.setdefault(key, None)
        else:
            self.wanted.pop(key, None)

    def drop(self, key: Hashable) -> None:
        for d in (self.clean, self.dirty, self.host, self.wanted):
            d.pop(key, None)

    @staticmethod
    def victim(lru: OrderedDict, protect: set, locked) -> Hashable | None:
        """The least recently used key of ``lru`` outside ``protect`` and ``locked``."""
        for key in lru:
            if key not in protect and key not in locked:
                return key
        return None

    def device_victim(self, protect: set, locked) -> Hashable | None:
        """A device-resident user to evict: clean ones first (nothing is lost), then dirty."""
        key = self.victim(self.clean, protect, locked)
        return key if key is not None else self.victim(self.dirty, protect, locked)

    def resident(self) -> int:
        return len(self.clean) + len(self.dirty)
