"""Catalog updates in place: a catalog change whose trie has the shapes of a retired version's
(same levels and widest fan-outs, room in its tables) is written into that version's device
tables (its decode plans stay valid on CUDA) instead of building a version; it answers exactly
as a version built for that catalog, removed items are never answered, later weights refits
and rollbacks still work. Real engines on the CPU (gen-small, fp32)."""

from __future__ import annotations

import numpy as np
import pytest

from streamgr import Engine
from streamgr.api import GenerateRequest
from streamgr.errors import IdOutOfRange
from streamgr.selection.vocabulary import SidTrie
from streamgr.selection.catalog import CatalogDelta, apply_delta
from tests.engine.test_updates import GEN, answers, requests

SPARE = {**GEN, "engine.refit_spare": True}


def _items(results):
    return [(r.items, np.round(r.scores, 5).tolist()) for r in results]


def removal_that_fits(eng, n=6, seed=0):
    """``n`` catalog items whose removal leaves the trie's shapes as they are."""
    act = eng.gen_runner.active
    sizes = eng.spec.catalog.codebook_sizes
    rng = np.random.default_rng(seed)
    gone: list[int] = []
    for item in rng.permutation(act.catalog.item_ids).tolist():
        cat = apply_delta(act.catalog, CatalogDelta(remove=gone + [item]), sizes)
        if SidTrie(cat, sizes, eng.spec.catalog.token_offset).fits(act.trie):
            gone.append(item)
            if len(gone) == n:
                return gone
    raise AssertionError("no removal keeps the trie's shapes")


async def built_answers(reqs, delta, seed=None):
    """The reference: a fresh engine (of weights ``seed``; None: the spec's) without a spare
    takes the catalog change by building a version."""
    over = GEN if seed is None else {**GEN, "model.init_seed": seed}
    async with Engine.from_spec("gen-small", over) as ref:
        await ref.update(catalog=delta)
        assert ref.gen_runner.refits_in_place == 0
        return _items(await answers(ref, reqs))


async def test_a_catalog_change_goes_into_the_spare_and_answers_as_a_built_version():
    eng = Engine.from_spec("gen-small", SPARE)
    runner = eng.gen_runner
    gone = removal_that_fits(eng)
    reqs = [r for r in requests(eng, 10, seed=3) if not set(r.history) & set(gone)]
    async with eng:
        before = _items(await answers(eng, reqs))
        spare, spare_trie = runner.spare, runner.spare.trie
        delta = CatalogDelta(remove=gone)
        vs = await eng.update(catalog=delta)
        assert runner.refits_in_place == 1 and runner.active is spare
        # The new catalog's tables went into the spare's own tables, in place.
        assert spare.trie is not spare_trie
        assert spare.trie.tables(0, runner.model.shared.weight.device)[0] is \
            spare_trie.tables(0, runner.model.shared.weight.device)[0]
        act = vs["generate"]["active"]
        assert act["catalog_items"] == 500 - len(gone) and act["version"] == runner.version
        got = await answers(eng, reqs)
        assert {r.stats.version for r in got} == {runner.version}
        assert all(not set(r.items) & set(gone) for r in got)
        assert _items(got) == await built_answers(reqs, delta)
        with pytest.raises(IdOutOfRange, match="not in the catalog"):
            await eng.generate(GenerateRequest(user_id=1, history=[gone[0]], top_k=5))
        # A weights refit next: into the retired version (old catalog), which takes the
        # active catalog's tables too, so it answers as weights 5 on the new catalog.
        await eng.update(weights=5)
        assert runner.refits_in_place == 2
        assert _items(await answers(eng, reqs)) == await built_answers(reqs, delta, seed=5)
        # Rollback: the catalog-changed version with the spec's weights, as before.
        await eng.rollback()
        assert _items(await answers(eng, reqs)) == _items(got)
    assert before  # answered before the change too


async def test_a_catalog_that_changes_the_trie_shapes_builds_a_version():
    eng = Engine.from_spec("gen-small", SPARE)
    runner = eng.gen_runner
    trie = runner.trie
    # A new child under the widest second-level node: that level's fan-out grows past the
    # width its decode plans were captured for.
    widths = np.diff(trie.ptr[1])
    n = int(np.argmax(widths))
    kids = set(trie.codes[1][trie.ptr[1][n]:trie.ptr[1][n + 1]].tolist())
    assert len(kids) < trie.codebook_sizes[1], "the widest node has every code"
    free = next(c for c in range(trie.codebook_sizes[1]) if c not in kids)
    item = int(runner.catalog_items.max()) + 1
    delta = {"add": {item: [int(trie.codes[0][n]), free, 0]}}
    reqs = requests(eng, 4, seed=4)
    async with eng:
        await eng.update(catalog=delta)
        assert runner.refits_in_place == 0
        assert runner.trie.max_fanout[1] == trie.max_fanout[1] + 1
        got = await answers(eng, reqs)
        assert _items(got) == await built_answers(reqs, delta)


async def test_a_spare_engine_warms_its_catalog_builds_on_the_build_thread():
    """``refit_spare`` engines build three throwaway catalog removals before serving, on the
    one thread live updates build on (so later builds reuse that memory), and nothing of them
    shows: the versions and the catalog are the engine's own, a real removal still goes in
    place on that thread and answers without the removed items; an engine without a spare
    builds none."""
    eng = Engine.from_spec("gen-small", SPARE)
    threads = []
    build = eng._build_catalog

    def recorded(catalog):
        import threading
        threads.append(threading.current_thread().name)
        return build(catalog)
    eng._build_catalog = recorded
    before, items = eng.versions(), eng.gen_runner.active.item_ids.copy()
    gone = removal_that_fits(eng, n=3, seed=5)
    async with eng:
        assert eng.metrics.counters["update_warm_builds"] == 3
        assert eng.versions() == before
        assert np.array_equal(eng.gen_runner.active.item_ids, items)
        await eng.update(catalog=CatalogDelta(remove=gone))
        assert eng.gen_runner.refits_in_place == 1
        res = await answers(eng, requests(eng, 6, seed=4))
        assert all(not set(r.items) & set(gone) for r in res)
    assert len(threads) == 4 and all(t.startswith("streamgr-build") for t in threads), threads
    async with Engine.from_spec("gen-small", GEN) as plain:
        assert plain.metrics.counters.get("update_warm_builds", 0) == 0
