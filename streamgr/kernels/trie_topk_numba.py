"""Numba CUDA kernels of ``trie_topk`` (see its module docstring for what they compute).

Imported only when they run: a CUDA device with numba-cuda, or ``NUMBA_ENABLE_CUDASIM=1``.
Arrays come from torch without copies (``__cuda_array_interface__``, no stream sync, so a
CUDA graph can capture the launches); kernels launch on torch's current stream.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from numba import cuda, float32, int32, int64, uint64

from .trie_topk import MAX_K, S, SIMULATED, TPB

LOW = np.uint64(0xFFFFFFFF)
TOP_BIT = np.uint64(0x80000000)
FULL = np.uint64(0xFFFFFFFFFFFFFFFF)
ZERO = np.uint64(0)
SH32 = np.uint64(32)
NEG_INF = float32(-np.inf)


if SIMULATED:  # kernels are Python there: the bits of a numpy float32 scalar
    def _bits(x):
        return np.float32(x).view(np.int32)
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def _bits(x):
        return libdevice.float_as_int(x)


@cuda.jit(device=True, inline=True)
def _compose(bits, c):
    """64-bit key: the score's order-preserving 32 bits, then ~c (lower c wins a tie)."""
    u = np.uint64(np.int64(bits) & 0xFFFFFFFF)
    key = (LOW ^ u) if bits < 0 else (u | TOP_BIT)
    return (key << SH32) | (LOW ^ np.uint64(c))


@cuda.jit(device=True)
def _select(keys, cnt, k, out, base):
    """Write the ``k`` largest of ``keys[:cnt]`` (shared, distinct) to ``out[base:base+k]`` in
    no order: radix select over 8-bit digits from the top, stopping once a digit's bin holds
    exactly the keys still wanted."""
    hist = cuda.shared.array(256, int32)
    st = cuda.shared.array(4, uint64)  # prefix, still wanted, done, collect counter
    tid = cuda.threadIdx.x
    if tid == 0:
        st[0] = ZERO
        st[1] = np.uint64(k)
        st[2] = ZERO
        st[3] = ZERO
    cuda.syncthreads()
    shift = 56
    while True:
        for i in range(tid, 256, TPB):
            hist[i] = 0
        cuda.syncthreads()
        prefix = st[0]
        sh = np.uint64(shift)
        hmask = ZERO if shift == 56 else (FULL << np.uint64(shift + 8))
        for i in range(tid, cnt, TPB):
            key = keys[i]
            if (key & hmask) == (prefix & hmask):
                cuda.atomic.add(hist, int32((key >> sh) & np.uint64(255)), 1)
        cuda.syncthreads()
        if tid == 0:
            want = st[1]
            cum = ZERO
            d = 255
            while d > 0:
                h = np.uint64(hist[d])
                if cum + h >= want:
                    break
                cum += h
                d -= 1
            st[0] = prefix | (np.uint64(d) << sh)
            st[1] = want - cum
            st[2] = np.uint64(1) if np.uint64(hist[d]) == want - cum else ZERO
        cuda.syncthreads()
        if st[2] == np.uint64(1) or shift == 0:
            break
        shift -= 8
        cuda.syncthreads()
    sh = np.uint64(shift)
    thr = st[0] >> sh
    for i in range(tid, cnt, TPB):
        key = keys[i]
        if (key >> sh) >= thr:
            p = cuda.atomic.add(st, 3, np.uint64(1))
            out[base + int64(p)] = key
    cuda.syncthreads()


@cuda.jit
def _expand(scores, nodes, logp, ptr, codes, off, F, B, cand, keys):
    r = cuda.blockIdx.y
    c = cuda.blockIdx.x * TPB + cuda.threadIdx.x
    if c >= B * F:
        return
    b = c // F
    j = c - b * F
    s = scores[r, b]
    val = NEG_INF
    if s > NEG_INF:
        n = nodes[r, b]
        lo = ptr[n]
        if j < ptr[n + 1] - lo:
            val = s + logp[r * B + b, off + codes[lo + j]]
    cand[r, c] = val
    keys[r, c] = _compose(_bits(val + float32(0.0)), c)  # -0.0 keys as +0.0: they compare equal


