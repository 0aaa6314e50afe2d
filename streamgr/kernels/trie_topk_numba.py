"""Numba CUDA kernels of ``trie_topk`` (see its module docstring for what they compute).

Imported only when they run: a CUDA device with numba-cuda, or ``NUMBA_ENABLE_CUDASIM=1``.
Arrays come from torch without copies (``__cuda_array_interface__``, no stream sync, so a
CUDA graph can capture the launches); kernels launch on torch's current stream. The block-wide
radix select and its digit picks are in ``trie_topk_radix``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import cuda, float32, int32, int64, uint64

from .head_lse import LogProbs
from .numba_common import as_array, torch_stream
from .trie_topk import CH, DIGIT, MAX_K, MID, S, SIMULATED, TPB, TS
from .trie_topk_radix import ZERO, _pick, _select

LOW = np.uint64(0xFFFFFFFF)
TOP_BIT = np.uint64(0x80000000)
SH32 = np.uint64(32)
NEG_INF = float32(-np.inf)
NB = 1 << DIGIT  # bins of a grid pass's digit
SH1, SH2 = np.uint64(64 - DIGIT), np.uint64(64 - 2 * DIGIT)  # the two digits' shifts
DMASK = np.uint64(NB - 1)
F2_BLOCKS = 4 if SIMULATED else 128
# Workspace per request (int32, zeroed per call): digit-1 histogram, digit-2 histogram, then
# the result's and the two buffers' fill counters.
W_H2, W_SURE, W_BUF, W_BUF2 = NB, 2 * NB, 2 * NB + 1, 2 * NB + 2
W_LEN = 2 * NB + 4


if SIMULATED:  # kernels are Python there: the bits of a numpy float32 scalar, and back
    def _bits(x):
        return np.float32(x).view(np.int32)

    def _float(bits):
        return np.int32(bits).view(np.float32)
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def _bits(x):
        return libdevice.float_as_int(x)

    @cuda.jit(device=True, inline=True)
    def _float(bits):
        return libdevice.int_as_float(bits)


@cuda.jit(device=True, inline=True)
def _log_prob(logp, lse, sh, row, col):
    """Column ``col`` of row ``row``'s log-probabilities: ``logp`` holds raw bits, fp32 ones
    (int32, ``sh`` 0) or bf16 logits (int16, ``sh`` 16: the upper half of an fp32), and
    ``lse`` [2, rows] each row's max and log-sum-exp (zeros for fp32 log-probabilities): the
    fp32 ``(x - max) - logsum`` of ``LogProbs.gather``, bit for bit."""
    x = _float(int32(logp[row, col]) << sh)
    return (x - lse[0, row]) - lse[1, row]


@cuda.jit(device=True, inline=True)
def _compose(bits, c):
    """64-bit key: the score's order-preserving 32 bits, then ~c (lower c wins a tie)."""
    u = np.uint64(np.int64(bits) & 0xFFFFFFFF)
    key = (LOW ^ u) if bits < 0 else (u | TOP_BIT)
    return (key << SH32) | (LOW ^ np.uint64(c))


@cuda.jit(device=True, inline=True)
def _score(r, c, F, B, scores, nodes, logp, lse, sh, ptr, codes, off):
    """Candidate c of request r: (its score, -inf where no child; its child node, its code)."""
    b = c // F
    j = c - b * F
    s = scores[r, b]
    if s > NEG_INF:
        n = nodes[r, b]
        lo = ptr[n]
        if j < ptr[n + 1] - lo:
            ch = lo + j
            cd = codes[ch]
            return s + _log_prob(logp, lse, sh, r * B + b, off + cd), ch, cd
    return NEG_INF, int64(0), int64(0)


@cuda.jit(device=True, inline=True)
def _key(r, c, F, B, scores, nodes, logp, lse, sh, ptr, codes, off):
    val, _, _ = _score(r, c, F, B, scores, nodes, logp, lse, sh, ptr, codes, off)
    return _compose(_bits(val + float32(0.0)), c)  # -0.0 keys as +0.0: they compare equal


