"""The batch planning of ``hstu_plan`` compiled with Numba (CPU JIT): the same work items, in
the same order, without ~100 small numpy calls per batch.

On the lent H200's host a cached rank batch of 8 spent 0.26 ms planning its attention (two
plans) and most of 0.19 ms padding them into the rank plan's buffer, before the graph could
launch (docs/benchmarks.md, session 7): numpy's per-call overhead, not the arithmetic (a few
hundred integers). These loops do the arithmetic directly. ``hstu_plan``'s numpy functions
stay the reference; the tests compare the two on random batches. Every tile and chunk
constant is an argument, never a global: a cached compilation must not keep an old A/B knob.
"""

from __future__ import annotations

import numpy as np

from .host_loops import cached_njit as njit_cached


@njit_cached
def _cdiv(a, b):
    return -(-a // b)


@njit_cached
def tiles(q_off, cand, tails, bm, tail, max_rows):
    """Row tiles (user, first row, rows) of every user, and each user's new-token count."""
    U = len(cand)
    count = np.empty(U, np.int64)
    new = np.empty(U, np.int64)
    T = 0
    for b in range(U):
        rows = q_off[b + 1] - q_off[b]
        new[b] = rows - cand[b]
        t = _cdiv(rows, bm)
        if tails and t > 1 and rows - (t - 1) * bm <= tail:
            t -= 1  # a user's last <= tail rows join its last full tile
        count[b] = t
        T += t
    user = np.empty(T, np.int64)
    row0 = np.empty(T, np.int64)
    nrows = np.empty(T, np.int64)
    i = 0
    for b in range(U):
        rows = q_off[b + 1] - q_off[b]
        for j in range(count[b]):
            left = rows - j * bm
            user[i], row0[i] = b, j * bm
            nrows[i] = left if left <= max_rows else bm  # the kernels' rule (hstu_slots.cuh)
            i += 1
    return user, row0, nrows, new


@njit_cached
def plan(user, row0, nrows, new, hist, cand_only, heads, sms, force, bn, kc):
    """One plan over the tiles (``cand_only``: those holding a candidate row): (split, items
    [5, n] = user, row0, kt0, kt1, slot; fin [4, tiles] = user, row0, slot0, slots; n_slots).
    ``force``: -1 decide, 0 direct, 1 split. Same decisions and order as ``hstu_plan``."""
    T0 = len(user)
    sel = np.empty(T0, np.int64)
    T = 0
    for i in range(T0):
        if not cand_only or row0[i] + nrows[i] > new[user[i]]:
            sel[T] = i
            T += 1
    n_kt = np.empty(T, np.int64)
    n_ch = np.empty(T, np.int64)
    for t in range(T):
        i = sel[t]
        u = user[i]
        end = row0[i] + nrows[i]
        key_lim = hist[u] if end > new[u] else hist[u] - new[u] + end
        n_kt[t] = _cdiv(key_lim, bn)
        n_ch[t] = _cdiv(key_lim, kc)
    if force >= 0:
        split = force == 1
    else:  # split when one tile's keys are well over a balanced share of two blocks per SM
        share = n_kt.sum() * heads / (2 * sms)
        split = T > 0 and n_ch.max() > 1 and n_kt.max() > 1.5 * share
    fin = np.empty((4, T), np.int64)
    for t in range(T):
        fin[0, t], fin[1, t] = user[sel[t]], row0[sel[t]]
    if split:
        per = kc // bn
        total = 0
        for t in range(T):
            fin[2, t], fin[3, t] = total, n_ch[t]
            total += n_ch[t]
        raw = np.empty((5, total), np.int64)  # tile-major, as the slots are numbered
        key = np.empty(total, np.int64)
        n = 0
        for t in range(T):
            for c in range(n_ch[t]):
                kt0 = c * per
                kt1 = min(kt0 + per, n_kt[t])
                raw[0, n], raw[1, n], raw[2, n], raw[3, n], raw[4, n] = (
                    fin[0, t], fin[1, t], kt0, kt1, n)
                # longest first; then by user, chunk, tile (a chunk's row tiles of one user
                # side by side: they share its K/V in L2); all four under 2**15
                key[n] = ((per - (kt1 - kt0)) << 48) | (fin[0, t] << 32) | (c << 16) | t
                n += 1
        order = np.argsort(key)
        items = np.empty((5, total), np.int64)
        for j in range(total):
            for f in range(5):
                items[f, j] = raw[f, order[j]]
        return split, items, fin, total
    key = np.empty(T, np.int64)
    top = n_kt.max() if T else 0
    for t in range(T):
        key[t] = ((top - n_kt[t]) << 32) | t  # most key tiles first, then tile order
    order = np.argsort(key)
    items = np.zeros((5, T), np.int64)
    for j in range(T):
        t = order[j]
        items[0, j], items[1, j], items[3, j], items[4, j] = fin[0, t], fin[1, t], n_kt[t], t
    for t in range(T):
        fin[2, t], fin[3, t] = t, 1 if n_kt[t] > 0 else 0
    return split, items, fin, T


@njit_cached
def _put(out, o, row, size, fill):
    """``row`` at ``out[o:]``, then ``fill`` up to ``size`` entries; the next offset."""
    for j in range(len(row)):
        out[o + j] = row[j]
    for j in range(len(row), size):
        out[o + j] = fill
    return o + size


@njit_cached
def pad(items, users, page_ptr, pages, fin, cap_items, cap_users, cap_pages, cap_fin, out):
    """``hstu_plan.pad_plan`` over the same layout: padding items and merge rows belong to the
    empty user (index ``cap_users``), the page table's tail repeats its end."""
    u = cap_users + 1
    if items.shape[1] > cap_items or users.shape[1] > u or len(page_ptr) > u + 1 \
            or len(pages) > cap_pages or fin.shape[1] > cap_fin:
        raise ValueError("plan larger than its capacity")
    o = 0
    for f in range(5):  # items: user (padding: the empty user), row0, kt0, kt1, slot
        o = _put(out, o, items[f], cap_items, cap_users if f == 0 else 0)
    for f in range(users.shape[0]):  # per user: q_start, hist, new, cand, paged, kv_row
        o = _put(out, o, users[f], u, 0)
    o = _put(out, o, page_ptr, u + 1, page_ptr[len(page_ptr) - 1])
    o = _put(out, o, pages, cap_pages, 0)
    for f in range(4):  # merge rows: user (padding: the empty user), row0, slot0, slots
        o = _put(out, o, fin[f], cap_fin, cap_users if f == 0 else 0)
    return o


@njit_cached
def all_hold(user, row0, nrows, new):
    """Whether every tile holds a candidate row (then the last layer's plan is the same)."""
    for i in range(len(user)):
        if row0[i] + nrows[i] <= new[user[i]]:
            return False
    return True
