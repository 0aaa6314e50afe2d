"""Device functions of the radix selection kernels (``trie_topk_one``, ``trie_topk_grid``).

A candidate ``c`` with fp32 score ``x`` becomes one int64 *key*: ``t << 31 | (MAXC - c)``, where
``t`` is the score's order-preserving 32 bits (``okey``) shifted so that the smallest real score
of the request gives 1 (every ``-inf`` gives 0). Keys are distinct (the low bits hold ``c``) and
compare as the stable order does: higher score first, then the lower ``c``. Shifting by the
request's minimum (``tmin``) and reading digits from the highest bit of ``tmax - tmin`` down makes
the first digit spread the request's scores over its bins instead of spending a round on the
sign and exponent bits they all share.

On the GPU a block is ``NT`` = 1,024 threads and a digit ``DIG`` = 10 bits, so a histogram has one
bin per thread and a bin pick is one block scan (warp shuffles, two barriers). Histogram adds are
warp-aggregated (``match_any_sync``), list appends take one atomic per warp (``ballot_sync``),
and the final bitonic sort exchanges through shuffles below a stride of 32 and shared memory
above. The CUDA simulator has no warp intrinsics: there (``SIMULATED``) every exchange goes
through shared memory, on small blocks, so CI runs the same networks of stages.
"""

from __future__ import annotations

import os

import numpy as np
from numba import cuda, float32, int32, int64

from .trie_topk import SIMULATED

