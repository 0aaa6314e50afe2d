"""Binned grid selection of ``trie_topk`` for requests of more than ``ONE_MAX`` candidates
that the merge does not serve (gen-ref's step 2 at beams of 1,024: 181,248 a request at k
1,024; one request's flat 2,097,152): one histogram round instead of radix digits. Where beam
units fit four a warp in one wave of at most 32 blocks a request, ``trie_topk_kept`` serves in
one launch (step 2 at beams of 1,024 and at 48 requests, since session 48); else two launches
on a workspace of counters that their last blocks leave zero (``counters.zeroed``):

1. ``bin_hist``: every block (``chunk`` candidates, one wave of 1,024-thread blocks over the GPU)
   loads its beams into shared memory (``trie_topk_beams``: a candidate then loads its code and
   its log-probability, in beam units where the fan-out allows, else eight candidates a thread a
   round), writes each candidate's okey to an
   [R, N] buffer and adds it to the bin of ``x - ref`` (``gbin``: the top 12 bits of that
   difference's order-preserving bits with bf16 logits, 11 with fp32, ``trie_topk_beams.gshift``;
   so bins are finest near the request's best beam score
   ``ref``, where the ``k``-th best lies, and every score has one). No block waits for the
   others: no last block, no pick.
2. ``bin_select``: every block picks the bin ``D`` holding the ``k``-th best from the request's
   histogram (each block alike) and two of its warps find the okeys where ``D`` starts and
   ends (``okey_from``); it reads its keys back (from the L2 cache, where bin_hist left them:
   no second scoring) and appends those past ``D`` to ``sure`` (fewer than ``k``) and those in
   ``D`` to ``buf`` (a compare with the two okeys; warps with no key reaching ``D`` skip the
   appends), a warp's slots in both lists by one atomic on a word that packs both counts and
   the blocks done, so the request's last block learns the counts from its election. It ranks
   the lists' keys by linear bins and answers each from the thread that holds it (``rank_answer``;
   2,048 keys at most, two a thread), or where they are more (ties in ``D``) radix-selects the
   rest of the ``k`` from ``buf`` first; it leaves the histogram and counters zero.

On the H200 (session 44) step 2 at beams of 1,024 took 0.0351 ms graph-replayed against
0.0632 for the previous two launches (which scored every candidate twice, the second time
where a group of 32 reached ``D``, and sorted the lists bitonically), flat 0.0274 against
0.0403, flat at k 1,024 0.0317 against 0.0529. Session 45 (the pick in every bin_select block,
one counter word, answers staged by rank, 32-bit candidate indices, ``okey_from`` starting at
its estimate) took them, on one machine, from 0.0348-0.0350 to 0.0304-0.0306 ms, 0.0270-0.0273
to 0.0234-0.0235 and 0.0315-0.0316 to 0.0278. Staging each block's appends in shared memory
(one global atomic a block instead of one a warp) measured no faster and was dropped. Session
47 (beam units, ``best_beam`` and bin_hist's loops in 32 bits) took them from 0.0303-0.0304 to
0.0285-0.0286, 0.0239 to 0.0228-0.0230 and 0.0276-0.0277 to 0.0267 (step 2 at 48 requests
0.0272-0.0273 to 0.0249).

The binning is a monotone function of the score (``x - ref`` rounds monotonically), so every key
of a bin above ``D`` beats every key in ``D``: the answer is the stable order's, exactly, with
no assumption about the scores' range. ``ref`` is only where the bins are finest.
"""

from __future__ import annotations

import functools
import os

import torch
from numba import cuda, float32, int32, int64, uint32

from . import trie_topk_kept as kept
from .counters import zeroed
from .kernel_cache import cached
from .numba_common import INLINE, stamp
from .trie_topk import SIMULATED
from .trie_topk_beams import (GB, GB1, best_bound, bins_of, gbin, gshift, keep, load_beams,
                              score8, score_units, units_of, zero_bins)
from .trie_topk_dev import FULL, JIT_NT, NB, NT, RED_N, SCAN_N, lane_mask_lt, pick
from .trie_topk_index import div_f
from .trie_topk_keys import KEY_NEG_INF, LOW32, MAXC, ix, okey, okey_float, put_abs
from .trie_topk_rank import SRT_N, first_level, held, radix_rest, rank_answer

