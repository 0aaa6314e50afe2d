"""cache.onload_split: host hits onload part of what the host holds and recompute the rest.

The choice (``cache/onload_split.py``) against brute force on small batches; the plans it
leaves (prefixes in whole chunks, counts that add up); and engines that split: every answer
equal to recompute's, the recomputed range then served from the GPU, the host copy untouched.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from streamgr.cache.manager import UserPlan
from streamgr.cache.onload_split import SplitCosts, split_by_cost, split_fraction
from tests.cache.helpers import req, run_batch, runners

C = 4


def _costs(a: float, quad: float = 1.0, lin: float = 0.0) -> SplitCosts:
    n = np.array([0, 4, 8, 16, 32, 64], dtype=float)
    return SplitCosts(a, n, lin * n + quad * n * n)


def _plan(key, length, held=0, gpu=0) -> UserPlan:
    p = UserPlan(key, length)
    if held:
        p.start = p.from_host = held
        p.onload = [(100 + i, i) for i in range(held // C)]
    elif gpu:
        p.start = p.from_gpu = gpu
    return p


def _span(plans, costs: SplitCosts) -> float:
    onload = sum(costs.onload_s * p.from_host for p in plans)
    return max(onload, sum(costs.recompute(p.length) - costs.recompute(p.start) for p in plans))


def test_split_costs_are_checked_and_made_monotone():
    with pytest.raises(ValueError):
        SplitCosts(1.0, np.array([1.0, 2.0]), np.array([0.0, 1.0]))  # not from 0
    with pytest.raises(ValueError):
        SplitCosts(float("nan"), np.array([0.0, 2.0]), np.array([0.0, 1.0]))
    c = SplitCosts(1.0, np.array([0.0, 4.0, 8.0]), np.array([0.5, 3.0, 2.0]))  # a noisy dip
    assert c.recompute_s.tolist() == [0.0, 2.5, 2.5]
    q = _costs(1.0)
    assert q.recompute(8) == 64.0 and q.recompute(6) == pytest.approx(40.0)  # interpolated
    # past the table: the last slope, growing linearly (a quadratic there: 64 * 64 + ...)
    assert q.recompute(128) > q.recompute(64) + 96 * (128 - 64) - 1e-9
    assert q.recompute(np.array([0, 64])).tolist() == [0.0, 4096.0]


@pytest.mark.parametrize("seed", range(40))
def test_cost_split_beats_onloading_all_and_recomputing_all(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 4))
    plans = []
    for i in range(n):
        held = C * int(rng.integers(1, 6))
        plans.append(_plan(i, held + int(rng.integers(0, 9)), held=held))
    plans.append(_plan("g", 20, gpu=12))  # a GPU hit's compute overlaps the onload too
    costs = _costs(float(rng.choice([0.0, 1.0, 4.0, 16.0, 64.0, 1e6])),
                   quad=float(rng.choice([0.0, 0.5, 1.0])), lin=float(rng.choice([0.0, 8.0])))
    held = {p.key: p.from_host for p in plans}
    # Brute force over every user's prefix (whole chunks).
    options = [range(0, held[p.key] + 1, C) if held[p.key] else [0] for p in plans]
    best = float("inf")
    for xs in itertools.product(*options):
        trial = [_plan(p.key, p.length, held=x) if held[p.key] else p for p, x in zip(plans, xs)]
        best = min(best, _span(trial, costs))
    everything = _span(plans, costs)
    recomputed = split_by_cost(plans, C, costs)
    got = _span(plans, costs)
    assert got <= everything + 1e-9
    assert got <= _span([_plan(p.key, p.length) if held[p.key] else p for p in plans],
                        costs) + 1e-9
    assert got <= best + 1e-9, (got, best)  # greedy by length: the optimum on these
    for p in plans:
        if held[p.key]:
            assert p.from_host % C == 0 and p.start == p.from_host
            assert p.from_host + p.host_recomputed == held[p.key]
            assert [i for _, i in p.onload] == list(range(p.from_host // C))
    assert recomputed == sum(p.host_recomputed for p in plans)


@pytest.mark.parametrize("seed", range(12))
def test_a_dearer_recompute_onloads_more(seed):
    """``split_by_cost(scale=)``: the recompute costs scaled up never onload less (a
    SplitFeedback that found compute dearer than modelled moves tokens to the onload), scaled
    down never more; scale 1 is the plain split."""
    rng = np.random.default_rng(100 + seed)
    lengths = [(C * int(rng.integers(1, 8)), int(rng.integers(0, 9))) for _ in range(3)]
    costs = _costs(float(rng.choice([2.0, 8.0, 30.0])), quad=float(rng.choice([0.5, 1.0])))

    def onloaded(scale):
        plans = [_plan(i, h + extra, held=h) for i, (h, extra) in enumerate(lengths)]
        split_by_cost(plans, C, costs, scale)
        return sum(p.from_host for p in plans)
    plain = [_plan(i, h + extra, held=h) for i, (h, extra) in enumerate(lengths)]
    split_by_cost(plain, C, costs)
    got = [onloaded(x) for x in (0.25, 0.5, 1.0, 2.0, 4.0)]
    assert got == sorted(got) and got[2] == sum(p.from_host for p in plain)


def test_split_feedback_moves_the_scale_toward_the_balance_and_stays_bounded():
    from streamgr.cache.onload_split import SplitFeedback
    fb = SplitFeedback()
    assert fb.update(13.4, 11.8) > 1.0  # compute reached the last layer after it landed
    up = fb.scale
    assert fb.update(10.0, 10.0) == up  # balanced: unchanged
    assert fb.update(9.0, 12.0) < up  # compute waited for the onload
    assert fb.update(0.0, 12.0) == fb.scale and fb.updates == 3  # no timing: ignored
    for _ in range(50):
        fb.update(40.0, 10.0)
    assert fb.scale == fb.hi
    for _ in range(50):
        fb.update(1.0, 10.0)
    assert fb.scale == fb.lo


def test_cost_split_extremes_and_the_longest_users_first():
    def batch():
        return [_plan(0, 40, held=32), _plan(1, 20, held=16), _plan(2, 12, held=8)]
    plans = batch()
    assert split_by_cost(plans, C, _costs(0.0)) == 0  # onload free: all of it
    assert [p.from_host for p in plans] == [32, 16, 8]
    plans = batch()
    assert split_by_cost(plans, C, _costs(1e9)) == 56  # onload dear: none of it
    assert [(p.from_host, p.start, p.onload) for p in plans] == [(0, 0, [])] * 3
    plans = batch()  # balanced: the longest is onloaded first (a byte saves most there)
    split_by_cost(plans, C, _costs(40.0))
    assert plans[0].from_host == 32 and plans[2].from_host < 8


def test_fraction_split_keeps_whole_chunks():
    plans = [_plan(0, 40, held=32), _plan(1, 20, held=12), _plan(2, 9)]
    assert split_fraction(plans, C, 0.5) == 16 + 8
    assert [(p.from_host, p.host_recomputed) for p in plans] == [(16, 16), (4, 8), (0, 0)]


def _host_hit_engines(split):
    # 12 device pages of 4 tokens (48 tokens): a second user of 40 tokens evicts the first
    # from the device, whose offloaded chunks stay on host.
    engines = runners(page_tokens=4, chunk_tokens=8, device_pages=12, host_chunks=32,
                      offload_quota_tokens=64, onload_split=split)
    return engines["hierarchical"], engines["recompute"]


@pytest.mark.parametrize("split", [0.0, 0.5, "auto", 1.0])
def test_engines_that_split_answer_as_recompute(split):
    eng, ref = _host_hit_engines(split)
    if split == "auto":  # measured at start on this CPU (tiny chunks: the slope may be ~0)
        costs = eng.runner.onload_split
        assert isinstance(costs, SplitCosts) and np.isfinite(costs.onload_s)
        assert costs.onload_s >= 0 and np.all(np.diff(costs.recompute_s) >= 0)
        # chunks of 8 tokens up to 16 chunks or the longest history (2 x 80 tokens)
        assert costs.lengths.tolist() == [0, 8, 16, 32, 64, 128]
        eng.runner.onload_split = _costs(1e9)  # this test needs a split that recomputes
    rng = np.random.default_rng(1)
    hist = {u: (rng.integers(100, size=20).tolist(), rng.integers(8, size=20).tolist())
            for u in (0, 1)}

    def visit(u):
        batch = [req(u, *hist[u], [3, 4, 5])]
        got, want = run_batch(eng, batch)[0], run_batch(ref, batch)[0]
        np.testing.assert_allclose(got[0], want[0], rtol=2e-4, atol=2e-5)
        return got[1]

    visit(0)
    visit(1)  # user 0 leaves the device; its 40 tokens stay in 5 host chunks
    m = eng.runner.manager
    assert m.users[0].device_len == 0 and len(m.users[0].chunks) == 5
    chunks = list(m.users[0].chunks)
    stats = visit(0)
    assert stats["tier"] == "host"
    assert stats["tokens_from_host"] + stats["tokens_host_recomputed"] == 40
    assert stats["tokens_host_recomputed"] == {0.0: 40, "auto": 40, 0.5: 24, 1.0: 0}[split]
    assert stats["tokens_recomputed"] == 40 - stats["tokens_from_host"]
    assert m.counters["host_tokens_recomputed"] == stats["tokens_host_recomputed"]
    assert m.users[0].chunks == chunks  # the host copy is still the user's, still valid
    again = visit(0)  # all of it on the device now
    assert again["tier"] == "gpu" and again["tokens_from_gpu"] == 40
    m.check_invariants()


def test_auto_split_that_cannot_be_measured_onloads_all_and_serves(monkeypatch):
    """A failed measurement at start leaves host hits onloading all they hold (1.0), with a
    warning, and the engine serving; the split in force is in the cache stats."""
    from streamgr.engine import onload_costs

    def broken(runner):
        raise RuntimeError("no room for the synthetic batch")
    monkeypatch.setattr(onload_costs, "recompute_table", broken)
    eng, ref = _host_hit_engines("auto")
    assert eng.runner.onload_split == 1.0
    assert eng.stats()["cache"]["onload_split"] == 1.0
    batch = [req(0, [1, 2, 3], [0, 1, 0], [4, 5])]
    np.testing.assert_allclose(run_batch(eng, batch)[0][0], run_batch(ref, batch)[0][0],
                               rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("times,want", [((0.002, 0.002), 0.002), ((0.003, 0.002), 0.002),
                                         ((0.001, 0.005), None)])
def test_onload_rate_never_reads_free(monkeypatch, times, want):
    """The onload's cost a token is the slope between two onload sizes; where the larger
    onload took no longer (tiny chunks: jitter of the fixed costs hides the bytes, as on the
    H200 in session 23), it is the larger onload's mean a token, never 0 (a free onload
    would never be split)."""
    from streamgr.engine import onload_costs
    eng, _ = _host_hit_engines(1.0)
    runner, seen = eng.runner, iter(times)
    monkeypatch.setattr(onload_costs, "_best", lambda fn, device, device_time=False: next(seen))
    st = runner.stores
    k = min(onload_costs.MAX_CHUNKS, st.host.shape[0], st.pages.shape[1] // st.chunk_pages)
    k0 = max(1, k // 4)
    a = onload_costs.onload_seconds_per_token(runner)
    if want is None:
        want = (times[1] - times[0]) / ((k - k0) * st.C)
    else:
        want = want / (k * st.C)
    assert a == pytest.approx(want) and a > 0


def test_split_feedback_scales_the_split_and_waits_for_device_timings():
    """With ``split_feedback`` set, the runner splits with its scale (here set by hand: at
    scale 4 compute is dear and 32 of the 40 held tokens are onloaded, where scale 1 onloads
    16) and shows it in the cache stats; on the CPU there are no device timings, so it never updates itself. Answers stay
    recompute's."""
    from streamgr.cache.onload_split import SplitFeedback
    eng, ref = _host_hit_engines(1.0)
    n = np.array([0.0, 8.0, 16.0, 32.0, 64.0, 128.0])
    eng.runner.onload_split = SplitCosts(1.5, n, n)  # scale 1: onload dearer than recompute
    fb = eng.runner.split_feedback = SplitFeedback()
    fb.scale = 4.0
    rng = np.random.default_rng(1)
    hist = {u: (rng.integers(100, size=20).tolist(), rng.integers(8, size=20).tolist())
            for u in (0, 1)}
    stats = None
    for u in (0, 1, 0):
        batch = [req(u, *hist[u], [3, 4, 5])]
        got, want = run_batch(eng, batch)[0], run_batch(ref, batch)[0]
        np.testing.assert_allclose(got[0], want[0], rtol=2e-4, atol=2e-5)
        stats = got[1]
    assert stats["tier"] == "host" and stats["tokens_host_recomputed"] == 8
    assert fb.updates == 0 and fb.scale == 4.0
    assert eng.stats()["cache"]["onload_split"]["feedback_scale"] == 4.0
    fb.scale = 1.0
    plans = [_plan("u", 40, held=40)]
    split_by_cost(plans, C, eng.runner.onload_split, fb.scale)
    assert plans[0].host_recomputed == 24  # what scale 1 would have done


