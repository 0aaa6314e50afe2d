"""Two-level selection of ``trie_topk`` in one launch, for requests whose candidates split over a
few blocks (gen-ref's step 2 at beams of 256: 45,312 candidates, ``k`` 256, 6 blocks a request,
in up to two waves of blocks: up to 44 requests on 132 SMs).

Every block of a request takes a chunk of at most ``ONE_MAX`` candidates, computes their okeys
into shared memory as ``trie_topk_one`` does, and hands on a superset of its own ``k`` best to
the request's list in global memory, as absolute keys ``okey << 31 | (MAXC - c)`` (comparable
across blocks: no per-block shift), each with its answer (child node and code, ``aux_of``)
beside it: the keys at or above a floor sampled from its chunk
(``trie_topk_sample``), or, where that list would not hold from ``k`` to a block of keys (or
the chunk is small, or ``STREAMGR_TOPK_SAMPLE=0``), every key of the bins from its ``k``-th's
up (one round of ``obin`` bins below its best score; where those hold over a block of keys,
exactly its ``k`` best by radix select). The request's ``k`` best are among the blocks' ``k``
best, so the request's last block to finish (each block adds its listed count and its one to
the request's done counter in one atomic, so the last learns the list's length from it)
selects from the list alone:
held in registers from one round of four loads a thread (up to ``UCAP`` keys, with their
answers), ``select_held`` (one bins round below the list's best score, each key of the bins
from the ``k``-th's up ranked within its bin and answered from its listed answer, or sorted
whole where a bin is crowded); a longer list (ties), or one of only ``-inf`` keys, by radix
select over the list in global memory, then decoded as every path does. A listing block
reduces only its chunk's best score (``best_okey``: one barrier; the smallest only a radix
fallback would use, and it then counts from the lowest okey).

Against the grid path (``trie_topk_bins``: two launches, a global histogram of
4,096 bins flushed by every block, every candidate group near the pick scored twice, the
last block sorting) this is one launch on 2 counters a request (``counters.zeroed``; the last
block zeroes them again, so a graph needs no memset node): each candidate is
scored once, and no global histogram is built. It serves where every block's chunk fits shared
memory and the blocks' lists are expected to fit ``UCAP`` (``plan``); elsewhere the grid path.
``STREAMGR_TOPK_MERGE=0`` turns it off (A/B runs). Keys are distinct and the bins monotone in the
score, so the answer is the stable order's, exactly, on every path.
"""

from __future__ import annotations

import os

import torch
from numba import cuda, int32, int64

from .counters import zeroed
from .kernel_cache import cached
from .numba_common import INLINE, STAMP, stamp
from .trie_topk import SIMULATED
from .trie_topk_bins import SMS_SIM, sm_count
from .trie_topk_dev import (BIG, DIG, I32MAX, JIT_NT, NB, NT, RED_N, SCAN_N, append, bit_length,
                            collect, pick, radix)
from .trie_topk_keys import KEY_NEG_INF, LOW32, MAXC, child_of, key_c, okey_float
from .trie_topk_held import select_global, select_held
from .trie_topk_sample import (ONE_MAX, SAMPLE, SAMPLE_MIN, UCAP, best_okey, list_above, obin,
                               obin_hist, rev_okey, sample_floor, score_chunk)

MERGE = os.environ.get("STREAMGR_TOPK_MERGE", "1") == "1"
# Requests that fit one block stay one block (trie_topk_one): on the H200 step 1 (8,192
# candidates) took 0.0273 ms here over 2-8 blocks, 0.0251 there (session 29).
MERGE_MIN = ONE_MAX
# Waves of blocks (one an SM) a launch may take: past one (step 2 at 23 to 44 requests) the
# blocks of the later waves list while the first ones wait. Not three: on the H200 gen-ref's
# step 2 at 48 requests (6 blocks a request, 2.2 waves) took 0.0293-0.0296 ms here against the
# grid launches' 0.0272-0.0273; at 24 and 40 requests (two waves) 0.0211 and 0.0225 here against
# 0.0227 and 0.0236 there (session 46). STREAMGR_TOPK_MERGE_WAVES=1: one wave (A/B).
WAVES = int(os.environ.get("STREAMGR_TOPK_MERGE_WAVES", "2"))
# A block's chunk: whole rounds of one candidate a thread (note_all takes four a thread while
# over two rounds are left). At step 2 (16 requests) 6 blocks of 8,192 took 0.0363 ms, 8 of
# 6,144 0.0374, 12 of 4,096 0.0447 when the last block loaded each answer (session 29); with the
# answers listed beside the keys (aux_of) 8 blocks of 6,144 took 0.0140-0.0141 ms against 6 of
# 8,192's 0.0143-0.0144 in one call on the H200, a gain within the spread of the calls around it
# (session 42). STREAMGR_TOPK_MERGE_UNIT sets it (A/B runs; 4,096 was the unit before).
UNIT = int(os.environ.get("STREAMGR_TOPK_MERGE_UNIT", str(NT)))
# A block's list in quarters of k, for the plan: ~7/4 above a sampled floor (sample_floor's
# margin), ~5/4 from the bins (and under the simulator, whose test cases are sized for it)
LIST4 = 7 if SAMPLE and not SIMULATED else 5
# ws columns: DONE the blocks done (low LISTED bits) plus the keys they listed (the bits above),
# added in one atomic a block; UCNT the list's slots reserved so far
DONE, UCNT = 0, 1
assert UCAP <= 4 * NT  # the last block loads its list in one round of four a thread
LISTED = 24  # ws[r, DONE]'s low bits: blocks done (a request has at most WAVES x SMs blocks)