# ws columns: the packed counts, the request's reference okey, then its histogram from HG.
# CNT packs buf's count (bits 0-31: at most N < 2**31), sure's (32-43: at most k <= 1,024) and
# bin_select's blocks done (44-62), so one atomic a warp reserves its slots in both lists and
# the election's atomic returns the final counts.
CNT, REF = range(2)
HG = 8
W_LEN = HG + GB
SURE_SH, DONE_SH = 32, 44
SURE_M = int64(0xFFF)
ONE_SURE = int64(1) << SURE_SH
ONE_DONE = int64(1) << DONE_SH
OKEY_TOP = int64(0xFF800001)  # past okey(+inf): above every real score's
SMS_SIM = 4  # the simulator's "SMs" (blocks a wave)
# bin_hist scores beam units where the fan-out allows (trie_topk_beams.units_of);
# STREAMGR_TOPK_UNITS=0 keeps score8's rounds, for A/B runs
UNITS = os.environ.get("STREAMGR_TOPK_UNITS", "1") == "1"


@cached
@cuda.jit(**JIT_NT)
def bin_hist(N, k, ch, upb, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, ws, keys):
    r = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    stamp(14)
    hist = cuda.shared.array(GB1, int32)
    red = cuda.shared.array(RED_N, int64)
    bs = cuda.shared.array(NT, float32)
    bm = cuda.shared.array(NT, float32)
    bl = cuda.shared.array(NT, float32)
    bf = cuda.shared.array(NT, int32)
    bc = cuda.shared.array(NT, int32)
    gs = gshift(logp)
    nbins = bins_of(gs)
    i = tid
    while i <= nbins:  # 32-bit loops (a range() sets up a 64-bit trip count: 100 instructions)
        hist[i] = 0
        i = int32(i + NT)
    start = cuda.blockIdx.x * ch
    end = min(N, start + ch)
    b0 = div_f(start, FM)
    nb = div_f(end - 1, FM) - b0 + 1
    load_beams(r, b0, nb, B, scores, nodes, ptr, lse, sh, bs, bm, bl, bf, bc)
    ref = best_bound(scores, lse, sh, r, B, red)  # its barriers publish the hist and beams
    if cuda.blockIdx.x == 0 and tid == 0:  # bin_select's (every block's ref is the same)
        ws[r, REF] = okey(ref)
    stamp(1)
    if upb:  # beam units (sh a constant at each call: its conversion folded, 0.0282 against
        # 0.0287 ms with sh a variable at step 2 at beams of 1,024 on the H200, session 47)
        if sh == 16:
            score_units(r, nb, upb, F, b0, B, logp, 16, codes, off, bs, bm, bl, bf, bc, keys,
                        hist, ref, gs)
        else:
            score_units(r, nb, upb, F, b0, B, logp, 0, codes, off, bs, bm, bl, bf, bc, keys,
                        hist, ref, gs)
    else:
        n_end = uint32(end)
        for base in range(start, end, 8 * NT):  # eight candidates' loads in flight a thread
            i0 = uint32(base + tid)  # 32-bit candidate indices (64-bit: 3 instructions more)
            x0, x1, x2, x3, x4, x5, x6, x7 = score8(r, i0, n_end, F, FM, b0, B, logp, sh,
                                                    codes, off, bs, bm, bl, bf, bc)
            keep(keys, hist, r, i0, n_end, x0, ref, gs)
            keep(keys, hist, r, uint32(i0 + NT), n_end, x1, ref, gs)
            keep(keys, hist, r, uint32(i0 + 2 * NT), n_end, x2, ref, gs)
            keep(keys, hist, r, uint32(i0 + 3 * NT), n_end, x3, ref, gs)
            keep(keys, hist, r, uint32(i0 + 4 * NT), n_end, x4, ref, gs)
            keep(keys, hist, r, uint32(i0 + 5 * NT), n_end, x5, ref, gs)
            keep(keys, hist, r, uint32(i0 + 6 * NT), n_end, x6, ref, gs)
            keep(keys, hist, r, uint32(i0 + 7 * NT), n_end, x7, ref, gs)
    cuda.syncthreads()
    stamp(2)
    # every non-empty bin (adding only those from the block's own k-th up, exact too, measured
    # no faster on the H200, session 27)
    i = tid
    while i < nbins:
        if hist[i]:
            cuda.atomic.add(ws, (r, HG + i), int64(hist[i]))
        i = int32(i + NT)
    stamp(15)


