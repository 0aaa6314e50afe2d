"""Grid selection of ``trie_topk`` for requests of more than ``ONE_MAX`` candidates (gen-ref's
step 2: 45,312 at beams of 256, 181,248 at 1,024; one request's flat 2,097,152), as AIR top-k
does it but with the request's score range known before the first digit. Four launches, no memset:

1. ``keys``: one thread per four candidates over the whole GPU computes okeys into ``kbuf``
   ([R, N] int32) and each block's smallest real and largest okey into ``part``; block 0 of a
   request zeroes its workspace row ``ws`` (histograms and counters) for the next launches.
2. ``hist1``: every block (``chunk`` keys each: one wave of blocks over the GPU) reduces
   ``part`` to the request's range, adds its keys' first digit to the request's histogram;
   the last block to finish (a counter in ``ws``) picks the digit holding the ``k``-th key.
3. ``filter1``: keys above that digit go to ``sure`` (fewer than ``k``), keys in it to ``buf``
   with the histogram of their next digit, whose pick the last block makes.
4. ``final``: one block per request takes ``sure``, the keys of ``buf`` above the second digit,
   and radix-selects the rest from those tied at it (in shared memory, or from ``buf`` past
   ``TS`` of them); sorts the ``k`` and decodes them.
"""

from __future__ import annotations

import functools

import torch
from numba import cuda, int32, int64

from .trie_topk import SIMULATED
from .trie_topk_dev import (BIG, DIG, DM, JIT, JIT_NT, NB, NT, RED_N, SCAN_N, append, bit_length,
                            collect, hist_add, minmax, pick, radix, sort_desc)
from .trie_topk_keys import KEY_NEG_INF, LOW32, decode, note4, tkey

T1, CPT = (32, 4) if SIMULATED else (256, 4)  # keys: threads a block, candidates a thread
SMS_SIM = 4  # the simulator's "SMs" (hist1/filter1 blocks a wave)
TS = 16 if SIMULATED else 4096  # tied keys final selects from in shared memory
# ws columns: the two histograms, then counters and the picks
H1, H2 = 0, NB
DONE1, DONE2, NSURE, NBUF = 2 * NB, 2 * NB + 1, 2 * NB + 2, 2 * NB + 3
D1, NEED1, N1, D2, NEED2, N2, TMIN, S1 = (2 * NB + 4 + i for i in range(8))
W_LEN = 2 * NB + 12


@cuda.jit(**JIT)
def keys(N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, kbuf, part, ws):
    r = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    red = cuda.shared.array(RED_N, int64)
    if cuda.blockIdx.x == 0:
        for i in range(tid, W_LEN, T1):
            ws[r, i] = 0
    i0 = cuda.blockIdx.x * (T1 * CPT) + tid
    lo, hi = note4(kbuf[r], i0, T1, r, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off,
                   BIG, int64(-1))
    lo, hi = minmax(lo, hi, red)
    if tid == 0:
        part[r, cuda.blockIdx.x, 0] = lo
        part[r, cuda.blockIdx.x, 1] = hi


@cuda.jit(device=True, inline=True)
def _range(part, r, red):
    """The request's (tmin, first digit's shift) from the keys blocks' partial minima/maxima."""
    tid = cuda.threadIdx.x
    lo = BIG
    hi = int64(-1)
    for j in range(tid, part.shape[1], NT):
        lo = min(lo, part[r, j, 0])
        hi = max(hi, part[r, j, 1])
    lo, hi = minmax(lo, hi, red)
    tmin = lo if lo != BIG else KEY_NEG_INF
    top_bit = 31 + bit_length(max(hi - tmin + 1, int64(1)))
    return tmin, top_bit - DIG if top_bit > DIG else 0


@cuda.jit(device=True, inline=True)
def _last(ws, r, col, flag):
    """True in the request's last block to get here (after its global adds are fenced)."""
    cuda.threadfence()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        flag[0] = cuda.atomic.add(ws, (r, col), 1) == cuda.gridDim.x - 1
    cuda.syncthreads()
    return flag[0]


