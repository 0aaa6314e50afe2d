"""One-launch selection of ``trie_topk`` for requests of many candidates that the merge does not
serve (``k`` over half a block, or lists that would outgrow the last block): gen-ref's step 2 at
beams of 1,024 (181,248 candidates, ``k`` 1,024), one request's flat 2,097,152.

Every block of a request computes the same floor ``T`` (an absolute key, ``okey << 31 | MAXC -
c``) from the same spread sample of the request's candidates (``sample_at``: one in each of ``S``
strata, at an offset hashed from the stratum, so that no stride of the beams' layout aliases it):
``T`` is the sample's ``want``-th best key (a radix select over the sample's okeys in shared
memory, ``want`` about twice the sample's expected count above the request's ``k``-th key plus
eight), so that the request's keys at or above ``T`` number about ``want x N / S`` and fall
short of ``k`` with odds of about one in a million. Each block then scores its chunk of
candidates four a thread (nothing held: the keys are compared and dropped) and lists the keys at
or above ``T`` in global memory, each with its answer (child node << 32 | code) beside it, one
atomic a warp that lists any. The request's last block to finish selects from that list: where
``k`` is within half a block and the list within ``UCAP``, held in registers and ranked in its
bins (``select_held``); else by radix select over the list in global memory
(``select_global``).

Where the list holds fewer than ``k`` keys or more than its capacity (an unlucky sample, or
adversarial scores), the last block finds an exact floor itself: a radix select over all of the
request's keys, scored again by its threads, 10-bit digits from the top until the keys at or
above the picked prefix fit the list; then it lists them again. Slow (milliseconds for a flat
request) and exact: no answer depends on the sample's luck, only the time does.

Against the two grid launches of ``trie_topk_bins`` (every candidate scored twice, a global
histogram of 4,096 bins, the last block sorting what its bin and those above it hold) it scores
each candidate once in one launch of one wave and lists a few thousand keys. Measured on the
H200 it is slower, so it is off by default (``STREAMGR_TOPK_FILTER=1`` turns it on, for A/B runs
and further work): graph-replayed, step 2 at beams of 1,024 took 0.0621-0.0663 ms against the
grid's 0.0623-0.0624, flat 0.0439-0.0441 against 0.0395-0.0397, flat at k 1,024 0.0715-0.0718
against 0.0525-0.0527 (session 43). Its phase stamps (``tools/probe_topk.py --timeline``) say
where: each block's sample costs 5.4 us at one candidate a thread (step 2, beams of 1,024) and
16.4 us at eight (flat: every block reads the same 8,192 scattered candidates, each a chain of
dependent loads), its radix floor 6.1-12.3 us, the listing 8.7 us (flat, 16,384 candidates a
block) to 17-18.6 us (22,656), and the last block's ``select_global`` at ``k`` 1,024 25-27.5 us
(``select_held`` at ``k`` 256: 5.6 us). Computing the floor once a request (a launch before)
and answering ``k`` over half a block from registers, as ``select_held`` does, are the next
steps. The answer is the stable order's, exactly, either way.
"""

from __future__ import annotations

import os

import torch
from numba import cuda, int32, int64

from .counters import zeroed
from .kernel_cache import cached
from .numba_common import INLINE, STAMP, stamp
from .trie_topk import SIMULATED
from .trie_topk_bins import MAXK, SMS_SIM, chunk, last_block, sm_count
from .trie_topk_dev import (DIG, DM, FULL, JIT_NT, NB, NT, RED_N, SCAN_N, bit_length, hist_add,
                            lane_mask_lt, minmax, pick, radix, warp_min_into)
from .trie_topk_held import select_global, select_held
from .trie_topk_keys import KEY_NEG_INF, LOW32, at, cand, okey, tkey
from .trie_topk_merge import akey
from .trie_topk_sample import ONE_MAX, UCAP

FILTER = os.environ.get("STREAMGR_TOPK_FILTER", "0") == "1"  # off: slower (above)
SPT_MAX = ONE_MAX // NT  # sampled keys a thread (the sample's okeys fill kx at most)
LAMBDA = 4  # the sample's expected count above the k-th key the plan aims for, at the least
# ws columns: the request's blocks done, its list's slots reserved
DONE, UCNT = 0, 1
HASH = 0x9E3779B1  # Knuth's multiplicative hash (2**32 / golden ratio)


