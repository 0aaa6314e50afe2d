"""The request's last block of ``trie_topk_kept.kept_select``: where its keys come from and
how they are placed for ``trie_topk_rank.rank_answer``.

Each of the request's blocks wrote its kept keys to its own segment of ``kept`` in bin order,
best first, and its counts from each bin up to ``cum``. Once the last block knows ``D``, the
bin of the request's ``k``-th best, every warp loads the blocks' counts at ``D`` and ``D + 1``
into its lanes (``counts_at``) and sums them there (``wscan``: no barrier before any key is
loaded; ``kept_select`` puts its own keys while the counts come), each thread takes its keys
by those sums (``wfetch``, by shuffles) and places them (``place``), finding the keys' least
and best okeys along the way (``lohi``), so the ranking needs no reduction of its own. Where
ties crowd ``D`` (the keys past ``SRT_N``) and under the simulator (no shuffles), one warp sums
them into shared memory for all (``starts``, ``fetch``). On the H200 step 2 at beams of 1,024
the per-warp sums took 0.0201-0.0202 ms against one warp's 0.0204-0.0205 (session 56, call 1),
0.0201-0.0204 against 0.0203-0.0205 (call 2), with the answers' early loads of
``trie_topk_rank.first_level`` in both.
"""

from __future__ import annotations

from numba import cuda, int32, uint32

from .numba_common import INLINE
from .trie_topk import SIMULATED
from .trie_topk_dev import FULL, I32MAX, NT, block_scan
from .trie_topk_index import I32MIN, ix, signed_order

GMAX = 32  # blocks a request at most: one warp sums their counts (``starts``)
GMAX1 = GMAX + 1


@cuda.jit(device=True, **INLINE)
def fetch(kept, r, ch, pre, pa, gb, i):
    """The last block's key ``i`` of the keys in ``D`` and above, taken from the blocks'
    segments in block order (``pre``: each block's first, ``pa``: keys past ``D`` before it,
    ``gb`` + 1 entries each): (key, its slot among those past ``D`` or -1, its slot among
    ``D``'s)."""
    lo = int32(0)
    hi = int32(gb - 1)
    while lo < hi:  # the block whose keys hold i: the last with pre <= i
        mid = int32((lo + hi + 1) >> 1)
        if pre[ix(mid)] <= i:
            lo = mid
        else:
            hi = int32(mid - 1)
    a0 = pa[ix(lo)]
    return take(kept, r, ch, lo, pre[ix(lo)], a0, int32(pa[ix(lo + 1)] - a0), i)


@cuda.jit(device=True, **INLINE)
def take(kept, r, ch, b, p0, a0, na, i):
    """Key ``i`` from block ``b``'s segment, whose keys from ``D`` up start at ``p0`` of the
    last block's, those past ``D`` (its segment's first ``na``) at ``a0``: (key, its slot among
    those past ``D`` or -1, its slot among ``D``'s)."""
    j = int32(i - p0)
    v = kept[ix(r), ix(uint32(b) * uint32(ch) + uint32(j))]  # unsigned: no wraparound code
    return v, int32(a0 + j) if j < na else int32(-1), int32(p0 - a0 + j - na)


@cuda.jit(device=True, **INLINE)
def starts(cum, r, gb, d, pre, pa, scan, nbins):
    """Each of the request's ``gb`` (at most 32) blocks' first slot, in block order, of the
    keys from ``D`` (``d``) up into ``pre``, and of those past ``D`` into ``pa`` (``gb`` + 1
    entries, their total last), from the blocks' ``cum``: on the GPU by one warp's shuffles
    (two block scans took four barriers). The caller's next barrier publishes them."""
    tid = cuda.threadIdx.x
    n_all, n_a = counts_at(cum, r, tid, gb, d, nbins)
    x = int32(0)
    y = int32(0)
    if SIMULATED:  # no shuffles there
        x, _ = block_scan(n_all, scan, NT)
        y, _ = block_scan(n_a, scan, NT)
    elif tid < 32:
        x, y = scan2(n_all, n_a, tid)
    if tid < gb:
        pre[tid] = int32(x - n_all)
        pa[tid] = int32(y - n_a)
        if tid == gb - 1:
            pa[gb] = y


