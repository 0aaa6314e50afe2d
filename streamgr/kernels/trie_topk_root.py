"""One-launch selection of ``trie_topk`` for requests of one beam (a search's first step: the
root's children; gen-ref's step 1, 8,192 candidates, ``k`` 256, or 1,024 at beams of 1,024) of
over a block and at most ``RN`` blocks of candidates: one block of ``NT`` threads per request,
``RN`` candidates a thread held in registers.

``trie_topk_one`` writes every okey to shared memory, samples a floor from them, lists the keys
above it, bins and ranks the list, and answers each key by reading its code again (``k`` up to
half a block; a larger ``k`` takes its radix rounds and a sort of the ``k``: step 1 at beams of
1,024 took 0.0351 ms there on the H200, 0.0120 here; at k 256 0.0118-0.0120 against
0.0099-0.0101, sessions 36-37). Here, as in ``trie_topk_quad``: the beam is read once and each
thread scores its ``RN`` candidates (eight codes in flight, then their eight
log-probabilities, every load unpredicated at an index in bounds, the selects after; 32-bit
indices into a 1-D view of the beam's row: step 1 0.0112-0.0114 -> 0.0099-0.0101 ms, session
37), keeps their okeys in registers and holds their codes in shared memory
(int32: the kernels index the log-probabilities by a 32-bit column); the block's best okey is a
warp min and one shared atomic. One key a thread, spread over the chunk, is a sample: its
``obin`` bins give the bin of the sample's scaled ``k``-th key with a margin (as
``sample_floor``'s), and the cutoff is the smallest sampled okey from that bin up. Only the
keys at or above the cutoff (about ``k`` x 7/4) are counted, in one round of ``NB`` linear bins
of their distance below the best (``lbin``: the range is already about the ``k`` best, so
neither ``obin``'s round nor a second is needed), picked, laid out by bin, ranked in their bins
by the threads of their slots, and answered from the key (score, candidate) and the held code:
no global read after the scoring. Where the sample ran high (fewer than ``k`` keys at or above
the cutoff; far below one in a thousand) or a bin is crowded (ties, every candidate ``-inf``)
the ``k`` best are radix-selected from the registers' keys and sorted whole: exact either way.
"""

from __future__ import annotations

import os

import numpy as np
from numba import cuda, float32, int32, int64, uint32, uint64

from .kernel_cache import cached
from .numba_common import INLINE, STAMP, stamp
from .trie_topk_dev import (DIG, I32MAX, JIT_NT, NB, NT, SCAN_N, SEG_MAX, bin_rank, hist_add,
                            pick, pick_segments)
from .trie_topk_keys import NEG_INF, beam_of, ix, key_c, logp_of, okey, okey_float
from .trie_topk_rank import sort_k
from .trie_topk_quad import KEY_TOP, LIST_N, key_of, lbin, place, radix_count, radix_take
from .trie_topk_sample import best_okey, least_okey, okey32, or_max, rev_okey, ubin

# STREAMGR_TOPK_ROOT=0: one-beam requests on trie_topk_one / trie_topk_quad (A/B runs)
ROOT = os.environ.get("STREAMGR_TOPK_ROOT", "1") == "1"
RN = 8  # candidates a thread (an unrolled loop over register arrays: constant indices only)
RMAX = RN * NT


def serves(B: int, N: int) -> bool:
    """This kernel takes a request of ``B`` beams and ``N`` candidates (host side)."""
    return ROOT and B == 1 and NT < N <= RMAX


@cuda.jit(device=True, **INLINE)
def pick_of(x, i, sel, v):
    """``v`` where ``i == sel``, else ``x``: a register array's element by a thread-dependent
    index without a local-memory load."""
    return v if i == sel else x


@cuda.jit(device=True, **INLINE)
def cbin(u, ref, scale):
    """The bin of okey ``u`` (at or above the cutoff): linear in its distance below the best
    ``ref`` (``lbin``), or the top bin where ``scale`` is 0 (every such key equal)."""
    return lbin(u, ref, scale) if scale > 0 else int32(NB - 1)


@cuda.jit(device=True, **INLINE)
def answer(v, rank, r, first, cnt, capr, held, top, parent, child, code):
    """The answer of rank ``rank`` from its key ``v`` (candidate c: the beam's child slot c) and
    the held code; ``capr`` the request's width."""
    c = key_c(v)
    rr, kk = ix(r), ix(rank)  # unsigned: no negative-index wraparound selects a store
    top[rr, kk] = okey_float(v >> 31) if rank < capr else NEG_INF
    parent[rr, kk] = 0
    child[rr, kk] = first + c if c < cnt else int64(0)
    code[rr, kk] = held[ix(c)]