@cuda.jit(device=True, **INLINE)
def sample_at(s, S, N):
    """The candidate of sample ``s`` of ``S`` (``N >= 2 S``): in stratum ``[s N / S, (s + 1) N /
    S)`` at an offset hashed from ``s``. Strictly increasing in ``s``, so the sample's order by
    (okey, lower ``s``) is its candidates' key order."""
    lo = (s * N) // S
    w = ((s + 1) * N) // S - lo
    h = (s * HASH) & LOW32
    return lo + ((h * w) >> 32)


@cuda.jit(device=True, **INLINE)
def cand_key(r, c, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off):
    """Candidate c's absolute key and its answer (child node << 32 | code; 0 where no child)."""
    v, ch, cd = cand(r, c, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
    return akey(okey(v), c), (ch << 32) | (cd & LOW32)


@cuda.jit(device=True, **INLINE)
def sample_okey(s, S, N, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off):
    return okey(cand(r, sample_at(s, S, N), F, FM, B, scores, nodes, logp, lse, sh, ptr, codes,
                     off)[0])


@cuda.jit(device=True, **INLINE)
def hold_okey(kx, s, u, S):
    """Sample s's okey ``u`` into ``kx[s]`` (int32 bits) where ``s < S``; returns it (-1 past
    ``S``) for the running best."""
    if s < S:
        kx[s] = int32(u - (int64(1) << 32) if u >= (int64(1) << 31) else u)
        return u
    return int64(-1)


@cuda.jit(device=True, **INLINE)
def sampled_floor(kx, S, N, want, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off,
                  k64, hist, scan, res, red):
    """The floor ``T``: the ``want``-th best key of the request's sample (``sample_at``), its
    okeys held in ``kx[:S]``. Every thread calls it; it ends synchronized."""
    tid = cuda.threadIdx.x
    hi = int64(-1)
    for s in range(tid, S, 4 * NT):  # four a thread at a time: their loads overlap
        u0 = sample_okey(s, S, N, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
        u1 = sample_okey(min(s + NT, S - 1), S, N, r, F, FM, B, scores, nodes, logp, lse, sh,
                         ptr, codes, off)
        u2 = sample_okey(min(s + 2 * NT, S - 1), S, N, r, F, FM, B, scores, nodes, logp, lse,
                         sh, ptr, codes, off)
        u3 = sample_okey(min(s + 3 * NT, S - 1), S, N, r, F, FM, B, scores, nodes, logp, lse,
                         sh, ptr, codes, off)
        hi = max(hi, hold_okey(kx, s, u0, S))
        hi = max(hi, hold_okey(kx, s + NT, u1, S))
        hi = max(hi, hold_okey(kx, s + 2 * NT, u2, S))
        hi = max(hi, hold_okey(kx, s + 3 * NT, u3, S))
    stamp(1)
    _, hi = minmax(int64(0), hi, red)  # okeys < 2**32: within minmax's range
    if tid == 0:
        red[0] = MAXK  # warp_min_into's cell (radix's barriers publish it)
    # keys (okey - KEY_NEG_INF + 1) << 31 | MAXC - s: every okey at or above -inf's, so none
    # collapses to 0 and the order is (okey, lower s), the candidates' own
    top_bit = 31 + bit_length(max(hi - KEY_NEG_INF + 1, int64(1)))
    shift = top_bit - DIG if top_bit > DIG else 0
    prefix, shift = radix(kx, k64, 0, S, KEY_NEG_INF, want, int64(0), int64(63), shift, hist,
                          scan, res, NT)
    thr = prefix >> shift
    m = MAXK
    for s in range(tid, S, NT):
        u = int64(kx[s]) & LOW32
        if (tkey(u, int64(s), KEY_NEG_INF) >> shift) >= thr:
            m = min(m, akey(u, sample_at(s, S, N)))
    # the block's least (red[0] is left alone until the last block's barriers)
    t = warp_min_into(m, red, 0)
    stamp(2)
    return t


@cuda.jit(device=True, **INLINE)
def list_key(ul, ua, ws, r, cap_u, v, aux, take):
    """``ul[r, p]`` = ``v`` and ``ua[r, p]`` = ``aux`` at the next slot ``p`` of request r's list
    where ``take``: one global atomic a warp that lists any (slots past ``cap_u`` counted, not
    written). Every lane calls it."""
    if SIMULATED:
        if take:
            p = cuda.atomic.add(ws, (r, UCNT), 1)
            if p < cap_u:
                ul[r, p] = v
                ua[r, p] = aux
        return
    mask = cuda.ballot_sync(FULL, take)
    if mask != 0:  # warp-uniform
        lane = cuda.threadIdx.x & 31
        base = int64(0)
        if lane == 0:
            base = cuda.atomic.add(ws, (r, UCNT), int64(cuda.popc(mask)))
        base = cuda.shfl_sync(FULL, base, 0)
        p = base + cuda.popc(int64(mask) & lane_mask_lt(lane))
        if take and p < cap_u:
            ul[r, p] = v
            ua[r, p] = aux


@cuda.jit(device=True, **INLINE)
def list_chunk(c0, n, t, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, ws, ul, ua,
               cap_u):
    """List the keys of candidates ``c0 .. c0 + n - 1`` at or above ``t``, four a thread at a
    time (their loads issued at clamped indices before any compare, so that they overlap)."""
    tid = cuda.threadIdx.x
    for base in range(0, n, 4 * NT):  # block-uniform trips
        i = base + tid
        v0, a0 = cand_key(r, at(c0, i, n), F, FM, B, scores, nodes, logp, lse, sh, ptr, codes,
                          off)
        v1, a1 = cand_key(r, at(c0, i + NT, n), F, FM, B, scores, nodes, logp, lse, sh, ptr,
                          codes, off)
        v2, a2 = cand_key(r, at(c0, i + 2 * NT, n), F, FM, B, scores, nodes, logp, lse, sh, ptr,
                          codes, off)
        v3, a3 = cand_key(r, at(c0, i + 3 * NT, n), F, FM, B, scores, nodes, logp, lse, sh, ptr,
                          codes, off)
        list_key(ul, ua, ws, r, cap_u, v0, a0, i < n and v0 >= t)
        list_key(ul, ua, ws, r, cap_u, v1, a1, i + NT < n and v1 >= t)
        list_key(ul, ua, ws, r, cap_u, v2, a2, i + 2 * NT < n and v2 >= t)
        list_key(ul, ua, ws, r, cap_u, v3, a3, i + 3 * NT < n and v3 >= t)


@cuda.jit(device=True, **INLINE)
def exact_floor(N, k, cap_u, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, hist,
                scan, res):
    """The least key ``T`` at or above which request r holds from ``k`` to ``cap_u`` keys: a
    radix select over all of its keys, each round scoring every candidate again (one block:
    the fallback of an unlucky sample). Every thread calls it; it ends synchronized."""
    tid = cuda.threadIdx.x
    prefix = int64(0)
    fixed = int64(63)
    shift = int64(63 - DIG)
    want = int64(k)
    while True:
        hist[tid] = 0
        cuda.syncthreads()
        for base in range(0, N, NT):  # block-uniform trips
            c = base + tid
            v, _ = cand_key(r, at(0, c, N), F, FM, B, scores, nodes, logp, lse, sh, ptr, codes,
                            off)
            hist_add(hist, int32((v >> shift) & DM), c < N and (v >> fixed) == (prefix >> fixed))
        cuda.syncthreads()
        d, need, inbin = pick(hist, NB, want, scan, res, NT)
        prefix |= d << shift
        if k - need + inbin <= cap_u or shift == 0:  # the keys at or above prefix
            return prefix
        want = need
        fixed = shift
        shift = shift - DIG if shift > DIG else 0


@cached
@cuda.jit(**JIT_NT)
def filter_select(N, k, KP, ch, S, want, cap_u, F, FM, B, scores, nodes, logp, lse, sh, ptr,
                  codes, off, ws, ul, ua, cap, top, parent, child, code):
    r = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    kx = cuda.shared.array(ONE_MAX, int32)
    hist = cuda.shared.array(NT, int32)
    srt = cuda.shared.array(NT, int64)
    scan = cuda.shared.array(SCAN_N, int32)
    res = cuda.shared.array(4, int32)
    red = cuda.shared.array(RED_N, int64)
    ctr = cuda.shared.array(1, int32)
    flag = cuda.shared.array(1, int32)
    stamp(14)
    t = sampled_floor(kx, S, N, want, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off,
                      srt, hist, scan, res, red)
    c0 = int64(cuda.blockIdx.x) * ch
    list_chunk(c0, min(N - c0, ch), t, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes,
               off, ws, ul, ua, cap_u)
    if STAMP:
        cuda.syncthreads()
        stamp(3)
    if not last_block(ws, r, DONE, flag):
        stamp(15)
        return
    stamp(4)
    cuda.threadfence()
    if tid == 0:
        red[0] = cuda.atomic.add(ws, (r, UCNT), 0)
    cuda.syncthreads()
    U = red[0]
    if U < k or U > cap_u:  # block-uniform: the sample ran high or low; list again, exactly
        t = exact_floor(N, k, cap_u, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off,
                        hist, scan, res)
        if tid == 0:
            cuda.atomic.add(ws, (r, UCNT), -U)  # to 0: the block lists alone now
        cuda.syncthreads()
        list_chunk(0, N, t, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, ws, ul,
                   ua, cap_u)
        cuda.threadfence()
        cuda.syncthreads()
        if tid == 0:
            red[0] = cuda.atomic.add(ws, (r, UCNT), 0)
        cuda.syncthreads()
        U = red[0]
    cuda.syncthreads()  # every thread has read red[0]
    if tid == 0:
        ctr[0] = 0
        res[3] = 0x7FFFFFFF  # select_held's best_okey cell
        # every block of the request has added to both: zero for the next launch (counters)
        ws[r, DONE] = 0
        ws[r, UCNT] = 0
    cuda.syncthreads()
    if not (2 * k <= NT and U <= UCAP and select_held(ul, ua, U, k, KP, kx, hist, srt, scan, res,
                                                      ctr, r, F, FM, B, scores, nodes, logp, lse,
                                                      sh, ptr, codes, off, cap, top, parent,
                                                      child, code)):
        stamp(10)
        select_global(ul, U, k, KP, hist, srt, scan, res, red, ctr, r, F, FM, B, scores, nodes,
                      logp, lse, sh, ptr, codes, off, cap, top, parent, child, code)
    if STAMP:
        cuda.syncthreads()
        stamp(15)


def want_sample(k: int, S: int, N: int) -> int:
    """The sample's rank of the floor: twice its expected count above the ``k``-th key, plus
    eight (the odds that the request holds fewer than ``k`` keys above it: about one in a
    million at the plan's samples)."""
    return min(S, 2 * -(-k * S // N) + 8)


def plan(N: int, R: int, k: int, sms: int):
    """(chunk, blocks a request, sample size, its floor's rank, list capacity) where this path
    serves R requests of N candidates wanting k, else None: more than ``ONE_MAX`` candidates;
    the sample the smallest of whole blocks' worth with ``LAMBDA`` expected above the ``k``-th
    key (at most ``SPT_MAX`` a thread and half the candidates); one wave of blocks."""
    if not FILTER or N <= ONE_MAX:
        return None
    spt = 1
    while spt < SPT_MAX and k * spt * NT < LAMBDA * N and 4 * spt * NT <= N:
        spt *= 2
    S = spt * NT
    ws = want_sample(k, S, N)
    ch = chunk(N, R, sms)
    cap_u = max(2 * k, 4 * (ws * N // S))
    return ch, -(-N // ch), S, ws, cap_u


def plan_for(N: int, R: int, k: int, dev):
    return plan(N, R, k, SMS_SIM if SIMULATED else sm_count(dev))


def run(launch, R, N, k, KP, ch, g, S, ws, cap_u, F, FM, B, sc, nd, lp, trie, outs, dev, arr):
    """The one launch (``launch(fn, grid, threads)``) on 2 counters a request (``zeroed``: a
    graph's own, which the last blocks leave zero, or a fill)."""
    w = zeroed((R, 2), dev)
    ul = torch.empty(R, cap_u, dtype=torch.int64, device=dev)
    ua = torch.empty_like(ul)
    launch(filter_select, (g, R), NT)(N, k, KP, ch, S, ws, cap_u, F, FM, B, sc, nd, *lp, *trie,
                                      arr(w), arr(ul), arr(ua), *outs)