def test_measured_split_is_in_the_stats():
    eng, _ = _host_hit_engines("auto")
    got = eng.stats()["cache"]["onload_split"]
    assert set(got) == {"feedback_scale", "onload_us_per_token", "recompute_ms"}
    assert got["feedback_scale"] == 1.0  # no device timings on the CPU: never updated
    assert list(got["recompute_ms"]) == ["0", "8", "16", "32", "64", "128"]


def test_a_host_hit_batch_retried_after_an_onload_fault_counts_once():
    """An onload that fails sends the batch again with those users recomputed whole (not
    cached this time); the split of the failed attempt is not counted, answers stay right."""
    eng, ref = _host_hit_engines(0.5)
    rng = np.random.default_rng(2)
    hist = {u: (rng.integers(100, size=20).tolist(), rng.integers(8, size=20).tolist())
            for u in (0, 1)}
    for u in (0, 1):  # user 0 ends on host only
        run_batch(eng, [req(u, *hist[u], [3])])
    eng.runner.onload.fail_next = True
    batch = [req(0, *hist[0], [3, 4, 5])]
    got, want = run_batch(eng, batch)[0], run_batch(ref, batch)[0]
    np.testing.assert_allclose(got[0], want[0], rtol=2e-4, atol=2e-5)
    assert eng.runner.onload_faults == 1 and got[1]["tokens_recomputed"] == 40
    assert eng.runner.manager.counters["host_tokens_recomputed"] == 0
    eng.runner.manager.check_invariants()
