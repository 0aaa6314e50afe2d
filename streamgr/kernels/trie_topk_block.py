"""One-block-per-request selection of ``trie_topk`` (Numba CUDA): for requests of ``S`` to
``MID`` candidates (gen-ref's steps 1 and 2: 8,192 and 45,312 at beams of 256).

Two launches instead of the grid passes' memset and four: ``_keys`` computes every candidate's
64-bit key (``trie_topk_numba._key``: the score's order bits, then ``~c``) with one thread per
candidate over the whole GPU, so the four dependent loads behind each key (beam -> node ->
child -> code -> log-probability) overlap across the grid instead of queueing in a few blocks;
``_select_block`` then gives each request one block that radix-selects its ``k`` keys from that
contiguous buffer (L2-resident: <= 2 MiB per request) with ``DIGIT2``-bit digits from the top,
stopping once a digit settles the set, and sorts and decodes them exactly as the other paths
do (the same keys, so the same answer bit for bit). A digit's bin is found in two levels (chunk
sums, then one chunk's bins), three barriers instead of a prefix sum's two per doubling step.
Past ``MID`` candidates one block would stream too much alone, and the grid passes serve.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, int32, int64, uint64

from .trie_topk import MAX_K, SIMULATED
from .trie_topk_numba import FULL, ZERO, _emit, _key, _walk

# Threads of the select block, digit bits, bins, chunks of the two-level pick (bins per chunk).
TPB2, DIGIT2 = (32, 5) if SIMULATED else (512, 11)  # 512: ~90 registers a thread
NB2 = 1 << DIGIT2
CHUNKS = 8 if SIMULATED else 64
CW = NB2 // CHUNKS
DMASK2 = np.uint64(NB2 - 1)


@cuda.jit
def _keys(N, F, B, scores, nodes, logp, ptr, codes, off, kbuf):
    """kbuf[r, c] = candidate c's key, one thread per candidate (grid: ceil(N / threads), R)."""
    r = cuda.blockIdx.y
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if c < N:
        kbuf[r, c] = _key(r, c, F, B, scores, nodes, logp, ptr, codes, off)


@cuda.jit(device=True)
def _pick_chunked(hist, want, csum, res):
    """From the highest of ``hist[:NB2]`` (shared): res = (the bin holding the ``want``-th key,
    how many of its keys are still wanted, how many it holds). Threads < CHUNKS sum a chunk
    each; each then adds the chunks above its own (a broadcast read per chunk); the one whose
    chunk holds the ``want``-th key walks its CW bins. Every thread calls it; it ends synced."""
    tid = cuda.threadIdx.x
    if tid < CHUNKS:
        hi = NB2 - 1 - tid * CW
        own = 0
        for i in range(CW):
            own += hist[hi - i]
        csum[tid] = own
    cuda.syncthreads()
    if tid < CHUNKS:
        above = 0
        for j in range(CHUNKS):
            if j < tid:
                above += csum[j]
        if above < want and want <= above + csum[tid]:
            _walk(hist, NB2 - 1 - tid * CW, CW, above, want, res)
    cuda.syncthreads()


@cuda.jit
def _select_block(N, k, KP, F, B, scores, nodes, logp, ptr, codes, off, kbuf, cap, top, parent,
                  child, code):
    """Request r's ``k`` largest keys of ``kbuf[r, :N]`` (distinct), sorted and decoded."""
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    hist = cuda.shared.array(NB2, int32)
    csum = cuda.shared.array(CHUNKS, int32)
    res = cuda.shared.array(3, int32)
    st = cuda.shared.array(2, uint64)  # the selected prefix, the collect counter
    srt = cuda.shared.array(MAX_K, uint64)
    for i in range(tid, KP, nt):
        srt[i] = ZERO
    if tid == 0:
        st[0] = ZERO
        st[1] = ZERO
    want = k
    shift = 64 - DIGIT2
    hmask = ZERO  # the bits above the digit, fixed by the prefix so far
    while True:
        for i in range(tid, NB2, nt):
            hist[i] = 0
        cuda.syncthreads()
        prefix = st[0]
        sh = np.uint64(shift)
        for i in range(tid, N, nt):
            key = kbuf[r, i]
            if (key & hmask) == (prefix & hmask):
                cuda.atomic.add(hist, int32((key >> sh) & DMASK2), 1)
        cuda.syncthreads()
        _pick_chunked(hist, want, csum, res)
        d, need, inbin = res[0], res[1], res[2]
        if tid == 0:
            st[0] = prefix | (np.uint64(d) << sh)
        cuda.syncthreads()
        if need == inbin or shift == 0:
            break
        want = need
        hmask = FULL << sh
        shift = shift - DIGIT2 if shift > DIGIT2 else 0
    # Keys are distinct, so exactly k lie at or above the selected prefix: collect them.
    sh = np.uint64(shift)
    thr = st[0] >> sh
    for i in range(tid, N, nt):
        key = kbuf[r, i]
        if (key >> sh) >= thr:
            p = cuda.atomic.add(st, 1, np.uint64(1))
            srt[int64(p)] = key
    cuda.syncthreads()
    _emit(srt, k, KP, r, F, B, scores, nodes, logp, ptr, codes, off, cap, top, parent, child,
          code)


def run_block(launch, N, k, KP, F, B, sc, nd, lp, trie, outs, R, dev, arr, tpb):
    """The two launches (``launch(fn, grid, threads)``) for R requests of N candidates."""
    import torch
    kbuf = torch.empty(R, N, dtype=torch.uint64, device=dev)
    launch(_keys, ((N + tpb - 1) // tpb, R), tpb)(N, F, B, sc, nd, lp, *trie, arr(kbuf))
    launch(_select_block, (R,), TPB2)(N, k, KP, F, B, sc, nd, lp, *trie, arr(kbuf), *outs)
