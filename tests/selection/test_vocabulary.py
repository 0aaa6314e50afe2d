"""The SID trie against a plain Python dictionary of prefixes: the children beam selection
offers (``kernels.trie_topk`` over the trie's tables), leaves and item lists, on random,
skewed and degenerate catalogs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamgr.kernels.trie_topk import trie_topk_reference
from streamgr.selection.vocabulary import ItemIndex, SidTrie
from streamgr.selection.catalog import Catalog, CatalogDelta, apply_delta, random_catalog


def prefix_children(cat: Catalog) -> dict[tuple, list[int]]:
    kids: dict[tuple, set] = {}
    for s in cat.sids.tolist():
        for t in range(len(s)):
            kids.setdefault(tuple(s[:t]), set()).add(s[t])
    return {k: sorted(v) for k, v in kids.items()}


def walk(trie: SidTrie, valid: torch.Tensor, nodes: torch.Tensor, level: int):
    """The [beams, F] grid of children that selection sees: every candidate kept (all score
    0, so the order is the grid's), put back at its grid slot."""
    B, F = len(nodes), max(trie.max_fanout[level], 1)
    ptr, codes = trie.tables(level, torch.device("cpu"))
    scores = torch.where(valid, 0.0, float("-inf")).view(1, B)
    off = trie.level_offset[level]
    logp = torch.zeros(B, off + trie.codebook_sizes[level])
    top, parent, child_s, code_s = trie_topk_reference(scores, nodes.view(1, B), logp, ptr, codes,
                                                       off, F, B * F, torch.tensor([B * F]))
    child = torch.full((B, F), -1, dtype=torch.long)
    code = torch.zeros(B, F, dtype=torch.long)
    real = torch.zeros(B, F, dtype=torch.bool)
    for i in torch.nonzero(torch.isfinite(top[0])).view(-1).tolist():
        b, ch = int(parent[0, i]), int(child_s[0, i])
        j = ch - int(ptr[nodes[b]])
        child[b, j], code[b, j], real[b, j] = ch, code_s[0, i], True
    return child, code, real


def skewed_catalog(rng) -> Catalog:
    """One level-0 code holds most items (a wide fan-out next to narrow ones)."""
    n = 300
    s1 = np.where(rng.random(n) < 0.8, 0, rng.integers(1, 7, size=n))
    sids = np.stack([s1, rng.integers(50, size=n), rng.integers(3, size=n)], axis=1)
    return Catalog(np.arange(1000, 1000 + n, dtype=np.int64), sids.astype(np.int64))


@pytest.mark.parametrize("make", ["random", "skewed", "one-item"])
def test_child_grid_equals_prefix_dictionary(make):
    rng = np.random.default_rng(7)
    if make == "random":
        cat, books = random_catalog(500, [9, 40, 6], seed=3, distinct=False), [9, 40, 6]
    elif make == "skewed":
        cat, books = skewed_catalog(rng), [7, 50, 3]
    else:
        cat, books = Catalog(np.array([42]), np.array([[2, 0, 1]])), [3, 1, 2]
    trie = SidTrie(cat, books, token_offset=3)
    kids = prefix_children(cat)
    # Breadth-first over every prefix: the grid lists exactly the dictionary's children, in
    # code order, and each child node leads on to its own children.
    frontier = {(): 0}
    for level in range(len(books)):
        prefixes = list(frontier)
        nodes = torch.tensor([frontier[p] for p in prefixes] + [0], dtype=torch.long)
        valid = torch.tensor([True] * len(prefixes) + [False])  # a dead beam row last
        child, code, real = walk(trie, valid, nodes, level)
        assert not real[-1].any()
        nxt = {}
        for r, p in enumerate(prefixes):
            got = code[r][real[r]].tolist()
            assert got == kids[p], (level, p)
            assert (child[r][~real[r]] == -1).all()
            for c, node in zip(got, child[r][real[r]].tolist()):
                nxt[p + (c,)] = node
        frontier = nxt
    # Leaves: each full SID's items, in catalog order, and the node's stored SID.
    for sid, leaf in frontier.items():
        want = cat.item_ids[(cat.sids == np.array(sid)).all(axis=1)]
        assert trie.items_of(leaf, "all").tolist() == want.tolist()
        assert trie.items_of(leaf, "first").tolist() == want[:1].tolist()
        assert tuple(trie.leaf_sids[leaf].tolist()) == sid
    assert len(frontier) == len({tuple(s) for s in cat.sids.tolist()})


def test_fan_out_of_a_gen_ref_sized_catalog():
    cat = random_catalog(200_000, [8192] * 3, seed=0)
    trie = SidTrie(cat, [8192] * 3, token_offset=3)
    assert trie.max_fanout[0] == len(np.unique(cat.sids[:, 0]))
    # The second level's grid is far narrower than a codebook: what makes selection cheap.
    assert trie.max_fanout[1] < 100 and trie.max_fanout[2] <= 3


@pytest.mark.parametrize("ids", [
    np.arange(1000, dtype=np.int64),  # dense: the lookup table
    np.sort(np.random.default_rng(1).choice(5000, size=1200, replace=False)).astype(np.int64),
    np.sort(np.random.default_rng(2).integers(0, 2**62, size=300)).astype(np.int64),  # sparse
    np.array([-7, 3, 9], dtype=np.int64),  # negative ids: the search
    np.array([], dtype=np.int64),
])
def test_item_index_equals_binary_search(ids):
    """Rows and unknown items as a binary search over the sorted ids finds them, for ids in
    the catalog, beside it, past its largest id, negative, and huge."""
    idx = ItemIndex(ids)
    assert (idx.table is not None) == (len(ids) > 0 and ids[0] >= 0 and ids[-1] < 1 << 20)
    rng = np.random.default_rng(len(ids))
    probe = np.concatenate([rng.choice(ids, size=50) if len(ids) else np.zeros(0, np.int64),
                            [-1, 2**62 + 5, int(ids[-1]) + 1 if len(ids) else 0, 10**7]]).astype(np.int64)
    rng.shuffle(probe)
    pos, bad = idx.rows(probe)
    known = np.isin(probe, ids)
    assert bad.tolist() == np.nonzero(~known)[0].tolist()
    assert (ids[pos[known]] == probe[known]).all()
    assert len(idx.rows(np.zeros(0, np.int64))[1]) == 0
    if len(ids):  # ids all in the catalog (the table's fast path), then with gaps in range
        inside = rng.choice(ids, size=40)
        pos, bad = idx.rows(inside)
        assert len(bad) == 0 and (ids[pos] == inside).all()
        gaps = np.setdiff1d(np.arange(ids[0], min(ids[-1], ids[0] + 10**4) + 1), ids)[:3]
        pos, bad = idx.rows(np.concatenate([inside[:5], gaps]))
        assert bad.tolist() == list(range(5, 5 + len(gaps)))
        assert (ids[pos[:5]] == inside[:5]).all()


@pytest.mark.parametrize("seed", range(4))
def test_a_removal_reuses_its_parents_sort_and_builds_the_same_trie(seed):
    """A catalog derived by removals takes its SID order from its parent's (no new sort); the
    order and the trie equal those of the same catalog sorted afresh, with duplicate SIDs
    (stable ties), removals of none but one item, and chains of removals."""
    rng = np.random.default_rng(seed)
    n = 400
    sids = rng.integers(0, 4, size=(n, 3))  # many items share a SID
    cat = Catalog(rng.permutation(np.arange(5000, 5000 + n)).astype(np.int64), sids)
    SidTrie(cat, [4, 4, 4], 3)  # the parent's order computed (as a serving version's is)
    for size in (1, 37, -1):  # -1: all but one
        size = size if size > 0 else len(cat.item_ids) - 1
        gone = rng.choice(cat.item_ids, size, replace=False).tolist()
        child = apply_delta(cat, CatalogDelta(remove=gone), [4, 4, 4])
        assert child._sid_order is not None
        fresh = Catalog(child.item_ids.copy(), child.sids.copy())
        np.testing.assert_array_equal(child.sid_order(), fresh.sid_order())
        a, b = SidTrie(child, [4, 4, 4], 3), SidTrie(fresh, [4, 4, 4], 3)
        for x, y in zip(a.ptr + a.codes + [a.leaf_ptr, a.leaf_items, a.leaf_sids],
                        b.ptr + b.codes + [b.leaf_ptr, b.leaf_items, b.leaf_sids]):
            np.testing.assert_array_equal(x, y)
        cat = child  # the next removal derives from this one
    added = apply_delta(cat, CatalogDelta(add={1: [0, 0, 0]}), [4, 4, 4])
    assert added._sid_order is None  # additions sort afresh


@pytest.mark.parametrize("seed", range(3))
def test_views_after_a_removal_equal_views_built_afresh(seed):
    """The request-side views of a catalog that lost some items (sorted ids, their index, their
    SID tokens), filtered from the views before instead of sorted again, equal those built from
    the new trie; with duplicate SIDs and an id that appears twice."""
    from streamgr.engine.generate import catalog_views, views_after_removal
    rng = np.random.default_rng(seed)
    n = 300
    ids = rng.permutation(np.arange(100, 100 + n)).astype(np.int64)
    ids[7] = ids[8]  # one id named twice, under two SIDs
    cat = Catalog(ids, rng.integers(0, 5, size=(n, 3)))
    before = catalog_views(SidTrie(cat, [5, 5, 5], 3))
    gone = [int(ids[8])] + rng.choice(ids[10:], 40, replace=False).tolist()
    after = apply_delta(cat, CatalogDelta(remove=gone), [5, 5, 5])
    want = catalog_views(SidTrie(after, [5, 5, 5], 3))
    got = views_after_removal(before, gone)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[2], want[2])
    probe = np.concatenate([ids, [-1, 10**6]])
    for a, b in zip(got[1].rows(probe), want[1].rows(probe)):
        np.testing.assert_array_equal(a, b)