@cuda.jit(device=True, **INLINE)
def akey(u, c):
    """Candidate c's absolute key from its okey ``u`` (32 bits): comparable across blocks."""
    return (u << 31) | (MAXC - c)


@cuda.jit(device=True, **INLINE)
def reserve(ws, r, cnt, red):
    """The start of ``cnt`` slots of request r's list, to every thread (one global atomic)."""
    if cuda.threadIdx.x == 0:
        red[0] = cuda.atomic.add(ws, (r, UCNT), int64(cnt))
    cuda.syncthreads()
    return red[0]


@cuda.jit(device=True, **INLINE)
def last_listed(ws, r, listed, flag, cnt, res):
    """True in the request's last block to get here (after its list is fenced), with the
    request's count of listed keys in ``cnt[0]``: one global atomic adds the block's count
    (high bits) and its one (low bits) to ``ws[r, DONE]``, so the last block need not read
    the count in a second round trip. ``res[3]`` is left ``I32MAX`` (published) for the last
    block's ``best_okey`` (``select_held``)."""
    cuda.threadfence()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        old = cuda.atomic.add(ws, (r, DONE), (listed << LISTED) + 1)
        flag[0] = (old & ((int64(1) << LISTED) - 1)) == cuda.gridDim.x - 1
        cnt[0] = int32((old >> LISTED) + listed)
        res[3] = I32MAX
    cuda.syncthreads()
    return flag[0]


@cuda.jit(device=True, **INLINE)
def aux_of(r, v, F, FM, scores, nodes, ptr, codes):
    """List key ``v``'s answer beside it (``ua``): its child node << 32 | its code (0 and 0
    where it is no child), as ``put_abs`` computes them. The block that scored the key reads
    them, so its loads (beam, child range, code) hit lines its scoring brought into the SM's
    L1; the last block then answers with no load of its own (``select_held``)."""
    _, _, real, ch, cd = child_of(r, key_c(v), F, FM, scores, nodes, ptr, codes)
    return (ch << 32) | ((cd & LOW32) if real else int64(0))


@cuda.jit(device=True, **INLINE)
def put_listed(ul, ua, r, p, v, F, FM, scores, nodes, ptr, codes):
    """List key ``v`` into slot ``p`` of request r's list, its answer beside it."""
    ul[r, p] = v
    ua[r, p] = aux_of(r, v, F, FM, scores, nodes, ptr, codes)


@cuda.jit(device=True, **INLINE)
def hand_on(kx, c0, n, want, lo, hi, r, ws, ul, ua, F, FM, scores, nodes, ptr, codes, hist, srt,
            scan, res, red, ctr):
    """List a superset of the chunk's ``want`` best keys (``kx[:n]``, candidates ``c0 + i``),
    each with its answer (``put_listed``):
    those of the bins from its ``want``-th's up where they hold at most a block, else exactly
    the ``want`` best (radix select); where every candidate is -inf, the ``want`` lowest.
    Returns how many it listed (to every thread)."""
    tid = cuda.threadIdx.x
    if hi <= KEY_NEG_INF:  # block-uniform
        pos = reserve(ws, r, want, red)
        for i in range(tid, want, NT):
            put_listed(ul, ua, r, pos + i, akey(KEY_NEG_INF, c0 + i), F, FM, scores, nodes, ptr,
                       codes)
        return want
    ref = okey_float(hi)
    if SAMPLE and n > SAMPLE_MIN:  # the keys at or above a sampled floor, if they fit
        t = sample_floor(kx, n, want, ref, hist, scan, res)
        cnt = list_above(kx, n, c0, t, want, srt, ctr)  # in shared memory, then copied out
        if want <= cnt and cnt <= NT:  # block-uniform; a block lists at most NT keys
            pos = reserve(ws, r, cnt, red)
            if tid < cnt:
                put_listed(ul, ua, r, pos + tid, srt[tid], F, FM, scores, nodes, ptr, codes)
            return cnt
    obin_hist(hist, kx, n, ref)
    stamp(10)
    d, need, nd = pick(hist, NB, want, scan, res, NT)
    stamp(11)
    total = want - need + nd  # the keys of the bins from d up
    if total <= NT:
        # their slots reserved at once: a global atomic a warp and round took ~5.9 us at step 2
        # on the H200, against ~0.8 for the block's other work on the list (session 30)
        if tid == 0:
            ctr[0] = int32(cuda.atomic.add(ws, (r, UCNT), total))
        cuda.syncthreads()
        for base in range(0, n, NT):
            i = min(base + tid, n - 1)
            take = base + tid < n and obin(kx[i], ref) >= d
            v = akey(int64(kx[i]) & LOW32, c0 + i)
            p = append(ul[r], ctr, 0, v, take)
            if p >= 0:
                ua[r, p] = aux_of(r, v, F, FM, scores, nodes, ptr, codes)
        return total
    tmin = lo if lo != BIG else KEY_NEG_INF  # ties: the want best exactly, by their digits
    top_bit = 31 + bit_length(max(hi - tmin + 1, int64(1)))
    shift = top_bit - DIG if top_bit > DIG else 0
    prefix, shift = radix(kx, srt, 0, n, tmin, want, int64(0), int64(63), shift, hist, scan, res,
                          NT)
    collect(kx, srt, 0, n, tmin, prefix, int64(63), shift, srt, ctr)
    pos = reserve(ws, r, want, red)
    for j in range(tid, want, NT):
        i = key_c(srt[j])
        put_listed(ul, ua, r, pos + j, akey(int64(kx[i]) & LOW32, c0 + i), F, FM, scores, nodes,
                   ptr, codes)
    return want


