"""One-launch selection of ``trie_topk`` for requests of at most ``ONE_MAX`` candidates (gen-ref's
step 1: 8,192 at beams of 256; step 3 at beams of 1,024: 3,072; requests of at most a block take
``trie_topk_own`` unless ``STREAMGR_TOPK_OWN=0``): one block of ``NT``
threads per request computes its candidates' okeys into shared memory (four candidates a thread
at a time, so their load chains overlap; where they are one beam's children, as at step 1, the
beam read once and eight at a time: ``note_beam``) and takes the block's smallest real and
largest okey.
Then, for ``k`` up to half the block, it lists the keys that may be among the ``k`` best and
selects from the list (``trie_topk_sample.select_list``: one round of score bins, each key of the
bins from the ``k``-th's up ranked within its bin, no sort unless a bin is crowded): over
``SAMPLE_MIN`` candidates the list is the keys at or above a sampled floor (where they number
from ``k`` to a block; ``trie_topk_sample``), else every key. Otherwise (ties, or ``k`` over
half the block) it
radix-selects the ``k`` best keys (``trie_topk_dev.radix``: digits from the range's top bit,
usually two or three rounds), sorts and decodes them. No global scratch, no memset: the whole
step is one node of the decode plan's graph.
"""

from __future__ import annotations

import os

from numba import cuda, int32, int64

from .kernel_cache import cached
from .numba_common import STAMP, stamp
from .trie_topk_dev import BIG, DIG, JIT_NT, NT, RED_N, SCAN_N, bit_length, collect, radix
from .trie_topk_keys import KEY_NEG_INF, decode, okey_float
from .trie_topk_rank import sort_k
from .trie_topk_sample import (ONE_MAX, SAMPLE, SAMPLE_MIN, UCAP, hold, list_above, sample_floor,
                               score_chunk, select_list)

BINS = os.environ.get("STREAMGR_TOPK_BINS", "1") == "1"  # 0: radix rounds only (A/B runs)


@cached
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
    lo, hi, beam = score_chunk(kx, 0, N, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes,
                               off, red, ctr, res, False)
    tmin = lo if lo != BIG else KEY_NEG_INF
    # a list of the keys that may be among the k best, selected by one round of bins below the
    # best score (block-uniform; for k over half the block the bins rarely fit a block, and
    # ranking such lists in kx's free tail measured slower on the H200: step 3 at beams of 1,024
    # 0.0321 against 0.0292 ms, session 28)
    if BINS and 2 * k <= NT and hi > KEY_NEG_INF:
        U = int64(0)
        if SAMPLE and N > SAMPLE_MIN:  # the keys at or above a sampled floor, if they fit
            t = sample_floor(kx, N, k, okey_float(hi), hist, scan, res)
            stamp(6)
            U = list_above(kx, N, 0, t, k, srt, ctr)
            stamp(7)
            if k <= U and U <= NT:  # block-uniform
                if tid < U:
                    hold(kx, tid, srt[tid])
            else:  # ties or an unlucky sample: the radix rounds (kx untouched, ctr zeroed)
                U = 0
        elif N <= UCAP:  # every key listed: each okey stays, its candidate beside it
            for j in range(tid, N, NT):
                kx[UCAP + j] = j
            U = N
        cuda.syncthreads()
        stamp(8)
        # a list of at most a block always answers; one of all N <= UCAP keys may not (ties),
        # and its okeys are still in kx for the radix rounds
        if U > 0 and select_list(kx, U, okey_float(hi), k, KP, hist, srt, scan, res, ctr, r, F,
                                 FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top,
                                 parent, child, code, beam):
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
    sort_k(srt, k, KP)
    decode(srt, k, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top, parent,
           child, code)
