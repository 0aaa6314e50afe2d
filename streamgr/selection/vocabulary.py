"""The SID vocabulary: the trie of valid SID prefixes over a catalog (``catalog.py``), and the
item index requests are prepared with.

Level ``l``'s code ``c`` is model token ``token_offset + sum(codebook_sizes[:l])
+ c``. One SID may name several items; the SID policy returns all of them (catalog order) or the
first. The trie is CSR per level, built with one lexicographic sort (a million items in about a
second): node ``n`` at level ``l`` has children ``codes[l][ptr[l][n]:ptr[l][n+1]]``, and the
child at CSR position ``p`` is node ``p`` of level ``l+1``.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from .catalog import Catalog


class SidTrie:
    """CSR trie over the catalog's SIDs, with item lists at the leaves."""

    def __init__(self, cat: Catalog, codebook_sizes: list[int], token_offset: int) -> None:
        self.depth = cat.depth
        self.codebook_sizes = list(codebook_sizes)
        self.level_offset = [token_offset + sum(codebook_sizes[:l]) for l in range(self.depth)]
        order = cat.sid_order()
        s = cat.sids[order]
        self.ptr: list[np.ndarray] = []
        self.codes: list[np.ndarray] = []
        parent = np.zeros(len(s), dtype=np.int64)  # node of each sorted item at the level above
        n_nodes = 1
        for level in range(self.depth):
            # A new node wherever the prefix up to this level changes.
            new = np.ones(len(s), dtype=bool)
            if len(s):
                new[1:] = (s[1:, :level + 1] != s[:-1, :level + 1]).any(axis=1)
            node = np.cumsum(new) - 1
            starts = np.nonzero(new)[0]
            self.codes.append(s[starts, level])
            ptr = np.zeros(n_nodes + 1, dtype=np.int64)
            np.add.at(ptr, parent[starts] + 1, 1)
            self.ptr.append(np.cumsum(ptr))
            parent, n_nodes = node, len(starts)
        self.leaf_ptr = np.zeros(n_nodes + 1, dtype=np.int64)
        np.add.at(self.leaf_ptr, parent + 1, 1)
        self.leaf_ptr = np.cumsum(self.leaf_ptr)
        self.leaf_items = cat.item_ids[order]
        self.leaf_sids = s[self.leaf_ptr[:-1]] if n_nodes else np.zeros((0, self.depth), np.int64)
        # Widest fan-out per level: the width of a level's child grid.
        self.max_fanout = [int(np.diff(p).max()) if len(p) > 1 else 0 for p in self.ptr]
        # Device tables get room to spare (an eighth, at least 64): a later catalog of the same
        # shape can be written into them in place (``write_into``), so the decode plans that
        # captured their addresses stay valid. Kernels read only the ranges ``ptr`` names.
        self._cap = [(_room(len(p)), _room(len(c))) for p, c in zip(self.ptr, self.codes)]
        self._dev: dict = {}

    def n_items(self) -> int:
        return len(self.leaf_items)

    def view(self) -> "SidTrie":
        """The same trie (host arrays shared, never written) with device tables of its own:
        a version whose tables may later take another catalog's must not share them."""
        v = copy.copy(self)
        v._dev = {}
        return v

    def same_catalog(self, other: "SidTrie") -> bool:
        """Built from the same catalog (one trie, or views of it)."""
        return self.leaf_items is other.leaf_items

    def tables(self, level: int, device: torch.device):
        """Device tensors of one level: (ptr int64, codes int32), each with room past its
        length. Codes in 32 bits: the selection kernels load one a candidate, and at gen-ref's
        step 2 with beams of 1,024 int64 codes took 0.0233-0.0238 ms against 0.0227-0.0229 on
        the H200 (session 52; int16 timed as int32)."""
        key = (level, str(device))
        if key not in self._dev:
            out = []
            with torch.inference_mode(False):  # ordinary tensors: ``write_into`` writes them
                for arr, cap, dt in zip((self.ptr[level], self.codes[level]), self._cap[level],
                                        (torch.int64, torch.int32)):
                    t = torch.zeros(cap, dtype=dt, device=device)
                    t[:len(arr)].copy_(torch.from_numpy(arr))
                    out.append(t)
            self._dev[key] = tuple(out)
        return self._dev[key]

    def fits(self, other: "SidTrie") -> bool:
        """Its tables can go into ``other``'s in place: the same levels, codebooks and widest
        fan-outs (the decode plans' shapes) and room for every array."""
        return (self.depth == other.depth and self.level_offset == other.level_offset
                and self.max_fanout == other.max_fanout
                and all(len(p) <= cp and len(c) <= cc for p, c, (cp, cc)
                        in zip(self.ptr, self.codes, other._cap)))

    def staged(self, device: torch.device) -> list:
        """Its tables on ``device``, cut to their lengths, to be written into another trie's
        (``write_into``): its own device tables where it has them, else copies of the host
        arrays (a worker thread, before a cutover; on the CPU, the arrays themselves)."""
        return [tuple(t[:len(arr)] for t, arr in zip(self._dev[(level, str(device))], (p, c)))
                if (level, str(device)) in self._dev
                else (torch.from_numpy(p).to(device), torch.from_numpy(c).to(device))
                for level, (p, c) in enumerate(zip(self.ptr, self.codes))]

    def write_into(self, other: "SidTrie", device: torch.device, staged: list) -> None:
        """Between batches (executor): ``staged`` (this trie's, or a trie's of the same catalog:
        see ``staged``) copied into ``other``'s device tables on the current stream, after
        every batch queued there; those tables become this trie's (``other`` must own them and
        ``fits``). Room past the lengths keeps stale codes that no ``ptr`` range names."""
        for level, (p, c) in enumerate(staged):
            tp, tc = other.tables(level, device)
            with torch.no_grad():
                tp[:len(p)].copy_(p, non_blocking=True)
                tc[:len(c)].copy_(c, non_blocking=True)
            for src in (p, c):
                if src.is_cuda:  # made on another stream: kept until these copies ran
                    src.record_stream(torch.cuda.current_stream(src.device))
            self._dev[(level, str(device))] = (tp, tc)
        self._cap = other._cap

    def items_of(self, leaf: int, policy: str) -> np.ndarray:
        items = self.leaf_items[self.leaf_ptr[leaf]:self.leaf_ptr[leaf + 1]]
        return items[:1] if policy == "first" else items


