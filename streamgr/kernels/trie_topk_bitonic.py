"""The bitonic sort that ranks a selection's last few keys whole (``sort_desc``, one key a
thread of the block) and the span it takes (``sort_span``): the radix kernels' fallback where
ties or a crowded bin leave more keys than the bins rank one by one.

Strides below 32 exchange through warp shuffles, the others through shared memory (two barriers a
stage). The CUDA simulator has no shuffles: there (``SIMULATED``) ``WARPX`` is 1 and every stage
exchanges through shared memory, so CI runs the same network.
"""

from __future__ import annotations

from numba import cuda, int64

from .numba_common import INLINE
from .trie_topk_dev import FULL, WARPX, bit_length


@cuda.jit(device=True, **INLINE)
def sort_desc(srt, KP):
    """Bitonic sort of ``srt[:KP]`` (shared int64, KP a power of two <= the block) descending:
    one key a thread, strides below WARPX through shuffles, the others through ``srt`` (two barriers
    a stage). Every thread calls it; it ends synchronized."""
    tid = cuda.threadIdx.x
    live = tid < KP
    wlive = tid < max(KP, 32)  # warps past KP only pass the barriers
    x = srt[tid] if live else int64(0)
    size = 2
    while size <= KP:
        stride = size >> 1
        while stride > 0:
            if stride >= WARPX:
                if live:
                    srt[tid] = x
                cuda.syncthreads()
                y = srt[tid ^ stride] if live else int64(0)
                cuda.syncthreads()
            elif wlive:
                y = cuda.shfl_xor_sync(FULL, x, stride)
            if wlive:
                if ((tid & stride) == 0) == ((tid & size) == 0):
                    x = max(x, y)
                else:
                    x = min(x, y)
            stride >>= 1
        size <<= 1
    if live:
        srt[tid] = x
    cuda.syncthreads()


@cuda.jit(device=True, **INLINE)
def sort_span(total, KP):
    """The keys ``sort_desc`` takes to sort ``total`` listed keys whole (padded with 0, below
    every key): the power of two at or above ``total``, at least ``KP``."""
    return max(KP, int64(1) << bit_length(max(total - 1, int64(1))))
