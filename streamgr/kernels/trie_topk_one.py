"""One-launch selection of ``trie_topk`` for requests of at most ``ONE_MAX`` candidates (gen-ref's
steps 1 and 3: 8,192 and 768 at beams of 256, 3,072 at beams of 1,024): one block of ``NT``
threads per request computes its candidates' okeys into shared memory (four candidates a thread
at a time, so their load chains overlap), takes the block's smallest real and largest okey,
then (for ``k`` up to half the block) counts them by ``obin``, the distance of their score below
the best one, 8 bins an octave: where the bins from the ``k``-th up hold at most a block of
keys (one histogram round; the usual case), it places each of those keys in its bin's segment
of a list laid out best bin first and ranks it by counting the keys of its bin above it, so
that the thread holding rank ``i < k`` answers it (no sort; where a bin holds over ``SEG_MAX``
keys it sorts the list whole instead). Otherwise (ties, or ``k`` over half the block) it
radix-selects the ``k`` best keys (``trie_topk_dev.radix``: digits from the range's top bit,
usually two or three rounds), sorts and decodes them. No global scratch, no memset: the whole
step is one node of the decode plan's graph.
"""

from __future__ import annotations

import os

from numba import cuda, int32, int64

from .numba_common import STAMP, stamp
from .trie_topk import SIMULATED
from .trie_topk_dev import (BIG, DIG, JIT_NT, NB, NT, RED_N, SCAN_N, append, bit_length, collect,
                            hist_add, minmax, pick, pick_segments, radix, rank_put, SEG_MAX,
                            sort_desc, sort_span)
from .trie_topk_keys import KEY_NEG_INF, LOW32, MAXC, decode, note_all, okey_float, tkey
from .trie_topk_sample import (ONE_MAX, SAMPLE, SAMPLE_MIN, count_above, hold, obin, obin_hist,
                               sample_floor, select_list, write_above)

BINS = os.environ.get("STREAMGR_TOPK_BINS", "1") == "1"  # 0: radix rounds only (A/B runs)
# The bins' keys ranked within their bins (each key counts the keys of its bin above it) where no
# bin from the k-th's up holds more than SEG_MAX; else sorted whole (a bitonic network: 35% of
# the kernel's instructions at step 1). On the H200 (session 27) step 3 takes 0.0102 ms ranked
# against 0.0147 sorted; step 1 (issue-bound) the same. STREAMGR_TOPK_SEG=0: always sorted (A/B).
SEG = os.environ.get("STREAMGR_TOPK_SEG", "1") == "1"


@cuda.jit(**JIT_NT)
def one_select(N, k, KP, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top, parent,
               child, code):
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    kx = cuda.shared.array(ONE_MAX, int32)
    hist = cuda.shared.array(NT, int32)
    srt = cuda.shared.array(NT, int64)
    scan = cuda.shared.array(SCAN_N, int32)
    res = cuda.shared.array(4, int32)
    red = cuda.shared.array(RED_N, int64)
    ctr = cuda.shared.array(1, int32)
    stamp(14)
    if tid == 0:
        ctr[0] = 0
    lo, hi = note_all(kx, 0, N, NT, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
    stamp(1)
    lo, hi = minmax(lo, hi, red)  # its barriers also publish kx
    stamp(2)
    tmin = lo if lo != BIG else KEY_NEG_INF
    # a round of bins below the best score (block-uniform; for k over half the block the bins
    # rarely fit a block, and ranking such lists in kx's free tail measured slower on the H200:
    # step 3 at beams of 1,024 0.0321 against 0.0292 ms, session 28)
    if BINS and 2 * k <= NT and hi > KEY_NEG_INF:
        ref = okey_float(hi)
        if SAMPLE and N > SAMPLE_MIN:  # the keys at or above a sampled floor, if they fit
            t = sample_floor(kx, N, k, ref, hist, scan, res, red)
            stamp(6)
            at, U = count_above(kx, N, t, scan, res)
            stamp(7)
            if k <= U and U <= NT:  # block-uniform
                write_above(kx, N, 0, t, srt, at)
                cuda.syncthreads()
                if tid < U:
                    hold(kx, tid, srt[tid])
                cuda.syncthreads()
                stamp(8)
                select_list(kx, U, ref, k, KP, hist, srt, scan, res, ctr, r, F, FM, B, scores,
                            nodes, logp, lse, sh, ptr, codes, off, cap, top, parent, child, code)
                if STAMP:
                    cuda.syncthreads()
                    stamp(15)
                return  # a list of at most a block always answers
        obin_hist(hist, kx, N, ref)
        stamp(3)
        big = int32(1)
        if SEG:  # hist becomes the bins' segment starts
            d, need, n, big = pick_segments(hist, NB, k, SEG_MAX, scan, res)
        else:
            d, need, n = pick(hist, NB, k, scan, res, NT)
        stamp(4)
        total = k - need + n
        if big == 0 and total <= NT:  # each key of the bins from d up into its bin's segment
            for base in range(0, N, NT):
                i = min(base + tid, N - 1)
                b = obin(kx[i], ref)
                if base + tid < N and b >= d:
                    srt[cuda.atomic.add(hist, b, 1)] = tkey(int64(kx[i]) & LOW32, int64(i), tmin)
            cuda.syncthreads()  # hist[b]: bin b's segment end, the next lower bin's start
            stamp(5)
            for j in range(tid, total, NT):  # each ranked in its bin: its answer's rank, no sort
                v = srt[j]
                rank_put(srt, v, obin(kx[MAXC - (v & MAXC)], ref), hist, NB, k, r, F, FM, B,
                         scores, nodes, logp, lse, sh, ptr, codes, off, cap, top, parent, child,
                         code)
            if STAMP:
                cuda.syncthreads()
                stamp(15)
            return
        if total <= NT:  # every key of the bins from d up fits: sort them all
            srt[tid] = 0
            cuda.syncthreads()
            for base in range(0, N, NT):
                i = min(base + tid, N - 1)
                u = int64(kx[i]) & LOW32
                take = base + tid < N and obin(kx[i], ref) >= d
                append(srt, ctr, 0, tkey(u, int64(i), tmin), take)
            cuda.syncthreads()
            stamp(6)
            sort_desc(srt, sort_span(total, KP))
            stamp(7)
            decode(srt, k, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top,
                   parent, child, code)
            if STAMP:
                cuda.syncthreads()
                stamp(15)
            return
    top_bit = 31 + bit_length(max(hi - tmin + 1, int64(1)))  # keys < 2**top_bit
    shift = top_bit - DIG if top_bit > DIG else 0
    # every thread works the rounds: with 256 the kernel ran slower on the H200 (latency-bound)
    prefix, shift = radix(kx, srt, 0, N, tmin, k, int64(0), int64(63), shift, hist, scan, res,
                          NT)
    collect(kx, srt, 0, N, tmin, prefix, int64(63), shift, srt, ctr)
    for i in range(k + tid, KP, NT):
        srt[i] = 0
    cuda.syncthreads()
    sort_desc(srt, KP)
    decode(srt, k, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top, parent,
           child, code)
