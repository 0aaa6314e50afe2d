"""Binned grid selection of ``trie_topk`` for requests of more than ``ONE_MAX`` candidates
(gen-ref's step 2: 45,312 at beams of 256, 181,248 at 1,024; one request's flat 2,097,152):
one histogram round instead of a range pass and two radix digits, and no key buffer. Two
launches on a workspace of counters that their last blocks leave zero (``counters.zeroed``):

1. ``bin_hist``: every block (``chunk`` candidates, one wave of 1,024-thread blocks over the GPU)
   scores its candidates and adds each to the bin of ``x - ref`` (``gbin``: the top ``GBITS`` of
   that difference's order-preserving bits, so bins are finest near the request's best beam
   score ``ref``, where the ``k``-th best lies, and every score has one); the request's last
   block to finish picks the bin ``D`` holding the ``k``-th best candidate.
2. ``bin_select``: every block scores again the candidates of its groups of 32 whose highest
   bin (``gm``, recorded by ``bin_hist``) reaches ``D`` (the keys are never written) and appends
   the keys of bins above ``D`` to ``sure`` (fewer than ``k``) and those in ``D`` to ``buf``;
   the request's last block selects: if ``sure`` and ``buf`` fit a block it sorts them all
   (the usual case: ``D`` holds tens to hundreds; ranking each key within its bin, as
   ``trie_topk_one`` does, measured slower here: session 28), else it radix-selects the rest of
   the ``k`` from ``buf`` by the keys' bits below those they share (ties; exact either way),
   sorts the ``k`` and decodes them.

The binning is a monotone function of the score (``x - ref`` rounds monotonically), so every key
of a bin above ``D`` beats every key in ``D``: the answer is the stable order's, exactly, with
no assumption about the scores' range. ``ref`` is only where the bins are finest.
"""

from __future__ import annotations

import functools

import torch
from numba import cuda, float32, int32, int64

from .counters import zeroed
from .kernel_cache import cached
from .numba_common import INLINE
from .trie_topk import SIMULATED
from .trie_topk_dev import (BIG, DIG, FULL, JIT_NT, NB, NT, NW, RED_N, SCAN_N, append,
                            bit_length, collect, hist_add, minmax, pick, radix, sort_desc,
                            sort_span)
from .trie_topk_keys import (KEY_NEG_INF, LOW32, MAXC, _bits, _float, cand, decode, okey,
                             okey_float)

GBITS = 8 if SIMULATED else 12  # bins of bin_hist: 16 KiB of shared counters on the GPU
GB = 1 << GBITS
GSHIFT = 32 - GBITS
# ws columns: counters and the pick, then the request's histogram
DONE1, DONE2, NSURE, NBUF, D, NEED, ND, REF = range(8)
HG = 8
W_LEN = HG + GB
MAXK = int64(0x7FFFFFFFFFFFFFFF)
SMS_SIM = 4  # the simulator's "SMs" (blocks a wave)
VOTE_N = 32 if SIMULATED else 1  # ballot's scratch (the simulator's only)


@cuda.jit(device=True, **INLINE)
def last_block(ws, r, col, flag):
    """True in the request's last block to get here (after its global adds are fenced)."""
    cuda.threadfence()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        flag[0] = cuda.atomic.add(ws, (r, col), 1) == cuda.gridDim.x - 1
    cuda.syncthreads()
    return flag[0]


@cuda.jit(device=True, **INLINE)
def best_beam(scores, r, B, red):
    """The request's best beam score (0 where every beam is dead): the bins' reference."""
    hi = int64(-1)
    for b in range(cuda.threadIdx.x, B, cuda.blockDim.x):
        hi = max(hi, okey(scores[r, b]))
    _, hi = minmax(BIG, hi, red)
    return okey_float(hi) if hi > KEY_NEG_INF else float32(0.0)


@cuda.jit(device=True, **INLINE)
def gbin(x, ref):
    """The bin of score ``x`` (higher bins hold higher scores)."""
    return int32(okey(x - ref) >> GSHIFT)


