"""GPU: the cached modes equal recompute in bf16 on CUDA, under evictions and host hits."""

from __future__ import annotations

import numpy as np
import pytest

from streamgr.config import load_spec
from tests.cache.helpers import GPU_MODEL, MODES, req, run_batch, runners

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_cached_equals_recompute(seed):
    rng = np.random.default_rng(seed)
    cuda = runners("cuda", "bfloat16", GPU_MODEL, page_tokens=4, chunk_tokens=8, device_pages=40,
                   host_chunks=64, offload_quota_tokens=16)
    cpu = runners("cpu", "float32", GPU_MODEL, page_tokens=4, chunk_tokens=8, device_pages=40,
                  host_chunks=64, offload_quota_tokens=16)
    hist = {}
    worst = {m: 0.0 for m in MODES}
    for _ in range(40):
        users = rng.choice(8, size=int(rng.integers(1, 4)), replace=False)
        batch = []
        for u in users:
            items, actions = hist.setdefault(int(u), ([], []))
            n = min(int(rng.integers(0, 8)), 80 - len(items))
            items += rng.integers(100, size=n).tolist()
            actions += rng.integers(8, size=n).tolist()
            batch.append(req(int(u), items, actions, rng.choice(100, size=4, replace=False)))
        ref = run_batch(cpu["recompute"], batch)  # fp32 CPU reference
        got = {m: run_batch(cuda[m], batch) for m in MODES}
        for m in MODES:
            for g, r in zip(got[m], ref):
                worst[m] = max(worst[m], float(np.abs(g[0] - r[0]).max()))
        for g_re, g_h in zip(got["recompute"], got["hierarchical"]):
            np.testing.assert_allclose(g_h[0], g_re[0], rtol=0.05, atol=0.05)
    assert max(worst.values()) < 0.1, worst
    c = cuda["hierarchical"].runner.manager.counters
    assert c["evictions"] > 0 and c["offloaded_chunks"] > 0
    assert cuda["hierarchical"].runner.bytes_onloaded > 0
    cuda["hierarchical"].runner.manager.check_invariants()


def _workload(seed, n_batches=30, users=6):
    rng = np.random.default_rng(seed)
    hist, out = {}, []
    for _ in range(n_batches):
        batch = []
        for u in rng.choice(users, size=int(rng.integers(1, 4)), replace=False):
            items, actions = hist.setdefault(int(u), ([], []))
            n = min(int(rng.integers(1, 9)), 80 - len(items))
            items += rng.integers(100, size=n).tolist()
            actions += rng.integers(8, size=n).tolist()
            batch.append(req(int(u), list(items), list(actions),
                             rng.choice(100, size=int(rng.integers(1, 5)), replace=False)))
        out.append(batch)
    return out


@pytest.mark.parametrize("layers", [4, 1])
@pytest.mark.parametrize("mode", ["recompute", "gpu-only", "hierarchical"])
def test_rank_plans_replay_equals_eager(mode, layers):
    """A rank plan (the forward as two replayed CUDA graphs: the batch's copy, embedding and
    first layer, then the rest; of a one-layer model, the copy and embedding, then the layer)
    gives the eager path's scores, batch after batch, while its shapes are reused. Within bf16
    rounding, not bit for bit: the plan runs its GEMMs over a padded row count, and cuBLAS may
    pick another kernel for it."""
    from tests.cache.helpers import tiny_spec
    from streamgr.engine.core import Engine
    # hierarchical: a device cache too small for the users, so batches onload (those run eager)
    kw = dict(page_tokens=4, chunk_tokens=8, device_pages=40 if mode == "hierarchical" else 400,
              host_chunks=64, offload_quota_tokens=16, mode=mode)
    model = {**GPU_MODEL, "num_layers": layers}
    planned = Engine(tiny_spec("cuda", "bfloat16", model, **kw))
    eager = Engine(load_spec(tiny_spec("cuda", "bfloat16", model, **kw),
                             {"engine.rank_plans": 0}))
    assert planned.runner.plans is not None and eager.runner.plans is None
    worst = 0.0
    for batch in _workload(7):
        a, b = run_batch(planned, batch), run_batch(eager, batch)
        for x, y in zip(a, b):
            np.testing.assert_allclose(x[0], y[0], rtol=0.02, atol=0.02)
        worst = max(worst, max(float(np.abs(x[0] - y[0]).max()) for x, y in zip(a, b)))
    print(f"rank plans vs eager, {mode}: max abs difference {worst:.3g}")
    st = planned.runner.plans.stats()
    assert st["capture_failures"] == 0 and st["captures"] < st["replays"], st
    if mode != "hierarchical":
        assert st["replays"] == 30, st


