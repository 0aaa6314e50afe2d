"""Dynamic batching on the event loop: collect up to ``max_batch`` requests or wait ``max_wait_ms``.

A batch never holds the same user twice (the cache state of a user must be read and written
once per batch): a repeated user waits for the next batch, in arrival order. Requests whose
caller went away (cancelled futures) are dropped before they reach the model.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Pending:
    key: Any  # (kind, user) that must be unique within a batch
    payload: Any
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)


class Batcher:
    def __init__(self, max_batch: int, max_wait_ms: float) -> None:
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1e3
        self._queue: deque[Pending] = deque()
        self._arrived = asyncio.Event()

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, item: Pending) -> None:
        self._queue.append(item)
        self._arrived.set()

    def _live(self) -> int:
        while self._queue and self._queue[0].future.done():
            self._queue.popleft()
        return len(self._queue)

    def wake(self) -> None:
        """Something the batcher waits on changed (a busy key was released)."""
        self._arrived.set()

    async def next_batch(self, busy: set | frozenset = frozenset()) -> list[Pending]:
        """Wait for work, then give up to ``max_batch`` live requests of distinct keys, none of
        them ``busy`` (keys of batches still in flight wait, in order, for a later batch)."""
        while True:
            batch = await self._next(busy)
            if batch:
                return batch
            self._arrived.clear()  # every live request is busy: wait for a release or arrival
            await self._arrived.wait()

    async def _next(self, busy) -> list[Pending]:
        while not self._live():
            self._arrived.clear()
            await self._arrived.wait()
        deadline = self._queue[0].enqueued + self.max_wait
        while len(self._queue) < self.max_batch:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except asyncio.TimeoutError:
                break
        batch: list[Pending] = []
        keys: set = set()
        kept: deque[Pending] = deque()
        while self._queue and len(batch) < self.max_batch:
            item = self._queue.popleft()
            if item.future.done():
                continue
            if item.key in keys or item.key in busy:
                kept.append(item)
            else:
                keys.add(item.key)
                batch.append(item)
        self._queue.extendleft(reversed(kept))
        return batch

    def fail_all(self, exc_factory) -> None:
        while self._queue:
            item = self._queue.popleft()
            if not item.future.done():
                item.future.set_exception(exc_factory())
