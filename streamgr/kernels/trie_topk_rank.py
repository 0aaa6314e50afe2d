"""A last block ordering its request's list: the grid selection's (``trie_topk_bins.bin_select``,
``trie_topk_kept.kept_select``) up to ``SRT_N`` = two blocks' worth of distinct keys, two a
thread, ranked by one histogram over linear bins of their scores (``lin_bin``) and answered by
the threads that hold them (``rank_answer``), or
sorted bitonically where a bin is crowded by ties (``sort_pairs``); and, for it and the merge's
fallback (``trie_topk_held.select_global``), the best of a longer list in global memory by one
radix select (``radix_rest``). On the H200 (session 44) ranking 1,000-1,300 keys took 3.9-4.2
us where the bitonic sort of 2,048 took 42.9 us.
"""

from __future__ import annotations

from numba import cuda, float32, int32, int64, uint32

from .numba_common import INLINE, stamp
from .trie_topk_index import beam_node, div_f, ix, node_span, slot, span_of
from .trie_topk_keys import LOW32, answer, key_c, okey_float
from .trie_topk_bitonic import sort_desc, sort_span
from .trie_topk_dev import (BIG, DIG, NB, NT, SEG_MAX, bin_rank, bit_length, collect, hist_add,
                            minmax, pick_segments, radix)

SRT_N = 2 * NT  # keys the last block holds (two a thread)
MAXK = int64(0x7FFFFFFFFFFFFFFF)


@cuda.jit(device=True, **INLINE)
def sort_k(srt, k, KP):
    """``srt[:k]`` (shared, written) sorted descending: padded with 0 (below every key) to
    ``KP``, the power of two ``sort_desc`` takes. Every thread calls it; it ends synchronized."""
    for i in range(k + cuda.threadIdx.x, KP, NT):
        srt[i] = 0
    cuda.syncthreads()
    sort_desc(srt, KP)


@cuda.jit(device=True, **INLINE)
def radix_rest(lists, r, n, want, hist, scan, res, red, out, ctr):
    """Append the ``want`` best of the ``n`` (more than ``want``) distinct int64 keys
    ``lists[r, :n]`` to ``out`` at ``ctr[0]`` (shared int32): one radix select by the bits
    below those all of them share. (The row's view is taken after the min and max: taken
    before, it held registers over them and ``bin_select`` spilled 8 bytes.) Every thread
    calls it; it ends synchronized."""
    lo = MAXK
    hi = int64(-1)
    for i in range(cuda.threadIdx.x, n, NT):
        v = lists[r, i]
        lo = min(lo, v)
        hi = max(hi, v)
    lo, hi = minmax(lo, hi, red)
    fixed = bit_length(lo ^ hi)  # n > want >= 1 distinct keys: they differ
    prefix = (hi >> fixed) << fixed
    shift = fixed - DIG if fixed > DIG else 0
    p, s = radix(hist, lists[r], 1, n, 0, want, prefix, fixed, shift, hist, scan, res, NT)
    collect(hist, lists[r], 1, n, 0, p, fixed, s, out, ctr)


@cuda.jit(device=True, **INLINE)
def sort_pairs(srt, P):
    """Bitonic sort of ``srt[:P]`` (shared int64, P a power of two, ``2 NT`` at most)
    descending, all through shared memory: each thread one compare-exchange a stage, for lists
    of up to two keys a thread (``sort_desc`` holds one a thread). Keys are distinct. Every
    thread calls it after the keys are published; it ends synchronized."""
    tid = cuda.threadIdx.x
    size = 2
    while size <= P:
        stride = size >> 1
        while stride > 0:
            for t in range(tid, P >> 1, cuda.blockDim.x):
                i = 2 * t - (t & (stride - 1))  # the pair's lower index: its ``stride`` bit 0
                a = srt[i]
                b = srt[i + stride]
                if (a < b) == ((i & size) == 0):  # descending where i's ``size`` bit is 0
                    srt[i] = b
                    srt[i + stride] = a
            cuda.syncthreads()
            stride >>= 1
        size <<= 1


