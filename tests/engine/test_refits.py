"""Weights refits in place: a weights-only update writes into a retired version's tensors (its
decode plans stay valid on CUDA) and answers exactly as a fresh engine of those weights; other
updates build a new version; a batch in flight on the reused version keeps its old name."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import safetensors.torch
import torch

from streamgr import Engine
from streamgr.errors import CheckpointError, ContractError, IdOutOfRange
from tests.engine.test_updates import GEN, answers, requests


def _items(results):
    return [(r.items, np.round(r.scores, 5).tolist()) for r in results]


async def _fresh(seed, reqs):
    async with Engine.from_spec("gen-small", {**GEN, "model.init_seed": seed}) as e:
        return _items(await answers(e, reqs))


async def test_weight_refits_reuse_retired_versions_and_answer_as_fresh_weights():
    eng = Engine.from_spec("gen-small", GEN)
    reqs = requests(eng, 6)
    runner = eng.gen_runner
    first_model = runner.model
    async with eng:
        await eng.update(weights=11, keep_previous=False)  # nothing retired yet: a new version
        assert runner.refits_in_place == 0 and runner.spare is not None
        second_model = runner.model
        for k, seed in enumerate((12, 13, 14)):
            vs = await eng.update(weights=seed, keep_previous=False)
            assert runner.refits_in_place == k + 1
            # The two versions' storage alternates: no third model is built to serve.
            assert runner.model is (first_model if k % 2 == 0 else second_model)
            assert runner.previous is None and runner.spare is not None
            got = await answers(eng, reqs)
            assert {r.stats.version for r in got} == {vs["generate"]["active"]["version"]}
            assert _items(got) == await _fresh(seed, reqs), seed
        assert eng.stats()["counters"]["generate_refits_in_place"] == 3


async def test_refit_keeps_rollback_and_other_updates_build_new_versions():
    eng = Engine.from_spec("gen-small", GEN)
    reqs = requests(eng, 4)
    runner = eng.gen_runner
    async with eng:
        await eng.update(weights=21)  # active 21, previous: the spec's weights
        await eng.update(weights=22)  # refit into the spec's version: previous is 21
        assert runner.refits_in_place == 1
        await eng.rollback()
        assert _items(await answers(eng, reqs)) == await _fresh(21, reqs)
        await eng.update(policy={"max_per_prefix": 2})  # not weights only: a new version
        assert runner.refits_in_place == 1
        ids = runner.catalog_items
        await eng.update(catalog={"remove": [int(ids[0])]})
        assert runner.refits_in_place == 1


async def test_a_batch_in_flight_on_the_reused_version_keeps_its_name():
    """The version a batch was submitted on names its answers, even when a refit renames that
    version's storage before the batch is answered."""
    eng = Engine.from_spec("gen-small", GEN)
    reqs = requests(eng, 3)
    runner = eng.gen_runner
    async with eng:
        v1 = runner.version
        handle = runner.submit([runner.prepare(r) for r in reqs])  # in flight on v1's storage
        await eng.update(weights=31)  # v1 retired to previous
        await eng.update(weights=32)  # refit into v1's storage, renamed
        assert runner.refits_in_place == 1 and runner.version != v1
        out = runner.finish(handle)
        assert {per["version"] for _, per in out.results} == {v1}


async def test_a_refit_builds_the_weights_only(monkeypatch):
    """A weights refit in place builds no generate version (no item index over the catalog,
    no search): only the model, checked against the active version's contract."""
    import streamgr.engine.factory as factory
    built = []
    real = factory.GenerateVersion

    def counting(*a, **kw):
        built.append(a[0])
        return real(*a, **kw)
    eng = Engine.from_spec("gen-small", GEN)
    reqs = requests(eng, 3)
    async with eng:
        await eng.update(weights=51, keep_previous=False)  # a version (nothing retired yet)
        monkeypatch.setattr(factory, "GenerateVersion", counting)
        vs = await eng.update(weights=52, keep_previous=False)
        assert eng.gen_runner.refits_in_place == 1 and built == []
        got = await answers(eng, reqs)
        assert {r.stats.version for r in got} == {vs["generate"]["active"]["version"]}
        assert _items(got) == await _fresh(52, reqs)
        built.clear()  # the fresh engine's own
        await eng.update(policy={"max_per_prefix": 2})  # not weights only: a version is built
        assert len(built) == 1


