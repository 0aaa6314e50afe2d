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
    from streamgr.selection.vocabulary import CatalogDelta
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