@cuda.jit(device=True, **INLINE)
def okey_from(g, ref, gs):
    """The least okey whose score's bin (``gbin`` at shift ``gs``) is ``g`` or above
    (``OKEY_TOP`` for none), over the okeys of real scores, ``-inf`` to ``+inf``, where ``gbin``
    of the score is monotone. On the GPU one warp calls it: a round over the 32 okeys around the
    answer's estimate, else rounds whose lanes test 32 points spread over the range left (seven
    for 2**32 okeys); the simulator bisects, every thread alike."""
    lo = KEY_NEG_INF
    hi = OKEY_TOP  # the answer is in [lo, hi]; hi itself is never tested
    if SIMULATED:
        while lo < hi:
            mid = (lo + hi) >> 1
            if gbin(okey_float(mid), ref, gs) >= g:
                hi = mid
            else:
                lo = mid + 1
        return lo
    lane = cuda.threadIdx.x & 31
    if g < bins_of(gs):  # first the 32 okeys around ref + the least difference of bin g: the
        # answer is the least x with x - ref at or past that difference, within an ulp of their
        # sum (a round where the search takes seven); past the window, the search
        u = okey(ref + okey_float(int64(g) << gs))
        p = min(max(u + (lane - 16), KEY_NEG_INF), OKEY_TOP - 1)
        m = cuda.ballot_sync(FULL, gbin(okey_float(p), ref, gs) >= g)
        if m != 0 and (m & 1) == 0:
            return cuda.shfl_sync(FULL, p, cuda.ffs(m) - 1)
    while lo < hi:  # warp-uniform: every lane holds the same lo, hi
        p = lo + (((hi - lo) * lane) >> 5)  # p of lane 0 is lo; every p below hi
        m = cuda.ballot_sync(FULL, gbin(okey_float(p), ref, gs) >= g)  # monotone in the lane
        q = cuda.shfl_sync(FULL, p, max(cuda.ffs(m) - 2, 0))  # the last point below it
        if m == 0:
            lo = cuda.shfl_sync(FULL, p, 31) + 1
        elif (m & 1) != 0:
            hi = lo
        else:
            hi = cuda.shfl_sync(FULL, p, cuda.ffs(m) - 1)
            lo = q + 1
    return lo


@cuda.jit(device=True, **INLINE)
def bounds(ws, r, k, scan, res, bnd, gs):
    """(the okey from which a key's bin reaches D, the okey from which it passes D or, where
    D is wanted whole, reaches it; how many of D's keys are wanted): ``pick`` over the
    request's histogram where bin_hist left it in ``ws`` (read in place: 4 bins a thread, the
    one thread where the ``k``-th falls reading its own again from its L1 cache), then a search
    a warp, the two at once (``bnd``: 2 shared int64). Every thread calls it."""
    ref = okey_float(ws[r, REF])
    d, need, n = pick(ws[r, HG:], bins_of(gs), k, scan, res, NT)
    if SIMULATED:  # a block of one warp there
        if cuda.threadIdx.x == 0:
            bnd[0] = okey_from(d, ref, gs)
            bnd[1] = okey_from(d + (0 if need == n else 1), ref, gs)
    elif cuda.threadIdx.x < 64:
        t = okey_from(d + (1 if cuda.threadIdx.x >= 32 and need != n else 0), ref, gs)
        if (cuda.threadIdx.x & 31) == 0:
            bnd[cuda.threadIdx.x >> 5] = t
    cuda.syncthreads()
    return bnd[0], bnd[1], need