@cuda.jit(device=True, **INLINE)
def slot_of(v, has, F, FM):
    """The beam and child slot (uint32) of absolute key ``v``'s candidate (0, 0 where there is
    no key)."""
    b, j = slot(key_c(v) if has else int64(0), F, FM)
    return uint32(b), j


@cuda.jit(device=True, **INLINE)
def lin_bin(u, lo, hi):
    """Okey ``u``'s bin of ``NB`` linear bins over the scores from okey ``lo`` to ``hi``: by
    score where their span is finite (linear in the okeys, a span across 0 crowded all but a
    few bins, the bins of tiny magnitudes being empty: gen-ref's bf16 bench step 2 at beams
    of 1,024 sorted its lists, 0.0690 ms against fp32's 0.0253 on the H200, session 48), else
    by okey (infinities, NaN). fp32 math, monotone in the key either way (every rounding is)."""
    xlo = okey_float(lo)
    span = okey_float(hi) - xlo
    if span > float32(0.0) and span < float32(3.0e38):
        x = (okey_float(u) - xlo) * (float32(NB - 1) / span)
    else:
        x = float32(u - lo) * (float32(NB - 1) / float32(max(hi - lo, int64(1))))
    return min(int32(x), int32(NB - 1))


@cuda.jit(device=True, **INLINE)
def held(srt, total):
    """The thread's two of the keys ``srt[:total]`` (``tid``'s and ``tid + NT``'s, 0 past
    ``total``) and whether it holds each."""
    tid = cuda.threadIdx.x
    has0 = tid < total
    has1 = tid + NT < total
    v0 = srt[tid] if has0 else int64(0)
    v1 = srt[min(tid + NT, SRT_N - 1)] if has1 else int64(0)
    return v0, v1, has0, has1


@cuda.jit(device=True, **INLINE)
def first_level(v0, v1, has0, has1, r, F, FM, scores, nodes):
    """The answers' first load level for keys ``v0``, ``v1`` (where held), issued: each key's
    child slot, and its beam's score and node (``beam_node``)."""
    p0, j0 = slot_of(v0, has0, F, FM)
    p1, j1 = slot_of(v1, has1, F, FM)
    s0, n0 = beam_node(r, p0, scores, nodes)
    s1, n1 = beam_node(r, p1, scores, nodes)
    return j0, j1, s0, n0, s1, n1


