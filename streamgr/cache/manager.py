"""``KVCacheManager``: the metadata of the hierarchical user K/V cache (MTServe section 4.3).

Pure Python, no tensors: it decides, the stores and the runner move bytes. Per user it tracks the
device pages holding the first ``device_len`` tokens, the host chunks holding the first
``persisted_len`` tokens (chunk ``i`` = tokens ``[i*C, (i+1)*C)``), a fingerprint per chunk-sized
segment of the cached tokens, and the weights version the K/V were computed with.

- Pools (``pools.IdPool``): the free device pages and host chunks.
- Residency (``residency.Residency``): LRU lists in O(1) of *clean* users (every device token
  has a host copy: eviction loses nothing), *dirty* ones (an un-persisted tail is lost on
  eviction and recomputed on the next visit) and host copies. ``allocate`` evicts clean users
  first, then dirty ones, least recently used first, never a user of a batch in flight or a
  locked one. Eviction only changes metadata (zero-copy): nothing is copied out.
- Leases: ``plan_batch`` pins its users until ``commit_batch`` or ``abort_batch``; several
  batches may be in flight, never two holding the same user.
- Offload: a user whose un-persisted tokens fill a chunk is queued; ``plan_offloads`` turns the
  queue into jobs under the offload quota (tokens in flight). Over the quota a job is deferred and
  retried later; a range is marked persisted only by ``finish_offload``. A user is locked while a
  job reads its pages: it is never evicted, truncated or dropped meanwhile.
- Validation: a cached prefix is used only if every segment's fingerprint equals the request's
  history and the weights version matches; what does not match is dropped, never served.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Hashable, Iterable

import numpy as np

from .offload_plan import OffloadJob, OffloadPlanning
from .pools import IdPool
from .residency import Residency


def fingerprint(tokens: np.ndarray) -> int:
    """Fingerprint of a token segment (64-bit, process-local: the cache is in-process too)."""
    return hash((len(tokens), np.ascontiguousarray(tokens, dtype=np.int64).tobytes()))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class UserEntry:
    key: Hashable
    version: str
    pages: list[int] = field(default_factory=list)
    device_len: int = 0
    chunks: list[int] = field(default_factory=list)
    fps: list[int] = field(default_factory=list)
    # The history stamp (cache/history.py) of the tokens last committed; None when unknown.
    hist_stamp: int | None = None
    _ids: tuple | None = field(default=None, repr=False, compare=False)  # (pages, as int64)

    def page_ids(self) -> np.ndarray:
        """``pages`` as an int64 array, converted again only when the list changed: it is
        replaced when pages are added and cut in place when pages are dropped, so its identity
        and length tell (a batch's page table needs the array; ~400 ids per user)."""
        c = self._ids
        if c is None or c[0] is not self.pages or len(c[1]) != len(self.pages):
            c = self._ids = (self.pages, np.asarray(self.pages, dtype=np.int64))
        return c[1]

    def persisted_len(self, chunk: int) -> int:
        return len(self.chunks) * chunk

    def cached_len(self, chunk: int) -> int:
        return max(self.device_len, len(self.chunks) * chunk)


@dataclass
class UserPlan:
    """What one user of a batch gets: compute tokens ``[start, length)`` plus its candidates."""

    key: Hashable
    length: int  # history tokens of the request
    start: int = 0  # tokens served from the cache
    from_gpu: int = 0
    from_host: int = 0  # tokens onloaded from host chunks
    host_recomputed: int = 0  # held on host, recomputed because that was cheaper (onload_split)
    lost: int = 0  # tokens the cache held before but had to drop (mismatch, version, eviction)
    pages: list[int] = field(default_factory=list)  # covers [0, length) unless transient
    page_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # as int64
    onload: list[tuple[int, int]] = field(default_factory=list)  # (host chunk id, chunk index)
    transient: bool = False  # computed without caching (did not fit, or locked)


class KVCacheManager(OffloadPlanning):
    def __init__(self, page_tokens: int, chunk_tokens: int, device_pages: int, host_chunks: int,
                 offload_quota_tokens: int, hierarchical: bool = True) -> None:
        if chunk_tokens % page_tokens:
            raise ValueError("chunk_tokens must be a multiple of page_tokens")
        self.P, self.C = page_tokens, chunk_tokens
        self.device_pages, self.host_chunks = device_pages, host_chunks
        self.quota = offload_quota_tokens
        self.hierarchical = hierarchical
        self.users: dict[Hashable, UserEntry] = {}
        self.pages = IdPool(device_pages)
        self.chunk_pool = IdPool(host_chunks if hierarchical else 0)
        self.res = Residency(chunk_tokens, hierarchical)
        self.locked: dict[Hashable, OffloadJob] = {}
        # Users of each batch planned and not yet committed or aborted (a lease per batch):
        # their pages are pinned, and no other batch may plan them meanwhile.
        self._leases: list[frozenset] = []
        self.queued_tokens = 0
        self.counters: Counter[str] = Counter()

    # -- residency bookkeeping -------------------------------------------------------------------

    def _trim_fps(self, e: UserEntry) -> None:
        del e.fps[_ceil_div(e.cached_len(self.C), self.C):]

    def _forget(self, e: UserEntry) -> None:
        self.pages.give(e.pages)
        self.chunk_pool.give(e.chunks)
        e.pages, e.chunks, e.device_len, e.fps = [], [], 0, []
        self.res.drop(e.key)
        del self.users[e.key]

    def _evict_device(self, e: UserEntry) -> None:
        lost = e.device_len - e.persisted_len(self.C)
        self.counters["evictions"] += 1
        if lost <= 0:
            self.counters["zero_copy_evictions"] += 1
        else:
            self.counters["tail_tokens_dropped"] += lost
        self.pages.give(e.pages)
        e.pages, e.device_len = [], 0
        if not e.chunks:
            self._forget(e)
            return
        self._trim_fps(e)
        self.res.relist(e, touch=False)

    def _evict_host(self, e: UserEntry) -> None:
        self.counters["host_evictions"] += 1
        self.chunk_pool.give(e.chunks)
        e.chunks = []
        if e.device_len == 0:
            self._forget(e)
            return
        self._trim_fps(e)
        self.res.relist(e, touch=False)

    def _truncate(self, e: UserEntry, n: int) -> None:
        """Keep only the first ``n`` cached tokens (``n`` is a multiple of C or the cached length)."""
        if e.device_len > n:
            keep = _ceil_div(n, self.P)
            self.pages.give(e.pages[keep:])
            del e.pages[keep:]
            e.device_len = n
        keep_chunks = n // self.C
        if len(e.chunks) > keep_chunks:
            self.chunk_pool.give(e.chunks[keep_chunks:])
            del e.chunks[keep_chunks:]
        if e.cached_len(self.C) == 0:
            self._forget(e)
            return
        self._trim_fps(e)
        self.res.relist(e, touch=False)

    def allocate(self, n: int, protect: set) -> list[int] | None:
        """``n`` free pages, evicting LRU users outside ``protect`` (clean first); None if impossible."""
        while len(self.pages) < n:
            key = self.res.device_victim(protect, self.locked)
            if key is None:
                return None
            self._evict_device(self.users[key])
        return self.pages.take(n)

    # -- the batch ------------------------------------------------------------------------------

    def _valid_prefix(self, e: UserEntry, tokens: np.ndarray) -> int:
        cached = e.cached_len(self.C)
        for i, fp in enumerate(e.fps):
            end = min((i + 1) * self.C, cached)
            if end > len(tokens) or fingerprint(tokens[i * self.C:end]) != fp:
                return i * self.C
        return cached

    def plan_batch(self, requests: list[tuple[Hashable, np.ndarray]], version: str,
                   transient: set | frozenset = frozenset(),
                   known: dict[Hashable, tuple[int, int]] | None = None) -> list[UserPlan]:
        """Lookup, validate, allocate for a batch of distinct users (history token arrays).
        Users in ``transient`` are computed without the cache (e.g. after an onload fault).
        ``known[user] = (stamp, n)``: the first ``n`` tokens are those of the history with that
        stamp; when the cache committed that history last, its cached tokens (at most ``n``)
        are valid without comparing fingerprints."""
        keys = [k for k, _ in requests]
        if len(set(keys)) != len(keys):
            raise ValueError("a batch must not hold the same user twice")
        busy = self.in_batch.intersection(keys)
        if busy:
            raise ValueError(f"users {sorted(map(repr, busy))} are in a batch still in flight")
        self._leases.append(frozenset(keys))
        plans = []
        try:
            for key, tokens in requests:
                if key in transient:
                    self.counters["transient_users"] += 1
                    plans.append(UserPlan(key, len(tokens), transient=True))
                else:
                    plans.append(self._plan_user(key, tokens, version,
                                                 known.get(key) if known else None))
        except BaseException:
            self._leases.remove(frozenset(keys))
            raise
        return plans

    def _plan_user(self, key: Hashable, tokens: np.ndarray, version: str,
                   known: tuple[int, int] | None = None) -> UserPlan:
        L = len(tokens)
        plan = UserPlan(key, L)
        e = self.users.get(key)
        if L == 0:  # nothing to cache; a history rewritten to empty drops what was cached
            if e is not None and key not in self.locked:
                plan.lost = e.cached_len(self.C)
                self._forget(e)
            return plan
        if e is not None:
            before = e.cached_len(self.C)
            if e.version != version:
                valid = 0
            elif known is not None and e.hist_stamp is not None and known[0] == e.hist_stamp \
                    and before <= min(known[1], L):
                valid = before  # a prefix of the history it committed: no hashing
                self.counters["prefix_known_users"] += 1
            else:
                valid = self._valid_prefix(e, tokens)
            if valid < before:
                if key in self.locked:  # its pages are being read: leave it, compute from scratch
                    plan.transient, plan.lost = True, before
                    self.counters["transient_users"] += 1
                    return plan
                self.counters["dropped_tokens" if e.version == version else "stale_version_tokens"] += before - valid
                self._truncate(e, valid)
                e = self.users.get(key)
            plan.lost = before - (e.cached_len(self.C) if e else 0)
        resident = e is not None and e.device_len > 0
        if resident:
            plan.start = plan.from_gpu = e.device_len
        elif e is not None and self.hierarchical and e.chunks:
            plan.start = plan.from_host = e.persisted_len(self.C)
        total_pages = _ceil_div(L, self.P)
        have = len(e.pages) if resident else 0
        new_pages = self.allocate(total_pages - have, self.in_batch) \
            if total_pages <= self.device_pages else None
        if new_pages is None:
            self.counters["transient_users"] += 1
            plan.transient, plan.start, plan.from_gpu, plan.from_host = True, 0, 0, 0
            return plan
        if e is None:
            e = self.users[key] = UserEntry(key, version)
        e.version = version
        # The held list itself when nothing is added (see UserEntry.page_ids).
        plan.pages = e.pages if resident and not new_pages else \
            (e.pages if resident else []) + new_pages
        if plan.from_host:
            plan.onload = [(cid, i) for i, cid in enumerate(e.chunks)]
        # Pages are owned from now on; device_len moves only at commit.
        e.pages = plan.pages
        plan.page_ids = e.page_ids()
        return plan

    def commit_batch(self, plans: list[UserPlan], tokens: dict[Hashable, np.ndarray],
                     stamps: dict[Hashable, int] | None = None) -> None:
        """After the model wrote every planned user's K/V: the cache now holds their histories
        (``stamps``: each one's history stamp, see ``plan_batch``)."""
        for p in plans:
            if p.transient:
                continue
            e = self.users.get(p.key)
            if e is None or p.length == 0:
                continue
            old = e.cached_len(self.C)
            self.counters["host_tokens_recomputed"] += p.host_recomputed
            e.device_len = p.length
            e.hist_stamp = stamps.get(p.key) if stamps else None
            toks = tokens[p.key]
            first = old // self.C
            del e.fps[first:]
            for i in range(first, _ceil_div(p.length, self.C)):
                e.fps.append(fingerprint(toks[i * self.C:min((i + 1) * self.C, p.length)]))
            self.res.relist(e, touch=True)
        self._release(plans)

    def abort_batch(self, plans: list[UserPlan]) -> None:
        """The batch failed: pages taken for it go back; onloaded users are not resident."""
        for p in plans:
            e = self.users.get(p.key)
            if p.transient or e is None:
                continue
            if p.onload:
                self.pages.give(e.pages)
                e.pages = []
            else:
                keep = _ceil_div(e.device_len, self.P)
                self.pages.give(e.pages[keep:])
                del e.pages[keep:]
            if e.cached_len(self.C) == 0:
                self._forget(e)
        self._release(plans)

    @property
    def in_batch(self) -> set:
        """Users of every batch in flight (planned, not yet committed or aborted)."""
        return set().union(*self._leases)

    def _release(self, plans: list[UserPlan]) -> None:
        keys = frozenset(p.key for p in plans)
        if keys in self._leases:
            self._leases.remove(keys)

    # -- views ------------------------------------------------------------------------------------

    def page_table(self, keys: Iterable[Hashable]) -> tuple[list[int], list[int], list[int]]:
        """FlashInfer's CSR page table of the users' device tokens: ``indptr``, ``indices``,
        ``last_page_len`` (1..page_tokens; 0 for a user with no device pages)."""
        indptr, indices, last = [0], [], []
        for key in keys:
            e = self.users.get(key)
            n = e.device_len if e else 0
            pages = e.pages[:_ceil_div(n, self.P)] if e else []
            indices.extend(pages)
            indptr.append(len(indices))
            last.append(n - (len(pages) - 1) * self.P if pages else 0)
        return indptr, indices, last

    COUNTERS = ("evictions", "zero_copy_evictions", "tail_tokens_dropped", "host_evictions",
                "dropped_tokens", "stale_version_tokens", "transient_users", "offloaded_chunks",
                "deferred_offloads", "host_full", "offload_failures", "host_tokens_recomputed")

    def snapshot(self) -> dict:
        return {**{k: 0 for k in self.COUNTERS}, "users": len(self.users),
                "resident_users": self.res.resident(),
                "free_pages": len(self.pages), "free_chunks": len(self.chunk_pool),
                "queued_offload_tokens": self.queued_tokens, "locked_users": len(self.locked),
                **self.counters}

    def check_invariants(self) -> None:
        """Raise AssertionError if the metadata is inconsistent (used by the tests)."""
        owned = [p for e in self.users.values() for p in e.pages]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert not set(owned) & self.pages.free_ids(), "a page is both free and owned"
        assert len(owned) + len(self.pages) == self.device_pages, "pages leaked"
        chunks = [c for e in self.users.values() for c in e.chunks]
        chunks += [c for j in self.locked.values() for c in j.chunk_ids]
        assert len(chunks) == len(set(chunks)), "a chunk is owned twice"
        total_chunks = self.host_chunks if self.hierarchical else 0
        assert not set(chunks) & self.chunk_pool.free_ids(), "a chunk is both free and owned"
        assert len(chunks) + len(self.chunk_pool) == total_chunks, "chunks leaked"
        queued = 0
        for key, e in self.users.items():
            persisted = e.persisted_len(self.C)
            if key not in self.in_batch:
                assert len(e.pages) == _ceil_div(e.device_len, self.P), f"{key}: page count"
            if e.device_len:
                assert persisted <= e.device_len, f"{key}: persisted beyond the device copy"
                clean = self.hierarchical and persisted == e.device_len
                assert (key in self.res.clean) == clean and (key in self.res.dirty) == (not clean)
            else:
                assert key not in self.res.clean and key not in self.res.dirty
            assert e.cached_len(self.C) > 0 or key in self.in_batch, f"{key}: empty entry kept"
            assert len(e.fps) == _ceil_div(e.cached_len(self.C), self.C), f"{key}: fingerprints"
        for key, job in self.locked.items():
            assert self.users[key].device_len >= (job.first_chunk + len(job.chunk_ids)) * self.C
            queued += job.tokens(self.C)
        assert queued == self.queued_tokens <= max(self.quota, 0), "offload quota"
        assert set(self.res.clean) | set(self.res.dirty) == {k for k, e in self.users.items() if e.device_len}