@cuda.jit(device=True)
def _emit(srt, k, KP, r, F, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top, parent,
          child, code):
    """Sort ``srt[:KP]`` (shared; zeros past k) descending (bitonic), then decode the first
    ``k``: their scores (recomputed, the same fp32 add), parent beams, child nodes, codes.
    Any block size (the grid passes' last block and the one-block select differ)."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    size = 2
    while size <= KP:
        stride = size // 2
        while stride > 0:
            for i in range(tid, KP, nt):
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
    for i in range(tid, k, nt):
        c = int64(LOW ^ (srt[i] & LOW))
        val, ch, cd = _score(r, c, F, B, scores, nodes, logp, lse, sh, ptr, codes, off)
        top[r, i] = val if i < cap[r] else NEG_INF
        parent[r, i] = c // F
        child[r, i] = ch
        code[r, i] = cd


@cuda.jit
def _small(N, k, KP, F, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top, parent,
           child, code):
    """A request of at most ``S`` candidates, in one block: keys, select, sort, decode."""
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    sm = cuda.shared.array(S, uint64)
    srt = cuda.shared.array(MAX_K, uint64)
    for i in range(tid, N, TPB):
        sm[i] = _key(r, i, F, B, scores, nodes, logp, lse, sh, ptr, codes, off)
    for i in range(tid, KP, TPB):
        srt[i] = ZERO
    cuda.syncthreads()
    if N <= k:
        for i in range(tid, N, TPB):
            srt[i] = sm[i]
        cuda.syncthreads()
    else:
        _select(sm, N, k, srt, 0)
    _emit(srt, k, KP, r, F, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top, parent,
          child, code)


@cuda.jit(device=True)
def _digit_pick(ws, r, lo, want, h):
    """:func:`_pick` over the request's histogram ``ws[r, lo:lo+NB]`` (global), copied into
    the caller's shared ``h``: (the bin holding the ``want``-th key, how many of its keys are
    still wanted, how many it holds)."""
    scan = cuda.shared.array(TPB, int32)
    res = cuda.shared.array(3, int32)
    for i in range(cuda.threadIdx.x, NB, TPB):
        h[i] = ws[r, lo + i]
    cuda.syncthreads()
    _pick(h, NB, want, scan, res)
    return res[0], res[1], res[2]


@cuda.jit(device=True)
def _flush(h, ws, r, lo):
    """A block's shared histogram into the request's global one."""
    for i in range(cuda.threadIdx.x, NB, TPB):
        if h[i]:
            cuda.atomic.add(ws, (r, lo + i), h[i])


@cuda.jit
def _hist1(N, F, B, scores, nodes, logp, lse, sh, ptr, codes, off, ws):
    """Grid pass 1: the histogram of every candidate key's top digit, per request."""
    r = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    h = cuda.shared.array(NB, int32)
    for i in range(tid, NB, TPB):
        h[i] = 0
    cuda.syncthreads()
    for c in range(cuda.blockIdx.x * CH + tid, min(N, (cuda.blockIdx.x + 1) * CH), TPB):
        key = _key(r, c, F, B, scores, nodes, logp, lse, sh, ptr, codes, off)
        cuda.atomic.add(h, int32(key >> SH1), 1)
    cuda.syncthreads()
    _flush(h, ws, r, 0)


@cuda.jit
def _filter1(N, k, F, B, scores, nodes, logp, lse, sh, ptr, codes, off, ws, sure, buf):
    """Grid pass 2: keys above the k-th key's top digit to the result, those sharing it to the
    buffer (with the histogram of their next digit)."""
    r = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    h = cuda.shared.array(NB, int32)
    d1, need1, n1 = _digit_pick(ws, r, 0, k, h)
    t1, all_in = np.uint64(d1), need1 == n1
    for i in range(tid, NB, TPB):
        h[i] = 0
    cuda.syncthreads()
    for c in range(cuda.blockIdx.x * CH + tid, min(N, (cuda.blockIdx.x + 1) * CH), TPB):
        key = _key(r, c, F, B, scores, nodes, logp, lse, sh, ptr, codes, off)
        d = key >> SH1
        if d > t1 or (d == t1 and all_in):
            sure[r, cuda.atomic.add(ws, (r, W_SURE), 1)] = key
        elif d == t1:
            buf[r, cuda.atomic.add(ws, (r, W_BUF), 1)] = key
            cuda.atomic.add(h, int32((key >> SH2) & DMASK), 1)
    cuda.syncthreads()
    _flush(h, ws, r, W_H2)


@cuda.jit
def _filter2(k, ws, sure, buf, buf2):
    """Grid pass 3 over the buffer: keys above the wanted key's second digit to the result,
    those sharing it to the second buffer."""
    r = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    h = cuda.shared.array(NB, int32)
    _, need1, n1 = _digit_pick(ws, r, 0, k, h)
    if need1 == n1:
        return  # the first digit settled it: nothing was buffered
    cuda.syncthreads()
    d2, need2, n2 = _digit_pick(ws, r, W_H2, need1, h)
    t2, all_in = np.uint64(d2), need2 == n2
    for i in range(cuda.blockIdx.x * TPB + tid, n1, cuda.gridDim.x * TPB):  # grid-stride
        key = buf[r, i]
        d = (key >> SH2) & DMASK
        if d > t2 or (d == t2 and all_in):
            sure[r, cuda.atomic.add(ws, (r, W_SURE), 1)] = key
        elif d == t2:
            buf2[r, cuda.atomic.add(ws, (r, W_BUF2), 1)] = key


