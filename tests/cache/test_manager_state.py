"""KVCacheManager as a hypothesis state machine: batches, offloads in flight, aborts, versions.

Invariants after every step: no page or chunk owned twice, free + used = total, persisted <=
cached, locked and in-batch users never evicted, the CSR page table valid, and the manager never
offers a cached prefix longer than what truly matches the request (checked against a shadow copy
of what each user's cache was committed with).
"""

from __future__ import annotations

import numpy as np
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from streamgr.cache import KVCacheManager


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if len(diff) else n


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.m: KVCacheManager | None = None
        self.tokens: dict[int, np.ndarray] = {}  # each user's current history
        self.committed: dict[int, np.ndarray] = {}  # what the cache was last committed with
        self.jobs = []
        self.version = 0
        self.rng = np.random.default_rng(0)

    @initialize(P=st.sampled_from([1, 2, 4]), k=st.sampled_from([1, 2, 3]), pages=st.integers(1, 40),
                chunks=st.integers(0, 30), quota=st.integers(0, 12), hier=st.booleans())
    def setup(self, P, k, pages, chunks, quota, hier):
        self.m = KVCacheManager(P, P * k, pages, chunks if hier else 0, quota * P * k, hier)

    @rule(users=st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True),
          grow=st.integers(0, 20), change=st.sampled_from(["append", "rewrite", "shrink"]),
          commit=st.booleans())
    def batch(self, users, grow, change, commit):
        m = self.m
        reqs = []
        for u in users:
            t = self.tokens.get(u, np.zeros(0, np.int64))
            if change == "rewrite" and len(t) > 1:
                t = t.copy()
                t[self.rng.integers(len(t))] += 1
            elif change == "shrink":
                t = t[: len(t) // 2]
            t = np.concatenate([t, self.rng.integers(50, size=grow)])
            self.tokens[u] = t
            reqs.append((u, t))
        locked_before = {k: list(m.users[k].pages) for k in m.locked}
        resident_before = {u for u in users if u in m.users and m.users[u].device_len}
        plans = m.plan_batch(reqs, str(self.version))
        m.check_invariants()
        for k, pages in locked_before.items():
            assert m.users[k].pages[:len(pages)] == pages, "a locked user's pages changed"
        for p in plans:
            # Never serve more than truly matches what was cached.
            truth = common_prefix(self.committed.get(p.key, np.zeros(0, np.int64)), self.tokens[p.key])
            assert p.start <= truth, (p, truth)
            assert p.start == p.from_gpu + p.from_host
            if p.key in resident_before and not p.transient and p.from_gpu == 0 and p.length:
                assert p.lost > 0, "a resident in-batch user lost its pages without a mismatch"
            if not p.transient:
                assert len(p.pages) == -(-p.length // m.P)
        if commit:
            m.commit_batch(plans, dict(reqs))
            for p in plans:
                if not p.transient:
                    self.committed[p.key] = self.tokens[p.key]
        else:
            m.abort_batch(plans)

    @rule()
    def offload(self):
        self.jobs.extend(self.m.plan_offloads())

    @rule(data=st.data(), ok=st.booleans())
    @precondition(lambda self: self.jobs)
    def complete(self, data, ok):
        job = self.jobs.pop(data.draw(st.integers(0, len(self.jobs) - 1)))
        (self.m.finish_offload if ok else self.m.abort_offload)(job)

    @rule()
    def new_version(self):
        self.version += 1

    @invariant()
    def consistent(self):
        m = self.m
        m.check_invariants()
        indptr, indices, last = m.page_table(sorted(m.users))
        assert indptr[0] == 0 and indptr[-1] == len(indices)
        assert all(a <= b for a, b in zip(indptr, indptr[1:]))
        for i, key in enumerate(sorted(m.users)):
            n = indptr[i + 1] - indptr[i]
            e = m.users[key]
            assert n == -(-e.device_len // m.P)
            assert (1 <= last[i] <= m.P) if n else last[i] == 0
            assert indices[indptr[i]:indptr[i + 1]] == e.pages[:n]
            assert e.persisted_len(m.C) <= e.cached_len(m.C)


ManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestManager = ManagerMachine.TestCase
