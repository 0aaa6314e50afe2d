"""Rank batches in flight (``engine.rank_in_flight``): batch n+1 is planned while batch n runs,
with the cache manager leasing each batch's users. Scores equal one-batch-at-a-time serving and
recompute, every cache mode, under concurrent returning users; no user is in two batches at once."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from streamgr import Engine, RankRequest
from tests.conftest import small_overrides


def visits(seed: int, n: int = 120, users: int = 10):
    """Returning users, each visit extending the last: (user, items, actions, candidates)."""
    rng = np.random.default_rng(seed)
    hist: dict[int, tuple[list, list]] = {}
    out = []
    for _ in range(n):
        u = int(rng.integers(users))
        items, actions = hist.setdefault(u, ([], []))
        k = min(int(rng.integers(1, 6)), 60 - len(items))
        items += rng.integers(200, size=k).tolist()
        actions += rng.integers(16, size=k).tolist()
        out.append(RankRequest(user_id=u, items=list(items), actions=list(actions),
                               candidates=rng.choice(200, size=4, replace=False).tolist()))
    return out


async def serve(overrides, reqs, concurrency=12, setup=None):
    """Per user in order (each visit after the last), across users concurrently. Returns the
    scores, the engine's stats, and the most batches seen between submit and finish.
    ``setup(engine)`` runs before the first request."""
    import threading
    async with Engine.from_spec("rank-small", overrides) as eng:
        if setup is not None:
            setup(eng)
        runner, lock, live = eng.runner, threading.Lock(), {"n": 0, "max": 0}
        submit, finish = runner.submit, runner.finish

        def counted_submit(batch):
            with lock:
                live["n"] += 1
                live["max"] = max(live["max"], live["n"])
            return submit(batch)

        def counted_finish(handle):
            # A batch's answer takes a little while (as a GPU batch's does): on a loaded CI
            # machine the CPU's finish can otherwise return before the next submit begins,
            # and two batches would never be seen in flight at once.
            time.sleep(0.003)
            try:
                return finish(handle)
            finally:
                with lock:
                    live["n"] -= 1
        runner.submit, runner.finish = counted_submit, counted_finish
        by_user: dict = {}
        for i, r in enumerate(reqs):
            by_user.setdefault(r.user_id, []).append(i)
        out: list = [None] * len(reqs)
        sem = asyncio.Semaphore(concurrency)

        async def user(idx):
            for i in idx:
                async with sem:
                    out[i] = (await eng.rank(reqs[i])).scores
        await asyncio.gather(*(user(idx) for idx in by_user.values()))
        stats = eng.stats()
    # After close (the batches' commits run after their replies, and close drains them):
    if hasattr(eng.runner, "manager"):
        eng.runner.manager.check_invariants()
        assert not eng.runner.manager.in_batch  # every lease released
    return np.array(out), stats, live["max"]


@pytest.mark.parametrize("mode", ["gpu-only", "hierarchical"])
async def test_two_batches_in_flight_equal_one_at_a_time(mode):
    reqs = visits(3)
    cache = {"cache.mode": mode, "cache.page_tokens": 4, "cache.chunk_tokens": 8,
             "cache.device_pages": 40, "cache.host_chunks": 256,
             "cache.offload_quota_tokens": 64, "engine.max_batch": 4, "engine.max_wait_ms": 0.5}
    one, _, most1 = await serve(small_overrides(**cache, **{"engine.rank_in_flight": 1}), reqs)
    two, st, most2 = await serve(small_overrides(**cache, **{"engine.rank_in_flight": 2}), reqs)
    ref, _, _ = await serve(small_overrides(**{"cache.mode": "recompute"}), reqs)
    assert most1 == 1 and most2 == 2  # two batches really were in flight at once
    np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(two, ref, rtol=2e-4, atol=2e-5)
    assert st["counters"]["rank_requests"] == len(reqs)
    assert st["gpu_hit_ratio"] > 0


async def test_inline_onload_with_two_batches_in_flight_answers_as_recompute():
    """The page-locked store's inline onload (CUDA's default; forced here on the CPU) under
    the batch loop with two batches in flight: a host hit's copies issued from the executor's
    thread while the completion thread answers the batch before it. Answers equal recompute's
    and one-at-a-time serving's, and host hits were onloaded."""
    from tests.streams.test_threaded_transfers import force_direct
    reqs = visits(5, n=160)
    cache = {"cache.mode": "hierarchical", "cache.page_tokens": 4, "cache.chunk_tokens": 8,
             "cache.device_pages": 24, "cache.host_chunks": 256,
             "cache.offload_quota_tokens": 64, "engine.max_batch": 4, "engine.max_wait_ms": 0.5}
    seen = []

    def inline(eng):
        onload = force_direct(eng.runner)
        assert onload.deferred
        seen.append(eng.runner)
    two, _, most = await serve(small_overrides(**cache, **{"engine.rank_in_flight": 2}), reqs,
                               setup=inline)
    one, _, _ = await serve(small_overrides(**cache, **{"engine.rank_in_flight": 1}), reqs,
                            setup=inline)
    ref, _, _ = await serve(small_overrides(**{"cache.mode": "recompute"}), reqs)
    assert most == 2 and all(r.bytes_onloaded > 0 for r in seen)
    np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(two, ref, rtol=2e-4, atol=2e-5)


