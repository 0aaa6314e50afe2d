"""Two tiers of a merge block's list (``trie_topk_merge``), so that the request's last block
selects from about ``NT`` keys instead of every block's ``k`` x 7/4.

A listing block that took a sampled floor ``T`` (at least ``k`` of its keys at or above it,
counted) also takes a higher floor ``T_hi`` from the same sample, for about ``k / g`` x 3/2 of
its keys (``g`` blocks a request) with no count behind it. It hands on its keys at or above
``T_hi`` to the request's tier A (``ul``, shared by the blocks through one global atomic) and its
whole list to its own region of tier B (``ub[r, b * NT:]``), writing its count and ``T_hi`` to
``ws`` and ``T`` to the request's floor by an atomic max. Blocks on the other paths (bins, radix,
every candidate -inf) list into tier A alone, as before.

The last block holds the tier A keys at or above ``F`` = the largest ``T`` (at least ``k`` keys
of one chunk are at or above it, so no key below it is among the request's ``k`` best) and
counts those at or above ``M`` = the largest ``T_hi``. Where that count reaches ``k`` the held
keys hold the request's ``k`` best (a key missing from tier A is below its block's ``T_hi``, so
below ``M``, and ``k`` keys are above it); else it adds the tier B keys from ``F`` up below
their block's ``T_hi`` (the rest of each list at or above ``F``: the largest ``T``'s block
listed at least ``k`` there). With beams in random order (the benchmarks' shapes) the count
holds; with beams sorted best first (serving: the best candidates in the first block) it
does not, and ``F`` (that block's ``T``) leaves the other blocks' lists mostly out.
``STREAMGR_TOPK_TIER=0``: one tier (A/B runs).
"""

from __future__ import annotations

import os

from numba import cuda, int32, int64, uint32

from .trie_topk import SIMULATED
from .trie_topk_dev import FULL, HALF, I32MAX, NB, NT, append, lane_mask_lt, pick, reserve_slots, \
    warp_min_into
from .trie_topk_keys import LOW32
from .trie_topk_sample import UCAP, hold, obin, sample_floor

TIER = os.environ.get("STREAMGR_TOPK_TIER", "1") == "1"
DONE, UCNT, FLO, BCOL = 0, 1, 2, 3  # ws: blocks done, tier A's count, F; per block (count, T_hi)
RES_N = 5  # sample_floors' shared int32 scratch
# The higher floor's margin in sampled keys (sample_floor's is 8): small under the simulator,
# whose 32 samples a block would otherwise give both floors alike
PAD = 2 if SIMULATED else 8


def ws_cols(g: int) -> int:
    return BCOL + 2 * g


