"""Offload planning of the cache metadata: which users' full, un-persisted chunks go to the host
tier now, within the offload quota (tokens in flight), and what a finished or failed transfer
changes. Mixed into ``KVCacheManager``, whose state it reads and writes; pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable


@dataclass
class OffloadJob:
    key: Hashable
    first_chunk: int  # index of the first chunk in the user's history
    chunk_ids: list[int]
    page_ids: list[int]  # pages holding those chunks' tokens, in order

    def tokens(self, chunk: int) -> int:
        return len(self.chunk_ids) * chunk


class OffloadPlanning:
    """The offload half of ``KVCacheManager`` (``users``, ``locked``, the quota, the chunk pool
    and the residency lists are the manager's)."""

    def _host_chunks(self, n: int, protect: set) -> list[int]:
        """Up to ``n`` host chunks, evicting LRU users' host copies outside ``protect``."""
        while len(self.chunk_pool) < n:
            key = self.res.victim(self.res.host, protect, self.locked)
            if key is None:
                break
            self._evict_host(self.users[key])
        return self.chunk_pool.take(min(n, len(self.chunk_pool)))

    def plan_offloads(self) -> list[OffloadJob]:
        """Jobs for users with full un-persisted chunks, within the quota; the rest is deferred."""
        jobs = []
        for key in list(self.res.wanted):
            if key in self.locked:
                continue
            e = self.users[key]
            n = e.device_len // self.C - len(e.chunks)
            room = (self.quota - self.queued_tokens) // self.C
            if room <= 0:
                self.counters["deferred_offloads"] += 1
                continue
            chunks = self._host_chunks(min(n, room), self.in_batch | {key})
            if not chunks:
                self.counters["host_full"] += 1
                continue
            first = len(e.chunks)
            per = self.C // self.P
            job = OffloadJob(key, first, chunks, e.pages[first * per:(first + len(chunks)) * per])
            self.locked[key] = job
            self.queued_tokens += job.tokens(self.C)
            self.res.wanted.pop(key, None)
            jobs.append(job)
        return jobs

    def finish_offload(self, job: OffloadJob) -> None:
        e = self.users[job.key]
        del self.locked[job.key]
        self.queued_tokens -= job.tokens(self.C)
        assert len(e.chunks) == job.first_chunk, "offload jobs of one user are serialized"
        e.chunks.extend(job.chunk_ids)
        self.counters["offloaded_chunks"] += len(job.chunk_ids)
        self.res.relist(e, touch=False)

    def abort_offload(self, job: OffloadJob) -> None:
        """A failed transfer: the chunks go back, nothing is marked persisted, retry later."""
        e = self.users[job.key]
        del self.locked[job.key]
        self.queued_tokens -= job.tokens(self.C)
        self.chunk_pool.give(job.chunk_ids)
        self.counters["offload_failures"] += 1
        self.res.relist(e, touch=False)