@cuda.jit(device=True, **INLINE)
def _route(sure, buf, ws, r, kx, c, end, t_d, t_s):
    """Candidate c's key (okey ``kx``; none at or past ``end``) to ``sure`` (at or above
    ``t_s``: its bin above D, or D where D is wanted whole) or ``buf`` (from ``t_d`` up: in
    D); every lane calls it, and a warp none of whose keys reach D skips the appends. One
    atomic a warp reserves its slots in both lists (``CNT`` packs their counts)."""
    take = c < end and kx >= t_d
    if not SIMULATED:
        if not cuda.any_sync(FULL, take):  # most warps: about k of the N keys reach D
            return
    s = take and kx >= t_s
    v = (kx << 31) | (MAXC - int64(c))
    if SIMULATED:
        if take:
            at = cuda.atomic.add(ws, (r, CNT), ONE_SURE if s else int64(1))
            if s:
                sure[r, (at >> SURE_SH) & SURE_M] = v
            else:
                buf[r, at & LOW32] = v
        return
    ms = cuda.ballot_sync(FULL, s)
    mb = cuda.ballot_sync(FULL, take and not s)
    lane = cuda.threadIdx.x & 31
    at = int64(0)
    if lane == 0:
        at = cuda.atomic.add(ws, (r, CNT), (int64(cuda.popc(ms)) << SURE_SH)
                             | int64(cuda.popc(mb)))
    at = cuda.shfl_sync(FULL, at, 0)
    below = lane_mask_lt(lane)
    if s:
        sure[r, ((at >> SURE_SH) & SURE_M) + cuda.popc(int64(ms) & below)] = v
    elif take:
        buf[r, (at & LOW32) + cuda.popc(int64(mb) & below)] = v


@cached
@cuda.jit(**JIT_NT)
def bin_select(N, k, KP, ch, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, ws, keys,
               sure, buf, cap, top, parent, child, code):
    r = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    srt = cuda.shared.array(SRT_N, int64)
    seg = cuda.shared.array(SRT_N, int64)
    hist = cuda.shared.array(NB, int32)
    scan = cuda.shared.array(SCAN_N, int32)
    res = cuda.shared.array(4, int32)
    red = cuda.shared.array(RED_N, int64)
    bnd = cuda.shared.array(2, int64)
    flag = cuda.shared.array(1, int32)
    cnt = cuda.shared.array(2, int32)  # counts (a shared int32 atomic: no CAS loop)
    stamp(14, 1)
    # (loading the first two rounds' keys before the pick, which does not need them, measured
    # slower on the H200: the pick's loads queued behind them, 1.96 -> 3.15 us; session 47)
    gs = gshift(logp)
    t_d, t_s, need = bounds(ws, r, k, scan, res, bnd, gs)
    stamp(5, 1)
    start = cuda.blockIdx.x * ch
    end = min(N, start + ch)
    e = uint32(end - 1)
    n_end = uint32(end)
    for base in range(start, end, 8 * NT):  # the keys bin_hist wrote, eight loads in flight
        i0 = uint32(base + tid)
        k0 = int64(keys[ix(r), ix(min(i0, e))]) & LOW32
        k1 = int64(keys[ix(r), ix(min(uint32(i0 + 1 * NT), e))]) & LOW32
        k2 = int64(keys[ix(r), ix(min(uint32(i0 + 2 * NT), e))]) & LOW32
        k3 = int64(keys[ix(r), ix(min(uint32(i0 + 3 * NT), e))]) & LOW32
        k4 = int64(keys[ix(r), ix(min(uint32(i0 + 4 * NT), e))]) & LOW32
        k5 = int64(keys[ix(r), ix(min(uint32(i0 + 5 * NT), e))]) & LOW32
        k6 = int64(keys[ix(r), ix(min(uint32(i0 + 6 * NT), e))]) & LOW32
        k7 = int64(keys[ix(r), ix(min(uint32(i0 + 7 * NT), e))]) & LOW32
        _route(sure, buf, ws, r, k0, i0, n_end, t_d, t_s)
        _route(sure, buf, ws, r, k1, uint32(i0 + 1 * NT), n_end, t_d, t_s)
        _route(sure, buf, ws, r, k2, uint32(i0 + 2 * NT), n_end, t_d, t_s)
        _route(sure, buf, ws, r, k3, uint32(i0 + 3 * NT), n_end, t_d, t_s)
        _route(sure, buf, ws, r, k4, uint32(i0 + 4 * NT), n_end, t_d, t_s)
        _route(sure, buf, ws, r, k5, uint32(i0 + 5 * NT), n_end, t_d, t_s)
        _route(sure, buf, ws, r, k6, uint32(i0 + 6 * NT), n_end, t_d, t_s)
        _route(sure, buf, ws, r, k7, uint32(i0 + 7 * NT), n_end, t_d, t_s)
    stamp(7, 1)
    cuda.threadfence()  # the block's appends before its election
    cuda.syncthreads()
    if tid == 0:  # the election's atomic returns the lists' final counts (every other block's
        # appends came before its own election)
        at = cuda.atomic.add(ws, (r, CNT), ONE_DONE)
        flag[0] = (at >> DONE_SH) == cuda.gridDim.x - 1
        cnt[0] = int32((at >> SURE_SH) & SURE_M)
        cnt[1] = int32(at & LOW32)
    cuda.syncthreads()
    if not flag[0]:
        stamp(15, 1)
        return
    cuda.threadfence()
    # left zero for the next launch (counters.zeroed): every block read them before it voted
    if tid == 0:
        ws[r, CNT] = 0
        ws[r, REF] = 0
    zero_bins(ws, r, HG, gs)
    n_sure = cnt[0]
    n_buf = cnt[1]
    total = n_sure + n_buf
    if total <= SRT_N:
        for i in range(tid, total, NT):
            srt[i] = sure[r, i] if i < n_sure else buf[r, i - n_sure]
        cuda.syncthreads()
    else:  # many tied in D: the rest of the k from buf (appended at cnt[0], which holds n_sure)
        for i in range(tid, n_sure, NT):
            srt[i] = sure[r, i]
        radix_rest(buf, r, n_buf, need, hist, scan, res, red, srt, cnt)
        total = k
    stamp(8, 1)
    v0, v1, has0, has1 = held(srt, total)
    j0, j1, s0, n0, s1, n1 = first_level(v0, v1, has0, has1, r, F, FM, scores, nodes)
    if not rank_answer(srt, seg, hist, scan, res, red, total, k, KP, r, F, FM, scores, nodes,
                       ptr, codes, cap, top, parent, child, code, 1, int64(-1), int64(-1), v0, v1,
                       has0, has1, j0, j1, s0, n0, s1, n1):
        for i in range(tid, k, NT):  # sorted where ties crowd a bin: answers from the keys
            put_abs(srt[i], i, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap,
                    top, parent, child, code, int64(-1))
    stamp(15, 1)


