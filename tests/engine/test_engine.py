"""The embedded engine on a real event loop with real tensors (CPU, fp32)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import numpy as np
import pytest

from streamgr import BlockingEngine, Engine, GenerateRequest, RankRequest
from streamgr import errors as E
from tests.conftest import in_a_fork, small_overrides


def req(rng, user, n_hist, n_cand=5, num_items=200):
    return RankRequest(user_id=user, items=rng.integers(num_items, size=n_hist).tolist(),
                       actions=rng.integers(16, size=n_hist).tolist(),
                       candidates=rng.choice(num_items, size=n_cand, replace=False).tolist())


async def test_concurrent_equals_one_at_a_time():
    rng = np.random.default_rng(0)
    reqs = [req(rng, u, int(rng.integers(0, 64))) for u in range(20)]
    async with Engine.from_spec("rank-small", small_overrides()) as eng:
        alone = [await eng.rank(r) for r in reqs]
        together = await asyncio.gather(*(eng.rank(r) for r in reqs))
    assert max(r.stats.batch_size for r in together) > 1  # they really were batched
    assert all(r.stats.batch_size == 1 for r in alone)
    for a, b in zip(alone, together):
        assert len(a.scores) == 5
        np.testing.assert_allclose(a.scores, b.scores, rtol=1e-5, atol=1e-6)


async def test_same_user_twice_in_one_batch():
    rng = np.random.default_rng(1)
    first = req(rng, "alice", 10)
    longer = RankRequest(user_id="alice", items=first.items + [3, 4], actions=first.actions + [1, 2],
                         candidates=first.candidates)
    async with Engine.from_spec("rank-small", small_overrides()) as eng:
        both = await asyncio.gather(eng.rank(first), eng.rank(longer))
        again = [await eng.rank(first), await eng.rank(longer)]
    for a, b in zip(both, again):
        np.testing.assert_allclose(a.scores, b.scores, rtol=1e-5, atol=1e-6)
    assert both[0].scores != both[1].scores


BAD = [
    (E.EmptyCandidates, dict(candidates=[])),
    (E.IdOutOfRange, dict(candidates=[1, 200])),
    (E.IdOutOfRange, dict(items=[-1, 2], actions=[0, 0])),
    (E.IdOutOfRange, dict(items=[1, 2], actions=[0, 16])),
    (E.HistoryTooLong, dict(items=[1] * 65, actions=[0] * 65)),
    (E.LengthMismatch, dict(items=[1, 2, 3], actions=[0, 1])),
    (E.TooManyCandidates, dict(candidates=list(range(17)))),
    (E.InvalidRequest, dict(items=[1.5], actions=[0])),
    (E.InvalidRequest, dict(user_id=None)),
    (E.InvalidRequest, dict(user_id="u" * 1025)),  # past MAX_USER_ID (1,024 is served below)
    (E.InvalidRequest, dict(user_id=2**64)),
    (E.InvalidRequest, dict(user_id=-2**63 - 1)),
    (E.InvalidRequest, dict(base_len=-1)),
    (E.InvalidRequest, dict(base_len=True)),
    (E.InvalidRequest, dict(base_len=2.0)),
    (E.HistoryTooLong, dict(base_len=63)),  # 63 events sent before + these 2: past 64
    (E.HistoryTooLong, dict(base_len=2**64)),  # a count, only far too large
]


async def test_user_ids_at_their_bounds_are_served():
    async with Engine.from_spec("rank-small", small_overrides()) as eng:
        for uid in ("u" * 1024, 2**64 - 1, -2**63, ""):
            r = await eng.rank(RankRequest(user_id=uid, items=[1], actions=[0], candidates=[3]))
            assert len(r.scores) == 1


@pytest.mark.parametrize("err,fields", BAD, ids=[f"{e.__name__}-{i}" for i, (e, _) in enumerate(BAD)])
async def test_bad_input_typed_error_then_serving(err, fields):
    good = RankRequest(user_id=1, items=[1, 2], actions=[0, 1], candidates=[3, 4])
    bad = RankRequest(**{**dict(user_id=1, items=[1, 2], actions=[0, 1], candidates=[3, 4]), **fields})
    async with Engine.from_spec("rank-small", small_overrides()) as eng:
        with pytest.raises(err) as info:
            await eng.rank(bad)
        assert isinstance(info.value, E.InvalidRequest)
        ok = await eng.rank(good)
        assert len(ok.scores) == 2
        assert eng.stats()["counters"]["rank_invalid"] == 1


async def test_not_started_and_closed():
    eng = Engine.from_spec("rank-small", small_overrides())
    good = RankRequest(user_id=1, items=[], actions=[], candidates=[3])
    with pytest.raises(E.EngineClosed):
        await eng.rank(good)
    async with eng:
        assert len((await eng.rank(good)).scores) == 1
    with pytest.raises(E.EngineClosed):
        await eng.rank(good)


async def test_overload_is_immediate():
    rng = np.random.default_rng(2)
    async with Engine.from_spec("rank-small", small_overrides(**{"engine.max_queue": 4})) as eng:
        tasks = [asyncio.ensure_future(eng.rank(req(rng, u, 30))) for u in range(12)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
    over = [r for r in results if isinstance(r, E.Overloaded)]
    done = [r for r in results if not isinstance(r, Exception)]
    assert len(done) == 4 and len(over) == 8


async def test_cancelled_request_never_reaches_the_model():
    rng = np.random.default_rng(3)
    async with Engine.from_spec("rank-small", small_overrides(**{"engine.max_wait_ms": 50.0})) as eng:
        t = asyncio.ensure_future(eng.rank(req(rng, 1, 10)))
        await asyncio.sleep(0.005)
        t.cancel()
        r = await eng.rank(req(rng, 2, 10))
        assert r.stats.batch_size == 1
        assert eng.stats()["counters"]["rank_requests"] == 1


def test_blocking_engine():
    rng = np.random.default_rng(4)
    reqs = [req(rng, u, 20) for u in range(6)]
    with BlockingEngine("rank-small", small_overrides()) as eng:
        one = eng.rank(reqs[0])
        many = eng.rank_many(reqs)
    np.testing.assert_allclose(one.scores, many[0].scores, rtol=1e-5, atol=1e-6)
    assert len(many) == 6


def test_blocking_engine_lists_past_the_queue_errors_in_place_and_after_close():
    """``rank_many`` keeps at most ``engine.max_queue`` of its list in flight (a list longer
    than the queue is served, not refused with ``Overloaded``); ``return_exceptions=True``
    answers a bad request's typed error in its place and the others' results (by default the
    first error raises); a closed engine raises ``EngineClosed``, not the loop's RuntimeError."""
    rng = np.random.default_rng(5)
    reqs = [req(rng, u, 10) for u in range(20)]
    bad = RankRequest(user_id=99, items=[5000], actions=[1], candidates=[8])
    eng = BlockingEngine("rank-small", small_overrides(**{"engine.max_queue": 4}))
    try:
        many = eng.rank_many(reqs)
        assert len(many) == 20 and all(len(r.scores) == 5 for r in many)
        mixed = eng.rank_many([reqs[0], bad, reqs[1]], return_exceptions=True)
        assert isinstance(mixed[1], E.IdOutOfRange)
        np.testing.assert_allclose(mixed[0].scores, many[0].scores, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(mixed[2].scores, many[1].scores, rtol=1e-5, atol=1e-6)
        with pytest.raises(E.IdOutOfRange):
            eng.rank_many([reqs[0], bad])
    finally:
        eng.close()
    eng.close()  # twice: a no-op
    with pytest.raises(E.EngineClosed):
        eng.rank(reqs[0])
    with pytest.raises(E.EngineClosed):
        eng.rank_many(reqs[:2])


async def test_numpy_integer_user_ids_are_the_same_users_as_ints():
    """A user id from a numpy array (``np.int64``, ``np.uint64``) is served as that int: its
    next visit with a plain int hits the K/V the first left (it was refused: "must be an int
    or a str"); a numpy float stays refused."""
    rng = np.random.default_rng(11)
    async with Engine.from_spec("rank-small", small_overrides()) as eng:
        for uid, same in ((np.int64(7), 7), (np.uint64(2**64 - 1), 2**64 - 1)):
            first = req(rng, 0, 12)
            first = RankRequest(user_id=uid, items=first.items, actions=first.actions,
                                candidates=first.candidates)
            a = await eng.rank(first)
            assert a.stats.tokens_from_gpu == 0
            b = await eng.rank(RankRequest(user_id=same, items=first.items,
                                           actions=first.actions, candidates=first.candidates))
            assert b.stats.tokens_from_gpu > 0  # the same user: its history cached
            np.testing.assert_allclose(b.scores, a.scores, rtol=1e-5, atol=1e-6)
        with pytest.raises(E.InvalidRequest, match="user_id"):
            await eng.rank(RankRequest(user_id=np.float64(7), items=[1], actions=[1],
                                       candidates=[2]))


async def test_a_failing_batch_fails_its_requests_and_the_engine_serves_on():
    rng = np.random.default_rng(9)
    async with Engine.from_spec("rank-small", small_overrides()) as eng:
        real = eng.runner.submit  # what the batch loop calls on the executor
        calls = {"n": 0}

        def flaky(batch):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected fault")
            return real(batch)
        eng.runner.submit = flaky
        with pytest.raises(E.StreamgrError, match="injected fault"):
            await eng.rank(req(rng, 1, 10))
        ok = await eng.rank(req(rng, 2, 10))
        assert len(ok.scores) == 5 and eng.stats()["counters"]["batch_errors"] == 1

        def dead(batch):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        eng.runner.submit = dead
        with pytest.raises(E.EngineDead):
            await eng.rank(req(rng, 3, 10))
        with pytest.raises(E.EngineDead):  # refused at admission from now on
            await eng.rank(req(rng, 4, 10))


async def test_a_stalled_batch_fails_with_engine_dead_and_close_returns():
    """A batch whose finish never returns (a hung kernel holds its stream so: sessions 37-39 on
    the H200) fails its requests with ``EngineDead`` after ``engine.stall_timeout_s``; so does a
    batch queued behind it on the completion thread, and every later request at admission; and
    ``close`` returns instead of joining the stuck thread."""
    rng = np.random.default_rng(11)
    release = threading.Event()
    eng = Engine.from_spec("rank-small", small_overrides(**{"engine.stall_timeout_s": 0.3}))
    await eng.start()
    try:
        real = eng.runner.finish  # what the completion thread calls

        def hung(handle):
            release.wait(30)
            return real(handle)
        eng.runner.finish = hung
        t0 = time.monotonic()
        first = asyncio.ensure_future(eng.rank(req(rng, 1, 10)))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(eng.rank(req(rng, 2, 10)))  # the next batch in flight
        for fut in (first, second):
            with pytest.raises(E.EngineDead, match="did not finish within 0.3 s"):
                await fut
        assert time.monotonic() - t0 < 10
        with pytest.raises(E.EngineDead):  # refused at admission from now on
            await eng.rank(req(rng, 3, 10))
        t1 = time.monotonic()
        await eng.close()
        assert time.monotonic() - t1 < 5  # the stuck thread is not joined
    finally:
        release.set()  # lets the stuck thread end, after the close
        await eng.close()


@pytest.mark.parametrize("freeze", [True, False])
async def test_gc_freeze_for_the_serving_lifetime(freeze):
    """With engine.gc_freeze the objects alive at start leave the collector's reach while the
    engine serves (no full collection walks them), and are given back at close."""
    import gc
    gc.unfreeze()
    before = gc.get_threshold()
    eng = Engine.from_spec("rank-small", small_overrides(**{"engine.gc_freeze": freeze,
                                                             "engine.gc_gen0": 20_000}))
    async with eng:
        frozen = gc.get_freeze_count()
        assert (frozen > 1000) == freeze, frozen
        # The young generation's threshold raised while serving (gc_gen0), with the freeze.
        assert gc.get_threshold()[0] == (max(20_000, before[0]) if freeze else before[0])
        r = await eng.rank(req(np.random.default_rng(3), 1, 10))
        assert len(r.scores) == 5
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == before


async def test_gc_settings_last_until_the_last_engine_closes():
    """Two engines whose lifetimes overlap: the first to close leaves the other's settings in
    place (freeze, threshold); the last one restores the interpreter's."""
    import gc
    gc.unfreeze()
    before = gc.get_threshold()
    ov = small_overrides(**{"engine.gc_gen0": 30_000})
    a, b = Engine.from_spec("rank-small", ov), Engine.from_spec("rank-small", ov)
    await a.start()
    await b.start()
    await a.close()
    assert gc.get_freeze_count() > 1000 and gc.get_threshold()[0] == max(30_000, before[0])
    assert len((await b.rank(req(np.random.default_rng(4), 1, 10))).scores) == 5
    await b.close()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before


async def test_switch_interval_while_serving():
    """engine.switch_interval_ms sets the interpreter's thread switch interval while the engine
    serves (with or without gc_freeze) and puts the interpreter's back at close; an invalid
    one is refused at configuration."""
    import sys
    before = sys.getswitchinterval()
    eng = Engine.from_spec("rank-small", small_overrides(**{"engine.switch_interval_ms": 0.5,
                                                             "engine.gc_freeze": False}))
    async with eng:
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        assert len((await eng.rank(req(np.random.default_rng(5), 1, 10))).scores) == 5
    assert sys.getswitchinterval() == before
    with pytest.raises(Exception, match="switch_interval_ms"):
        Engine.from_spec("rank-small", small_overrides(**{"engine.switch_interval_ms": -1}))


async def test_close_mid_flight_settles_every_rank_request():
    """A close that does not wait: each admitted request gets its scores or EngineClosed,
    including those of the batch the engine holds when it stops."""
    rng = np.random.default_rng(6)
    eng = Engine.from_spec("rank-small", small_overrides(**{"engine.max_batch": 2}))
    await eng.start()
    futs = [eng.submit_rank(req(rng, u, 60)) for u in range(60)]
    await futs[0]  # one batch answered; the rest in flight or queued
    await eng.close(drain_timeout=0.0)
    out = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 10)
    refused = [r for r in out if isinstance(r, Exception)]
    assert all(isinstance(r, E.EngineClosed) for r in refused), refused[:3]
    assert refused and len(refused) < len(out)


