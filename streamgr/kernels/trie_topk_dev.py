"""Block-wide device functions of the radix selection kernels (``trie_topk_one``,
``trie_topk_bins``): min/max, histogram adds, list appends, scans, digit picks and the radix rounds,
over the keys of ``trie_topk_keys`` (the final bitonic sort: ``trie_topk_bitonic``).

On the GPU a block is ``NT`` = 1,024 threads and a digit ``DIG`` = 10 bits, so a histogram has one
bin per thread and a bin pick is one block scan (warp shuffles, two barriers). Histogram adds are
one shared atomic a key (``MATCH``), list appends one atomic per warp (``ballot_sync``, or a
shuffle scan: ``reserve_slots``). The CUDA simulator has no warp intrinsics: there
(``SIMULATED``) every exchange goes through shared memory, on small blocks, so CI runs the same
networks of stages.
"""

from __future__ import annotations

import os

from numba import cuda, int32, int64, uint32

from .numba_common import INLINE
from .trie_topk import SIMULATED
from .trie_topk_keys import LOW32, ix, tkey

NT, DIG = (32, 5) if SIMULATED else (1024, 10)  # threads of a select block; digit bits
NB = 1 << DIG  # bins; NT threads a block (a bin each in the grid passes)
assert NB == NT  # a bin a thread: the one-block kernel's histogram relies on it
DM = int64(NB - 1)
NW = NT // 32  # warps of a block (the scan's totals; NT under the simulator: its scan array)
SCAN_N = NT if SIMULATED else NW
RED_N = 2 + 2 * NW  # minmax scratch
WARPX = 1 if SIMULATED else 32  # strides at or above this exchange through shared memory
FULL = -1 if SIMULATED else int32(-1)  # every lane of a warp
BIG = int64(1) << 40
I32MAX = int32(0x7FFFFFFF)
HALF = int64(1) << 31
SEG_MAX = 4 if SIMULATED else 128  # keys a bin's segment ranks one by one (else a sort)
# Histogram adds one shared atomic a key, or aggregated over a warp's lanes of one bin
# (match_any_sync; STREAMGR_TOPK_MATCH=1, for A/B runs): match_any costs more than the atomics
# it saves where most lanes' bins differ, as in every phase here (on the H200 step 1 0.0142 ->
# 0.0131 ms, step 2 0.0238 -> 0.0222, step 3 at beams of 1,024 0.0290 -> 0.0275, session 32).
MATCH = os.environ.get("STREAMGR_TOPK_MATCH", "0") == "1"
# The kernels' options: STREAMGR_NUMBA_LINEINFO=1 keeps source lines for ncu's stall attribution.
JIT = {} if SIMULATED else {"lineinfo": os.environ.get("STREAMGR_NUMBA_LINEINFO") == "1"}
# Kernels launched with NT = 1,024 threads may use 64 registers a thread at most, or the launch
# fails: Numba sets no launch bounds, and a strided (unaligned) view's indexing took more.
JIT_NT = JIT if SIMULATED else dict(JIT, max_registers=65536 // NT)


@cuda.jit(device=True, **INLINE)
def lane_mask_lt(lane):
    return (int64(1) << lane) - 1


@cuda.jit(device=True, **INLINE)
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


@cuda.jit(device=True, **INLINE)
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


@cuda.jit(device=True, **INLINE)
def append(out, ctr, at, v, take):
    """out[ctr[at]++] = v where ``take``, one atomic per warp; every lane calls it. ``ctr``:
    a global int64 array or a shared int32 one (ptxas makes a 64-bit shared atomic add a
    compare-and-swap loop: ~9 rounds an add under the block's contention, ncu, session 27).
    Returns the slot (or -1)."""
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
        base = int64(cuda.atomic.add(ctr, at, cuda.popc(mask)))
    base = cuda.shfl_sync(FULL, base, 0)
    if take:
        p = base + cuda.popc(int64(mask) & lane_mask_lt(lane))
        out[p] = v
        return p
    return int64(-1)


@cuda.jit(device=True, **INLINE)
def warp_min_into(m, cell, at):
    """The block-wide min of the threads' int32 ``m``, returned to every thread: each warp's by
    shuffles, then one shared atomic a warp into ``cell[at]`` (``I32MAX`` on entry, published).
    Every thread calls it; it ends with one barrier (the callers leave ``cell[at]`` alone until
    a later one)."""
    if not SIMULATED:
        for o in (16, 8, 4, 2, 1):
            m = min(m, cuda.shfl_xor_sync(FULL, m, o))
    if SIMULATED or (cuda.threadIdx.x & 31) == 0:
        if m != I32MAX:
            cuda.atomic.min(cell, at, m)
    cuda.syncthreads()
    return cell[at]


@cuda.jit(device=True, **INLINE)
def reserve_slots(c, ctr):
    """The first of this thread's ``c`` slots of a list counted at ``ctr[0]`` (shared int32):
    the warp's lanes in order, one atomic a warp, no block barrier (the list's order across
    warps is the atomics'). Every lane calls it."""
    if SIMULATED:
        return int64(cuda.atomic.add(ctr, 0, c))
    lane = cuda.threadIdx.x & 31
    x = int32(c)  # kept 32-bit: Numba widens int32 sums to int64 (two shuffles a step)
    for o in (1, 2, 4, 8, 16):
        y = cuda.shfl_up_sync(FULL, x, o)
        x = int32(x + y) if lane >= o else x
    base = int32(0)
    if lane == 31:
        base = cuda.atomic.add(ctr, 0, x)
    base = cuda.shfl_sync(FULL, base, 31)
    return int64(base) + int64(x) - int64(c)


@cuda.jit(device=True, **INLINE)
def block_scan(x, scan, nt, tail=True):
    """(inclusive prefix sum of ``x`` over threads ``0 .. nt-1``, their total), the total to
    every thread (``nt`` a multiple of 32 on the GPU; the others pass the barriers only).
    ``scan``: SCAN_N shared int32. Every thread calls it; it ends synchronized, or with
    ``tail`` False (a constant) unsynchronized: the caller then passes a barrier before
    ``scan`` is written again."""
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
        total = scan[nt - 1]
        cuda.syncthreads()
        return out, total
    lane = tid & 31
    w = tid >> 5
    x = int32(x)  # 32-bit sums, each cast back: a 64-bit scan shuffles twice a step
    if work:
        for o in (1, 2, 4, 8, 16):
            y = cuda.shfl_up_sync(FULL, x, o)
            if lane >= o:
                x = int32(x + y)
        if lane == 31:
            scan[w] = x
    cuda.syncthreads()
    if w == 0:
        t = scan[lane] if lane < (nt >> 5) else int32(0)
        for o in (1, 2, 4, 8, 16):
            y = cuda.shfl_up_sync(FULL, t, o)
            if lane >= o:
                t = int32(t + y)
        if lane < (nt >> 5):
            scan[lane] = t
    cuda.syncthreads()
    out = int32(x + (scan[w - 1] if w > 0 and work else int32(0)))
    total = scan[(nt >> 5) - 1]
    if tail:
        cuda.syncthreads()
    return out, total


@cuda.jit(device=True, **INLINE)
def pick(hist, nbins, want, scan, res, nt):
    """The bin holding the ``want``-th highest key of ``hist[:nbins]`` (shared): (bin, how
    many of its keys are still wanted, its count). Threads ``t < nt`` own ``nbins // nt`` bins
    each, the highest first. Every thread calls it; it ends synchronized."""
    pick_scan(hist, nbins, want, scan, res, nt)
    return int64(res[0]), int64(res[1]), int64(res[2])


@cuda.jit(device=True, **INLINE)
def pick_scan(hist, nbins, want, scan, res, nt, sync=True):
    """``pick``'s answer into ``res[:3]`` (untouched where the bins hold fewer than ``want``);
    returns this thread's (keys in the bins above its own, its highest bin). ``sync`` (a
    constant): end with the barrier that publishes ``res`` (else the caller's next one)."""
    tid = cuda.threadIdx.x
    per = nbins // nt
    hi = nbins - 1 - tid * per
    own = int32(0)
    if tid < nt:
        for e in range(per):
            own = int32(own + hist[ix(hi - e)])  # unsigned: no wraparound code
    incl, _ = block_scan(own, scan, nt, False)  # a barrier ends this (``sync``, or the caller's)
    first = int32(incl - own)
    above = first
    w = int32(want)  # below 2**31 (a request's candidates): 32-bit sums, as block_scan's
    if tid < nt and above < w and w <= incl:
        for e in range(per):
            h = hist[ix(hi - e)]
            if int32(above + h) >= w:
                res[0] = hi - e
                res[1] = int32(w - above)
                res[2] = h
                break
            above = int32(above + h)
    if sync:
        cuda.syncthreads()
    return first, hi


@cuda.jit(device=True, **INLINE)
def pick_segments(cnt, nbins, want, seg_max, scan, res):
    """``pick`` over the counts ``cnt[b]`` (``b < nbins``, shared) that also lays the bins out
    best first for ranking: ``cnt[b]`` becomes the keys in bins above ``b`` (a thread reads its
    bins before it writes them). Returns (the bin of the ``want``-th key, how many of its keys
    are still wanted, its count, 1 if a bin from it up holds more than ``seg_max`` keys).
    Threads own ``nbins // NT`` bins each, the highest first. ``res``: 4 shared int32. Every
    thread calls it; it ends synchronized."""
    tid = cuda.threadIdx.x
    per = nbins // NT
    hi = nbins - 1 - tid * per
    if tid == 0:
        res[3] = 0  # before the scan's barriers: every set below comes after them
    own = int32(0)
    for e in range(per):
        own = int32(own + cnt[hi - e])
    incl, _ = block_scan(own, scan, NT, False)  # the barrier at the end publishes it all
    above = int32(incl - own)
    w = int32(want)  # at most a block's keys: 32-bit sums throughout (as block_scan's)
    for e in range(per):
        h = cnt[hi - e]
        if above < w:  # the bins from the want-th key's up (ranked one by one)
            if w <= int32(above + h):
                res[0] = hi - e
                res[1] = int32(w - above)
                res[2] = h
            if h > seg_max:
                res[3] = 1
        cnt[hi - e] = above
        above = int32(above + h)
    cuda.syncthreads()
    return int64(res[0]), int64(res[1]), int64(res[2]), res[3]


@cuda.jit(device=True, **INLINE)
def bin_rank(keys, v, b, cur, nbins):
    """The rank of key ``v`` of bin ``b`` in ``keys`` laid out by bin (``cur[b]``: bin b's
    segment end, the next lower bin's start): the keys of the bins above and the (distinct)
    keys of its bin above it."""
    s = int32(cur[b + 1]) if b < nbins - 1 else int32(0)
    e = int32(cur[b])
    rank = s
    # 32-bit, each sum cast back (Numba widens int32 sums): range()'s 64-bit trip count took
    # ~45 SASS instructions before each key's first compare (ncu, session 46)
    while s < e:
        rank = int32(rank + int32(keys[uint32(s)] > v))
        s = int32(s + int32(1))
    return int64(rank)


@cuda.jit(device=True, **INLINE)
def getkey(k32, k64, mode, i, tmin):
    """Key i of a list: mode 0, ``k32[i]`` an okey (int32 bits) of candidate i; else ``k64[i]``."""
    if mode == 0:
        return tkey(int64(k32[i]) & LOW32, int64(i), tmin)
    return k64[i]


@cuda.jit(device=True, **INLINE)
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
        d, need, inbin = pick(hist, NB, want, scan, res, nt)
        prefix |= d << shift
        if need == inbin or shift == 0:
            return prefix, shift
        want = need
        fixed = shift
        shift = shift - DIG if shift > DIG else 0


@cuda.jit(device=True, **INLINE)
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


if SIMULATED:  # the simulator's clz counts over 32 bits only
    def bit_length(x):
        return int(x).bit_length()
else:
    @cuda.jit(device=True, **INLINE)
    def bit_length(x):
        """Bits of a non-negative int64."""
        return 64 - cuda.clz(x)