@cuda.jit
def _reduce(src, m, k, dst):
    """Group g of row r (``S`` keys) -> its top ``k`` at ``dst[r, g*k:(g+1)*k]`` (zeros pad a
    short group: a zero key loses to every real one)."""
    r = cuda.blockIdx.y
    g = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    base = g * S
    cnt = min(S, m - base)
    sm = cuda.shared.array(S, uint64)
    for i in range(tid, cnt, TPB):
        sm[i] = src[r, base + i]
    cuda.syncthreads()
    row = dst[r]
    if cnt <= k:
        for i in range(tid, k, TPB):
            row[g * k + i] = sm[i] if i < cnt else ZERO
        return
    _select(sm, cnt, k, row, g * k)


@cuda.jit
def _final(src, m, k, KP, cand, F, B, scores, nodes, ptr, codes, cap, top, parent, child, code):
    """The last group of row r: its top ``k`` sorted (bitonic, descending) and decoded."""
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    sm = cuda.shared.array(S, uint64)
    srt = cuda.shared.array(MAX_K, uint64)
    for i in range(tid, m, TPB):
        sm[i] = src[r, i]
    for i in range(tid, KP, TPB):
        srt[i] = ZERO
    cuda.syncthreads()
    if m <= k:
        for i in range(tid, m, TPB):
            srt[i] = sm[i]
        cuda.syncthreads()
    else:
        _select(sm, m, k, srt, 0)
    size = 2
    while size <= KP:
        stride = size // 2
        while stride > 0:
            for i in range(tid, KP, TPB):
                j = i ^ stride
                if j > i:
                    a = srt[i]
                    b = srt[j]
                    desc = (i & size) == 0
                    if (desc and a < b) or ((not desc) and a > b):
                        srt[i] = b
                        srt[j] = a
            cuda.syncthreads()
            stride //= 2
        size *= 2
    for i in range(tid, k, TPB):
        c = int64(LOW ^ (srt[i] & LOW))
        b = c // F
        j = c - b * F
        ch = int64(0)
        cd = int64(0)
        if scores[r, b] > NEG_INF:
            n = nodes[r, b]
            lo = ptr[n]
            if j < ptr[n + 1] - lo:
                ch = lo + j
                cd = codes[ch]
        top[r, i] = cand[r, c] if i < cap[r] else NEG_INF
        parent[r, i] = b
        child[r, i] = ch
        code[r, i] = cd


@functools.lru_cache(maxsize=64)
def _stream(handle: int):
    return cuda.external_stream(handle)


def _arr(t: torch.Tensor):
    return t.numpy() if SIMULATED else cuda.as_cuda_array(t, sync=False)


def run(scores, nodes, logp, ptr, codes, off: int, F: int, k: int, cap):
    R, B = scores.shape
    N = B * F
    dev = scores.device
    cand = torch.empty(R, N, dtype=torch.float32, device=dev)
    keys = torch.empty(R, N, dtype=torch.uint64, device=dev)
    top = torch.empty(R, k, dtype=torch.float32, device=dev)
    parent, child, code = (torch.empty(R, k, dtype=torch.int64, device=dev) for _ in range(3))
    if SIMULATED:
        launch = lambda fn, grid: fn[grid, TPB]  # noqa: E731
    else:
        stream = _stream(torch.cuda.current_stream(dev).cuda_stream)
        launch = lambda fn, grid: fn[grid, TPB, stream]  # noqa: E731
    a = _arr
    sc, nd = scores.float().contiguous(), nodes.contiguous()
    lp = logp if logp.dtype == torch.float32 else logp.float()
    launch(_expand, (math.ceil(N / TPB), R))(
        a(sc), a(nd), a(lp), a(ptr), a(codes), off, F, B, a(cand), a(keys))
    src, m = keys, N
    while m > S:
        G = math.ceil(m / S)
        dst = torch.empty(R, G * k, dtype=torch.uint64, device=dev)
        launch(_reduce, (G, R))(a(src), m, k, a(dst))
        src, m = dst, G * k
    KP = 1 << max(0, (k - 1).bit_length())
    launch(_final, (R,))(a(src), m, k, KP, a(cand), F, B, a(sc), a(nd), a(ptr), a(codes),
                         a(cap.contiguous()), a(top), a(parent), a(child), a(code))
    return top, parent, child, code