@pytest.mark.parametrize("bad", [2**63, 2**64 + 5, -2**70])
async def test_huge_ids_are_named_as_sent(bad):
    from streamgr.errors import IdOutOfRange
    async with Engine.from_spec("rank-small", small_overrides()) as eng:
        with pytest.raises(IdOutOfRange, match=rf"holds id {bad},"):
            await eng.rank(RankRequest(user_id=1, items=[1, bad], actions=[0, 1], candidates=[2]))
        r = await eng.rank(RankRequest(user_id=1, items=[1], actions=[0], candidates=[2]))
        assert len(r.scores) == 1


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64", "uint8", "uint64"])
def test_id_check_in_one_pass_still_names_negative_and_large_ids(dtype):
    """The range check reads ids as unsigned in one pass; a negative id of a narrow signed
    dtype (int8 -1 reads as 255) must still be refused, with the id as sent."""
    from streamgr.engine.fields import id_array as _ids
    from streamgr.errors import IdOutOfRange
    dt = np.dtype(dtype)
    ok = np.array([0, 3, 99], dtype=dt)
    assert _ids("items", ok, 0, 100).tolist() == [0, 3, 99]
    assert _ids("items", ok, 0, 100).dtype == np.int64
    if dt.kind == "i":
        with pytest.raises(IdOutOfRange, match=r"holds id -1,"):
            _ids("items", np.array([5, -1], dtype=dt), 0, 1000)
    with pytest.raises(IdOutOfRange, match=r"holds id 100,"):
        _ids("items", np.array([5, 100], dtype=dt), 0, 100)


