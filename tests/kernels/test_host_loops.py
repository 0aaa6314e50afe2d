"""The compiled host loops (``streamgr.kernels.host_loops``) against the numpy code each replaces (which
also runs where Numba cannot be imported), on random batches."""

from __future__ import annotations

import numpy as np
import pytest

from streamgr.kernels import host_loops
from streamgr.engine.rank import UserSlice


def _numpy(monkeypatch, name):
    monkeypatch.setattr(host_loops, name, None)


@pytest.mark.parametrize("seed", range(4))
def test_pack_rows_compiled_equals_numpy(monkeypatch, seed):
    rng = np.random.default_rng(seed)
    assert host_loops._pack_into is not None, "numba should be importable wherever the tests run"
    for _ in range(40):
        users = [UserSlice(rng.integers(0, 10**6, rng.integers(0, 40)), int(rng.integers(0, 5000)),
                           rng.integers(0, 10**6, rng.integers(0, 260)))
                 for _ in range(int(rng.integers(1, 17)))]
        got = host_loops.pack_rows(users)
        with monkeypatch.context() as m:
            _numpy(m, "_pack_into")
            want = host_loops.pack_rows(users)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        assert got[2] == want[2] and got[3] == want[3]
        assert got[0].dtype == got[1].dtype == np.int64
        # into a larger staging buffer (poisoned): the same rows, as views of it
        rows, cands = got[0].shape[1], len(got[1])
        buf = np.full(3 * rows + cands + 7, -5, dtype=np.int64)
        into = host_loops.pack_rows(users, out=buf)
        assert np.shares_memory(into[0], buf) and np.shares_memory(into[1], buf) or rows == 0
        assert np.array_equal(into[0], want[0]) and np.array_equal(into[1], want[1])
        assert into[2] == want[2] and (buf[3 * rows + cands:] == -5).all()


def test_pack_rows_refuses_a_short_buffer():
    users = [UserSlice(np.arange(6), 0, np.arange(3))]
    with pytest.raises(ValueError, match="at least 30"):
        host_loops.pack_rows(users, out=np.zeros(29, np.int64))


@pytest.mark.parametrize("seed", range(4))
def test_page_slots_compiled_equals_numpy(monkeypatch, seed):
    rng = np.random.default_rng(seed)
    for _ in range(40):
        n = int(rng.integers(0, 9))
        P = int(rng.choice([1, 4, 32]))
        end = rng.integers(0, 3000, n)
        start = np.minimum(end, rng.integers(0, 3000, n))
        per_user = [rng.permutation(10**5)[:-(-int(e) // P)].astype(np.int64) for e in end]
        ptr = np.zeros(n + 1, np.int64)
        np.cumsum([len(p) for p in per_user], out=ptr[1:])
        pages = np.concatenate(per_user + [np.zeros(1, np.int64)])  # (never empty, as page_csr)
        q0 = np.cumsum(rng.integers(0, 300, n)).astype(np.int64)
        got = host_loops.page_slots(q0, start, end, ptr, pages, P)
        with monkeypatch.context() as m:
            _numpy(m, "_slots")
            want = host_loops.page_slots(q0, start, end, ptr, pages, P)
        for a, b in zip(got, want):
            assert a.dtype == np.int64 and np.array_equal(a, b)


def test_prefix_equal_compiled_equals_numpy(monkeypatch):
    rng = np.random.default_rng(5)
    for _ in range(200):
        n = int(rng.integers(0, 50))
        items, actions = rng.integers(0, 5, n + 3), rng.integers(0, 3, n + 3)
        buf = np.empty(2 * n + 10, np.int64)
        buf[0:2 * n:2], buf[1:2 * n:2] = items[:n], actions[:n]
        if n and rng.random() < 0.5:  # one token differs
            buf[int(rng.integers(0, 2 * n))] += 1
        got = host_loops.prefix_equal(buf, items, actions, n)
        with monkeypatch.context() as m:
            _numpy(m, "_prefix_equal")
            want = host_loops.prefix_equal(buf, items, actions, n)
        assert got == want