@cuda.jit(device=True, inline=True)
def _flush_pick(hist, ws, r, lo, done, want, scan, res, flag):
    """The block's histogram into the request's (``ws[r, lo:lo+NB]``); the last block reads
    the sum back (atomically: not from a stale cache line) and returns its pick, else -1s."""
    tid = cuda.threadIdx.x
    if hist[tid]:
        cuda.atomic.add(ws, (r, lo + tid), int64(hist[tid]))
    if not _last(ws, r, done, flag):
        return int64(-1), int64(-1), int64(-1)
    cuda.threadfence()
    hist[tid] = int32(cuda.atomic.add(ws, (r, lo + tid), int64(0)))
    cuda.syncthreads()
    return pick(hist, want, scan, res, NT)


@cuda.jit(device=True, inline=True)
def _digit(kbuf, r, i, tmin, s):
    return int32((tkey(int64(kbuf[r, i]) & LOW32, int64(i), tmin) >> s) & DM)


@cuda.jit(**JIT_NT)
def hist1(N, k, ch, kbuf, part, ws):
    r = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    hist = cuda.shared.array(NB, int32)
    scan = cuda.shared.array(SCAN_N, int32)
    res = cuda.shared.array(3, int32)
    red = cuda.shared.array(RED_N, int64)
    flag = cuda.shared.array(1, int32)
    hist[tid] = 0
    tmin, s1 = _range(part, r, red)
    start = cuda.blockIdx.x * ch
    end = min(N, start + ch)
    for base in range(start, end, 4 * NT):  # four loads in flight before the adds
        i0 = base + tid
        i1 = i0 + NT
        i2 = i1 + NT
        i3 = i2 + NT
        d0 = _digit(kbuf, r, min(i0, N - 1), tmin, s1)
        d1 = _digit(kbuf, r, min(i1, N - 1), tmin, s1)
        d2 = _digit(kbuf, r, min(i2, N - 1), tmin, s1)
        d3 = _digit(kbuf, r, min(i3, N - 1), tmin, s1)
        hist_add(hist, d0, i0 < end)
        hist_add(hist, d1, i1 < end)
        hist_add(hist, d2, i2 < end)
        hist_add(hist, d3, i3 < end)
    cuda.syncthreads()
    d, need, n = _flush_pick(hist, ws, r, H1, DONE1, k, scan, res, flag)
    if d >= 0 and tid == 0:
        ws[r, D1] = d
        ws[r, NEED1] = need
        ws[r, N1] = n
        ws[r, TMIN] = tmin
        ws[r, S1] = s1


@cuda.jit(device=True, inline=True)
def _split(sure, buf, ws, r, hist, v, ok, d1, s1, s2, all_in):
    """Key v above the first digit's pick to ``sure``, at it to ``buf`` (with its next digit
    counted); every lane calls it."""
    dg = v >> s1
    tie = ok and dg == d1 and not all_in
    append(sure[r], ws[r], NSURE, v, ok and (dg > d1 or (dg == d1 and all_in)))
    append(buf[r], ws[r], NBUF, v, tie)
    hist_add(hist, int32((v >> s2) & DM), tie)


@cuda.jit(**JIT_NT)
def filter1(N, ch, kbuf, ws, sure, buf):
    r = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    hist = cuda.shared.array(NB, int32)
    scan = cuda.shared.array(SCAN_N, int32)
    res = cuda.shared.array(3, int32)
    flag = cuda.shared.array(1, int32)
    hist[tid] = 0
    cuda.syncthreads()
    d1, need1, tmin, s1 = ws[r, D1], ws[r, NEED1], ws[r, TMIN], ws[r, S1]
    all_in = need1 == ws[r, N1]
    s2 = s1 - DIG if s1 > DIG else 0
    start = cuda.blockIdx.x * ch
    end = min(N, start + ch)
    for base in range(start, end, 2 * NT):  # two loads in flight (64 registers)
        i0 = base + tid
        i1 = i0 + NT
        c0 = min(i0, N - 1)
        c1 = min(i1, N - 1)
        a0 = int64(kbuf[r, c0]) & LOW32
        a1 = int64(kbuf[r, c1]) & LOW32
        _split(sure, buf, ws, r, hist, tkey(a0, int64(c0), tmin), i0 < end, d1, s1, s2,
               all_in)
        _split(sure, buf, ws, r, hist, tkey(a1, int64(c1), tmin), i1 < end, d1, s1, s2,
               all_in)
    cuda.syncthreads()
    if all_in:
        return
    d, need, n = _flush_pick(hist, ws, r, H2, DONE2, need1, scan, res, flag)
    if d >= 0 and tid == 0:
        ws[r, D2] = d
        ws[r, NEED2] = need
        ws[r, N2] = n