def test_a_call_from_another_event_loop_is_refused_not_left_waiting():
    """An engine started on one loop, called from another (or from no loop): before, the
    request went into queues its loop never woke for and the caller waited for ever; now
    each entry point raises WrongEventLoop and the engine serves on on its own loop."""
    eng = Engine.from_spec("rank-small", small_overrides())
    home = asyncio.new_event_loop()
    thread = threading.Thread(target=home.run_forever, daemon=True)
    thread.start()
    on_home = lambda coro: asyncio.run_coroutine_threadsafe(coro, home).result(30)  # noqa: E731
    good = RankRequest(user_id=1, items=[4, 5], actions=[0, 1], candidates=[3, 7])
    try:
        on_home(eng.start())

        async def elsewhere(call):
            return await asyncio.wait_for(call(), 5)

        for call in (lambda: eng.rank(good), lambda: eng.update(weights=3),
                     lambda: eng.rollback(), eng.start, eng.close):
            with pytest.raises(E.WrongEventLoop, match="another event loop"):
                asyncio.run(elsewhere(call))
        with pytest.raises(E.WrongEventLoop):
            eng.submit_rank(good)  # no running loop at all
        assert len(on_home(eng.rank(good)).scores) == 2
        assert on_home(eng.update(weights=3))["rank"]["previous"] is not None
        assert eng.stats()["counters"]["rank_requests"] == 1
    finally:
        on_home(eng.close())
        home.call_soon_threadsafe(home.stop)
        thread.join(10)

    async def started_and_left():  # a loop that ends without close
        await eng.start()
        return await eng.rank(good)
    assert len(asyncio.run(started_and_left()).scores) == 2
    with pytest.raises(E.WrongEventLoop, match="has closed without engine.close"):
        asyncio.run(eng.rank(good))
    asyncio.run(eng.close())  # from a new loop: its threads released, then it starts again

    async def again():
        async with eng:
            return await eng.rank(good)
    assert len(asyncio.run(again()).scores) == 2
    # A batch that never finished on the closed loop leaves its users leased in the cache
    # (planted here: a loop closed between a batch's submit and its finish): the close finds
    # it and the engine is dead, instead of those users' requests failing later.
    asyncio.run(started_and_left())
    eng.runner.manager._leases.append(frozenset([1]))
    asyncio.run(eng.close())
    with pytest.raises(E.EngineDead, match="batch in flight"):
        asyncio.run(again())


