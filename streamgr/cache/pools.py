"""A fixed pool of block ids: the device tier's pages or the host tier's chunks.

Ids are handed out and given back last-in first-out, so the id freed most recently (its memory
most likely still in cache) is reused first, and a batch's ids come out in a stable order.
Pure bookkeeping: the stores own the bytes, the manager decides who owns which id.
"""

from __future__ import annotations

from collections.abc import Iterable


class IdPool:
    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError("a pool size must be >= 0")
        self.size = size
        self._free = list(range(size - 1, -1, -1))

    def __len__(self) -> int:
        """Ids free now."""
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """``n`` free ids (the caller checked ``len(pool) >= n``)."""
        if n > len(self._free):
            raise ValueError(f"{n} ids asked of a pool with {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def give(self, ids: Iterable[int]) -> None:
        """Ids back, in the order they were owned (the first comes out first next time)."""
        self._free.extend(reversed(list(ids)))

    def free_ids(self) -> set[int]:
        return set(self._free)
