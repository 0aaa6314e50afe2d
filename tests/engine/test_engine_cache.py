"""The engine with the cache on: delta requests, repeated users, weight updates, statistics."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from streamgr import Engine, RankRequest
from streamgr.errors import HistoryRequired, HistoryTooLong
from tests.conftest import small_overrides

CACHE = {"cache.page_tokens": 4, "cache.chunk_tokens": 8, "cache.device_pages": 24,
         "cache.host_chunks": 64}


def history(rng, n):
    return rng.integers(200, size=n).tolist(), rng.integers(16, size=n).tolist()


async def recompute_scores(reqs, **extra):
    async with Engine.from_spec("rank-small", small_overrides(**{"cache.mode": "recompute", **extra})) as e:
        return [(await e.rank(r)).scores for r in reqs]


@pytest.mark.parametrize("mode", ["recompute", "gpu-only", "hierarchical"])
async def test_delta_requests(mode):
    rng = np.random.default_rng(0)
    items, actions = history(rng, 30)
    more_i, more_a = history(rng, 5)
    full = RankRequest(user_id=7, items=items, actions=actions, candidates=[1, 2, 3])
    delta = RankRequest(user_id=7, items=more_i, actions=more_a, candidates=[1, 2, 3], base_len=30)
    whole = RankRequest(user_id=7, items=items + more_i, actions=actions + more_a, candidates=[1, 2, 3])
    async with Engine.from_spec("rank-small", small_overrides(**{"cache.mode": mode, **CACHE})) as e:
        with pytest.raises(HistoryRequired):  # the engine never saw user 7
            await e.rank(delta)
        await e.rank(full)
        with pytest.raises(HistoryRequired, match="holds 30 events"):
            await e.rank(RankRequest(user_id=7, items=more_i, actions=more_a, candidates=[1],
                                     base_len=29))
        got = await e.rank(delta)
        with pytest.raises(HistoryTooLong):
            await e.rank(RankRequest(user_id=7, items=[1] * 30, actions=[0] * 30, candidates=[1],
                                     base_len=35))
    ref = await recompute_scores([whole])
    np.testing.assert_allclose(got.scores, ref[0], rtol=1e-4, atol=1e-5)
    if mode != "recompute":
        assert got.stats.tokens_from_gpu == 60 and got.stats.tokens_recomputed == 10


async def test_history_store_off_means_full_history_required():
    ov = small_overrides(**{"engine.history_events": 0, **CACHE})
    async with Engine.from_spec("rank-small", ov) as e:
        await e.rank(RankRequest(user_id=1, items=[1], actions=[1], candidates=[2]))
        with pytest.raises(HistoryRequired):
            await e.rank(RankRequest(user_id=1, items=[2], actions=[1], candidates=[2], base_len=1))


async def test_concurrent_and_repeated_users_equal_recompute():
    rng = np.random.default_rng(1)
    reqs = []
    hist = {u: history(rng, int(rng.integers(1, 20))) for u in range(6)}
    for _ in range(30):  # users come back (often while their previous request is in flight)
        u = int(rng.integers(6))
        i, a = history(rng, int(rng.integers(0, 4)))
        hist[u] = (hist[u][0] + i, hist[u][1] + a)
        hist[u] = (hist[u][0][-60:], hist[u][1][-60:])  # a rewrite once over 60 events
        reqs.append(RankRequest(user_id=u, items=list(hist[u][0]), actions=list(hist[u][1]),
                                candidates=rng.choice(200, size=4, replace=False).tolist()))
    ov = small_overrides(**{"cache.mode": "hierarchical", **CACHE, "cache.device_pages": 40,
                            "engine.max_batch": 2})
    async with Engine.from_spec("rank-small", ov) as e:
        got = await asyncio.gather(*(e.rank(r) for r in reqs))
        stats = e.stats()
    ref = await recompute_scores(reqs)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g.scores, r, rtol=1e-4, atol=1e-5)
    c = stats["cache"]
    assert stats["total_hit_ratio"] > 0 and c["evictions"] > 0
    for key in ("zero_copy_evictions", "bytes_onloaded", "bytes_offloaded", "deferred_offloads",
                "free_pages", "resident_users"):
        assert key in c, key
    assert c["bytes_onloaded"] > 0 and c["bytes_offloaded"] > 0


async def test_weight_update_never_serves_stale_kv():
    rng = np.random.default_rng(2)
    items, actions = history(rng, 40)
    r = RankRequest(user_id=3, items=items, actions=actions, candidates=[5, 6])
    async with Engine.from_spec("rank-small", small_overrides(**{"cache.mode": "hierarchical", **CACHE})) as e:
        before = await e.rank(r)
        again = await e.rank(r)
        assert again.stats.tokens_from_gpu == 80
        version = await e.update_weights(init_seed=99)
        assert version != "" and e.weights_version == version
        after = await e.rank(r)
        assert after.stats.tokens_recomputed == 80  # the old K/V were dropped, not served
        assert e.stats()["cache"]["stale_version_tokens"] == 80
    ref = await recompute_scores([r], **{"model.init_seed": 99})
    np.testing.assert_allclose(after.scores, ref[0], rtol=1e-4, atol=1e-5)
    assert not np.allclose(after.scores, before.scores)


@pytest.mark.parametrize("mode", ["gpu-only", "hierarchical"])
async def test_a_history_that_extends_the_committed_one_skips_the_hashing(mode, monkeypatch):
    """A returning visit whose history extends the one the cache committed (a delta request, or
    a full request whose first events equal the held ones) reuses the cached tokens without
    fingerprinting them; a rewritten earlier event is still caught by the fingerprints. Scores
    equal recompute's either way."""
    from streamgr.cache.manager import KVCacheManager
    checked = []
    real = KVCacheManager._valid_prefix

    def counting(self, e, tokens):
        checked.append(e.key)
        return real(self, e, tokens)
    monkeypatch.setattr(KVCacheManager, "_valid_prefix", counting)
    rng = np.random.default_rng(3)
    items, actions = history(rng, 20)
    more_i, more_a = history(rng, 4)
    reqs = [RankRequest(user_id=5, items=items, actions=actions, candidates=[1, 2]),
            # the same history and more: full, then delta
            RankRequest(user_id=5, items=items + more_i, actions=actions + more_a,
                        candidates=[3, 4]),
            RankRequest(user_id=5, items=[7], actions=[1], candidates=[5], base_len=24)]
    rewritten = [9] + items[1:] + more_i + [7]  # the first event differs
    reqs.append(RankRequest(user_id=5, items=rewritten, actions=actions + more_a + [1],
                            candidates=[6]))
    async with Engine.from_spec("rank-small", small_overrides(**{"cache.mode": mode, **CACHE})) as e:
        got = []
        for k, r in enumerate(reqs):
            got.append(await e.rank(r))
            if k in (1, 2):  # extensions: cached tokens reused, no fingerprint compared
                assert checked == [] and got[-1].stats.tokens_recomputed < 2 * (20 + k * 4), k
        assert checked == [5]  # the rewritten history went through the fingerprints
        assert got[-1].stats.tokens_recomputed == 2 * 25  # and nothing cached was reused
        known_users = e.stats()["cache"]["prefix_known_users"]
    full = [reqs[0], reqs[1], RankRequest(user_id=5, items=items + more_i + [7],
                                          actions=actions + more_a + [1], candidates=[5]), reqs[3]]
    ref = await recompute_scores(full, **CACHE)
    for g, want in zip(got, ref):
        np.testing.assert_allclose(g.scores, want, rtol=1e-4, atol=1e-5)
    assert known_users == 2
