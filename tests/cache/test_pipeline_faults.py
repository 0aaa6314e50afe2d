"""The onload/offload pipelines on the CPU (streams as no-ops): injected faults keep answers right."""

from __future__ import annotations

import numpy as np

from tests.cache.helpers import req, run_batch, runners


def workload(rng, engines, steps=30):
    hist = {}
    for _ in range(steps):
        users = rng.choice(6, size=2, replace=False)
        batch = []
        for u in users:
            items, actions = hist.setdefault(int(u), ([], []))
            n = min(int(rng.integers(1, 6)), 80 - len(items))
            items += rng.integers(100, size=n).tolist()
            actions += rng.integers(8, size=n).tolist()
            batch.append(req(int(u), items, actions, rng.choice(100, size=3, replace=False)))
        yield batch


def same_as_recompute(engines, batch) -> None:
    ref = run_batch(engines["recompute"], batch)
    got = run_batch(engines["hierarchical"], batch)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g[0], r[0], rtol=2e-4, atol=2e-5)


def test_onload_fault_falls_back_to_recompute():
    rng = np.random.default_rng(0)
    engines = runners(page_tokens=4, chunk_tokens=8, device_pages=30, host_chunks=64)
    runner = engines["hierarchical"].runner
    faults = 0
    for batch in workload(rng, engines):
        if runner.manager.counters["offloaded_chunks"] and faults < 3:
            runner.onload.fail_next = True  # the next transfer that happens fails
        same_as_recompute(engines, batch)
        faults = runner.onload_faults
    assert runner.onload_faults >= 1 and runner.bytes_onloaded > 0
    runner.manager.check_invariants()


def test_offload_fault_is_retried_never_marked_persisted():
    rng = np.random.default_rng(1)
    engines = runners(page_tokens=4, chunk_tokens=8, device_pages=30, host_chunks=64)
    runner = engines["hierarchical"].runner
    runner.offload.fail_next = True
    for batch in workload(rng, engines, steps=20):
        same_as_recompute(engines, batch)
    c = runner.manager.counters
    assert c["offload_failures"] == 1 and c["offloaded_chunks"] > 0
    runner.manager.check_invariants()


def test_a_failed_commit_after_the_replies_fails_nothing_and_serves_on():
    """Commits run after a batch's replies: one that fails gives the batch's pages back, is
    counted, and fails neither that batch (already answered) nor the next one (whose submit may
    run it); later answers still equal recompute's."""
    rng = np.random.default_rng(2)
    engines = runners(page_tokens=4, chunk_tokens=8, device_pages=30, host_chunks=64)
    runner = engines["hierarchical"].runner
    real, calls = runner.manager.commit_batch, {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected commit fault")
        return real(*a, **k)
    runner.manager.commit_batch = flaky
    for batch in workload(rng, engines, steps=12):
        same_as_recompute(engines, batch)
    runner.flush()
    assert calls["n"] == 12 and runner.commit_failures == 1
    assert runner.snapshot()["commit_failures"] == 1
    runner.manager.check_invariants()
    assert not runner.manager.in_batch


def test_close_during_a_hung_transfer_returns_within_its_timeout():
    import time
    engines = runners(page_tokens=4, chunk_tokens=8, device_pages=30, host_chunks=64)
    runner = engines["hierarchical"].runner
    with runner.offload._lock:  # a transfer that never completes
        runner.offload._inflight += 1
    t = time.monotonic()
    assert runner.offload.close(timeout=0.3) is False
    assert time.monotonic() - t < 2.0


def test_a_failed_onload_fences_its_transfers_before_its_pages_are_freed(monkeypatch):
    """Every abort of a batch that was onloading comes after a fence (later device work waits
    for the copies and scatters already issued), on the threaded pipeline too: otherwise the
    retry could reuse a page while a stale scatter still heads for it."""
    rng = np.random.default_rng(0)
    engines = runners(page_tokens=4, chunk_tokens=8, device_pages=30, host_chunks=64)
    runner = engines["hierarchical"].runner
    runner.onload.threaded = True
    calls = []
    fence, abort = runner.streams.fence_transfers, runner.manager.abort_batch
    monkeypatch.setattr(runner.streams, "fence_transfers", lambda: (calls.append("fence"), fence())[1])
    monkeypatch.setattr(runner.manager, "abort_batch", lambda plans: (calls.append("abort"), abort(plans))[1])
    for batch in workload(rng, engines):
        if runner.manager.counters["offloaded_chunks"] and runner.onload_faults < 2:
            runner.onload.fail_next = True
        same_as_recompute(engines, batch)
    assert runner.onload_faults >= 1 and calls.count("abort") == runner.onload_faults
    assert all(calls[i - 1] == "fence" for i, c in enumerate(calls) if c == "abort"), calls
    runner.manager.check_invariants()


def test_a_hung_onload_fails_the_engine_instead_of_hanging_it(monkeypatch):
    """A layer's copies not issued within the transfer timeout: the batch cannot wait for ever,
    and its pages cannot be reused while the stuck thread may still write them, so the runner
    raises EngineDead (the engine stops serving with that error) after two timeouts (0.3 s
    each), well before the stalled thread would have finished (3 s)."""
    import time

    from streamgr.errors import EngineDead
    from streamgr.streams import streams as streams_mod
    monkeypatch.setattr(streams_mod, "TRANSFER_TIMEOUT_S", 0.3)
    rng = np.random.default_rng(0)
    engines = runners(page_tokens=4, chunk_tokens=8, device_pages=30, host_chunks=64)
    runner = engines["hierarchical"].runner
    runner.onload.threaded = True
    for batch in workload(rng, engines, steps=60):
        if runner.manager.counters["offloaded_chunks"]:
            runner.onload.delay_layers = {1: 3.0}  # layer 1's copies stall past the timeout
        t = time.monotonic()
        try:
            run_batch(engines["hierarchical"], batch)
        except EngineDead as err:
            assert time.monotonic() - t < 2.5, "waited for the stalled transfer"
            assert "did not settle" in str(err)
            return
    raise AssertionError("no batch onloaded host chunks")


def test_offload_completions_are_typed_with_their_outcome():
    """What the offload pipeline reports: the job, whether it persisted, its bytes, its time,
    and for a failure the error (nothing persisted)."""
    from streamgr.cache.offload_plan import OffloadJob
    from streamgr.streams import OffloadDone
    engines = runners(page_tokens=4, chunk_tokens=8, device_pages=30, host_chunks=64)
    pipe = engines["hierarchical"].runner.offload
    good, bad = OffloadJob("u", 0, [3], [0, 1]), OffloadJob("v", 0, [4], [2, 3])
    pipe.submit([good])
    pipe.fail_next = True
    pipe.submit([bad])
    pipe.wait_idle(5)
    out = [pipe.completions.get_nowait() for _ in range(2)]
    assert all(isinstance(d, OffloadDone) for d in out)
    assert out[0].job is good and out[0].ok and out[0].nbytes > 0 and out[0].error is None
    assert out[1].job is bad and not out[1].ok and out[1].nbytes == 0
    assert "injected offload fault" in out[1].error and out[1].seconds >= 0
