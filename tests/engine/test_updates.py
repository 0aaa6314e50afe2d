"""Live updates (engine/updates.py): versioned generate artifacts (weights, catalog, policy),
cutover under traffic with no request answered from a mixed or stale view, contract-breaking
changes refused with the field named while the active version keeps serving, rollback, and
rank weights with rollback. Real engines on the CPU (gen-small, rank-small)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from streamgr import Engine
from streamgr.api import GenerateRequest, RankRequest
from streamgr.errors import ContractError, IdOutOfRange, StreamgrError
from streamgr.selection.catalog import CatalogDelta
from tests.conftest import small_overrides

GEN = {"engine.device": "cpu", "model.dtype": "float32"}


def requests(eng, n, seed=0, size=12):
    rng = np.random.default_rng(seed)
    ids = eng.gen_runner.catalog_items
    return [GenerateRequest(user_id=i, history=rng.choice(ids, size=size).tolist(), top_k=10)
            for i in range(n)]


async def answers(eng, reqs):
    return [await eng.generate(r) for r in reqs]


async def test_weights_cutover_under_traffic_never_mixes_versions():
    eng = Engine.from_spec("gen-small", GEN)
    reqs = requests(eng, 48)
    async with eng:
        v1 = eng.versions()["generate"]["active"]["version"]
        old = {i: r.items for i, r in enumerate(await answers(eng, reqs))}
        await eng.update(weights=7)
        new = {i: r.items for i, r in enumerate(await answers(eng, reqs))}
        assert old != new  # other weights: other answers
        await eng.rollback()
        assert eng.versions()["generate"]["active"]["version"] == v1
        assert [r.items for r in await answers(eng, reqs[:4])] == [old[i] for i in range(4)]
        # Traffic in flight while the same new weights are published again (a new version).
        tasks = [asyncio.create_task(eng.generate(r)) for r in reqs]
        await asyncio.sleep(0)
        vs = await eng.update(weights=7)
        v3 = vs["generate"]["active"]["version"]
        tasks += [asyncio.create_task(eng.generate(r)) for r in reqs]
        done = await asyncio.gather(*tasks)
        seen = {r.stats.version for r in done}
        assert seen <= {v1, v3} and v3 in seen
        for k, r in enumerate(done):
            want = old if r.stats.version == v1 else new
            assert r.items == want[k % len(reqs)], (k, r.stats.version)
        st = eng.stats()
        assert st["generate_version"] == v3 and st["counters"]["generate_updates"] == 2


async def test_catalog_removal_is_never_generated_and_refuses_its_history():
    eng = Engine.from_spec("gen-small", GEN)
    reqs = requests(eng, 8, seed=1)
    async with eng:
        before = await answers(eng, reqs)
        gone = sorted({i for r in before for i in r.items[:3]})
        keep_hist = [r for r in reqs if not set(r.history) & set(gone)]
        vs = await eng.update(catalog=CatalogDelta(remove=gone))
        assert vs["generate"]["active"]["catalog_items"] == 500 - len(gone)
        after = await answers(eng, keep_hist)
        assert keep_hist and all(not set(r.items) & set(gone) for r in after)
        bad = GenerateRequest(user_id=1, history=[gone[0]], top_k=5)
        with pytest.raises(IdOutOfRange, match="not in the catalog"):
            await eng.generate(bad)
        # Added back with a new SID (dict form): servable again, under its new SID.
        item = gone[0]
        await eng.update(catalog={"add": {item: [15, 15, 15]}})
        trie = eng.gen_runner.trie
        leaf = np.nonzero(trie.leaf_items == item)[0]
        assert leaf.size == 1
        res = await eng.generate(GenerateRequest(user_id=1, history=[item], top_k=5))
        assert len(res.items) == 5


async def test_policy_update_changes_widths_and_keeps_the_contract():
    eng = Engine.from_spec("gen-small", GEN)
    reqs = requests(eng, 2, seed=2)
    async with eng:
        vs = await eng.update(policy={"beam_widths": [8, 8, 4], "top_k": 3})
        act = vs["generate"]["active"]
        assert act["beam_widths"] == [8, 8, 4] and act["top_k"] == 3
        res = await eng.generate(GenerateRequest(user_id=0, history=reqs[0].history, top_k=4))
        assert len(res.items) == 4 and res.stats.version == act["version"]


@pytest.mark.parametrize("change,field", [
    ({"policy": {"beam_widths": [8, 8]}}, "policy.beam_widths"),
    ({"policy": {"bogus": 1}}, "policy.bogus"),
    ({"policy": {"beam_widths": [8, 8, 99999]}}, "policy.beam_widths"),
    ({"policy": {"beam_widths": [8, 8, 1025]}}, "policy.beam_widths"),
    ({"policy": {"top_k": 2000}}, "policy.top_k"),
    ({"policy": {"top_k": "x"}}, "policy.top_k"),
    ({"catalog": {"add": {10**6: [16, 0, 0]}}}, "catalog.s1"),
    ({"catalog": {"add": {10**6: [1, 2]}}}, "catalog.add"),
    ({"catalog": {"remove": [10**9]}}, "catalog.remove"),
    ({"catalog": {"rename": []}}, "catalog")])
async def test_contract_breaking_changes_are_refused_and_serving_goes_on(change, field):
    eng = Engine.from_spec("gen-small", GEN)
    req = requests(eng, 1, seed=3)[0]
    async with eng:
        before = await eng.generate(req)
        with pytest.raises(ContractError, match=field):
            await eng.update(**change)
        after = await eng.generate(req)
        assert after.items == before.items and after.stats.version == before.stats.version


async def test_queued_requests_are_prepared_again_on_the_new_version():
    """A request prepared before the cutover runs on the new version; one the new version
    refuses fails alone."""
    eng = Engine.from_spec("gen-small", GEN)
    runner = eng.gen_runner
    reqs = requests(eng, 2, seed=4)
    prepared = [runner.prepare(r) for r in reqs]
    # An item of the first request's history only (so the second stays servable).
    victim = next(i for i in reqs[0].history if i not in reqs[1].history)
    new = eng._build_generate(None, CatalogDelta(remove=[victim]), None)
    runner.activate(new)
    out = runner.run(prepared)
    assert isinstance(out.results[0], IdOutOfRange)
    assert out.results[1][1]["version"] == new.name


async def test_rollback_needs_a_previous_version_and_bad_calls_are_typed():
    eng = Engine.from_spec("gen-small", GEN)
    async with eng:
        with pytest.raises(StreamgrError, match="no previous"):
            await eng.rollback()
        with pytest.raises(StreamgrError, match="give weights"):
            await eng.update()
        with pytest.raises(StreamgrError, match="does not serve rank"):
            await eng.update(weights=1, target="rank")
        await eng.update(policy={"top_k": 5}, keep_previous=False)
        assert eng.versions()["generate"]["previous"] is None


async def test_rank_weights_update_and_rollback():
    rng = np.random.default_rng(5)
    items = rng.integers(1, 200, size=20).tolist()
    r = RankRequest(user_id=3, items=items, actions=[1] * 20, candidates=[5, 6, 7])
    async with Engine.from_spec("rank-small", small_overrides(**{"cache.mode": "recompute"})) as e:
        before = await e.rank(r)
        v1 = e.versions()["rank"]["active"]
        vs = await e.update(weights=99)
        assert vs["rank"]["previous"] == v1 and vs["rank"]["active"] != v1
        after = await e.rank(r)
        assert after.stats.version == vs["rank"]["active"]
        assert not np.allclose(after.scores, before.scores)
        await e.rollback()
        back = await e.rank(r)
        assert back.stats.version == v1 and back.scores == before.scores
        with pytest.raises(Exception, match="weights only"):
            await e.update(policy={"top_k": 3})


async def test_an_update_whose_caller_is_cancelled_runs_to_its_end():
    """Cancelled while the new weights cut over (on the executor, which cannot be stopped):
    before, the version switched but the previous one was not kept, so the update could not be
    rolled back. Now the update finishes whole; the caller still gets its CancelledError."""
    async with Engine.from_spec("rank-small", small_overrides()) as e:
        v1 = e.versions()["rank"]["active"]
        cutover = e.runner.set_model
        started = asyncio.Event()
        loop = asyncio.get_running_loop()

        def slow_cutover(*args):  # a cutover slow enough to be cancelled during
            loop.call_soon_threadsafe(started.set)
            time.sleep(0.3)
            return cutover(*args)
        e.runner.set_model = slow_cutover
        task = asyncio.ensure_future(e.update(weights=7))
        await asyncio.wait_for(started.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 10
        while e.versions()["rank"]["previous"] is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        vs = e.versions()["rank"]
        assert vs["previous"] == v1 and vs["active"] != v1, vs
        assert e.stats()["counters"]["rank_updates"] == 1
        assert (await e.rollback())["rank"]["active"] == v1


@pytest.mark.parametrize("spec", ["rank-small", "gen-small"])
async def test_weights_holding_nan_or_inf_are_refused_and_serving_goes_on(spec, tmp_path):
    """A checkpoint of a diverged run (a NaN in one of its tensors): before, it was
    loaded and served (NaN scores, arbitrary items, no error). Now it is refused at start and as
    an update, naming the tensor, and the active version keeps serving."""
    from safetensors.torch import load_file, save_file

    from streamgr.cli import main
    from streamgr.errors import CheckpointError
    good, bad = tmp_path / "good", tmp_path / "bad"
    overrides = GEN if spec == "gen-small" else small_overrides()
    assert main(["init-model", "--spec", spec, "--out", str(good), "--seed", "3"]
                + [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]) == 0
    tensors = load_file(str(good / "model.safetensors"))
    name = sorted(k for k, t in tensors.items() if t.is_floating_point() and t.numel() > 1)[1]
    tensors[name].view(-1)[1] = float("nan")
    bad.mkdir()
    for f in good.iterdir():
        if f.name != "model.safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"`{name}` holds NaN or infinite values"):
        Engine.from_spec(bad / "spec.toml", overrides)
    async with Engine.from_spec(good / "spec.toml", overrides) as eng:
        if spec == "gen-small":
            ask = GenerateRequest(user_id=3, history=eng.gen_runner.catalog_items[:3].tolist(),
                                  top_k=5)
            serve = eng.generate
        else:
            ask = RankRequest(user_id=3, items=[5, 6, 7], actions=[1, 0, 1], candidates=[8, 9])
            serve = eng.rank
        before = await serve(ask)
        with pytest.raises(CheckpointError, match=f"`{name}` holds NaN or infinite values"):
            await eng.update(weights=str(bad))
        after = await serve(ask)
        assert after.stats.version == before.stats.version
        assert after.scores == pytest.approx(before.scores, abs=1e-5)