@cuda.jit(**JIT_NT)
def final(k, KP, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, ws, sure, buf, cap, top,
          parent, child, code):
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    hist = cuda.shared.array(NB, int32)
    scan = cuda.shared.array(SCAN_N, int32)
    res = cuda.shared.array(3, int32)
    srt = cuda.shared.array(NT, int64)
    tied = cuda.shared.array(TS, int64)
    ctr = cuda.shared.array(2, int64)
    n_sure = ws[r, NSURE]
    for i in range(tid, KP, NT):
        srt[i] = sure[r, i] if i < n_sure else 0
    if tid == 0:
        ctr[0] = n_sure
        ctr[1] = 0
    cuda.syncthreads()
    s1, need1, n1 = ws[r, S1], ws[r, NEED1], ws[r, N1]
    if need1 != n1:
        s2 = s1 - DIG if s1 > DIG else 0
        d2, need2, n2 = ws[r, D2], ws[r, NEED2], ws[r, N2]
        all2 = need2 == n2
        for base in range(0, n1, NT):
            i = base + tid
            ok = i < n1
            v = buf[r, i if ok else 0]
            dg = (v >> s2) & DM
            append(srt, ctr, 0, v, ok and (dg > d2 or (dg == d2 and all2)))
            if n2 <= TS:
                append(tied, ctr, 1, v, ok and dg == d2 and not all2)
        cuda.syncthreads()
        if not all2:  # s2 > 0 here: a last digit leaves one key a bin
            prefix = (ws[r, D1] << s1) | (d2 << s2)
            s3 = s2 - DIG if s2 > DIG else 0
            if n2 <= TS:  # the tied keys all match the prefix down to s2
                p, sh3 = radix(hist, tied, 1, n2, 0, need2, prefix, s2, s3, hist, scan, res, NT)
                collect(hist, tied, 1, n2, 0, p, s2, sh3, srt, ctr)
            else:
                p, sh3 = radix(hist, buf[r], 1, n1, 0, need2, prefix, s2, s3, hist, scan, res,
                               NT)
                collect(hist, buf[r], 1, n1, 0, p, s2, sh3, srt, ctr)
    sort_desc(srt, KP)
    decode(srt, k, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top, parent,
           child, code)


def chunk(N: int, R: int, sms: int) -> int:
    """Keys a block of hist1/filter1 reads (a multiple of 4 NT): as many as leave one wave of
    blocks (1,024 threads each, one an SM) where the requests fill the GPU; fewer blocks in a
    second wave measured slower (the wave's latency, not its bytes, bounds them)."""
    per = max(1, sms // max(R, 1))  # blocks a request
    step = 4 * NT
    keys = -(-N // per)  # a block's share, rounded up to whole steps
    return max(step, -(-keys // step) * step)


def run(launch, R, N, k, KP, F, FM, B, sc, nd, lp, trie, outs, dev, arr):
    """The four launches (``launch(fn, grid, threads)``) for R requests of N candidates."""
    g1 = -(-N // (T1 * CPT))
    ch = chunk(N, R, SMS_SIM if SIMULATED else _sms(dev))
    g2 = -(-N // ch)
    kbuf = torch.empty(R, N, dtype=torch.int32, device=dev)
    part = torch.empty(R, g1, 2, dtype=torch.int64, device=dev)
    ws = torch.empty(R, W_LEN, dtype=torch.int64, device=dev)
    sure = torch.empty(R, k, dtype=torch.int64, device=dev)
    buf = torch.empty(R, N, dtype=torch.int64, device=dev)
    kb, pa, w = arr(kbuf), arr(part), arr(ws)
    launch(keys, (g1, R), T1)(N, F, FM, B, sc, nd, *lp, *trie, kb, pa, w)
    launch(hist1, (g2, R), NT)(N, k, ch, kb, pa, w)
    launch(filter1, (g2, R), NT)(N, ch, kb, w, arr(sure), arr(buf))
    launch(final, (R,), NT)(k, KP, F, FM, B, sc, nd, *lp, *trie, w, arr(sure), arr(buf), *outs)


@functools.lru_cache(maxsize=None)
def _sms(dev) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count
