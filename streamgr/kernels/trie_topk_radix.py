"""Block-wide radix selection for the Numba kernels of ``trie_topk``: the ``k`` largest of a
block's distinct 64-bit keys (shared or global memory) by digits from the top, stopping once
a digit's bin holds exactly the keys still wanted. A digit's bin is found by a prefix sum over
the threads (``_pick``: TPB threads) or in two levels (``_pick_chunked``: any block size).
No warp shuffles: the CUDA simulator has none.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, int32, int64, uint64

from .trie_topk import SIMULATED, TPB

FULL = np.uint64(0xFFFFFFFFFFFFFFFF)
ZERO = np.uint64(0)
CHUNKS = 8 if SIMULATED else 64  # first level of the two-level pick (_pick_chunked)


@cuda.jit(device=True)
def _pick(hist, nbins, want, scan, res):
    """Over ``hist[:nbins]`` (shared; nbins a multiple of TPB) from the highest bin: res[0] =
    the bin d holding the ``want``-th key, res[1] = how many of d's keys are still wanted,
    res[2] = hist[d]. Every thread calls it; it ends synchronized."""
    tid = cuda.threadIdx.x
    per = nbins // TPB
    hi = nbins - 1 - tid * per
    own = _chunk_sum(hist, hi, per)
    scan[tid] = own
    cuda.syncthreads()
    step = 1
    while step < TPB:  # inclusive prefix over the threads' chunks, highest bins first
        v = scan[tid - step] if tid >= step else 0
        cuda.syncthreads()
        scan[tid] += v
        cuda.syncthreads()
        step *= 2
    above = scan[tid] - own
    if above < want and want <= scan[tid]:
        _walk(hist, hi, per, above, want, res)
    cuda.syncthreads()


@cuda.jit(device=True, inline=True)
def _chunk_sum(hist, hi, n):
    """Keys in ``hist[hi - n + 1 .. hi]``."""
    own = 0
    for i in range(n):
        own += hist[hi - i]
    return own


@cuda.jit(device=True, inline=True)
def _walk(hist, hi, n, above, want, res):
    """Down ``hist[hi - n + 1 .. hi]`` with ``above`` keys in higher bins, to the bin holding
    the ``want``-th key: res = (that bin, how many of its keys are still wanted, its count)."""
    for i in range(n):
        h = hist[hi - i]
        if above + h >= want:
            res[0] = hi - i
            res[1] = want - above
            res[2] = h
            break
        above += h


@cuda.jit(device=True)
def _pick_chunked(hist, nbins, want, csum, res):
    """:func:`_pick` for any block size, in two levels: threads < CHUNKS sum a chunk of
    ``nbins // CHUNKS`` bins each, each adds the chunks above its own (a broadcast read per
    chunk), and the one whose chunk holds the ``want``-th key walks its bins: three barriers
    instead of a prefix sum's two per doubling step. Every thread calls it; it ends synced."""
    tid = cuda.threadIdx.x
    cw = nbins // CHUNKS
    if tid < CHUNKS:
        csum[tid] = _chunk_sum(hist, nbins - 1 - tid * cw, cw)
    cuda.syncthreads()
    if tid < CHUNKS:
        above = 0
        for j in range(CHUNKS):
            if j < tid:
                above += csum[j]
        if above < want and want <= above + csum[tid]:
            _walk(hist, nbins - 1 - tid * cw, cw, above, want, res)
    cuda.syncthreads()


@cuda.jit(device=True)
def _radix_select(keys, cnt, k, out, base, hist, nbins, digit, chunked, scan, res, st):
    """Write the ``k`` largest of ``keys[:cnt]`` (distinct; shared or global memory) to
    ``out[base:base+k]`` in no order: radix select over ``digit``-bit digits from the top
    (``hist``: ``nbins = 2**digit`` shared counters), stopping once a digit's bin holds exactly
    the keys still wanted. The bin is found by :func:`_pick_chunked` (``chunked``, any block
    size; ``scan``: CHUNKS ints) or :func:`_pick` (TPB threads; ``scan``: TPB ints)."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    if tid == 0:
        st[0] = ZERO  # the selected prefix
        st[1] = ZERO  # the collect counter
    want = k
    shift = 64 - digit
    hmask = ZERO  # the bits above the digit, fixed by the prefix so far
    dmask = np.uint64(nbins - 1)
    while True:
        for i in range(tid, nbins, nt):
            hist[i] = 0
        cuda.syncthreads()
        prefix = st[0]
        sh = np.uint64(shift)
        for i in range(tid, cnt, nt):
            key = keys[i]
            if (key & hmask) == (prefix & hmask):
                cuda.atomic.add(hist, int32((key >> sh) & dmask), 1)
        cuda.syncthreads()
        if chunked:
            _pick_chunked(hist, nbins, want, scan, res)
        else:
            _pick(hist, nbins, want, scan, res)
        d, need, inbin = res[0], res[1], res[2]
        if tid == 0:
            st[0] = prefix | (np.uint64(d) << sh)
        cuda.syncthreads()
        if need == inbin or shift == 0:
            break
        want = need
        hmask = FULL << sh
        shift = shift - digit if shift > digit else 0
    # Keys are distinct, so exactly k lie at or above the selected prefix: collect them.
    sh = np.uint64(shift)
    thr = st[0] >> sh
    for i in range(tid, cnt, nt):
        key = keys[i]
        if (key >> sh) >= thr:
            p = cuda.atomic.add(st, 1, np.uint64(1))
            out[base + int64(p)] = key
    cuda.syncthreads()


@cuda.jit(device=True)
def _select(keys, cnt, k, out, base):
    """:func:`_radix_select` over 8-bit digits with TPB threads."""
    hist = cuda.shared.array(256, int32)
    scan = cuda.shared.array(TPB, int32)
    res = cuda.shared.array(3, int32)
    st = cuda.shared.array(2, uint64)
    _radix_select(keys, cnt, k, out, base, hist, 256, 8, False, scan, res, st)