def test_score_buffers_are_reused_and_answers_keep_their_scores():
    """Batches' scores come back through pooled page-locked buffers: after the first batch no
    new buffer is made, and an answer's scores stay what they were after later batches reuse
    the buffer they were read through."""
    cuda = runners("cuda", "bfloat16", GPU_MODEL, page_tokens=4, chunk_tokens=8, device_pages=40,
                   host_chunks=64, offload_quota_tokens=16)
    for mode in MODES:
        eng = cuda[mode]
        pool = eng.runner.score_buffers
        first = run_batch(eng, [req(0, [1, 2, 3], [0, 1, 0], [5, 6, 7])])
        kept = [s.copy() for s, _ in first]
        bufs = {id(b) for b, _ in pool._free}
        assert len(bufs) == 1, mode
        for u in range(1, 6):
            run_batch(eng, [req(u, [4, 5], [1, 1], [8, 9, 10, 11])])
        assert {id(b) for b, _ in pool._free} == bufs, mode  # the same buffer, reused
        assert all(np.array_equal(s, k) for (s, _), k in zip(first, kept)), mode


def serve_host_hits(eng, ref, rng, steps: int = 30) -> None:
    """Returning users of up to 80 events on a small device tier (evictions, host hits): every
    answer of ``eng`` within bf16 of ``ref``'s (recompute)."""
    hist = {}
    for _ in range(steps):
        batch = []
        for u in rng.choice(6, size=int(rng.integers(1, 4)), replace=False):
            items, actions = hist.setdefault(int(u), ([], []))
            n = min(int(rng.integers(1, 12)), 80 - len(items))
            items += rng.integers(100, size=n).tolist()
            actions += rng.integers(8, size=n).tolist()
            batch.append(req(int(u), items, actions, rng.choice(100, size=4, replace=False)))
        for g, r in zip(run_batch(eng, batch), run_batch(ref, batch)):
            np.testing.assert_allclose(g[0], r[0], rtol=0.05, atol=0.05)


@pytest.mark.parametrize("split", [0.5, 0.0, "auto"])
def test_host_hits_that_recompute_part_equal_recompute(split):
    """cache.onload_split on CUDA: host hits onload a prefix (or nothing) and recompute the
    rest, eagerly or in a rank plan (a batch left with no onload replays one); answers stay
    within bf16 of recompute's, and "auto" measured its costs on this GPU."""
    from streamgr.cache.onload_split import SplitCosts
    kw = dict(page_tokens=4, chunk_tokens=8, device_pages=24, host_chunks=64,
              offload_quota_tokens=64)
    cuda = runners("cuda", "bfloat16", GPU_MODEL, onload_split=split, **kw)
    eng, ref = cuda["hierarchical"], cuda["recompute"]
    if split == "auto":
        costs = eng.runner.onload_split
        assert isinstance(costs, SplitCosts) and costs.onload_s > 0, costs
        assert costs.recompute_s[-1] > 0, costs
    serve_host_hits(eng, ref, np.random.default_rng(5))
    c = eng.runner.manager.counters
    if split != "auto":  # (auto may onload everything: this GPU's onload is cheap here)
        assert c["host_tokens_recomputed"] > 0, c
    assert c["evictions"] > 0 and c["offloaded_chunks"] > 0, c
    eng.runner.manager.check_invariants()


def test_split_feedback_updates_from_host_hit_batches_and_answers_stay_right():
    """``CachedRankRunner.split_feedback`` (set with ``"auto"``): batches that both onload and
    recompute host tokens time where the compute reached the last layer's wait against when
    that layer's K/V landed, and the scale of the split's recompute costs moves within its
    bounds; answers stay within bf16 of recompute's. Costs are set so the split is interior
    (half the held tokens onloaded at scale 1)."""
    from streamgr.cache.onload_split import SplitCosts, SplitFeedback
    kw = dict(page_tokens=4, chunk_tokens=8, device_pages=24, host_chunks=64,
              offload_quota_tokens=64)
    cuda = runners("cuda", "bfloat16", GPU_MODEL, **kw)
    eng, ref = cuda["hierarchical"], cuda["recompute"]
    n = np.array([0.0, 8.0, 16.0, 32.0, 64.0, 128.0])
    eng.runner.onload_split = SplitCosts(1e-4, n, 1e-4 * n)  # onload and recompute alike
    fb = eng.runner.split_feedback = SplitFeedback()
    serve_host_hits(eng, ref, np.random.default_rng(7))
    c = eng.runner.manager.counters
    assert c["host_tokens_recomputed"] > 0 and fb.updates > 0, (c, fb.updates)
    assert fb.lo <= fb.scale <= fb.hi and fb.scale != 1.0
    assert eng.stats()["cache"]["onload_split"]["feedback_scale"] == round(fb.scale, 4)