@cuda.jit(device=True, **INLINE)
def rank_answer(srt, seg, hist, scan, res, red, total, k, KP, r, F, FM, scores, nodes, ptr,
                codes, cap, top, parent, child, code, second, lo, hi, v0, v1, has0, has1, j0,
                j1, s0, n0, s1, n1):
    """Rank ``k`` of the ``total`` (``k`` to ``SRT_N``) distinct absolute keys in
    ``srt[:total]`` and answer them (``answer``; ``cap[r]`` the request's width). Each thread
    holds two (``v0``, ``v1`` where ``has0``, ``has1``: ``held``'s, or any split of the keys
    two a thread), their first load level issued by the caller (``first_level``). One
    histogram of their scores over ``NB`` linear bins between the list's least and best okeys
    (``lo``, ``hi``: where ``lo`` < 0 found here by ``minmax``, which also publishes ``hist``
    zeroed; else the caller's, ``hist`` zeroed and published by it); the keys of the bins from
    the ``k``-th's up placed by bin (``pick_segments``) in ``seg`` and each ranked within its
    bin (``bin_rank``) by the thread that holds it, which stages its answer by rank in ``srt``
    (key, then child and code): its beam, child range and code were read a load level a phase
    along the ranking's barriers (``trie_topk_index``; the second level right after
    ``minmax``, or first thing where the caller passes ``lo``, ``hi``), so no answer waits on a
    load after it (on the H200 a decoding pass of three dependent loads after the ranking took
    2.1 us, session 44); the block then writes the answers out coalesced. Codes below 2**32 (as
    the scoring's indexing takes them).
    Returns False, unanswered, only where a bin from the ``k``-th's up holds over ``SEG_MAX``
    keys (ties): ``srt[:k]`` is then sorted (``sort_pairs``; 43 us for 2,048 keys on the H200,
    session 44) for the caller to answer. Every thread calls it after ``srt`` is published.
    ``second``: 1 where the caller is a pair's second launch (its phase stamps' rows, slots
    9-12)."""
    tid = cuda.threadIdx.x
    u0 = v0 >> 31
    u1 = v1 >> 31
    early = lo < 0  # (a constant where the caller passes one: the other path folded away)
    if early:
        hist[tid] = 0  # NB == NT: a bin a thread
        lo, hi = minmax(min(u0 if has0 else BIG, u1 if has1 else BIG),
                        max(u0 if has0 else int64(-1), u1 if has1 else int64(-1)), red)
    # level 2, after minmax's barriers, or first thing where the caller found lo and hi
    # (issued after the histogram's barrier instead, on the H200 step 2 at beams of 1,024 took
    # 0.0201-0.0202 ms against 0.0200-0.0201, sorted beams 0.0210-0.0213 against
    # 0.0208-0.0209, session 56)
    e0, g0 = node_span(s0, n0, ptr)
    e1, g1 = node_span(s1, n1, ptr)
    stamp(9, second)
    b0 = lin_bin(u0, lo, hi) if has0 else int32(0)
    b1 = lin_bin(u1, lo, hi) if has1 else int32(0)
    hist_add(hist, b0, has0)
    hist_add(hist, b1, has1)
    cuda.syncthreads()
    d, _, _, big = pick_segments(hist, NB, k, SEG_MAX, scan, res)
    stamp(10, second)
    if big == 0:
        f0, m0 = span_of(s0, e0, g0)  # level 2 used after pick's barriers
        f1, m1 = span_of(s1, e1, g1)
        real0 = j0 < m0
        real1 = j1 < m1
        h0 = uint32(f0 + j0) if real0 else uint32(0)
        h1 = uint32(f1 + j1) if real1 else uint32(0)
        d0 = codes[ix(h0)]  # level 3, used after the placement's barrier
        d1 = codes[ix(h1)]
        in0 = has0 and b0 >= d
        in1 = has1 and b1 >= d
        if in0:
            seg[ix(cuda.atomic.add(hist, b0, 1))] = v0
        if in1:
            seg[ix(cuda.atomic.add(hist, b1, 1))] = v1
        cuda.syncthreads()
        stamp(11, second)
        r0 = bin_rank(seg, v0, b0, hist, NB) if in0 else k
        r1 = bin_rank(seg, v1, b1, hist, NB) if in1 else k
        # staged by rank (srt's keys were read at the start): the answers' stores then
        # coalesce (scattered, they took 2 us more on the H200, session 45)
        if r0 < k:
            srt[ix(r0)] = v0
            srt[ix(NT + r0)] = (int64(h0) << 32) | (d0 & LOW32 if real0 else int64(0))
        if r1 < k:
            srt[ix(r1)] = v1
            srt[ix(NT + r1)] = (int64(h1) << 32) | (d1 & LOW32 if real1 else int64(0))
        cuda.syncthreads()
        stamp(12, second)
        w = cap[r]  # (loaded at the start instead: 0.0004 ms slower, session 51)
        if tid < k:  # k <= NT (MAX_K): an answer a thread (range(tid, k, NT)'s trip-count
            v = srt[ix(tid)]  # code took ~0.3 us of the block's issue, session 58)
            a = srt[ix(NT + tid)]
            answer(v, tid, r, div_f(key_c(v), FM), True, a >> 32, a & LOW32, w, top,
                   parent, child, code)
        return True
    P = sort_span(total, KP)
    for i in range(total + tid, P, NT):  # pad with 0, below every key
        srt[i] = 0
    cuda.syncthreads()
    if P <= NT:
        sort_desc(srt, P)
    else:
        sort_pairs(srt, P)
    return False
