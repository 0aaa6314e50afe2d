"""Sort selection of ``trie_topk`` for requests of at most ``SMALL_MAX`` candidates (with
``STREAMGR_TOPK_SMALL=1``, an A/B setting; gen-ref's step 3: 768 at beams of 256): one block of ``ST`` = 256 threads per request holds every
candidate's key in registers (``E`` = 4 a thread, positions ``4 tid .. 4 tid + 3``), sorts them
all with a bitonic network and answers the first ``k`` from the scores, children and codes it
kept in shared memory while computing the keys. No radix rounds and no range pass: against
``trie_topk_one``'s radix rounds it won at this size, but since that kernel's bins round ranks
the few keys from the ``k``-th's bin up without a sort, it wins (10.1 against 13.2 us at step 3
on the H200, session 27), so this path is off by default.

The keys are ``trie_topk_keys``' order without the request's minimum: ``okey << 31 | (MAXC -
c)`` (the okey's 32 bits fit below the sign), 0 for a padding slot (below every candidate's,
``-inf`` included): the same stable order.
"""

from __future__ import annotations

import os

from numba import cuda, float32, int32, int64

from .trie_topk import SIMULATED
from .trie_topk_dev import FULL, JIT
from .trie_topk_keys import MAXC, NEG_INF, cand, div_f, okey

ST = 8 if SIMULATED else 256  # threads a block
E = 4  # keys a thread
NS = ST * E  # keys a block
# Off by default: at gen-ref's step 3 (768 candidates, k 256) trie_topk_one's bins took 10.1 us
# against this sort's 13.2 (session 27); STREAMGR_TOPK_SMALL=1 routes such requests here (A/B).
SMALL_MAX = NS if os.environ.get("STREAMGR_TOPK_SMALL", "0") == "1" else 0
# strides at or above XS exchange through shared memory (the simulator has no shuffles)
XS = E if SIMULATED else 32 * E


@cuda.jit(device=True, inline=True)
def _key(r, c, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, sv, sch, scd):
    """Candidate c's key, its score, child and code kept in shared memory for the decode
    (int32: trie nodes and codes stay below 2**31). Every real key is above 0 (``okey`` of
    ``-inf`` or a NaN too), so with ``k <= N`` no padding slot is ever answered."""
    v, ch, cd = cand(r, min(c, N - 1), F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
    if c < N:
        sv[c] = v
        sch[c] = int32(ch)
        scd[c] = int32(cd)
        return (okey(v) << 31) | (MAXC - c)
    return int64(0)


@cuda.jit(device=True, inline=True)
def _out(x, i, k, r, FM, cap, sv, sch, scd, top, parent, child, code):
    """Rank i's answer from its key, out of shared memory (no second chain of global loads)."""
    if i < k:
        c = MAXC - (x & MAXC)
        top[r, i] = sv[c] if i < cap[r] else NEG_INF
        parent[r, i] = div_f(c, FM)
        child[r, i] = sch[c]
        code[r, i] = scd[c]


@cuda.jit(device=True, inline=True)
def _cx(a, b, desc):
    """(a, b) ordered: the larger first where ``desc``."""
    hi = max(a, b)
    lo = min(a, b)
    if desc:
        return hi, lo
    return lo, hi


@cuda.jit(device=True, inline=True)
def _keep(x, y, high):
    return max(x, y) if high else min(x, y)


@cuda.jit(**JIT)
def small_select(N, NP, k, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top,
                 parent, child, code):
    """Request ``blockIdx.x``: its ``N`` candidates' keys sorted over ``NP`` (a power of two,
    ``N <= NP <= ST * E``) slots, best first; the first ``k`` decoded."""
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    srt = cuda.shared.array(NS, int64)
    sv = cuda.shared.array(NS, float32)
    sch = cuda.shared.array(NS, int32)
    scd = cuda.shared.array(NS, int32)
    i0 = tid * E
    # four independent load chains before any use
    x0 = _key(r, i0, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, sv, sch, scd)
    x1 = _key(r, i0 + 1, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, sv, sch,
              scd)
    x2 = _key(r, i0 + 2, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, sv, sch,
              scd)
    x3 = _key(r, i0 + 3, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, sv, sch,
              scd)
    size = 2
    while size <= NP:
        stride = size >> 1
        while stride > 0:
            if stride >= E:  # the four keys' partners are one thread away: one rule for all
                high = ((i0 & stride) == 0) == ((i0 & size) == 0)
                if stride >= XS:
                    srt[i0] = x0
                    srt[i0 + 1] = x1
                    srt[i0 + 2] = x2
                    srt[i0 + 3] = x3
                    cuda.syncthreads()
                    j = i0 ^ stride
                    y0 = srt[j]
                    y1 = srt[j + 1]
                    y2 = srt[j + 2]
                    y3 = srt[j + 3]
                    cuda.syncthreads()
                else:
                    o = stride // E
                    y0 = cuda.shfl_xor_sync(FULL, x0, o)
                    y1 = cuda.shfl_xor_sync(FULL, x1, o)
                    y2 = cuda.shfl_xor_sync(FULL, x2, o)
                    y3 = cuda.shfl_xor_sync(FULL, x3, o)
                x0 = _keep(x0, y0, high)
                x1 = _keep(x1, y1, high)
                x2 = _keep(x2, y2, high)
                x3 = _keep(x3, y3, high)
            elif stride == 2:  # size >= 4: one direction for the thread's four
                desc = (i0 & size) == 0
                x0, x2 = _cx(x0, x2, desc)
                x1, x3 = _cx(x1, x3, desc)
            else:  # pairs (0, 1) and (2, 3); at size 2 they go opposite ways
                x0, x1 = _cx(x0, x1, (i0 & size) == 0)
                x2, x3 = _cx(x2, x3, ((i0 + 2) & size) == 0)
            stride >>= 1
        size <<= 1
    # the shared stores of the keys' details are published by the network's barriers, or by
    # this one where NP left none (up to 128 keys)
    cuda.syncthreads()
    _out(x0, i0, k, r, FM, cap, sv, sch, scd, top, parent, child, code)
    _out(x1, i0 + 1, k, r, FM, cap, sv, sch, scd, top, parent, child, code)
    _out(x2, i0 + 2, k, r, FM, cap, sv, sch, scd, top, parent, child, code)
    _out(x3, i0 + 3, k, r, FM, cap, sv, sch, scd, top, parent, child, code)