@cuda.jit(device=True, inline=True)
def sample_floors(kx, n, want, want_hi, ref, hist, scan, res):
    """(``sample_floor``'s floor for ``want``, a higher one from the same sample for about
    ``want_hi`` x 3/2 keys, no count behind it). ``res``: RES_N shared int32. Every thread
    calls it; it ends synchronized."""
    tid = cuda.threadIdx.x
    if tid == 0:
        res[4] = I32MAX  # published by sample_floor's barriers
    t = sample_floor(kx, n, want, ref, hist, scan, res)
    x = kx[(int64(tid) * n) // NT]  # the same sample, its bins still in hist
    b = obin(x, ref)
    wh = min(int64(NT), ((want_hi * NT + n - 1) // n) * 3 // 2 + PAD)
    d, _, _ = pick(hist, NB, wh, scan, res, NT)
    m = int32((int64(x) & LOW32) - HALF) if b >= d else I32MAX
    return t, int64(warp_min_into(m, res, 4)) + HALF


@cuda.jit(device=True, inline=True)
def hand_on_tiers(srt, cnt, t, th, r, ws, ul, ub, red, ctr):
    """The listing block's ``cnt`` keys in ``srt`` (those at or above ``t``, ``k`` or more) to
    tier A (those at or above ``th``) and its tier B region (all), ``ws`` told. ``ctr``: a
    shared int32 at 0."""
    tid = cuda.threadIdx.x
    v = srt[tid] if tid < cnt else int64(0)
    a_in = tid < cnt and uint32(v >> 31) >= uint32(th)
    a = reserve_slots(int32(1) if a_in else int32(0), ctr)
    cuda.syncthreads()
    blk = cuda.blockIdx.x
    if tid == 0:
        red[0] = cuda.atomic.add(ws, (r, UCNT), int64(ctr[0]))
        ws[r, BCOL + 2 * blk] = cnt
        ws[r, BCOL + 2 * blk + 1] = th
        cuda.atomic.max(ws, (r, FLO), t)
    cuda.syncthreads()
    if a_in:
        ul[r, red[0] + a] = v
    if tid < cnt:
        ub[r, int64(blk) * NT + tid] = v


@cuda.jit(device=True, inline=True)
def hold_append(kx, ctr, v, take):
    """``v`` held (``hold``) at the next slot counted at ``ctr[0]`` where ``take`` (one shared
    atomic a warp); slots past ``UCAP`` are counted, not written. Every lane calls it."""
    if SIMULATED:
        if take:
            p = cuda.atomic.add(ctr, 0, 1)
            if p < UCAP:
                hold(kx, p, v)
        return
    mask = cuda.ballot_sync(FULL, take)
    lane = cuda.threadIdx.x & 31
    base = int32(0)
    if lane == 0 and mask != 0:
        base = cuda.atomic.add(ctr, 0, int32(cuda.popc(mask)))
    base = cuda.shfl_sync(FULL, base, 0)
    p = int64(base) + cuda.popc(int64(mask) & lane_mask_lt(lane))
    if take and p < UCAP:
        hold(kx, p, v)


@cuda.jit(device=True, inline=True)
def count_into(cell, take):
    """cell[0] += the warp's ``take`` (shared int32, one atomic a warp)."""
    if SIMULATED:
        if take:
            cuda.atomic.add(cell, 0, 1)
        return
    mask = cuda.ballot_sync(FULL, take)
    if (cuda.threadIdx.x & 31) == 0 and mask != 0:
        cuda.atomic.add(cell, 0, int32(cuda.popc(mask)))


@cuda.jit(device=True, inline=True)
def stage(ws, r, g, srt, fl, ctr, cm):
    """The last block's first step: each block's (count, ``T_hi``) into ``srt[2b]``,
    ``srt[2b + 1]`` (``g <= NT / 2``), ``F`` and tier A's count into ``fl``, the counters
    zeroed; returns this thread's ``T_hi`` (0 past ``g``) for ``M``. Published by the caller's
    next barrier."""
    tid = cuda.threadIdx.x
    th = int64(0)
    if tid < g:
        th = ws[r, BCOL + 2 * tid + 1]
        srt[2 * tid] = ws[r, BCOL + 2 * tid]
        srt[2 * tid + 1] = th
    if tid == 0:
        fl[0] = cuda.atomic.add(ws, (r, FLO), int64(0))  # at L2, as the blocks' atomics
        fl[1] = cuda.atomic.add(ws, (r, UCNT), int64(0))
        ctr[0] = 0
        cm[0] = 0
    return th


@cuda.jit(device=True, inline=True)
def hold_tier_a(kx, ul, r, UA, F, M, ctr, cm):
    """Tier A's keys at or above ``F`` held; those at or above ``M`` counted into ``cm[0]``.
    Returns this thread's largest held key (-1 if none)."""
    tid = cuda.threadIdx.x
    hi = int64(-1)
    for base in range(0, UA, NT):
        j = base + tid
        v = ul[r, j] if j < UA else int64(0)
        u = v >> 31
        take = j < UA and u >= F
        if take:
            hi = max(hi, v)
        count_into(cm, take and u >= M)
        hold_append(kx, ctr, v, take)
    return hi


@cuda.jit(device=True, inline=True)
def add_tier_b(kx, ub, ulr, r, g, F, srt, ctr, to_list):
    """Every block's tier B keys from ``F`` up that are not in tier A (below its ``T_hi``),
    held in ``kx`` (``to_list`` 0), or appended to the request's list ``ulr`` (1: the radix
    fallback's whole list after tier A), counted at ``ctr[0]``. Every thread calls it."""
    tid = cuda.threadIdx.x
    for b in range(g):
        nb = srt[2 * b]
        th = srt[2 * b + 1]
        if th > F:  # else every key of its list from F up is in tier A
            for base in range(0, nb, NT):
                j = base + tid
                v = ub[r, int64(b) * NT + j] if j < nb else int64(0)
                u = v >> 31
                take = j < nb and u >= F and u < th
                if to_list:
                    append(ulr, ctr, 0, v, take)
                else:
                    hold_append(kx, ctr, v, take)
