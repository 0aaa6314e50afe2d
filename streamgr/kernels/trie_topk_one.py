"""One-launch selection of ``trie_topk`` for requests of at most ``ONE_MAX`` candidates (gen-ref's
steps 1 and 3: 8,192 and 768 at beams of 256, 3,072 at beams of 1,024): one block of ``NT``
threads per request computes its candidates' okeys into shared memory (four candidates a thread
at a time, so their load chains overlap), takes the block's smallest real and largest okey,
radix-selects the ``k`` best keys (``trie_topk_dev.radix``: digits from the range's top bit,
usually two or three rounds), sorts them and decodes. No global scratch, no memset: the whole
step is one node of the decode plan's graph.
"""

from __future__ import annotations

from numba import cuda, int32, int64

from .trie_topk import SIMULATED
from .trie_topk_dev import (BIG, DIG, JIT_NT, NT, RED_N, SCAN_N, bit_length, collect, minmax, radix,
                            sort_desc)
from .trie_topk_keys import KEY_NEG_INF, ckey, decode, note, note4

ONE_MAX = 64 if SIMULATED else 8192  # okeys in shared memory: 32 KiB
CPT = 4  # candidates a thread computes at once


@cuda.jit(**JIT_NT)
def one_select(N, k, KP, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top, parent,
               child, code):
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    kx = cuda.shared.array(ONE_MAX, int32)
    hist = cuda.shared.array(NT, int32)
    srt = cuda.shared.array(NT, int64)
    scan = cuda.shared.array(SCAN_N, int32)
    res = cuda.shared.array(3, int32)
    red = cuda.shared.array(RED_N, int64)
    ctr = cuda.shared.array(1, int64)
    if tid == 0:
        ctr[0] = 0
    lo = BIG
    hi = int64(-1)
    for base in range(0, N, CPT * NT):
        i0 = base + tid
        if N - base <= NT:  # one candidate a thread left (block-uniform)
            if i0 < N:
                lo, hi = note(kx, i0, ckey(r, i0, F, FM, B, scores, nodes, logp, lse, sh, ptr,
                                            codes, off), lo, hi)
            continue
        lo, hi = note4(kx, i0, NT, r, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes,
                       off, lo, hi)
    lo, hi = minmax(lo, hi, red)  # its barriers also publish kx
    tmin = lo if lo != BIG else KEY_NEG_INF
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
