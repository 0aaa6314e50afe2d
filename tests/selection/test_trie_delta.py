"""Removals applied to a trie (``selection.trie_delta.trie_without``) against the trie built
again from the smaller catalog: every array equal, on catalogs with shared prefixes and
several items per SID, removals that empty leaves, whole subtrees, or everything."""

from __future__ import annotations

import numpy as np
import pytest

from streamgr.selection.trie_delta import trie_without
from streamgr.selection.vocabulary import SidTrie
from streamgr.selection.catalog import Catalog, CatalogDelta, apply_delta

SIZES = [4, 3, 5]


def _catalog(rng, n: int) -> Catalog:
    ids = rng.permutation(10 * n)[:n].astype(np.int64)
    sids = np.stack([rng.integers(0, s, n) for s in SIZES], axis=1).astype(np.int64)
    return Catalog(ids, sids)  # SIDs repeat: leaves of several items


def _same(a: SidTrie, b: SidTrie) -> None:
    for name in ("leaf_ptr", "leaf_items", "leaf_sids"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name
    assert len(a.ptr) == len(b.ptr) == len(a.codes) == len(b.codes)
    for level in range(a.depth):
        for name in ("ptr", "codes"):
            x, y = getattr(a, name)[level], getattr(b, name)[level]
            assert x.dtype == y.dtype and np.array_equal(x, y), (name, level)
    assert a.max_fanout == b.max_fanout and a._cap == b._cap


@pytest.mark.parametrize("seed", range(6))
def test_removals_equal_a_trie_built_again(seed):
    rng = np.random.default_rng(seed)
    cat = _catalog(rng, int(rng.integers(1, 120)))
    trie = SidTrie(cat, SIZES, 3)
    ids = cat.item_ids
    for frac in (0.0, 0.05, 0.5, 0.9):
        rm = rng.choice(ids, int(frac * len(ids)), replace=False)
        want = SidTrie(apply_delta(cat, CatalogDelta(remove=rm.tolist()), SIZES), SIZES, 3)
        got = trie_without(trie, np.isin(trie.leaf_items, rm))
        _same(got, want)
    before = [p.copy() for p in trie.ptr]
    trie_without(trie, np.ones(len(ids), dtype=bool))
    assert all(np.array_equal(p, q) for p, q in zip(trie.ptr, before))  # left as it was


def test_a_whole_subtree_and_everything():
    rng = np.random.default_rng(9)
    cat = _catalog(rng, 200)
    trie = SidTrie(cat, SIZES, 3)
    first = cat.item_ids[cat.sids[:, 0] == 0]  # every item under one level-0 code
    for rm in (first, cat.item_ids):
        want = SidTrie(apply_delta(cat, CatalogDelta(remove=rm.tolist()), SIZES), SIZES, 3)
        _same(trie_without(trie, np.isin(trie.leaf_items, rm)), want)
    with pytest.raises(ValueError, match="bool mask"):
        trie_without(trie, np.zeros(3, dtype=bool))


def test_removal_views_by_bisection_equal_a_mask_of_the_removed():
    """``views_after_removal`` finds the removed ids' rows in the sorted ids by bisection:
    every row of each (ids may repeat) goes, the rest keep their order."""
    from streamgr.engine.generate import views_after_removal
    rng = np.random.default_rng(1)
    for _ in range(200):
        ids = np.sort(rng.integers(0, 50, int(rng.integers(0, 60))))
        tokens = rng.integers(0, 9, (len(ids), 2))
        rm = rng.choice(60, int(rng.integers(0, 10)), replace=False)  # some not in ids
        got, index, got_tokens = views_after_removal((ids, None, tokens), rm.tolist())
        keep = ~np.isin(ids, rm)
        assert np.array_equal(got, ids[keep]) and np.array_equal(got_tokens, tokens[keep])
