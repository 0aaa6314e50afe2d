"""Host loops of the rank batch compiled with Numba's CPU JIT, each beside the numpy code it
replaces (which also runs where Numba cannot be imported).

On the lent H200's host a cached rank batch of 8 spent ~1.3 ms in host work before its graph
launched (docs/benchmarks.md, session 7), most of it numpy's per-call overhead on small arrays
(a dozen calls per user). These do the same in one compiled call per batch: the history prefix
check of a full request, and the batch's row layout with its page slots.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("streamgr.kernels")


try:
    from numba import njit
except Exception as err:  # noqa: BLE001 - e.g. a numpy this numba does not support
    log.warning("host loops run in numpy: numba is not importable (%s)", err)
    njit = None


def _jit_or_none(fn):
    return cached_njit(fn) if njit is not None else None


def cached_njit(fn):
    """``njit`` with its machine code cached on disk, or without the cache where Numba finds no
    writable place for it (a read-only install, no writable home): slower starts, same code."""
    try:
        return njit(cache=True)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return njit(fn)


@_jit_or_none
def _prefix_equal(buf, items, actions, n):
    for i in range(n):
        if buf[2 * i] != items[i] or buf[2 * i + 1] != actions[i]:
            return False
    return True


@_jit_or_none
def _pack_into(ids, n_tok, n_cand, start, packed, cand_rows):
    U = len(n_tok)
    q_off = np.empty(U + 1, np.int64)
    hist = np.empty(U, np.int64)
    q_off[0] = 0
    r = 0
    c = 0
    for b in range(U):
        h = start[b] + n_tok[b]
        hist[b] = h
        for j in range(n_tok[b]):
            pos = start[b] + j
            packed[0, r], packed[1, r], packed[2, r] = ids[r], pos & 1, pos
            r += 1
        for j in range(n_cand[b]):
            packed[0, r], packed[1, r], packed[2, r] = ids[r], 0, h
            cand_rows[c] = r
            r += 1
            c += 1
        q_off[b + 1] = r
    return packed, cand_rows, q_off, hist


@_jit_or_none
def _slots(q0, start, end, page_ptr, pages, P):
    n = 0
    for b in range(len(q0)):
        n += max(end[b] - start[b], 0)
    rows = np.empty(n, np.int64)
    page = np.empty(n, np.int64)
    off = np.empty(n, np.int64)
    i = 0
    for b in range(len(q0)):
        for t in range(start[b], end[b]):
            rows[i] = q0[b] + t - start[b]
            page[i] = pages[page_ptr[b] + t // P]
            off[i] = t % P
            i += 1
    return rows, page, off


def prefix_equal(buf: np.ndarray, items: np.ndarray, actions: np.ndarray, n: int) -> bool:
    """Whether the interleaved tokens ``buf[:2n]`` are ``items[:n]``, ``actions[:n]``."""
    if _prefix_equal is not None and buf.dtype == items.dtype == actions.dtype == np.int64:
        return bool(_prefix_equal(buf, items, actions, n))
    return bool(np.array_equal(items[:n], buf[0:2 * n:2])
                and np.array_equal(actions[:n], buf[1:2 * n:2]))


def pack_rows(users, out: np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray, list[int], list[int]]:
    """``(packed [3, rows], candidate rows, q_offsets, hist_lens)`` of ``UserSlice``s: per user
    its new history tokens (positions ``start..``, odd positions are actions) then its
    candidates (all at the next free position). ``out``: an int64 buffer of at least
    ``3 * rows + candidates`` elements that ``packed`` and the candidate rows are written into
    (a page-locked staging buffer: the batch then uploads without another host copy)."""
    n_tok = np.array([len(u.tokens) for u in users], dtype=np.int64)
    n_cand = np.array([len(u.candidates) for u in users], dtype=np.int64)
    start = np.array([u.start for u in users], dtype=np.int64)
    rows, cands = int(n_tok.sum() + n_cand.sum()), int(n_cand.sum())
    if out is None:
        out = np.empty(3 * rows + cands, dtype=np.int64)
    elif out.dtype != np.int64 or out.ndim != 1 or len(out) < 3 * rows + cands:
        raise ValueError(f"pack_rows: out must be int64 of at least {3 * rows + cands} elements")
    packed, cand_rows = out[:3 * rows].reshape(3, rows), out[3 * rows:3 * rows + cands]
    if _pack_into is not None and len(users):
        ids = np.concatenate([a for u in users for a in (u.tokens, u.candidates)]).astype(
            np.int64, copy=False)
        _, _, q_off, hist = _pack_into(ids, n_tok, n_cand, start, packed, cand_rows)
        return packed, cand_rows, q_off.tolist(), hist.tolist()
    q_offsets, hist = [0], []
    for u in users:
        q_offsets.append(q_offsets[-1] + len(u.tokens) + len(u.candidates))
        hist.append(u.start + len(u.tokens))
    c0 = 0
    for u, q0, h in zip(users, q_offsets, hist):
        n, c = len(u.tokens), len(u.candidates)
        pos = np.arange(u.start, u.start + n)
        packed[0, q0:q0 + n] = u.tokens
        packed[1, q0:q0 + n] = pos & 1  # odd positions are action tokens
        packed[2, q0:q0 + n] = pos
        packed[0, q0 + n:q0 + n + c] = u.candidates
        packed[1, q0 + n:q0 + n + c] = 0
        packed[2, q0 + n:q0 + n + c] = h  # every candidate at the next free position
        cand_rows[c0:c0 + c] = np.arange(q0 + n, q0 + n + c)
        c0 += c
    return packed, cand_rows, q_offsets, hist


def page_slots(q0: np.ndarray, start: np.ndarray, end: np.ndarray, page_ptr: np.ndarray,
               pages: np.ndarray, P: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For tokens ``[start[b], end[b])`` of user ``b`` (its pages ``pages[page_ptr[b]:]``, the
    batch's CSR page table, ``P`` tokens each), living in batch rows from ``q0[b]``: (rows,
    page ids, in-page offsets)."""
    if _slots is not None:
        return _slots(q0, start, end, page_ptr, pages, P)
    rows, page, off = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for b in range(len(q0)):
        pos = np.arange(start[b], end[b])
        rows.append(q0[b] + pos - start[b])
        page.append(pages[page_ptr[b] + pos // P])
        off.append(pos % P)
    return np.concatenate(rows), np.concatenate(page), np.concatenate(off)


def warm() -> None:
    """Compile the loops now (a few seconds the first time; Numba caches them on disk), not in
    a first batch."""
    buf = np.zeros(4, np.int64)
    prefix_equal(buf, buf[:2], buf[:2], 2)
    pack_rows([_Slice(np.arange(2, dtype=np.int64), 1, np.arange(1, dtype=np.int64))])
    page_slots(np.zeros(1, np.int64), np.zeros(1, np.int64), np.ones(1, np.int64),
               np.array([0, 1], np.int64), np.zeros(1, np.int64), 4)


class _Slice:  # the fields of engine.rank.UserSlice that pack_rows reads
    def __init__(self, tokens, start, candidates) -> None:
        self.tokens, self.start, self.candidates = tokens, start, candidates
