"""A catalog update that only takes items down, applied to the trie it changes instead of a
trie built again: ``trie_without`` drops the items, then every leaf and inner node left with
nothing under it, level by level from the leaves up, in passes over the existing CSR arrays
(no gather of a million SIDs into SID order, no ``np.add.at``). The result equals
``SidTrie`` of the smaller catalog array for array (tests/selection/test_trie_delta.py).
gen-ref's update builds run on a worker thread beside serving; the from-scratch build of its
million-item trie was most of a catalog update's ~0.5 s on the H200 host (session 15).
"""

from __future__ import annotations

import copy

import numpy as np

from .vocabulary import SidTrie, _room


def _counts(alive: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    """How many of each parent's children (the CSR ranges ``ptr``) are alive."""
    c = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(alive, dtype=np.int64)])
    return c[ptr[1:]] - c[ptr[:-1]]


def _ptr(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(counts, dtype=np.int64)])


def trie_without(trie: SidTrie, gone: np.ndarray) -> SidTrie:
    """``trie`` less the items at the positions ``gone`` marks (bool over
    ``trie.leaf_items``): a new trie (no device tables yet); ``trie`` is left as it is."""
    if gone.shape != trie.leaf_items.shape or gone.dtype != np.bool_:
        raise ValueError("gone: a bool mask over the trie's leaf items")
    out = copy.copy(trie)  # depth, codebooks and level offsets stay
    kept = _counts(~gone, trie.leaf_ptr)  # items left in each leaf
    alive = kept > 0
    out.leaf_ptr = _ptr(kept[alive])
    out.leaf_items = trie.leaf_items[~gone]
    out.leaf_sids = trie.leaf_sids[alive]
    ptr, codes = list(trie.ptr), list(trie.codes)
    for level in range(trie.depth - 1, -1, -1):  # the leaves are the last level's nodes
        codes[level] = trie.codes[level][alive]
        kids = _counts(alive, trie.ptr[level])
        alive = kids > 0 if level else np.ones(len(kids), dtype=bool)  # the root stays
        ptr[level] = _ptr(kids[alive])
    out.ptr, out.codes = ptr, codes
    out.max_fanout = [int(np.diff(p).max()) if len(p) > 1 else 0 for p in ptr]
    out._cap = [(_room(len(p)), _room(len(c))) for p, c in zip(ptr, codes)]
    out._dev = {}
    return out
