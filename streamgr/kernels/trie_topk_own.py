"""One-launch selection of ``trie_topk`` for requests of at most a block of candidates (gen-ref's
step 3: 768 at beams of 256): one block of ``NT`` threads per request, one candidate a thread,
and each thread answers for its own candidate.

A thread computes its candidate's score, child and code (``cand``) and keeps them in registers.
The block's best okey comes from a warp min and one shared atomic (one barrier, instead of
``minmax``'s three), then one round of score bins below it (``obin``, the bins of
``trie_topk_sample``) and ``pick_segments``. A thread whose key is in the bins from the
``k``-th's up places its key in its bin's segment and counts the keys of its bin above it: its
rank. Where a bin is crowded (ties, or every candidate ``-inf``) the bins' keys are sorted whole
instead and each rank below ``k`` is handed to its candidate's thread through shared memory.
Every key is distinct and the bins are monotone in the score, so the ranks are the stable
order's, exactly. A rank below ``k`` writes its answer from the registers: no second read of
the beams, the trie or the log-probabilities (``trie_topk_one`` answers from the key, reading
the beam, its child range and the code again: three dependent load levels). ``N <= NT``
always fits a sort of a block, so no radix fallback is needed.

By default (``MODE`` 2) the selected keys are ranked by the threads of their slots in the bins'
layout instead (``slot_rank``: whole warps of ranks, as ``select_list`` does), and each answer
is read from the candidates' (score, child, code) held in shared memory: on the H200 step 3
took 0.0059 -> 0.0045 ms so (session 34). ``STREAMGR_TOPK_OWN=1``: each thread ranks its own
key and answers from its registers; ``=0``: these requests on ``trie_topk_one`` (A/B runs).
"""

from __future__ import annotations

import os

from numba import cuda, float32, int32, int64

from .kernel_cache import cached
from .numba_common import STAMP, stamp
from .trie_topk_bitonic import sort_desc, sort_span
from .trie_topk_dev import (I32MAX, JIT_NT, NB, NT, SCAN_N, SEG_MAX, append, bin_rank,
                            pick_segments, hist_add)
from .trie_topk_keys import MAXC, NEG_INF, cand, div_f, okey, okey_float
from .trie_topk_sample import best_okey, or_max, rev_okey, slot_rank, ubin

# STREAMGR_TOPK_OWN: 2 (the default) the keys ranked by the threads of their slots in the bins'
# layout, as trie_topk_sample's select_list does, each answer read from the candidates' (score,
# child, code) held in shared memory; 1 each thread ranks its own key and answers for it (the
# owners of the selected keys are scattered over the block's warps: step 3's placement and
# ranks took 1.52 us against select_list's 0.62 + ranks within 1.08, H200 session 33; step 3
# 0.0060 ms against 2's 0.0045, session 34); 0 these requests on trie_topk_one (A/B runs).
MODE = os.environ.get("STREAMGR_TOPK_OWN", "2")
OWN, COMPACT = MODE != "0", MODE == "2"
HELD_N = NT if COMPACT else 1  # the candidates' answers in shared memory (a literal shape)
RANK_N = 1 if COMPACT else NT  # the sorted ranks handed to their candidates' threads (mode 1)


@cached
@cuda.jit(**JIT_NT)
def own_select(N, k, KP, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top,
               parent, child, code):
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    hist = cuda.shared.array(NT, int32)
    srt = cuda.shared.array(NT, int64)
    rk = cuda.shared.array(RANK_N, int32)
    scan = cuda.shared.array(SCAN_N, int32)
    res = cuda.shared.array(4, int32)
    ctr = cuda.shared.array(1, int32)
    hv = cuda.shared.array(HELD_N, float32)
    hc = cuda.shared.array(HELD_N, int32)
    hd = cuda.shared.array(HELD_N, int32)
    stamp(14)
    capr = cap[r]  # with the scoring's loads, not alone at the answers (no change seen, s35)
    mine = tid < N
    c = int64(min(tid, N - 1))
    val, ch, cd = cand(r, c, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
    if COMPACT:  # published by the barriers below
        hv[tid] = val
        hc[tid] = int32(ch)
        hd[tid] = int32(cd)
    u = okey(val)
    v = (u << 31) | (MAXC - c)  # the candidate's key (trie_topk_keys)
    hist[tid] = 0
    if not COMPACT:
        rk[tid] = int32(k)  # no rank (the sorted way writes those below k)
    if tid == 0:
        res[3] = I32MAX
        ctr[0] = 0
    cuda.syncthreads()
    hi = best_okey(or_max(mine, rev_okey(u)), res)
    stamp(1)
    ref = okey_float(hi)
    b = ubin(u, ref)
    hist_add(hist, b, mine)
    cuda.syncthreads()
    d, need, nd, big = pick_segments(hist, NB, k, SEG_MAX, scan, res)
    stamp(9)
    take = mine and b >= d
    total = k - need + nd  # <= N <= NT
    if big == 0:  # the keys of the bins from d up laid out by bin
        if take:
            srt[cuda.atomic.add(hist, b, 1)] = v
    else:  # a crowded bin: those keys appended, to be sorted whole
        srt[tid] = 0
        cuda.syncthreads()
        append(srt, ctr, 0, v, take)
    if COMPACT:  # thread t ranks the key of slot t, as select_list does
        w, rank = slot_rank(srt, hist, ref, k, KP, total, big)
        c = MAXC - (w & MAXC)  # read where rank < k
    else:
        rank = int64(k)
        cuda.syncthreads()
        if big == 0:  # each thread ranks its own key in its bin
            if take:
                rank = bin_rank(srt, v, b, hist, NB)
        else:  # the sorted ranks below k handed to their candidates' threads
            sort_desc(srt, sort_span(total, KP))
            if tid < k:
                rk[MAXC - (srt[tid] & MAXC)] = int32(tid)
            cuda.syncthreads()
            rank = int64(rk[tid]) if mine else int64(k)
    stamp(12)
    if COMPACT and rank < k:  # candidate c's answer, held by its thread
        val = hv[c]
        ch = int64(hc[c])
        cd = int64(hd[c])
    if rank < k:
        top[r, rank] = val if rank < capr else NEG_INF
        parent[r, rank] = div_f(c, FM)
        child[r, rank] = ch
        code[r, rank] = cd
    if STAMP:
        cuda.syncthreads()
        stamp(15)