NT, DIG = (32, 5) if SIMULATED else (1024, 10)  # threads of a select block; digit bits
NB = 1 << DIG  # bins; NT threads a block (a bin each in the grid passes)
DM = int64(NB - 1)
NW = NT // 32  # warps of a block (the scan's totals; NT under the simulator: its scan array)
SCAN_N = NT if SIMULATED else NW
RED_N = 2 + 2 * NW  # minmax scratch
WARPX = 1 if SIMULATED else 32  # strides at or above this exchange through shared memory
FULL = -1 if SIMULATED else int32(-1)  # every lane of a warp
MAXC = int64(0x7FFFFFFF)  # candidate indices below 2**31
LOW32 = int64(0xFFFFFFFF)
KEY_NEG_INF = int64(0x007FFFFF)  # okey(-inf)
BIG = int64(1) << 40
M40 = int64((1 << 40) - 1)
NEG_INF = float32(-np.inf)
# Histogram adds aggregated over a warp's lanes of one bin (match_any_sync) or one atomic each
# (STREAMGR_TOPK_MATCH=0), for A/B runs.
MATCH = os.environ.get("STREAMGR_TOPK_MATCH", "1") == "1"
# The kernels' options: STREAMGR_NUMBA_LINEINFO=1 keeps source lines for ncu's stall attribution.
JIT = {} if SIMULATED else {"lineinfo": os.environ.get("STREAMGR_NUMBA_LINEINFO") == "1"}
# Kernels launched with NT = 1,024 threads may use 64 registers a thread at most, or the launch
# fails: Numba sets no launch bounds, and a strided (unaligned) view's indexing took more.
JIT_NT = JIT if SIMULATED else dict(JIT, max_registers=65536 // NT)

if SIMULATED:
    def _bits(x):
        return int(np.float32(x).view(np.int32))

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
def okey(val):
    """The fp32 score's order-preserving 32 bits as an int64 (-0.0 as +0.0: they tie)."""
    b = int64(_bits(val + float32(0.0)))
    u = b & LOW32
    return (LOW32 ^ u) if b < 0 else (u | int64(0x80000000))


@cuda.jit(device=True, inline=True)
def tkey(key32, c, tmin):
    """Candidate c's key from its okey and the request's smallest real okey."""
    t = key32 - tmin + 1 if key32 >= tmin else int64(0)
    return (t << 31) | (MAXC - c)


@cuda.jit(device=True, inline=True)
def cand(r, c, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off):
    """Candidate c of request r: (score, -inf where no child; child node; code), with every
    load issued at a clamped index before any branch, so that the loads of several candidates
    computed in a row overlap; ``FM`` is ``magic(F)``. ``logp`` holds raw bits: fp32 (int32,
    ``sh`` 0) or bf16 logits
    (int16, ``sh`` 16) read with ``lse`` [2, rows] (each row's max and log-sum): the fp32
    ``(x - max) - logsum`` of ``LogProbs.gather``, bit for bit."""
    b = div_f(c, FM)  # c // F without a division
    j = c - b * F
    s = scores[r, b]
    alive = s > NEG_INF
    n = nodes[r, b]
    n = n if alive else 0
    lo = ptr[n]
    real = alive and j < ptr[n + 1] - lo
    ch = lo + j if real else int64(0)
    cd = codes[ch]
    row = r * B + b
    x = _float(int32(logp[row, off + cd]) << sh)
    if sh:
        x = (x - lse[0, row]) - lse[1, row]
    if real:
        return s + x, ch, cd
    return NEG_INF, int64(0), int64(0)


@cuda.jit(device=True, inline=True)
def ckey(r, c, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off):
    v, _, _ = cand(r, c, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
    return okey(v)


@cuda.jit(device=True, inline=True)
def note(kx, i, key, lo, hi):
    """``kx[i]`` = the okey ``key`` as int32 bits; the running (smallest real, largest) okey."""
    kx[i] = int32(key - (int64(1) << 32) if key >= (int64(1) << 31) else key)
    hi = max(hi, key)
    if key > KEY_NEG_INF:
        lo = min(lo, key)
    return lo, hi


@cuda.jit(device=True, inline=True)
def note4(kx, i0, step, r, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, lo, hi):
    """``note`` of the okeys of candidates ``i0 + j * step`` (j < 4, those below N): their four
    load chains issued at clamped indices before any store, so that they overlap."""
    k0 = ckey(r, min(i0, N - 1), F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
    k1 = ckey(r, min(i0 + step, N - 1), F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
    k2 = ckey(r, min(i0 + 2 * step, N - 1), F, FM, B, scores, nodes, logp, lse, sh, ptr, codes,
              off)
    k3 = ckey(r, min(i0 + 3 * step, N - 1), F, FM, B, scores, nodes, logp, lse, sh, ptr, codes,
              off)
    if i0 < N:
        lo, hi = note(kx, i0, k0, lo, hi)
    if i0 + step < N:
        lo, hi = note(kx, i0 + step, k1, lo, hi)
    if i0 + 2 * step < N:
        lo, hi = note(kx, i0 + 2 * step, k2, lo, hi)
    if i0 + 3 * step < N:
        lo, hi = note(kx, i0 + 3 * step, k3, lo, hi)
    return lo, hi


@cuda.jit(device=True, inline=True)
def lane_mask_lt(lane):
    return (int64(1) << lane) - 1


@cuda.jit(device=True, inline=True)
def minmax(lo, hi, red):
    """Block-wide (min, max) of the threads' ``lo`` and ``hi``, returned to every thread;
    ``red``: RED_N shared int64. Each warp reduces by shuffles, warp 0 reduces the warps'
    results (no 64-bit shared atomics: ptxas makes them compare-and-swap loops). Every thread
    calls it; it ends synchronized."""
    tid = cuda.threadIdx.x
    if SIMULATED:  # no shuffles: atomics on the two cells
        if tid == 0:
            red[0] = BIG
            red[1] = -1
        cuda.syncthreads()
        cuda.atomic.min(red, 0, lo)
        cuda.atomic.max(red, 1, hi)
        cuda.syncthreads()
        lo = red[0]
        hi = red[1]
        cuda.syncthreads()
        return lo, hi
    lane = tid & 31
    for o in (16, 8, 4, 2, 1):
        lo = min(lo, cuda.shfl_xor_sync(FULL, lo, o))
        hi = max(hi, cuda.shfl_xor_sync(FULL, hi, o))
    if lane == 0:
        red[2 + (tid >> 5)] = lo
        red[2 + NW + (tid >> 5)] = hi
    cuda.syncthreads()
    if tid < 32:
        n = (cuda.blockDim.x + 31) >> 5
        lo = red[2 + lane] if lane < n else BIG
        hi = red[2 + NW + lane] if lane < n else int64(-1)
        for o in (16, 8, 4, 2, 1):
            lo = min(lo, cuda.shfl_xor_sync(FULL, lo, o))
            hi = max(hi, cuda.shfl_xor_sync(FULL, hi, o))
        if lane == 0:
            red[0] = lo
            red[1] = hi
    cuda.syncthreads()
    lo = red[0]
    hi = red[1]
    cuda.syncthreads()
    return lo, hi


@cuda.jit(device=True, inline=True)
def hist_add(hist, bin_, take):
    """hist[bin_] += 1 where ``take``; every lane of the warp calls it (uniform loops)."""
    if SIMULATED or not MATCH:
        if take:
            cuda.atomic.add(hist, bin_, 1)
        return
    b = int32(bin_) if take else int32(-1)
    peers = cuda.match_any_sync(FULL, b)
    lane = cuda.threadIdx.x & 31
    if take and (int64(peers) & lane_mask_lt(lane)) == 0:  # the lowest lane of its bin adds
        cuda.atomic.add(hist, bin_, cuda.popc(peers))


@cuda.jit(device=True, inline=True)
def append(out, ctr, at, v, take):
    """out[ctr[at]++] = v where ``take``, one atomic per warp; every lane calls it. ``ctr``
    is a shared or global int64 array. Returns the slot (or -1)."""
    if SIMULATED:
        if take:
            p = cuda.atomic.add(ctr, at, 1)
            out[p] = v
            return p
        return int64(-1)
    mask = cuda.ballot_sync(FULL, take)
    lane = cuda.threadIdx.x & 31
    base = int64(0)
    if lane == 0 and mask != 0:
        base = cuda.atomic.add(ctr, at, int64(cuda.popc(mask)))
    base = cuda.shfl_sync(FULL, base, 0)
    if take:
        p = base + cuda.popc(int64(mask) & lane_mask_lt(lane))
        out[p] = v
        return p
    return int64(-1)


@cuda.jit(device=True, inline=True)
def block_scan(x, scan, nt):
    """Inclusive prefix sum of ``x`` over threads ``0 .. nt-1`` (a multiple of 32 on the GPU;
    the others pass the barriers only). ``scan``: SCAN_N shared int32. Every thread calls it;
    it ends synchronized."""
    tid = cuda.threadIdx.x
    work = tid < nt
    if SIMULATED:  # one thread sums in order (each simulated barrier costs milliseconds)
        if work:
            scan[tid] = x
        cuda.syncthreads()
        if tid == 0:
            for i in range(1, nt):
                scan[i] += scan[i - 1]
        cuda.syncthreads()
        out = scan[tid] if work else 0
        cuda.syncthreads()
        return out
    lane = tid & 31
    w = tid >> 5
    if work:
        for o in (1, 2, 4, 8, 16):
            y = cuda.shfl_up_sync(FULL, x, o)
            if lane >= o:
                x += y
        if lane == 31:
            scan[w] = x
    cuda.syncthreads()
    if w == 0:
        t = scan[lane] if lane < (nt >> 5) else 0
        for o in (1, 2, 4, 8, 16):
            y = cuda.shfl_up_sync(FULL, t, o)
            if lane >= o:
                t += y
        if lane < (nt >> 5):
            scan[lane] = t
    cuda.syncthreads()
    out = x + (scan[w - 1] if w > 0 and work else 0)
    cuda.syncthreads()
    return out


@cuda.jit(device=True, inline=True)
def pick(hist, want, scan, res, nt):
    """The bin holding the ``want``-th highest key of ``hist[:NB]`` (shared): (bin, how many
    of its keys are still wanted, its count). Threads ``t < nt`` own ``NB // nt`` bins each,
    the highest first. Every thread calls it; it ends synchronized."""
    tid = cuda.threadIdx.x
    per = NB // nt
    hi = NB - 1 - tid * per
    own = int32(0)
    if tid < nt:
        for e in range(per):
            own += hist[hi - e]
    incl = block_scan(own, scan, nt)
    above = incl - own
    if tid < nt and above < want and want <= incl:
        for e in range(per):
            h = hist[hi - e]
            if above + h >= want:
                res[0] = hi - e
                res[1] = want - above
                res[2] = h
                break
            above += h
    cuda.syncthreads()
    return int64(res[0]), int64(res[1]), int64(res[2])


@cuda.jit(device=True, inline=True)
def getkey(k32, k64, mode, i, tmin):
    """Key i of a list: mode 0, ``k32[i]`` an okey (int32 bits) of candidate i; else ``k64[i]``."""
    if mode == 0:
        return tkey(int64(k32[i]) & LOW32, int64(i), tmin)
    return k64[i]


@cuda.jit(device=True, inline=True)
def radix(k32, k64, mode, cnt, tmin, want, prefix, fixed, shift, hist, scan, res, nt):
    """Radix select over the keys of a list whose bits at and above ``fixed`` equal
    ``prefix``'s (others are skipped): digits from ``shift`` down until a bin holds exactly the
    keys still wanted. Returns (prefix with the picked digits, the last digit's shift): the
    wanted keys are those matching at ``fixed`` whose bits from that shift up are at least
    the prefix's. Threads ``t < nt`` work (few: every round's fixed cost is paid by each
    working warp, and one SM issues for all of a block's); every thread calls it; it ends
    synchronized."""
    tid = cuda.threadIdx.x
    work = tid < nt
    while True:
        if work:
            for i in range(tid, NB, nt):
                hist[i] = 0
        cuda.syncthreads()
        if work:
            for base in range(0, cnt, nt):
                i = base + tid
                ok = i < cnt
                v = getkey(k32, k64, mode, i if ok else 0, tmin)
                hist_add(hist, int32((v >> shift) & DM),
                         ok and (v >> fixed) == (prefix >> fixed))
        cuda.syncthreads()
        d, need, inbin = pick(hist, want, scan, res, nt)
        prefix |= d << shift
        if need == inbin or shift == 0:
            return prefix, shift
        want = need
        fixed = shift
        shift = shift - DIG if shift > DIG else 0


@cuda.jit(device=True, inline=True)
def collect(k32, k64, mode, cnt, tmin, prefix, fixed, shift, out, ctr):
    """Append the list's keys that match ``prefix`` at ``fixed`` and reach it from ``shift``
    up (``radix``'s answer) to ``out`` at ``ctr[0]``, with every thread of the block. Ends
    synchronized."""
    thr = prefix >> shift
    nt = cuda.blockDim.x
    for base in range(0, cnt, nt):
        i = base + cuda.threadIdx.x
        ok = i < cnt
        v = getkey(k32, k64, mode, i if ok else 0, tmin)
        append(out, ctr, 0, v, ok and (v >> fixed) == (prefix >> fixed) and (v >> shift) >= thr)
    cuda.syncthreads()


@cuda.jit(device=True, inline=True)
def sort_desc(srt, KP):
    """Bitonic sort of ``srt[:KP]`` (shared int64, KP a power of two <= the block) descending:
    one key
    a thread, strides below WARPX through shuffles, the others through ``srt`` (two barriers
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


@cuda.jit(device=True, inline=True)
def decode(srt, k, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top, parent,
           child, code):
    """The sorted keys' candidates: scores (recomputed: the same fp32 add), parent beams, child
    nodes and codes; ranks at or past the request's width ``cap[r]`` score -inf."""
    for i in range(cuda.threadIdx.x, k, cuda.blockDim.x):
        c = MAXC - (srt[i] & MAXC)
        val, ch, cd = cand(r, c, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
        top[r, i] = val if i < cap[r] else NEG_INF
        parent[r, i] = div_f(c, FM)
        child[r, i] = ch
        code[r, i] = cd


if SIMULATED:  # the simulator's clz counts over 32 bits only
    def bit_length(x):
        return int(x).bit_length()
else:
    @cuda.jit(device=True, inline=True)
    def bit_length(x):
        """Bits of a non-negative int64."""
        return 64 - cuda.clz(x)


@cuda.jit(device=True, inline=True)
def div_f(c, FM):
    """``c // F`` for ``FM = magic(F)``."""
    return (c * (FM & M40)) >> (FM >> 40)


def magic(F: int) -> int:
    """``c // F`` for 0 <= c < 2**30 as ``(c * m) >> s`` (Hacker's Delight, round-up method:
    exact, checked in the tests), packed as ``m | s << 40`` (m <= 2**32 + 1)."""
    sh = 31 + (F - 1).bit_length()
    return ((1 << sh) // F + 1) | (sh << 40)