@cuda.jit(device=True, **INLINE)
def score(r, i, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off):
    v, _, _ = cand(r, min(i, N - 1), F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
    return v


@cuda.jit(device=True, **INLINE)
def _count(hist, gm, r, i, end, g):
    """Candidate i's bin ``g`` into the block's histogram, and the highest bin of its group of
    32 (a warp's lanes: i's low five bits) into ``gm``; every lane calls it."""
    ok = i < end
    hist_add(hist, g, ok)
    v = g if ok else int32(-1)
    if SIMULATED:  # no shuffles: gm starts at -1
        if ok:
            cuda.atomic.max(gm, (r, i >> 5), v)
        return
    for o in (16, 8, 4, 2, 1):
        v = max(v, cuda.shfl_xor_sync(FULL, v, o))
    if (cuda.threadIdx.x & 31) == 0 and (i & ~31) < end:
        gm[r, i >> 5] = v


@cached
@cuda.jit(**JIT_NT)
def bin_hist(N, k, ch, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, ws, gm):
    r = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    hist = cuda.shared.array(GB, int32)
    scan = cuda.shared.array(SCAN_N, int32)
    res = cuda.shared.array(3, int32)
    red = cuda.shared.array(RED_N, int64)
    flag = cuda.shared.array(1, int32)
    for i in range(tid, GB, NT):
        hist[i] = 0
    ref = best_beam(scores, r, B, red)  # its barriers also publish the zeroed hist
    start = cuda.blockIdx.x * ch
    end = min(N, start + ch)
    for base in range(start, end, 4 * NT):  # four load chains in flight before the adds
        i0 = base + tid
        x0 = score(r, i0, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
        x1 = score(r, i0 + NT, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
        x2 = score(r, i0 + 2 * NT, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
        x3 = score(r, i0 + 3 * NT, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
        _count(hist, gm, r, i0, end, gbin(x0, ref))
        _count(hist, gm, r, i0 + NT, end, gbin(x1, ref))
        _count(hist, gm, r, i0 + 2 * NT, end, gbin(x2, ref))
        _count(hist, gm, r, i0 + 3 * NT, end, gbin(x3, ref))
    cuda.syncthreads()
    # every non-empty bin (adding only those from the block's own k-th up, exact too, measured
    # no faster on the H200, session 27)
    for i in range(tid, GB, NT):
        if hist[i]:
            cuda.atomic.add(ws, (r, HG + i), int64(hist[i]))
    if not last_block(ws, r, DONE1, flag):
        return
    cuda.threadfence()
    # atomically: not from a stale cache line; each read leaves its counter zero, as every
    # block has added to it (counters.zeroed: a graph needs no memset node)
    for i in range(tid, GB, NT):
        hist[i] = int32(cuda.atomic.exch(ws, (r, HG + i), int64(0)))
    if tid == 0:
        ws[r, DONE1] = 0
    cuda.syncthreads()
    d, need, n = pick(hist, GB, k, scan, res, NT)
    if tid == 0:
        ws[r, D] = d
        ws[r, NEED] = need
        ws[r, ND] = n
        ws[r, REF] = _bits(ref)  # bin_select bins by the same reference, bit for bit


@cuda.jit(device=True, **INLINE)
def ballot(pred, vote):
    """The warp's lanes whose ``pred`` holds, as bits; every lane calls it. The simulator has no
    ballot: there a block is one warp, and ``vote`` (shared) gathers the lanes' votes."""
    if SIMULATED:
        lane = cuda.threadIdx.x & 31
        vote[lane] = 1 if pred else 0
        cuda.syncthreads()
        m = int64(0)
        for j in range(32):
            if vote[j]:
                m |= int64(1) << j
        cuda.syncthreads()
        return m
    return int64(cuda.ballot_sync(FULL, pred)) & LOW32


@cuda.jit(device=True, **INLINE)
def _route(sure, buf, ws, r, x, c, ok, ref, d, all_in):
    """Candidate c's key to ``sure`` (its bin above D) or ``buf`` (in D); every lane calls it."""
    g = gbin(x, ref)
    v = (okey(x) << 31) | (MAXC - c)
    append(sure[r], ws[r], NSURE, v, ok and (g > d or (g == d and all_in)))
    append(buf[r], ws[r], NBUF, v, ok and g == d and not all_in)


@cached
@cuda.jit(**JIT_NT)
def bin_select(N, k, KP, ch, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, ws, gm,
               sure, buf, cap, top, parent, child, code):
    r = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    srt = cuda.shared.array(NT, int64)
    hist = cuda.shared.array(NB, int32)
    scan = cuda.shared.array(SCAN_N, int32)
    res = cuda.shared.array(4, int32)
    red = cuda.shared.array(RED_N, int64)
    flag = cuda.shared.array(1, int32)
    cnt = cuda.shared.array(2, int32)  # counts (a shared int32 atomic: no CAS loop)
    vote = cuda.shared.array(VOTE_N, int32)
    ref = _float(int32(ws[r, REF]))
    d, need = ws[r, D], ws[r, NEED]
    all_in = need == ws[r, ND]
    start = cuda.blockIdx.x * ch
    end = min(N, start + ch)
    # each warp reads 32 of its groups' highest bins at once, then scores the groups reaching
    # D two at a time (their load chains in flight together)
    lane = tid & 31
    per = (ch >> 5) // NW  # groups a warp: the chunk's over the block's warps
    g0 = (start >> 5) + (tid >> 5) * per
    gend = (end + 31) >> 5
    for gg in range(g0, g0 + per, 32):
        gi = gg + lane
        m = ballot(gi < g0 + per and gi < gend and gm[r, gi] >= d, vote)
        while m != 0:  # warp-uniform
            low = m & -m
            m ^= low
            ia = (gg + cuda.popc(low - 1)) * 32 + lane
            two = m != 0
            low = m & -m
            m ^= low
            ib = (gg + cuda.popc(low - 1)) * 32 + lane if two else ia
            xa = score(r, ia, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
            xb = score(r, ib, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
            _route(sure, buf, ws, r, xa, int64(ia), ia < end, ref, d, all_in)
            _route(sure, buf, ws, r, xb, int64(ib), two and ib < end, ref, d, all_in)
    if not last_block(ws, r, DONE2, flag):
        return
    cuda.threadfence()
    if tid == 0:  # read and left zero for the next launch (counters.zeroed), as is the
        # pick, which every block of the request has read by now
        cnt[0] = cuda.atomic.exch(ws, (r, NSURE), int64(0))
        cnt[1] = cuda.atomic.exch(ws, (r, NBUF), int64(0))
        for j in (DONE2, D, NEED, ND, REF):
            ws[r, j] = 0
    cuda.syncthreads()
    n_sure = cnt[0]
    n_buf = cnt[1]
    total = n_sure + n_buf
    if total <= NT:  # sort them all (pad with 0, below every key)
        P = sort_span(total, KP)
        for i in range(tid, P, NT):
            srt[i] = sure[r, i] if i < n_sure else (buf[r, i - n_sure] if i < total else 0)
        cuda.syncthreads()
        sort_desc(srt, P)
    else:  # many tied in D: the rest of the k by the bits below those buf's keys share
        for i in range(tid, KP, NT):
            srt[i] = sure[r, i] if i < n_sure else 0
        lo = MAXK
        hi = int64(-1)
        for i in range(tid, n_buf, NT):
            v = buf[r, i]
            lo = min(lo, v)
            hi = max(hi, v)
        lo, hi = minmax(lo, hi, red)  # cnt[0], the collect's counter, holds n_sure
        fixed = bit_length(lo ^ hi)  # n_buf > need >= 1: keys differ
        prefix = (hi >> fixed) << fixed
        shift = fixed - DIG if fixed > DIG else 0
        p, s = radix(hist, buf[r], 1, n_buf, 0, need, prefix, fixed, shift, hist, scan, res, NT)
        collect(hist, buf[r], 1, n_buf, 0, p, fixed, s, srt, cnt)
        sort_desc(srt, KP)
    decode(srt, k, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top, parent,
           child, code)


def chunk(N: int, R: int, sms: int) -> int:
    """Candidates a block scores (a multiple of 4 NT): as many as leave one wave of blocks
    (1,024 threads each, one an SM) where the requests fill the GPU; fewer blocks in a second
    wave measured slower (the wave's latency, not its bytes, bounds them; session 19)."""
    per = max(1, sms // max(R, 1))  # blocks a request
    step = 4 * NT
    n = -(-N // per)  # a block's share, rounded up to whole steps
    return max(step, -(-n // step) * step)


def run(launch, R, N, k, KP, F, FM, B, sc, nd, lp, trie, outs, dev, arr):
    """The two launches (``launch(fn, grid, threads)``) for R requests of N candidates, on a
    workspace of counters (``zeroed``: a graph's own, which the last blocks leave zero, or a
    fill)."""
    ch = chunk(N, R, SMS_SIM if SIMULATED else sm_count(dev))
    g = -(-N // ch)
    ws = zeroed((R, W_LEN), dev)
    sure = torch.empty(R, k, dtype=torch.int64, device=dev)
    buf = torch.empty(R, N, dtype=torch.int64, device=dev)
    # each group of 32 candidates' highest bin (every group written by bin_hist)
    groups = (R, -(-N // 32))
    gm = torch.full(groups, -1, dtype=torch.int32, device=dev) if SIMULATED else \
        torch.empty(groups, dtype=torch.int32, device=dev)
    w, g_ = arr(ws), arr(gm)
    launch(bin_hist, (g, R), NT)(N, k, ch, F, FM, B, sc, nd, *lp, *trie, w, g_)
    launch(bin_select, (g, R), NT)(N, k, KP, ch, F, FM, B, sc, nd, *lp, *trie, w, g_, arr(sure),
                                   arr(buf), *outs)


@functools.lru_cache(maxsize=None)
def sm_count(dev) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count