def chunk(N: int, R: int, sms: int, F: int, B: int, upb: int) -> int:
    """Candidates a block scores: as many as leave one wave of blocks (1,024 threads each, one
    an SM) where the requests fill the GPU (fewer blocks in a second wave measured slower: the
    wave's latency, not its bytes, bounds them; session 19), in whole steps of ``4 NT``, and
    at most a span of ``NT`` beams (``load_beams`` holds one a thread); with beam units
    (``upb`` a beam), whole beams, at most ``NT``."""
    per = max(1, sms // max(R, 1))  # blocks a request
    if upb:
        return min(-(-B // per), NT) * F
    step = 4 * NT
    n = -(-N // per)  # a block's share, rounded up to whole steps
    return min(max(step, -(-n // step) * step), (NT - 2) * F + 1)


def run(launch, R, N, k, KP, F, FM, B, sc, nd, lp, trie, outs, dev, arr):
    """The two launches (``launch(fn, grid, threads)``) for R requests of N candidates, on a
    workspace of counters (``zeroed``: a graph's own, which the last blocks leave zero, or a
    fill) and an [R, N] int32 buffer of the candidates' okeys (written whole by ``bin_hist``:
    in the L2 cache when ``bin_select`` reads it)."""
    upb = units_of(F, UNITS)
    sms = SMS_SIM if SIMULATED else sm_count(dev)
    bpb = kept.plan(R, B, sms, upb)
    if bpb is not None:  # one launch
        kept.run(launch, R, N, k, KP, upb, F, FM, B, sc, nd, lp, trie, outs, dev, arr, bpb)
        return
    ch = chunk(N, R, sms, F, B, upb)
    g = -(-N // ch)
    ws = zeroed((R, W_LEN), dev)
    sure = torch.empty(R, k, dtype=torch.int64, device=dev)
    buf = torch.empty(R, N, dtype=torch.int64, device=dev)
    keys = arr(torch.empty(R, N, dtype=torch.int32, device=dev))
    w = arr(ws)
    launch(bin_hist, (g, R), NT)(N, k, ch, upb, F, FM, B, sc, nd, *lp, *trie, w, keys)
    launch(bin_select, (g, R), NT)(N, k, KP, ch, F, FM, B, sc, nd, *lp, *trie, w, keys,
                                   arr(sure), arr(buf), *outs)


@functools.lru_cache(maxsize=None)
def sm_count(dev) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count