@cached
@cuda.jit(**JIT_NT)
def merge_select(N, k, KP, ch, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, ws, ul,
                 ua, cap, top, parent, child, code):
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
    cnt = cuda.shared.array(1, int32)
    bst = cuda.shared.array(4, int32)  # the chunk's best (best_okey's cell: res[3] is the floor's)
    c0 = int64(cuda.blockIdx.x) * ch
    n = min(N - c0, ch)
    lo, hi, _ = score_chunk(kx, c0, n, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off,
                            red, ctr, bst, True)
    # the chunk's best alone, one barrier (lo is BIG: hand_on's radix fallback then counts from
    # KEY_NEG_INF)
    hi = best_okey(rev_okey(hi), bst)
    stamp(2)
    listed = hand_on(kx, c0, n, min(k, n), lo, hi, r, ws, ul, ua, F, FM, scores, nodes, ptr, codes,
                     hist, srt, scan, res, red, ctr)
    if STAMP:
        cuda.syncthreads()
        stamp(3)
    if not last_listed(ws, r, listed, flag, cnt, res):
        stamp(15)
        return
    stamp(4)
    cuda.threadfence()
    if tid == 0:
        ctr[0] = 0  # published by select_held's (or minmax's) barriers
        # every block of the request has added to both: zero for the next launch (counters)
        ws[r, DONE] = 0
        ws[r, UCNT] = 0
    U = int64(cnt[0])  # >= k: each block listed min(k, its n)
    if U <= UCAP and select_held(ul, ua, U, k, KP, kx, hist, srt, scan, res, ctr, r, F, FM, B,
                                 scores, nodes, logp, lse, sh, ptr, codes, off, cap, top, parent,
                                 child, code):
        if STAMP:
            cuda.syncthreads()
            stamp(15)
        return
    # ties or only -inf: radix select over the list in global memory
    select_global(ul, U, k, KP, hist, srt, scan, res, red, ctr, r, F, FM, B, scores, nodes, logp,
                  lse, sh, ptr, codes, off, cap, top, parent, child, code)


def plan(N: int, R: int, k: int, sms: int):
    """(chunk, blocks a request) where this path serves R requests of N candidates, else None:
    more than ``MERGE_MIN`` candidates, at least two blocks a request of at most ``ONE_MAX``
    each, in at most ``WAVES`` waves of one block an SM, ``k`` within half a block (the bins
    rounds), and the blocks' lists (each about ``k`` x 7/4 above a sampled floor, ``k`` x 5/4
    from the bins) within ``UCAP``, so that they usually fit the last block's shared memory."""
    if not MERGE or 2 * k > NT or N <= MERGE_MIN:
        return None
    fit = -(-N // ONE_MAX)  # blocks a request needs at the least
    per = max(fit, min(sms // max(R, 1), (4 * UCAP) // (LIST4 * k)))
    ch = -(-N // per)
    ch = -(-ch // UNIT) * UNIT
    g = -(-N // ch)
    ok = 2 <= g and ch <= ONE_MAX and g * LIST4 * k <= 4 * UCAP and R * g <= WAVES * sms
    return (ch, g) if ok else None


def plan_for(N: int, R: int, k: int, dev):
    return plan(N, R, k, SMS_SIM if SIMULATED else sm_count(dev))


def run(launch, R, N, k, KP, ch, g, F, FM, B, sc, nd, lp, trie, outs, dev, arr):
    """The one launch (``launch(fn, grid, threads)``) on the list's counters (``zeroed``: a
    graph's own, which the last blocks leave zero, or a fill)."""
    ws = zeroed((R, 2), dev)
    ul = torch.empty(R, g * NT, dtype=torch.int64, device=dev)  # a block lists <= NT (k <= NT)
    ua = torch.empty_like(ul)  # each listed key's answer (aux_of)
    launch(merge_select, (g, R), NT)(N, k, KP, ch, F, FM, B, sc, nd, *lp, *trie, arr(ws), arr(ul),
                                     arr(ua), *outs)