def test_a_forked_child_is_told_the_engine_stays_with_its_parent():
    """A BlockingEngine (and its Engine) used in a forked child: before, the call waited for
    ever on the parent's loop thread, which does not survive a fork; now EngineClosed says
    why, close is a no-op there, and the parent serves on."""
    good = RankRequest(user_id=1, items=[4, 5], actions=[0, 1], candidates=[3, 7])
    with BlockingEngine("rank-small", small_overrides()) as eng:
        first = eng.rank(good).scores

        def child():
            try:
                eng.rank(good)
            except E.EngineClosed as err:
                eng.close()
                return f"refused: {err}"
            return "served"

        def child_async():
            async def go():
                await eng.engine.rank(good)
            try:
                asyncio.run(go())
            except E.EngineClosed as err:
                return f"refused: {err}"
            return "served"

        for fn in (child, child_async):
            status, text = in_a_fork(fn)
            assert status == 0 and text.startswith("refused: the engine was started in "
                                                   f"process {os.getpid()}"), (status, text)
        assert eng.rank(good).scores == pytest.approx(first, abs=1e-5)


def test_a_blocking_call_that_times_out_withdraws_its_request():
    """Before, ``rank(timeout=...)`` raised TimeoutError and the request ran anyway; now the
    request is withdrawn while queued and never reaches the model."""
    good = RankRequest(user_id=1, items=[4, 5], actions=[0, 1], candidates=[3, 7])
    with BlockingEngine("rank-small", small_overrides(**{"engine.max_wait_ms": 300.0,
                                                         "engine.max_batch": 64})) as eng:
        with pytest.raises(TimeoutError):
            eng.rank(good, timeout=0.02)
        deadline = time.monotonic() + 5
        while "rank_cancelled" not in eng.stats()["counters"] and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.4)  # past the batch window: a request left queued would have run
        counters = eng.stats()["counters"]
        assert counters.get("rank_cancelled") == 1 and "rank_requests" not in counters, counters
        assert len(eng.rank(good).scores) == 2