async def test_a_spare_from_the_start_takes_the_first_refit():
    """engine.refit_spare: the first weights refit is already in place, into the spare built
    at start (its own weights: refits into it answer as fresh engines of those weights)."""
    eng = Engine.from_spec("gen-small", {**GEN, "engine.refit_spare": True})
    runner = eng.gen_runner
    reqs = requests(eng, 4)
    assert runner.spare is not None and runner.spare.model is not runner.model
    assert runner.spare.trie.same_catalog(runner.active.trie)
    assert runner.spare.trie is not runner.active.trie  # device tables of its own
    async with eng:
        before = _items(await answers(eng, reqs))
        vs = await eng.update(weights=61, keep_previous=False)
        assert runner.refits_in_place == 1
        got = await answers(eng, reqs)
        assert {r.stats.version for r in got} == {vs["generate"]["active"]["version"]}
        assert _items(got) == await _fresh(61, reqs) != before


async def test_a_spare_with_rollback_kept():
    """engine.refit_spare with keep_previous (the default): the refit goes into the spare, the
    old weights stay the rollback target, and the next refit reuses what that update drops."""
    eng = Engine.from_spec("gen-small", {**GEN, "engine.refit_spare": True})
    reqs = requests(eng, 3)
    runner = eng.gen_runner
    async with eng:
        base = _items(await answers(eng, reqs))
        await eng.update(weights=71)
        assert runner.refits_in_place == 1 and runner.previous is not None
        assert _items(await answers(eng, reqs)) == await _fresh(71, reqs)
        await eng.rollback()
        assert _items(await answers(eng, reqs)) == base
        await eng.update(weights=72)  # into 71's storage (the previous this update replaces)
        assert runner.refits_in_place == 2
        assert _items(await answers(eng, reqs)) == await _fresh(72, reqs)
        await eng.rollback()
        assert _items(await answers(eng, reqs)) == base


async def test_refit_pairs_are_made_off_the_executor_and_phases_are_marked():
    """The weights' tensors are paired with the slot's on the build thread (the executor only
    queues the copies); a pairing made for another slot is not trusted; every update leaves
    its phases' end times, in order, for the benchmark that attributes slow requests."""
    eng = Engine.from_spec("gen-small", GEN)
    reqs = requests(eng, 4)
    runner = eng.gen_runner
    async with eng:
        await eng.update(weights=31, keep_previous=False)  # a built version; the spare follows
        slot = runner.refit_slot()
        new = eng._build_weights(32, slot)
        assert new.pairs[0] is slot
        dsts = list(slot.model.state_dict().values())
        assert [t.data_ptr() for t in new.pairs[1]] == [t.data_ptr() for t in dsts]
        # Paired with the active version instead: used, it would overwrite the weights serving.
        old = runner.active
        before = [t.clone() for t in old.model.state_dict().values()]
        new.pairs = (old, list(old.model.state_dict().values()), new.pairs[2])
        runner.refit(slot, new, False)
        assert runner.active is slot
        assert all(torch.equal(a, b) for a, b in zip(before, old.model.state_dict().values()))
        assert _items(await answers(eng, reqs)) == await _fresh(32, reqs)
        await eng.update(weights=33, keep_previous=False)  # in place, through its own pairs
        assert _items(await answers(eng, reqs)) == await _fresh(33, reqs)
        marks = eng.update_phases[-1]
        assert list(marks) == ["start", "weights", "queued", "cutover"]
        assert sorted(marks.values()) == list(marks.values())


