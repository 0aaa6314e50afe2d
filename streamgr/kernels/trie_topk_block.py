"""One-block-per-request selection of ``trie_topk`` (Numba CUDA): for requests of ``S`` to
``MID`` candidates (gen-ref's steps 1 and 2: 8,192 and 45,312 at beams of 256).

Two launches instead of the grid passes' memset and four: ``_keys`` computes every candidate's
64-bit key (``trie_topk_numba._key``: the score's order bits, then ``~c``) with one thread per
candidate over the whole GPU, so the four dependent loads behind each key (beam -> node ->
child -> code -> log-probability) overlap across the grid instead of queueing in a few blocks;
``_select_block`` then gives each request one block that radix-selects its ``k`` keys from that
contiguous buffer (L2-resident: <= 2 MiB per request) with ``DIGIT2``-bit digits from the top,
stopping once a digit settles the set, and sorts and decodes them exactly as the other paths
do (the same keys, so the same answer bit for bit; ``trie_topk_numba._radix_select`` with its
two-level bin pick, which a block of 512 threads needs).
Past ``MID`` candidates one block would stream too much alone, and the grid passes serve.
"""

from __future__ import annotations

from numba import cuda, int32, uint64

from .trie_topk import MAX_K, SIMULATED
from .trie_topk_numba import _emit, _key
from .trie_topk_radix import CHUNKS, ZERO, _radix_select

# Threads of the select block, digit bits, bins.
TPB2, DIGIT2 = (32, 5) if SIMULATED else (512, 11)  # 512: ~90 registers a thread
NB2 = 1 << DIGIT2


@cuda.jit
def _keys(N, F, B, scores, nodes, logp, lse, sh, ptr, codes, off, kbuf):
    """kbuf[r, c] = candidate c's key, one thread per candidate (grid: ceil(N / threads), R)."""
    r = cuda.blockIdx.y
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if c < N:
        kbuf[r, c] = _key(r, c, F, B, scores, nodes, logp, lse, sh, ptr, codes, off)


@cuda.jit
def _select_block(N, k, KP, F, B, scores, nodes, logp, lse, sh, ptr, codes, off, kbuf, cap, top,
                  parent, child, code):
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
    _radix_select(kbuf[r], N, k, srt, 0, hist, NB2, DIGIT2, True, csum, res, st)
    _emit(srt, k, KP, r, F, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top, parent,
          child, code)


def run_block(launch, N, k, KP, F, B, sc, nd, lp, trie, outs, R, dev, arr, tpb):
    """The two launches (``launch(fn, grid, threads)``) for R requests of N candidates."""
    import torch
    kbuf = torch.empty(R, N, dtype=torch.uint64, device=dev)
    launch(_keys, ((N + tpb - 1) // tpb, R), tpb)(N, F, B, sc, nd, *lp, *trie, arr(kbuf))
    launch(_select_block, (R,), TPB2)(N, k, KP, F, B, sc, nd, *lp, *trie, arr(kbuf), *outs)