async def test_a_user_in_flight_waits_for_a_later_batch():
    """Two requests of one user back to back: never planned in two batches at once (the
    manager would refuse it), both answered."""
    ov = small_overrides(**{"cache.mode": "gpu-only", "engine.rank_in_flight": 2,
                            "engine.max_batch": 1})
    async with Engine.from_spec("rank-small", ov) as eng:
        a = RankRequest(user_id=7, items=[1, 2], actions=[0, 1], candidates=[3])
        b = RankRequest(user_id=7, items=[1, 2, 4], actions=[0, 1, 0], candidates=[3])
        ra, rb = await asyncio.gather(eng.rank(a), eng.rank(b))
        assert len(ra.scores) == len(rb.scores) == 1
        assert eng.stats()["counters"].get("batch_errors", 0) == 0


def test_score_buffers_hand_out_a_free_buffer_that_fits_and_keep_a_few():
    """The pool behind rank batches' score copies (pinned on a GPU; plain tensors here): the
    first free buffer large enough is handed out (whatever sits before it), a new one only when
    none fits, and at most KEEP buffers are kept."""
    import torch
    from streamgr.engine.rank import ScoreBuffers
    pool = ScoreBuffers()
    small, big = torch.zeros(10), torch.zeros(5000)
    pool.give_back(small), pool.give_back(big), pool.give_back(None)
    assert pool.take(4097, pinned=False) is big and [b for b, _ in pool._free] == [small]
    fresh = pool.take(20, pinned=False)
    assert fresh is not small and fresh.numel() >= 4096 and [b for b, _ in pool._free] == [small]
    for _ in range(2 * ScoreBuffers.KEEP):
        pool.give_back(torch.zeros(1))
    assert len(pool._free) == ScoreBuffers.KEEP


async def test_generate_batches_in_flight_answer_as_one_at_a_time():
    """``engine.gen_in_flight`` 1, 2 and 3 give every generate request the same answer (a
    deeper pipeline changes when batches are answered, not what); 0 is refused."""
    from streamgr.api import GenerateRequest
    rng = np.random.default_rng(8)
    reqs = [GenerateRequest(user_id=u, history=rng.integers(500, size=int(rng.integers(1, 30)))
                            .tolist(), top_k=5) for u in range(24)]
    got = []
    for n in (1, 2, 3):
        ov = {"engine.device": "cpu", "engine.max_batch": 4, "engine.gen_in_flight": n}
        async with Engine.from_spec("gen-small", ov) as eng:
            res = await asyncio.gather(*(eng.generate(r) for r in reqs))
        got.append([(r.items, r.sids) for r in res])
    assert got[0] == got[1] == got[2]
    with pytest.raises(Exception, match="gen_in_flight"):
        Engine.from_spec("gen-small", {"engine.device": "cpu", "engine.gen_in_flight": 0})