def _room(n: int) -> int:
    return n + max(64, n // 8)


def gather_rows(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``a[idx]`` for a C-contiguous 2D ``a``, as a 1D gather of whole rows (each row one
    element of a void dtype). On the event loop this matters: numpy's 2D fancy indexing and
    every ``take`` let the GIL go, and getting it back waits for whichever thread runs Python
    then, up to the 5 ms switch interval (a 256-row gather took 3.7 ms instead of 2 us beside
    one busy thread: docs/benchmarks.md, session 13); small 1D gathers by an intp index, copies
    and reductions keep it. An index of another dtype is cast first: numpy gathers by one
    through a casting iterator, which lets the GIL go (session 14)."""
    if idx.dtype != np.intp:
        idx = idx.astype(np.intp)
    if a.ndim != 2 or not a.flags.c_contiguous or a.shape[1] == 0:
        return a[idx]
    rows = a.view(np.dtype((np.void, a.shape[1] * a.itemsize))).reshape(-1)
    return rows[idx].view(a.dtype).reshape(len(idx), a.shape[1])


def _packed_tokens(table: np.ndarray, tokens: np.ndarray | None) -> np.ndarray | None:
    """Per id of ``table`` (id -> row, -1 absent), its row of ``tokens`` packed 16 bits a
    token into one int64 (-1: absent); None where a token does not fit or the depth is over 3
    (a fourth token would reach the sign bit)."""
    if tokens is None or tokens.ndim != 2 or not 0 < tokens.shape[1] <= 3 or not len(tokens) \
            or tokens.min() < 0 or tokens.max() > 0xFFFF:
        return None
    packed = np.zeros(len(tokens), dtype=np.int64)
    for k in range(tokens.shape[1]):
        packed |= tokens[:, k].astype(np.int64) << (16 * k)
    return np.where(table >= 0, packed[np.maximum(table, 0)], -1)


class ItemIndex:
    """Item id -> its row in the sorted catalog ids, for a request's history on the host.

    Dense ids (non-negative, the largest under ``max(4 n, 2**20)``) get a lookup table: one
    gather per history. Others take a binary search over the sorted ids, where each probe
    into a million ids is a cache miss: in a gen-ref closed-loop run that search was most of
    the event loop's time (docs/benchmarks.md, session 3)."""

    def __init__(self, sorted_ids: np.ndarray, tokens: np.ndarray | None = None) -> None:
        self.ids = sorted_ids
        n = len(sorted_ids)
        self.table = self.packed = None
        self.tokens = tokens  # [n, depth] each row's SID tokens (``context``), or None
        if n and sorted_ids[0] >= 0 and sorted_ids[-1] < max(4 * n, 1 << 20):
            # intp, not int32: the rows index ``gather_rows``, and numpy gathers with an index
            # of another dtype through a casting iterator that lets the GIL go (a 256-row
            # gather: 4 us alone, 316 us mean beside one busy thread; docs/benchmarks.md,
            # session 14).
            self.table = np.full(int(sorted_ids[-1]) + 1, -1, dtype=np.intp)
            self.table[sorted_ids] = np.arange(n, dtype=np.intp)
            self.packed = _packed_tokens(self.table, tokens)

    def context(self, items: np.ndarray, tail: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
        """(the SID tokens of ``items`` in order, flat int64 [len(items) * depth], then
        ``tail`` (e.g. the EOS token: one array, no concatenation after); positions in
        ``items`` of those not in the catalog: the tokens are meaningless unless it is
        empty). Needs ``tokens``. Where ids are dense and the tokens fit 16 bits, one gather
        from an id -> packed-tokens table: a history's items are random rows of a table of
        the whole catalog, and in serving each is a cache (and TLB) miss, one instead of two
        (id -> row, row -> tokens): 60 against 92 us a 256-item history with cold caches, 17
        against 24 warm (session 14)."""
        depth = self.tokens.shape[1]
        nt = 0 if tail is None else len(tail)
        # (one reduction bounds both ends: a negative id is huge as uint64)
        if self.packed is not None and items.size and items.dtype == np.int64 \
                and items.view(np.uint64).max() < len(self.packed):
            p = self.packed[items]
            if p.min() >= 0:  # every item known (absent ids are -1)
                flat = np.empty(len(items) * depth + nt, dtype=np.int64)
                out = flat[:len(items) * depth].reshape(-1, depth)
                # the 16-bit fields as they lie in a little-endian word (no copy on x86/ARM):
                # one cast a level, of 256 elements, which keeps the GIL (one of 768 would
                # let it go: numpy's size threshold)
                q = p.astype("<i8", copy=False).view("<u2").reshape(-1, 4)
                for k in range(depth):
                    out[:, k] = q[:, k]
                if nt:
                    flat[-nt:] = tail
                return flat, np.zeros(0, dtype=np.int64)
        pos, bad = self.rows(items)
        toks = gather_rows(self.tokens, pos).reshape(-1).astype(np.int64, copy=False)
        return (toks if not nt else np.concatenate([toks, tail])), bad

    def rows(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row of each item, positions in ``items`` of those not in the catalog); an unknown
        item's row is a valid row number, meaningless: callers check the second array first."""
        if self.table is not None:
            # Fast path (every id in the table's range and in the catalog): one gather and
            # three reductions, ~3 us for a 256-item history against ~8 for the masked path.
            if items.size == 0:
                return np.zeros(0, dtype=np.intp), np.zeros(0, dtype=np.int64)
            if items.min() >= 0 and items.max() < len(self.table):
                pos = self.table[items]  # (not ``take``: see ``gather_rows``)
                if pos.min() >= 0:
                    return pos, np.zeros(0, dtype=np.int64)
            inside = (items >= 0) & (items < len(self.table))
            pos = self.table[np.where(inside, items, 0)]
            bad = np.nonzero(~inside | (pos < 0))[0]
            return np.maximum(pos, 0), bad
        if not len(self.ids):
            return np.zeros(len(items), dtype=np.int64), np.arange(len(items))
        pos = np.minimum(np.searchsorted(self.ids, items), len(self.ids) - 1)
        return pos, np.nonzero(self.ids[pos] != items)[0]
