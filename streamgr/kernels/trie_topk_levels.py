"""Scoring a chunk of five to eight blocks of candidates in one round, one load level at a time
(the merge's listing blocks at gen-ref's step 2: chunks of 8,192 candidates of 177-child beams).

``note_all`` scores such a chunk in two rounds of four candidates a thread, each round a chain
of four dependent load levels (the beam's score and node, its child range, the child's code, its
log-probability) and its okeys stored to shared memory before the next round's loads: LLVM
cannot tell Numba's generic global pointers from shared ones, so the stores order the second
round's loads after them, and the chunk may pay two chains' latency. Here each thread's eight
candidates go through the levels together: the eight beams' loads, then their sixteen child
range loads, then eight codes, then eight log-probabilities (with the rows' max and log-sum),
every index clamped in bounds and every load unpredicated, the selects after, the stores last.
Per candidate the thread keeps four 32-bit words between levels (candidate, beam score, child
node, code). The okeys are ``ckey``'s, bit for bit.

Off by default until it is timed on the H200 (``STREAMGR_TOPK_LEVELS=1`` turns it on): written in
session 37 after that session's device time ran out. ptxas (sm_90, 64-register cap) puts
``merge_select`` at 64 registers with 12 bytes spilled (4 without), and cuobjdump shows the
four levels' loads issued level by level (32, then 8 codes, 8 log-probabilities, 16 row stats).
"""

from __future__ import annotations

import os

from numba import cuda, float32, int32, uint32

from .numba_common import INLINE
from .trie_topk_dev import NT
from .trie_topk_keys import NEG_INF, div_f, ix, logp_of, note, note_end, note_start, okey

LEVELS = os.environ.get("STREAMGR_TOPK_LEVELS", "0") == "1"
LN = 8  # candidates a thread (unrolled loops over register arrays: constant indices only)
NONE = uint32(0xFFFFFFFF)  # no child


@cuda.jit(device=True, **INLINE)
def note_levels(kx, c0, n, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off):
    """``note_all`` of candidates ``c0 .. c0 + n - 1`` (``4 * NT < n <= LN * NT``: ``score_chunk``
    routes such chunks here where ``LEVELS``) into ``kx``: the thread's (smallest real, largest)
    okey, as ``note_end``'s."""
    tid = cuda.threadIdx.x
    cq = cuda.local.array(LN, uint32)  # the candidate
    sq = cuda.local.array(LN, float32)  # its beam's score
    aq = cuda.local.array(LN, uint32)  # node, then first child, then the child (NONE: none)
    bq = cuda.local.array(LN, uint32)  # the next node's first child, then the code
    for i in range(LN):  # level 1: the beams' scores and nodes
        c = uint32(c0) + min(uint32(tid + i * NT), uint32(n - 1))
        b = uint32(div_f(c, FM))
        cq[i] = c
        sq[i] = scores[ix(r), ix(b)]
        aq[i] = uint32(nodes[ix(r), ix(b)])
    for i in range(LN):  # level 2: their child ranges (node 0's for a dead beam: in bounds)
        nd = aq[i] if sq[i] > NEG_INF else uint32(0)
        aq[i] = uint32(ptr[ix(nd)])
        bq[i] = uint32(ptr[ix(nd + uint32(1))])
    for i in range(LN):  # level 3: the children's codes
        b = uint32(div_f(cq[i], FM))
        j = cq[i] - b * uint32(F)
        cnt = bq[i] - aq[i] if sq[i] > NEG_INF else uint32(0)
        real = j < cnt
        ch = aq[i] + j if real else uint32(0)
        aq[i] = ch if real else NONE
        bq[i] = uint32(codes[ix(ch)])
    lo, hi = note_start()
    mq = cuda.local.array(LN, float32)
    lq = cuda.local.array(LN, float32)
    for i in range(LN):  # level 4: their log-probabilities, with the rows' max and log-sum
        row = ix(uint32(r) * uint32(B) + uint32(div_f(cq[i], FM)))
        bq[i] = uint32(int32(logp[row, ix(uint32(off) + bq[i])]))
        mq[i] = lse[0, row]
        lq[i] = lse[ix(sh >> 4), row]
    for i in range(LN):  # the okeys (cand's fp32 operations), stored after every load
        y = sq[i] + logp_of(int32(bq[i]), sh, mq[i], lq[i])
        key = okey(y if aq[i] != NONE else NEG_INF)
        if tid + i * NT < n:
            lo, hi = note(kx, tid + i * NT, key, lo, hi)
    return note_end(lo, hi, n)