@cached
@cuda.jit(**JIT_NT)
def root_select(N, k, KP, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top,
                parent, child, code):
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    hist = cuda.shared.array(NB, int32)
    lst = cuda.shared.array(LIST_N, int64)
    held = cuda.shared.array(RMAX, int32)
    scan = cuda.shared.array(SCAN_N, int32)
    res = cuda.shared.array(4, int32)
    ctr = cuda.shared.array(1, int32)
    u = cuda.local.array(RN, int64)
    bn = cuda.local.array(RN, int32)
    stamp(14)
    capr = cap[r]
    _, _, s, first, cnt = beam_of(r, 0, F, FM, scores, nodes, ptr)
    row = ix(r)  # r * B + 0
    m = lse[0, row]
    ls = lse[ix(sh >> 4), row]
    lrow = logp[row]  # the beam's log-probabilities as a 1-D view: its row offset taken once
    n32, c32, f32 = uint32(N), uint32(cnt), uint32(first)
    for i in range(RN):  # the codes' loads first, all in flight (as note_beam's round)
        j = uint32(tid) + uint32(i * NT)
        u[i] = codes[uint64(f32 + j if j < c32 else uint32(0))]
    # then their log-probabilities' loads, every one in flight: loaded in the loop that uses
    # them, ptxas issued each after the previous one's use (cuobjdump: eight load-use pairs)
    for i in range(RN):
        bn[i] = int32(lrow[ix(uint32(off) + uint32(u[i]))])
    for i in range(RN):  # the okeys from them: every load unpredicated, the selects after
        j = uint32(tid) + uint32(i * NT)
        y = s + logp_of(bn[i], sh, m, ls)
        v = okey(y if j < c32 else NEG_INF)
        bn[i] = int32(u[i]) if j < c32 else int32(0)
        u[i] = v if j < n32 else int64(-1)
    stamp(1)
    for i in range(RN):  # held after every load is issued (a shared store would order them)
        if tid + i * NT < N:
            held[tid + i * NT] = bn[i]
    hist[tid] = 0
    if tid == 0:
        res[3] = I32MAX
        ctr[0] = 0
    cuda.syncthreads()
    mn = I32MAX
    for i in range(RN):
        mn = min(mn, rev_okey(u[i]))
    hi = best_okey(mn, res)
    stamp(2)
    ref = okey_float(hi)
    sel = tid & (RN - 1)  # the sample: candidate tid + (tid % RN) * NT, spread over the chunk
    us = int64(-1)
    for i in range(RN):
        us = pick_of(us, i, sel, u[i])
    sb = ubin(us, ref) if us >= 0 else int32(0)  # none (past N) as the lowest bin: NT counted
    hist_add(hist, sb, True)
    cuda.syncthreads()
    if tid == 0:
        res[3] = I32MAX  # the cutoff's min (every thread has read the best: pick publishes it)
    ws = min(int64(NT), ((k * NT + N - 1) // N) * 3 // 2 + 8)
    ds, _, _ = pick(hist, NB, ws, scan, res, NT)  # ends synchronized: hist free again
    stamp(3)
    hist[tid] = 0
    # the cutoff: the smallest sampled okey of the bins from ds up (their keys all at or above)
    t = least_okey(or_max((us >= 0) & (sb >= ds), okey32(us)), res)
    stamp(4)
    # the keys from the cutoff up in NB linear bins of their distance below the best (lbin),
    # the cutoff's the lowest: the sample has narrowed the range to about the k best, so one
    # round (no obin round, no second). scale 0 (the cutoff at the best, or at -inf): one bin.
    dt = ref - okey_float(t)
    scale = float32(NB) / dt if dt > 0 and dt < float32(np.inf) else float32(0.0)
    if tid == 0:
        res[0] = -1  # stays where the keys from the cutoff up are fewer than k
    for i in range(RN):
        bn[i] = int32(-1) if u[i] < t else cbin(u[i], ref, scale)
        hist_add(hist, bn[i], bn[i] >= 0)
    cuda.syncthreads()
    stamp(5)
    d, need, nd, big = pick_segments(hist, NB, k, SEG_MAX, scan, res)
    stamp(6)
    if d < 0:  # block-uniform: the sample ran high (far below one in a thousand): the radix
        big = 1  # select over every key
    total = k - need + nd  # <= k - 1 + SEG_MAX where no bin is crowded
    if big == 0:  # the keys of the bins from d up laid out by bin, ranked by their slots
        for i in range(RN):
            place(lst, hist, u[i], tid + i * NT, bn[i], d)
        cuda.syncthreads()
        stamp(12)
        for s in range(tid, total, NT):
            v = lst[s]
            rank = bin_rank(lst, v, cbin(v >> 31, ref, scale), hist, NB)
            if rank < k:
                answer(v, rank, r, first, cnt, capr, held, top, parent, child, code)
    else:  # a crowded bin: radix select over the registers' keys, then a sort of the k
        for i in range(RN):
            u[i] = key_of(u[i], tid + i * NT)
        prefix, fixed, shift, want = int64(0), int64(63), int64(KEY_TOP), int64(k)
        while True:
            hist[tid] = 0
            cuda.syncthreads()
            for i in range(RN):
                radix_count(hist, u[i], prefix, fixed, shift)
            cuda.syncthreads()
            dd, need, inbin = pick(hist, NB, want, scan, res, NT)
            prefix |= dd << shift
            if need == inbin or shift == 0:
                break
            want = need
            fixed = shift
            shift = shift - DIG if shift > DIG else int64(0)
        for i in range(RN):
            radix_take(lst, ctr, u[i], prefix, shift)
        sort_k(lst, k, KP)
        if tid < k:
            answer(lst[tid], int64(tid), r, first, cnt, capr, held, top, parent, child, code)
    if STAMP:
        cuda.syncthreads()
        stamp(15)