def test_gather_rows_equals_fancy_indexing():
    """``gather_rows`` (a 1D gather of whole rows, which keeps the GIL) equals ``a[idx]`` for
    int32 and int64 indices, repeats, an empty index, and falls back for other layouts."""
    from streamgr.selection.vocabulary import gather_rows
    rng = np.random.default_rng(0)
    a = rng.integers(0, 1 << 40, size=(1000, 3))
    for idx in (rng.integers(0, 1000, 256).astype(np.int32), np.array([5, 5, 999, 0]),
                np.zeros(0, dtype=np.int64)):
        got = gather_rows(a, idx)
        assert got.shape == (len(idx), 3) and got.dtype == a.dtype
        assert np.array_equal(got, a[idx])
    t = np.asfortranarray(a)  # not C-contiguous: the plain gather
    assert np.array_equal(gather_rows(t, np.array([3, 1])), a[[3, 1]])
    assert gather_rows(np.zeros((4, 0), np.int64), np.array([1, 2])).shape == (2, 0)


def test_history_lookup_and_row_gather_keep_the_gil():
    """What ``prepare`` runs on the event loop for a history (the id lookup, then the SID
    rows' gather) never lets the GIL go: numpy gathers by an index of a dtype other than
    intp through a casting iterator that releases it, and getting it back beside a thread
    running Python waits up to the switch interval (the int32 row index did this in every
    request, session 14). A thread counting in Python only advances while the GIL is free."""
    from streamgr.selection.vocabulary import gather_rows
    from tests.gil import assert_keeps_the_gil, rounds_that_let_the_gil_go
    rng = np.random.default_rng(3)
    ids = np.sort(rng.choice(1 << 20, size=200_000, replace=False)).astype(np.int64)
    tokens = rng.integers(0, 8192, size=(len(ids), 3))
    index = ItemIndex(ids, tokens)
    hist = rng.choice(ids, size=256)
    got = {}

    def lookups(_):
        for _ in range(20):
            got["pos"], got["bad"] = index.rows(hist)
            got["rows"] = gather_rows(tokens, got["pos"])
            got["sids"], _ = index.context(hist)  # what prepare calls
    advanced = rounds_that_let_the_gil_go(lookups, 5)
    pos, rows = got["pos"], got["rows"]
    assert pos.dtype == np.intp and len(got["bad"]) == 0 and np.array_equal(rows, tokens[pos])
    assert np.array_equal(got["sids"], rows.reshape(-1))
    assert_keeps_the_gil(advanced)


