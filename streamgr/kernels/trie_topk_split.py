"""The answer of ``trie_topk_kept``'s one launch split over a request's blocks, where they are
one thread block cluster (``STREAMGR_TOPK_CLUSTER=1``): after the cluster's barrier every block
holds what the last block alone reads otherwise (the request's histogram, each block's counts
and its kept keys in bin order, all in global memory), so each block picks ``D`` itself and
answers a slice of the ranks instead of one block ranking all ``k``.

Each block owns the bins from ``D`` up whose first rank (the request's keys above the bin)
falls in its ``k / G`` share of the ranks (``my_bins``): whole bins, so the slices meet at bin
edges and ranking within a bin stays in one block. It reads its bins' keys from every block's
segment (``range_starts``: each block's first key of the range and how many, those past ``D``
first; ``range_fetch``), ranks them as the last block does (``trie_topk_rank.rank_answer``, or
where ``D`` is its and crowded the radix select from ``buf``) and answers from rank ``off``:
the request's keys above its bins. A block whose share holds no bin answers nothing. The last
block zeroes the request's counters after a second barrier (every block has read them).

Under the CUDA simulator, which runs blocks one after another, the launch runs twice
(``SIM_PHASE``): the scoring, then the answers; there the last block runs after the others.
An A/B setting, not yet run on the H200 (session 49).
"""

from __future__ import annotations

from numba import cuda, int32, int64

from .numba_common import INLINE
from .trie_topk import SIMULATED
from .trie_topk_beams import GB
from .trie_topk_dev import FULL, NT, block_scan, pick_scan
from .trie_topk_keys import put_abs
from .trie_topk_rank import SRT_N, radix_rest, rank_answer

HG = 8  # the request's histogram in ws (trie_topk_kept's layout)

if SIMULATED:
    SIM_PHASE = [3]  # 1: scoring and keys, 2: answers; set by the host between two launches

    def phase():
        return SIM_PHASE[0]
else:
    @cuda.jit(device=True, **INLINE)
    def phase():
        """Both halves in one launch, the cluster's barrier between them."""
        return 3


@cuda.jit(device=True, **INLINE)
def prefix2(x, y, scan):
    """Inclusive prefix sums of two int32 over threads 0-31, as ``trie_topk_kept.starts`` and
    ``range_starts`` take each block's counts (at most 32 blocks): on the GPU one warp's
    shuffles (two block scans took four barriers), under the simulator block scans (no
    shuffles there; every thread calls it)."""
    tid = cuda.threadIdx.x
    if SIMULATED:
        x, _ = block_scan(x, scan, NT)
        y, _ = block_scan(y, scan, NT)
        return x, y
    if tid >= 32:
        return int32(0), int32(0)
    for o in (1, 2, 4, 8, 16):
        xo = cuda.shfl_up_sync(FULL, x, o)
        yo = cuda.shfl_up_sync(FULL, y, o)
        if tid >= o:
            x = int32(x + xo)
            y = int32(y + yo)
    return x, y


@cuda.jit(device=True, **INLINE)
def seg_of(pre, gb, i):
    """The block whose keys hold the last block's key ``i``: the last of ``gb`` with
    ``pre <= i``."""
    lo = int32(0)
    hi = int32(gb - 1)
    while lo < hi:
        mid = int32((lo + hi + 1) >> 1)
        if pre[mid] <= i:
            lo = mid
        else:
            hi = int32(mid - 1)
    return lo


@cuda.jit(device=True, **INLINE)
def place(srt, buf, r, v, a, dn, above, small):
    """A fetched key to its slot: past ``D`` at ``a``, in ``D`` after those (``small``) or in
    ``buf``."""
    if a >= 0:
        srt[a] = v
    elif small:
        srt[above + dn] = v
    else:
        buf[r, dn] = v


