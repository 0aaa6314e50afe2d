"""The cache manager's parts on their own: the id pools (LIFO reuse, refusal past what is
free) and the residency lists (clean/dirty/host/wanted by a user's state, LRU victims outside
protected and locked users)."""

from __future__ import annotations

import pytest

from streamgr.cache.manager import UserEntry
from streamgr.cache.pools import IdPool
from streamgr.cache.residency import Residency


def test_pool_hands_out_and_reuses_last_freed_first():
    pool = IdPool(4)
    assert len(pool) == 4 and pool.take(2) == [0, 1]
    a = pool.take(1)
    pool.give([7, 8])  # given back in owned order: 7 comes out first
    assert pool.take(2) == [7, 8] and a == [2]
    with pytest.raises(ValueError, match="3 ids asked"):
        pool.take(3)
    assert pool.free_ids() == {3} and len(IdPool(0)) == 0
    with pytest.raises(ValueError):
        IdPool(-1)


def test_pool_takes_in_bulk_what_one_at_a_time_would_give():
    """``take(n)`` gives the ids n single takes would, in that order, and leaves the same free
    list (it takes them in two list operations: a host hit takes ~1,800 pages at once)."""
    import random
    rng = random.Random(0)
    pool, one = IdPool(300), IdPool(300)
    for _ in range(200):
        n = rng.randrange(0, min(len(pool), 40) + 1)
        got, want = pool.take(n), [x for _ in range(n) for x in one.take(1)]
        assert got == want
        back = rng.sample(got, rng.randrange(0, len(got) + 1))
        pool.give(back)
        one.give(back)
        assert pool._free == one._free
    assert pool.take(len(pool)) == one.take(len(one)) and len(pool) == 0 == len(pool.take(0))


def test_residency_lists_follow_the_entry_state():
    C = 4
    res = Residency(C, hierarchical=True)
    e = UserEntry("u", "v1", pages=[0, 1], device_len=8)  # nothing persisted: dirty, wants offload
    res.relist(e, touch=True)
    assert "u" in res.dirty and "u" not in res.clean and "u" in res.wanted and "u" not in res.host
    e.chunks = [5, 6]  # both chunks persisted: clean, on the host, nothing to offload
    res.relist(e, touch=False)
    assert "u" in res.clean and "u" not in res.dirty and "u" in res.host and "u" not in res.wanted
    e.pages, e.device_len = [], 0  # evicted from the device: host only
    res.relist(e, touch=False)
    assert res.resident() == 0 and "u" in res.host
    res.drop("u")
    assert not (res.clean or res.dirty or res.host or res.wanted)


def test_victims_are_least_recent_outside_protected_and_locked():
    res = Residency(4, hierarchical=True)
    for k in "abc":
        res.relist(UserEntry(k, "v", pages=[0], device_len=4, chunks=[1]), touch=True)  # clean
    res.relist(UserEntry("d", "v", pages=[2], device_len=4), touch=True)  # dirty
    assert res.device_victim(set(), {}) == "a"
    assert res.device_victim({"a"}, {"b": object()}) == "c"
    assert res.device_victim({"a", "b", "c"}, {}) == "d"  # dirty only when no clean one is free
    assert res.device_victim({"a", "b", "c", "d"}, {}) is None
    res.relist(UserEntry("a", "v", pages=[0], device_len=4, chunks=[1]), touch=True)  # a: MRU
    assert res.device_victim(set(), {}) == "b"
    assert not Residency(4, hierarchical=False).wanted


def test_host_store_in_huge_pages_is_an_ordinary_tensor():
    """The host chunk store backed by an anonymous mapping advised to huge pages: the shape and
    dtype asked for, zero-filled, writable in place, and still valid through a view after the
    store tensor itself is dropped (the mapping lives as long as any view)."""
    import gc

    import torch

    from streamgr.cache.store import KVStores, host_tensor
    t = host_tensor((3, 2, 4, 5), torch.bfloat16, True)
    assert t.shape == (3, 2, 4, 5) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()  # fresh anonymous memory reads as zeros
    t[1].fill_(2.5)
    view = t[1, 0]
    del t
    gc.collect()
    assert float(view.sum()) == 2.5 * 20
    assert host_tensor((0, 4), torch.float32, True).shape == (0, 4)
    both = [KVStores(2, 2, 8, 4, 8, 16, 6, torch.float32, torch.device("cpu"), host_huge_pages=h)
            for h in (False, True)]
    assert both[0].host.shape == both[1].host.shape and both[1].chunk_bytes == both[0].chunk_bytes
    both[1].host[5].copy_(torch.arange(both[1].host[5].numel(), dtype=torch.float32).view(
        both[1].host[5].shape))
    assert float(both[1].host[5].flatten()[-1]) == both[1].host[5].numel() - 1