@pytest.mark.parametrize("depth,high", [(3, 24_640), (1, 9), (2, 0xFFFF), (4, 100), (3, 1 << 20)])
def test_item_context_equals_row_gather(depth, high):
    """``ItemIndex.context`` (one gather from the packed id -> tokens table where it applies:
    dense ids, depth <= 3, tokens <= 0xFFFF) returns the SID tokens ``rows`` + a row gather
    give, and flags the same unknown items; deeper or wider tokens take the row gather."""
    rng = np.random.default_rng(depth)
    ids = np.sort(rng.choice(50_000, size=20_000, replace=False)).astype(np.int64)
    tokens = rng.integers(0, high + 1, size=(len(ids), depth))
    tokens[0] = high  # the largest token present
    idx = ItemIndex(ids, tokens)
    assert (idx.packed is not None) == (depth <= 3 and high <= 0xFFFF)
    known = rng.choice(ids, size=256)
    got, bad = idx.context(known)
    pos = np.searchsorted(ids, known)
    assert got.dtype == np.int64 and len(bad) == 0
    assert np.array_equal(got, tokens[pos].reshape(-1))
    gaps = np.setdiff1d(np.arange(50_000), ids)[:2]
    probe = np.concatenate([known[:5], gaps, [-3, 10**9]])
    assert idx.context(probe)[1].tolist() == [5, 6, 7, 8]
    assert len(idx.context(np.zeros(0, np.int64))[0]) == 0
    eos = np.array([7])  # a tail (prepare's EOS) follows the tokens in the same array
    with_tail, bad = idx.context(known, eos)
    assert len(bad) == 0 and np.array_equal(with_tail, np.append(tokens[pos].reshape(-1), 7))
    assert idx.context(np.zeros(0, np.int64), eos)[0].tolist() == [7]
    assert idx.context(known.astype(np.int32), eos)[0].tolist() == with_tail.tolist()
    assert np.array_equal(ItemIndex(ids).rows(known)[0], pos)  # without tokens: rows only