def _checkpoint(eng, seed, root, change=None):
    """A checkpoint directory of the engine's generate architecture with init seed ``seed``
    (``change``: edits its tensors dict or config first)."""
    from streamgr.models.checkpoint import save_checkpoint
    from streamgr.models.t5 import T5
    from streamgr.runtime.deployment import t5_config_from_spec
    cfg = t5_config_from_spec(eng.spec)
    if change is not None and "d_ff" in change:
        cfg = msgspec.structs.replace(cfg, d_ff=change["d_ff"])
    model = T5(cfg).init_random(seed)
    out = save_checkpoint(model, cfg, root / f"ckpt{seed}")
    if change is not None and "cut" in change:  # the weights file loses its last bytes
        path = out / "model.safetensors"
        path.write_bytes(path.read_bytes()[:-change["cut"]])
    if change is not None and "drop" in change:
        path = out / "model.safetensors"
        state = safetensors.torch.load_file(str(path))
        del state[change["drop"]]
        safetensors.torch.save_file(state, str(path))
    return str(out)


async def test_checkpoint_refits_load_tensors_only_and_answer_as_fresh_weights(tmp_path):
    """A refit from a checkpoint directory moves its tensors into the retired version without
    building a model, and answers as an engine initialized with those weights; a checkpoint
    that lacks a tensor or has another architecture is refused naming what, while the active
    version keeps serving."""
    eng = Engine.from_spec("gen-small", GEN)
    reqs = requests(eng, 4, seed=7)
    runner = eng.gen_runner
    async with eng:
        await eng.update(weights=_checkpoint(eng, 41, tmp_path), keep_previous=False)
        assert runner.refits_in_place == 0  # nothing retired yet: a version is built
        assert _items(await answers(eng, reqs)) == await _fresh(41, reqs)
        await eng.update(weights=_checkpoint(eng, 42, tmp_path), keep_previous=False)
        assert runner.refits_in_place == 1
        assert runner._refit_source.model is None and runner._refit_source.tensors
        marks = eng.update_phases[-1]  # the read apart from the move (bench_update's phases)
        assert list(marks) == ["start", "read", "weights", "queued", "cutover"]
        assert sorted(marks.values()) == list(marks.values())
        now = _items(await answers(eng, reqs))
        assert now == await _fresh(42, reqs)
        name = runner.version
        bad = [(_checkpoint(eng, 43, tmp_path, {"drop": "decoder.final_layer_norm.weight"}),
                "weights.decoder.final_layer_norm.weight: missing"),
               (_checkpoint(eng, 44, tmp_path, {"d_ff": 96}), "model.d_ff: the new weights have 96")]
        for path, field in bad:
            with pytest.raises(ContractError, match=field):
                await eng.update(weights=path, keep_previous=False)
            assert runner.version == name and _items(await answers(eng, reqs)) == now
        # a weights file cut short (the reader fills its buffer with readinto): refused too
        with pytest.raises(CheckpointError, match="model.safetensors: truncated"):
            await eng.update(weights=_checkpoint(eng, 45, tmp_path, {"cut": 5}),
                             keep_previous=False)
        assert runner.version == name and _items(await answers(eng, reqs)) == now


async def test_queued_requests_are_prepared_again_only_when_the_catalog_or_policy_changed():
    """A request prepared before a weights cutover runs as prepared (one catalog, one policy:
    the same preparation); after a catalog change it is prepared again, so an item taken out
    fails its request alone."""
    eng = Engine.from_spec("gen-small", GEN)
    runner = eng.gen_runner
    req = requests(eng, 1, seed=5)[0]
    async with eng:
        p = runner.active.prepare(req)
        await eng.update(weights=51, keep_previous=False)
        fresh, *_ = handle = runner.submit([p])
        runner.finish(handle)
        assert fresh[0] is p
        gone = [int(req.history[-1])]  # (the context keeps the latest items)
        await eng.update(catalog={"remove": gone}, keep_previous=False)
        fresh, *_ = handle = runner.submit([p])
        runner.finish(handle)
        assert isinstance(fresh[0], IdOutOfRange) and str(gone[0]) in str(fresh[0])
        q = runner.active.prepare(requests(eng, 1, seed=6)[0])
        await eng.update(policy={"max_per_prefix": 3})
        fresh, *_ = handle = runner.submit([q])
        runner.finish(handle)
        assert fresh[0] is not q and fresh[0].version is runner.active