@cuda.jit(device=True, **INLINE)
def lohi(v0, v1, has0, has1, mm):
    """The block's least and best okeys (``v >> 31`` of its keys ``v0``, ``v1`` where it has
    them) into ``mm`` (shared int32, ``I32MAX`` and ``I32MIN`` on entry) in the signed order
    (``signed_order``: one 32-bit shuffle a step, as ``best_bound``'s), by each warp's shuffles
    and one shared atomic each a warp, along the placement's barrier (``minmax`` after it took
    two more: on the H200 the ranking's first phase 1.45 -> 0.58 us, the placing 1.19 -> 1.53,
    session 54). Every thread calls it."""
    a0 = signed_order(v0 >> 31)
    a1 = signed_order(v1 >> 31)
    lo = min(a0 if has0 else I32MAX, a1 if has1 else I32MAX)
    hi = max(a0 if has0 else I32MIN, a1 if has1 else I32MIN)
    if not SIMULATED:
        for o in (16, 8, 4, 2, 1):
            lo = min(lo, cuda.shfl_xor_sync(FULL, lo, o))
            hi = max(hi, cuda.shfl_xor_sync(FULL, hi, o))
    if SIMULATED or (cuda.threadIdx.x & 31) == 0:
        cuda.atomic.min(mm, 0, lo)
        cuda.atomic.max(mm, 1, hi)


@cuda.jit(device=True, **INLINE)
def place(srt, buf, r, v, a, dn, above, small):
    """A fetched key to its slot: past ``D`` at ``a``, in ``D`` after those (``small``) or in
    ``buf``."""
    if a >= 0:
        srt[ix(a)] = v
    elif small:
        srt[ix(above + dn)] = v
    else:
        buf[ix(r), ix(dn)] = v


@cuda.jit(device=True, **INLINE)
def wscan(n_all, n_a, lane):
    """``starts`` by every warp for itself, from lane ``lane``'s counts (``counts_at(cum, r,
    lane, ...)``, loaded by the caller, which may work while they come): lane ``l`` < ``gb``
    gets block ``l``'s first slot of the keys from ``D`` up and of those past ``D``, and its
    keys past ``D`` (lanes from ``gb`` on: the totals, and 0), for ``wfetch``'s shuffles. No
    barrier: each warp loads the ``2 gb`` counts itself (GPU only: shuffles)."""
    x, y = scan2(n_all, n_a, lane)
    return int32(x - n_all), int32(y - n_a), n_a


@cuda.jit(device=True, **INLINE)
def counts_at(cum, r, b, gb, d, nbins):
    """Block ``b``'s kept keys in bins from ``d`` up and past ``d`` (0, 0 for ``b`` >=
    ``gb``)."""
    n_all = int32(0)
    n_a = int32(0)
    if b < gb:
        n_all = cum[ix(r), ix(b), ix(d)]
        n_a = cum[ix(r), ix(b), ix(d + 1)] if d + 1 < nbins else int32(0)
    return n_all, n_a


@cuda.jit(device=True, **INLINE)
def scan2(x, y, lane):
    """Inclusive sums of ``x`` and ``y`` over the warp's lanes, by shuffles (every lane of
    the warp calls it)."""
    for o in (1, 2, 4, 8, 16):
        xo = cuda.shfl_up_sync(FULL, x, o)
        yo = cuda.shfl_up_sync(FULL, y, o)
        if lane >= o:
            x = int32(x + xo)
            y = int32(y + yo)
    return x, y


@cuda.jit(device=True, **INLINE)
def wfetch(kept, r, ch, wpre, wpa, wna, i):
    """``fetch`` from ``wscan``'s lanes: the block of key ``i`` (the last lane whose first
    slot is at most ``i``; the lanes past the blocks hold the total, above every ``i``) by
    five shuffles. Every lane of the warp calls it."""
    lo = int32(0)
    for o in (16, 8, 4, 2, 1):
        c = int32(lo + o)
        p = cuda.shfl_sync(FULL, wpre, c)
        if p <= i:
            lo = c
    return take(kept, r, ch, lo, cuda.shfl_sync(FULL, wpre, lo), cuda.shfl_sync(FULL, wpa, lo),
                cuda.shfl_sync(FULL, wna, lo), i)