def _threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith("streamgr")}


async def test_a_close_cut_short_is_finished_by_the_next():
    """A close whose caller gives up (a timeout) runs on to its end, and the next close waits
    for it: before, the second close returned at once and the engine's threads and the
    interpreter's gc settings were left as they were."""
    import gc
    before, frozen = _threads(), gc.get_freeze_count()
    eng = Engine.from_spec("rank-small", small_overrides(**{"engine.max_wait_ms": 200.0,
                                                            "engine.gc_freeze": True}))
    await eng.start()
    await eng.rank(req(np.random.default_rng(0), 0, 40))  # the threads exist
    futs = [eng.submit_rank(req(np.random.default_rng(u), u, 40)) for u in range(1, 6)]
    assert _threads() - before and gc.get_freeze_count() > frozen
    with pytest.raises(asyncio.TimeoutError):  # (the close drains the queued batch: ~200 ms)
        await asyncio.wait_for(eng.close(), 0.02)
    await eng.close()
    assert not _threads() - before and gc.get_freeze_count() == frozen
    out = await asyncio.gather(*futs, return_exceptions=True)
    assert all(not isinstance(r, Exception) or isinstance(r, E.EngineClosed) for r in out), out


async def test_a_start_cut_short_while_warming_up_never_overlaps_the_next():
    """A start cancelled during its warm-up (its thread cannot be stopped) and a start right
    after: before, the second warm-up ran beside the first on the same runner; now it waits."""
    eng = Engine.from_spec("gen-small", small_overrides(**{"engine.max_wait_ms": 1.0}))
    warm, busy, most = eng.gen_runner.warm_up, [0], [0]
    lock = threading.Lock()

    def slow_warm_up(*args):
        with lock:
            busy[0] += 1
            most[0] = max(most[0], busy[0])
        try:
            time.sleep(0.3)
            return warm(*args)
        finally:
            with lock:
                busy[0] -= 1
    eng.gen_runner.warm_up = slow_warm_up
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(eng.start(), 0.05)
    async with eng:
        assert most[0] == 1
        assert len((await eng.generate(GenerateRequest(user_id=1, history=[1, 2, 3],
                                                       top_k=3))).items) == 3