@cuda.jit
def _final(k, KP, F, B, scores, nodes, logp, lse, sh, ptr, codes, off, ws, sure, buf2, cap, top,
           parent, child, code):
    """Per request: the result's keys plus the wanted ones of the keys left tied (selected in
    shared memory, or from the global buffer when more than ``TS`` are tied), sorted, decoded."""
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    h = cuda.shared.array(NB, int32)
    tied = cuda.shared.array(TS, uint64)
    srt = cuda.shared.array(MAX_K, uint64)
    n_sure = ws[r, W_SURE]
    for i in range(tid, KP, TPB):
        srt[i] = sure[r, i] if i < n_sure else ZERO
    _, need1, n1 = _digit_pick(ws, r, 0, k, h)
    if need1 != n1:
        cuda.syncthreads()
        _, need2, n2 = _digit_pick(ws, r, W_H2, need1, h)
        if need2 != n2:  # n_sure == k - need2: the rest from the n2 tied keys
            if n2 <= TS:
                for i in range(tid, n2, TPB):
                    tied[i] = buf2[r, i]
                cuda.syncthreads()
                _select(tied, n2, need2, srt, n_sure)
            else:
                _select(buf2[r], n2, need2, srt, n_sure)
    cuda.syncthreads()
    _emit(srt, k, KP, r, F, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top, parent,
          child, code)




def _log_probs(logp, a) -> tuple:
    """(bits, [2, rows] max and log-sum, shift) of ``_log_prob`` for a ``LogProbs`` (bf16
    logits, read in place: no [rows, vocab] fp32 matrix) or a dense matrix (fp32)."""
    if isinstance(logp, LogProbs) and logp.logits.dtype == torch.bfloat16:
        return a(logp.logits.view(torch.int16)), a(logp.stats), 16
    if isinstance(logp, LogProbs):
        logp = logp.dense()
    logp = logp.float()
    if logp.stride(-1) != 1:
        logp = logp.contiguous()
    zeros = torch.zeros(2, logp.shape[0], dtype=torch.float32, device=logp.device)
    return a(logp.view(torch.int32)), a(zeros), 0


def run(scores, nodes, logp, ptr, codes, off: int, F: int, k: int, cap):
    R, B = scores.shape
    N = B * F
    dev = scores.device
    top = torch.empty(R, k, dtype=torch.float32, device=dev)
    parent, child, code = (torch.empty(R, k, dtype=torch.int64, device=dev) for _ in range(3))
    if SIMULATED:
        launch = lambda fn, grid: fn[grid, TPB]  # noqa: E731
    else:
        stream = torch_stream(dev)
        launch = lambda fn, grid: fn[grid, TPB, stream]  # noqa: E731
    a = as_array
    sc, nd = a(scores.float().contiguous()), a(nodes.contiguous())
    lp = _log_probs(logp, a)
    trie = (a(ptr), a(codes), off)
    outs = (a(cap.contiguous()), a(top), a(parent), a(child), a(code))
    KP = 1 << max(0, (k - 1).bit_length())
    if N <= S:
        launch(_small, (R,))(N, k, KP, F, B, sc, nd, *lp, *trie, *outs)
        return top, parent, child, code
    if N <= MID:  # one block per request over a key buffer (trie_topk_block)
        from .trie_topk_block import run_block
        launch3 = (lambda fn, grid, threads: fn[grid, threads]) if SIMULATED else \
            (lambda fn, grid, threads: fn[grid, threads, stream])
        run_block(launch3, N, k, KP, F, B, sc, nd, lp, trie, outs, R, dev, a, TPB)
        return top, parent, child, code
    ws = torch.zeros(R, W_LEN, dtype=torch.int32, device=dev)
    sure = torch.empty(R, k, dtype=torch.uint64, device=dev)
    buf, buf2 = (torch.empty(R, N, dtype=torch.uint64, device=dev) for _ in range(2))
    grid = (math.ceil(N / CH), R)
    launch(_hist1, grid)(N, F, B, sc, nd, *lp, *trie, a(ws))
    launch(_filter1, grid)(N, k, F, B, sc, nd, *lp, *trie, a(ws), a(sure), a(buf))
    # The buffer is a fraction of the candidates, unknown here: a grid of at most F2_BLOCKS
    # blocks strides over it (each block's prologue reads two histograms).
    launch(_filter2, (min(grid[0], F2_BLOCKS), R))(k, a(ws), a(sure), a(buf), a(buf2))
    launch(_final, (R,))(k, KP, F, B, sc, nd, *lp, *trie, a(ws), a(sure), a(buf2), *outs)
    return top, parent, child, code
