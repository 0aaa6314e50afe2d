"""Weights refits in place on CUDA with decode plans (CUDA graphs that bake in the weights'
addresses): after refits written into a retired version's tensors, the replayed plans answer
exactly as a fresh engine of those weights, and no plan was captured for the refit."""

from __future__ import annotations

import numpy as np
import pytest

from streamgr import Engine
from tests.engine.test_updates import answers, requests

pytestmark = pytest.mark.gpu

CUDA = {"engine.device": "cuda", "model.dtype": "float32"}


def _items(results):
    return [(r.items, np.round(r.scores, 4).tolist()) for r in results]


async def test_refits_in_place_replay_plans_that_answer_as_fresh_weights():
    eng = Engine.from_spec("gen-small", CUDA)
    reqs = requests(eng, 8)
    runner = eng.gen_runner
    async with eng:
        await answers(eng, reqs)  # the spec's version captures its plans
        await eng.update(weights=41, keep_previous=False)  # a new version beside it
        await answers(eng, reqs)
        for seed in (42, 43):
            slot = runner.spare
            assert slot is not None and slot.search.plans is not None
            captured = slot.search.plans.captures
            vs = await eng.update(weights=seed, keep_previous=False)
            got = await answers(eng, reqs)
            assert {r.stats.version for r in got} == {vs["generate"]["active"]["version"]}
            async with Engine.from_spec("gen-small", {**CUDA, "model.init_seed": seed}) as fresh:
                want = _items(await answers(fresh, reqs))
            assert _items(got) == want, seed
            assert runner.active is slot  # the refit reused the retired version's storage
            assert slot.search.plans.captures == captured  # and captured nothing
        assert runner.refits_in_place == 2


async def test_a_spare_from_the_start_has_its_plans_before_serving():
    """engine.refit_spare on CUDA: the spare's decode plans are captured at start, so the first
    refit captures nothing and its answers equal a fresh engine of the new weights."""
    eng = Engine.from_spec("gen-small", {**CUDA, "engine.refit_spare": True})
    reqs = requests(eng, 8)
    runner = eng.gen_runner
    async with eng:
        spare = runner.spare
        assert spare is not None and spare.search.plans is not None
        captured = spare.search.plans.captures
        assert captured > 0 and set(spare.plan_keys()) >= set(runner.active.plan_keys())
        vs = await eng.update(weights=44, keep_previous=False)
        assert runner.active is spare and spare.search.plans.captures == captured
        got = await answers(eng, reqs)
        assert {r.stats.version for r in got} == {vs["generate"]["active"]["version"]}
        async with Engine.from_spec("gen-small", {**CUDA, "model.init_seed": 44}) as fresh:
            assert _items(got) == _items(await answers(fresh, reqs))


async def test_a_catalog_change_in_place_replays_the_spares_plans():
    """A catalog change of the same trie shapes goes into the spare's own device tables: its
    decode plans (which captured those tables' addresses) replay the new catalog; the only
    captures are the shapes the traffic used that the spare lacked (before the cutover), none
    after it, and the answers equal a version built for that catalog."""
    from tests.engine.test_catalog_refits import removal_that_fits
    from streamgr.selection.catalog import CatalogDelta
    eng = Engine.from_spec("gen-small", {**CUDA, "engine.refit_spare": True})
    runner = eng.gen_runner
    gone = removal_that_fits(eng)
    reqs = [r for r in requests(eng, 8) if not set(r.history) & set(gone)]
    delta = CatalogDelta(remove=gone)
    async with eng:
        await answers(eng, reqs)
        spare = runner.spare
        missing = set(runner.active.plan_keys()) - set(spare.plan_keys())
        captured = spare.search.plans.captures
        await eng.update(catalog=delta)
        assert runner.active is spare and runner.refits_in_place == 1
        assert spare.search.plans.captures == captured + len(missing)
        got = await answers(eng, reqs)
        assert spare.search.plans.captures == captured + len(missing)
        assert all(not set(r.items) & set(gone) for r in got)
    async with Engine.from_spec("gen-small", CUDA) as ref:
        await ref.update(catalog=delta)
        assert ref.gen_runner.refits_in_place == 0
        assert _items(got) == _items(await answers(ref, reqs))


async def test_checkpoint_refits_on_cuda_replay_plans_that_answer_as_fresh_weights(tmp_path):
    """A refit from checkpoint files moves only the checkpoint's tensors to the device (no
    model built) into the spare, whose plans then answer as a fresh engine of those weights."""
    from tests.engine.test_refits import _checkpoint
    eng = Engine.from_spec("gen-small", {**CUDA, "engine.refit_spare": True})
    reqs = requests(eng, 8)
    runner = eng.gen_runner
    async with eng:
        spare = runner.spare
        captured = spare.search.plans.captures
        await eng.update(weights=_checkpoint(eng, 45, tmp_path), keep_previous=False)
        assert runner.active is spare and spare.search.plans.captures == captured
        assert runner._refit_source.model is None
        assert all(t.is_cuda for t in runner._refit_source.tensors.values())
        got = await answers(eng, reqs)
        async with Engine.from_spec("gen-small", {**CUDA, "model.init_seed": 45}) as fresh:
            want = _items(await answers(fresh, reqs))
        assert _items(got) == want


async def test_rank_checkpoint_refits_keep_plans_and_equal_recompute(tmp_path):
    """Rank refits from checkpoints on CUDA (bf16, the cache and rank plans on): the loaded
    weights are 16-byte aligned although the file packs a one-element head bias before them
    (so the fused kernels still run), the plans are captured again without a failure, and
    every answer after a cutover equals a fresh recompute engine of that checkpoint (within
    bench_update_rank's tolerance; session 15's first checkpoint refits missed it in 136 of
    200 samples)."""
    import torch
    from streamgr.api import RankRequest
    from streamgr.models.checkpoint import save_checkpoint
    rng = np.random.default_rng(3)
    hist = {u: (rng.integers(1, 200, size=30).tolist(), rng.integers(0, 4, size=30).tolist())
            for u in range(6)}
    spec = {"engine.device": "cuda", "model.dtype": "bfloat16"}

    def visit(u, n):
        items, actions = hist[u]
        return RankRequest(user_id=u, items=items[:n], actions=actions[:n],
                           candidates=[5, 6, 7, 8])
    async with Engine.from_spec("rank-small", spec) as eng:
        runner = eng.runner
        assert runner.plans is not None
        for u in hist:
            await eng.rank(visit(u, 20))  # cached K/V of the spec's weights
        for seed in (7, 8):
            gen = torch.Generator(device="cuda").manual_seed(seed)
            state = {k: v + 0.05 * torch.randn(v.shape, generator=gen, device="cuda",
                                               dtype=torch.float32).to(v.dtype)
                     for k, v in runner.model.state_dict().items()}
            path = save_checkpoint(state, runner.model.cfg, tmp_path / f"w{seed}")
            vs = await eng.update(weights=str(path), keep_previous=False)
            assert all(p.data_ptr() % 16 == 0 for p in runner.model.parameters())
            got = [await eng.rank(visit(u, 20 + seed)) for u in hist]
            async with Engine.from_spec("rank-small", {**spec, "model.checkpoint": str(path),
                                                       "model.init_seed": None,
                                                       "cache.mode": "recompute"}) as ref:
                want = [await ref.rank(visit(u, 20 + seed)) for u in hist]
            for g, w in zip(got, want):
                assert g.stats.version == vs["rank"]["active"]
                np.testing.assert_allclose(g.scores, w.scores, rtol=2e-3, atol=2e-4)
        assert runner.plans.stats()["capture_failures"] == 0