def test_a_list_call_that_raises_withdraws_the_rest():
    """``rank_many`` without ``return_exceptions``: the first error raises, and the list's
    other requests, still queued, are withdrawn (before, they ran for nobody)."""
    rng = np.random.default_rng(8)
    reqs = [req(rng, u, 10) for u in range(12)]
    late_bad = RankRequest(user_id=99, items=[5000], actions=[1], candidates=[8])
    with BlockingEngine("rank-small", small_overrides(**{"engine.max_wait_ms": 300.0,
                                                         "engine.max_batch": 64})) as eng:
        with pytest.raises(E.IdOutOfRange):
            eng.rank_many(reqs + [late_bad])
        time.sleep(0.5)  # past the batch window: a request left queued would have run
        counters = eng.stats()["counters"]
        assert counters.get("rank_cancelled") == 12 and "rank_requests" not in counters, counters


def test_threads_calling_a_blocking_engine_at_once_wait_rather_than_overload():
    """Three threads' lists and eight threads' single calls at once on a queue of 8: before,
    each list kept its own max_queue in flight, so together they overran the queue and all but
    one list failed with Overloaded; now one gate serves every caller."""
    reqs = [RankRequest(user_id=u, items=[1, 2, 3], actions=[0, 1, 0], candidates=[4, 5])
            for u in range(60)]
    out, errors = {}, []
    with BlockingEngine("rank-small", small_overrides(**{"engine.max_queue": 8})) as eng:
        def work(i):
            try:
                out[i] = (len(eng.rank_many(reqs)) if i < 3 else
                          len(eng.rank(reqs[i], timeout=60).scores))
            except Exception as err:  # noqa: BLE001: reported below
                errors.append(err)
        threads = [threading.Thread(target=work, args=(i,)) for i in range(11)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors and out == {i: 60 if i < 3 else 2 for i in range(11)}, errors[:2]


async def test_a_close_that_fails_raises_once_and_leaves_the_engine_closed():
    """A runner whose close fails: that close raises; the engine is closed all the same (a
    later close returns, a request gets EngineClosed, a start serves again), rather than every
    later close raising the same error."""
    before = _threads()
    eng = Engine.from_spec("rank-small", small_overrides())
    await eng.start()
    await eng.rank(req(np.random.default_rng(9), 1, 10))  # the threads exist
    real = eng.runner.close

    def broken(*args):
        eng.runner.close = real
        raise RuntimeError("disk gone")
    eng.runner.close = broken
    with pytest.raises(RuntimeError, match="disk gone"):
        await eng.close()
    assert not {t for t in _threads() - before if "exec" in t.name or "finish" in t.name}
    await eng.close()
    with pytest.raises(E.EngineClosed):
        await eng.rank(req(np.random.default_rng(9), 1, 10))
    async with eng:
        assert len((await eng.rank(req(np.random.default_rng(9), 1, 10))).scores) == 5


def test_lengths_are_refused_before_the_ids_are_read():
    """A rank history or candidate list longer than the model takes, or a generate deny list
    past its cap, is refused from its length: before, every id was converted first (3M ids:
    ~85 ms of the event loop on the CPU VM)."""
    from streamgr.engine.rank import prepare_rank

    class Unread:  # a sequence whose ids must not be read
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            raise AssertionError("ids read")

        def __iter__(self):
            raise AssertionError("ids read")
    eng = Engine.from_spec("rank-small", small_overrides())
    cfg = eng.runner.model.cfg
    long = cfg.max_history + 1
    with pytest.raises(E.HistoryTooLong, match=f"history of {long} events"):
        prepare_rank(RankRequest(user_id=1, items=Unread(long), actions=Unread(long),
                                 candidates=[3]), cfg)
    many = cfg.max_candidates + 1
    with pytest.raises(E.TooManyCandidates, match=f"{many} candidates"):
        prepare_rank(RankRequest(user_id=1, items=[1], actions=[0], candidates=Unread(many)),
                     cfg)
    from streamgr.engine.fields import MAX_EXCLUDE, id_set
    with pytest.raises(E.InvalidRequest, match=f"holds {MAX_EXCLUDE + 1} item ids"):
        id_set(Unread(MAX_EXCLUDE + 1), "exclude_items")  # generate's deny list