@cuda.jit(device=True, **INLINE)
def my_bins(ws, r, k, G, blk, scan, res, lim):
    """(D, its keys wanted, its count, this block's highest bin, its lowest; -1 and GB where
    it owns none). The bins from ``D`` up (the request's histogram at ``ws[r, HG:]``), each
    owned by block ``A G // k`` where ``A`` is the request's keys above it (below ``k`` from
    ``D`` up). ``lim``: 2 shared int32, ``-1`` and ``GB`` on entry (published by the pick's
    barriers). Every thread calls it; it ends synchronized."""
    ex, hi = pick_scan(ws[r, HG:], GB, k, scan, res, NT)
    d = res[0]
    a = ex
    for e in range(GB // NT):
        g = hi - e
        h = int32(ws[r, HG + g])
        if g >= d and h != 0 and int32((int64(a) * G) // k) == blk:
            cuda.atomic.max(lim, 0, g)
            cuda.atomic.min(lim, 1, g)
        a = int32(a + h)
    cuda.syncthreads()
    return int32(d), int32(res[1]), int32(res[2]), lim[0], lim[1]


@cuda.jit(device=True, **INLINE)
def range_starts(cum, r, G, d, gh, gl, own_d, pre, pa, base, lim, scan):
    """For each of the request's ``G`` blocks (``cum``: its keys in each bin and above, from
    its own ``d`` up) its first key of bins ``gl .. gh`` in its segment (``base``), the prefix
    over the blocks of their keys there (``pre``) and of those past ``D`` (``pa``; all of them
    where this block does not own ``D``), ``G`` + 1 entries each, totals last; ``lim[2]``
    (0 on entry) the request's keys above ``gh``. The caller's next barrier publishes them."""
    tid = cuda.threadIdx.x
    n_all = int32(0)
    n_a = int32(0)
    if tid < G:
        b = cum[r, tid, gh + 1] if gh + 1 < GB else int32(0)
        n_all = int32(cum[r, tid, gl] - b)
        n_a = int32((cum[r, tid, d + 1] if d + 1 < GB else int32(0)) - b) if own_d else n_all
        base[tid] = b
        cuda.atomic.add(lim, 2, b)
    x, y = prefix2(n_all, n_a, scan)
    if tid < G:
        pre[tid] = int32(x - n_all)
        pa[tid] = int32(y - n_a)
        if tid == G - 1:
            pre[G] = x
            pa[G] = y


@cuda.jit(device=True, **INLINE)
def range_fetch(kept, r, ch, pre, pa, base, G, i):
    """Key ``i`` of this block's bins, taken from the blocks' segments in block order (as
    ``trie_topk_kept.fetch``, from each one's ``base``): (key, its slot among those past ``D``
    or -1, its slot among ``D``'s)."""
    lo = seg_of(pre, G, i)
    j = int32(i - pre[lo])
    na = int32(pa[lo + 1] - pa[lo])
    v = kept[r, int64(lo) * ch + base[lo] + j]
    return v, int32(pa[lo] + j) if j < na else int32(-1), int32(pre[lo] - pa[lo] + j - na)


@cuda.jit(device=True, **INLINE)
def split_answer(k, KP, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, ws, kept, cum,
                 buf, cap, top, parent, child, code, ch, r, blk, G, scan, res, red, cnt, pre,
                 pa, srt, seg2, hist2):
    """This block's slice of the request's answer (the module's docstring), after every block
    of the request wrote its keys, counts and bins. Every thread calls it; it ends
    synchronized."""
    tid = cuda.threadIdx.x
    lim = cuda.shared.array(3, int32)
    base = cuda.shared.array(33, int32)  # trie_topk_kept.GMAX1
    if tid == 0:
        lim[0] = -1
        lim[1] = GB
        lim[2] = 0
    d, need, nd, gh, gl = my_bins(ws, r, k, G, blk, scan, res, lim)
    if gh < 0:  # no bin of the request's answer is this block's
        return
    own_d = gl == d
    range_starts(cum, r, G, d, gh, gl, own_d, pre, pa, base, lim, scan)
    cuda.syncthreads()
    above = pa[G]  # this block's keys past D
    total = pre[G]  # and D's, where D is its own
    kb = int32(above + need) if own_d else total  # the ranks it answers
    small = total <= SRT_N
    if tid == 0:
        cnt[0] = above  # radix_rest's appends (where D is crowded)
    if small:  # two keys a thread at most: both loads issued before either is placed
        w0, a0, n0 = range_fetch(kept, r, ch, pre, pa, base, G, min(tid, total - 1))
        w1, a1, n1 = range_fetch(kept, r, ch, pre, pa, base, G, min(tid + NT, total - 1))
        if tid < total:
            place(srt, buf, r, w0, a0, n0, above, True)
        if tid + NT < total:
            place(srt, buf, r, w1, a1, n1, above, True)
    else:
        for i in range(tid, total, NT):
            w0, a0, n0 = range_fetch(kept, r, ch, pre, pa, base, G, i)
            place(srt, buf, r, w0, a0, n0, above, False)
    cuda.syncthreads()
    if not small:  # ties crowd D: the rest of its share from buf (appended at cnt[0])
        radix_rest(buf, r, nd, need, hist2, scan, res, red, srt, cnt)
        total = kb
    o = lim[2]
    if not rank_answer(srt, seg2, hist2, scan, res, red, total, kb, KP, r, F, FM, scores, nodes,
                       ptr, codes, cap, top, parent, child, code, o):
        for i in range(tid, kb, NT):  # sorted where ties crowd a bin: answers from the keys
            put_abs(srt[i], i + o, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off,
                    cap, top, parent, child, code, int64(-1))
    cuda.syncthreads()
