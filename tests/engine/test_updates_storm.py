"""A storm of live updates under concurrent traffic: every answer equals what a fresh engine built
on the version stamped in its stats returns; removed items are never answered after their
cutover; an added item is generated; a corrupt checkpoint and a catalog file with illegal SIDs
are refused with the cause named while the active version keeps serving. CPU, fp32."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

from streamgr import Engine
from streamgr.api import GenerateRequest
from streamgr.errors import CheckpointError, ContractError
from streamgr.selection.catalog import CatalogDelta, save_catalog

GEN = {"engine.device": "cpu", "model.dtype": "float32", "engine.max_wait_ms": 0.5}


def fresh_overrides(version, path) -> dict:
    """A spec that builds ``version`` from scratch: its seed, its catalog, its policy."""
    seed = int(re.search(r"seed:(\d+)", version.weights).group(1))
    save_catalog(version.catalog, path)
    pol = version.policy
    return {**GEN, "model.init_seed": seed, "catalog.random_items": 0, "catalog.path": str(path),
            "policy.beam_widths": list(pol.beam_widths), "policy.top_k": pol.top_k,
            "policy.max_per_prefix": pol.max_per_prefix}


async def test_update_storm_every_answer_matches_its_version(tmp_path):
    eng = Engine.from_spec("gen-small", GEN)
    ids = eng.gen_runner.catalog_items
    safe, doomed = ids[ids < 250], ids[ids >= 250]  # histories only use safe items
    rng = np.random.default_rng(0)
    reqs = [GenerateRequest(user_id=i, history=rng.choice(safe, 8).tolist(), top_k=8)
            for i in range(12)]
    changes = [{"weights": 5}, {"catalog": CatalogDelta(remove=doomed[:60].tolist())},
               {"policy": {"beam_widths": [8, 16, 16]}}, {"weights": 9, "policy": {"top_k": 4}},
               {"catalog": CatalogDelta(remove=doomed[60:120].tolist(),
                                        add={10_000: [1, 2, 3]})},
               {"weights": 5}]
    versions, removed_at = {}, {}
    results = []
    async with eng:
        def record():
            v = eng.gen_runner.active
            versions[v.name] = fresh_overrides(v, tmp_path / f"{v.name}.csv")
        record()

        async def traffic():
            while len(results) < 400:
                results.extend(await asyncio.gather(*(eng.generate(r) for r in reqs)))

        async def storm():
            gone: set[int] = set()
            for change in changes:
                await asyncio.sleep(0.02)
                await eng.update(**change)
                cat = change.get("catalog")
                if cat is not None:
                    gone |= set(cat.remove)
                removed_at[eng.gen_runner.version] = set(gone)
                record()
        await asyncio.gather(traffic(), storm())
        assert eng.stats()["counters"]["generate_updates"] == len(changes)
    by_version: dict[str, list] = {}
    for k, r in enumerate(results):
        by_version.setdefault(r.stats.version, []).append((k % len(reqs), r))
    assert len(by_version) >= 3  # the traffic really crossed several cutovers
    for name, got in by_version.items():
        assert not set().union(*(set(r.items) for _, r in got)) & removed_at.get(name, set())
        async with Engine.from_spec("gen-small", versions[name]) as ref:
            for i in sorted({i for i, _ in got}):
                want = await ref.generate(reqs[i])
                for j, r in got:
                    if j == i:
                        assert r.items == want.items, (name, i)
                        np.testing.assert_allclose(r.scores, want.scores, rtol=1e-5, atol=1e-5)


async def test_an_added_item_is_generated():
    async with Engine.from_spec("gen-small", GEN) as eng:
        req = GenerateRequest(user_id=3, history=eng.gen_runner.catalog_items[:5].tolist(),
                              top_k=5)
        before = await eng.generate(req)
        top, sid = before.items[0], before.sids[0]
        await eng.update(catalog=CatalogDelta(remove=[top], add={777_777: sid}))
        after = await eng.generate(req)
        assert after.items[0] == 777_777 and after.sids[0] == sid
        assert after.scores[0] == before.scores[0] and top not in after.items


async def test_corrupt_checkpoint_and_illegal_catalog_file_are_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{not json")
    bad_cat = tmp_path / "bad.csv"
    bad_cat.write_text("item_id,s1,s2,s3\n1,0,0,0\n2,99,0,0\n")
    async with Engine.from_spec("gen-small", GEN) as eng:
        req = GenerateRequest(user_id=3, history=[1, 2], top_k=5)
        before = await eng.generate(req)
        with pytest.raises(CheckpointError):
            await eng.update(weights=str(ckpt))
        with pytest.raises(ContractError, match="catalog.s1.*99"):
            await eng.update(catalog=str(bad_cat))
        with pytest.raises(ContractError, match="no such file"):
            await eng.update(catalog=str(tmp_path / "missing.csv"))
        after = await eng.generate(req)
        assert after.items == before.items and after.stats.version == before.stats.version
        assert eng.versions()["generate"]["previous"] is None
