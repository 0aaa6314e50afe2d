"""Score bins and sampled floors shared by the one-block and merge selection kernels
(``trie_topk_one``, ``trie_topk_merge``), and their selection from a short list of keys.

``obin`` bins a score by its distance below the best one (``2**OCT`` bins an octave): monotone in
the score, so a bin pick bounds the ``k``-th key. Counting every key of a chunk by bin costs a
histogram round and a second pass that recomputes the bins (on the H200, at 8,192 keys a block:
5.4 and 3.2 us of step 1's 18 us, session 30). A spread sample of one key a thread does instead:
its bins give a floor ``T`` (the smallest sampled key of the bins from the sample's scaled
``k``-th key up, with a margin), the chunk's keys at or above ``T`` are listed in one pass
(each thread marks its keys in a bit mask, its warp reserves their slots with one shared atomic,
it writes the marked: ``list_above``; a count, a block scan and a second pass over every key
took the listing 3.48 -> 1.21 us of step 1 on the H200, session 32), and where that list holds
at least the ``k`` wanted and fits a block (``sample_floor`` leaves the odds of missing far below
one in a thousand; the callers fall back to the full rounds otherwise) the answer is selected
from the list alone (``select_list``: one bins round over it, each key ranked in its bin; sorted
where a bin is crowded). ``STREAMGR_TOPK_SAMPLE=0`` turns the sampled floor off (A/B runs);
``select_list`` serves the merge's last block either way.
"""

from __future__ import annotations

import os

from numba import cuda, int32, int64, uint32

from .trie_topk import SIMULATED
from .trie_topk_dev import BIG, HALF, I32MAX, NB, NT, SEG_MAX, append, hist_add, minmax, \
    bin_rank, pick, pick_segments, reserve_slots, warp_min_into
from .trie_topk_bitonic import sort_desc, sort_span
from .numba_common import INLINE, stamp
from .trie_topk_index import bits32
from .trie_topk_keys import (LOW32, MAXC, _bits, div_f, key_c, note_all, note_beam, okey_float,
                             put_abs)
from .trie_topk_levels import LEVELS, note_levels

# obin's window: 2**OCT bins an octave of the distance below the best score, NB >> OCT octaves
# centred on 1 (closer is the best bin, farther or -inf the worst). Finer bins hold fewer keys
# each, and every listed key is ranked against its bin's: 16 an octave (OCT 4) against 8 took
# step 1 0.0250 -> 0.0192 ms on the H200 (session 30: at 8 the k-th key's bin often held over
# SEG_MAX keys, and a sort of 1,024 keys took 8.4 us), 32 (OCT 5: 32 octaves, distances 2**-16
# to 2**16) 0.0142 -> 0.0129, and 64 (OCT 6: 16 octaves, distances 2**-8 to 2**8; closer or
# farther keys share the end bins, which a sort then serves, exactly) 0.0117 -> 0.0113 with
# step 2 0.0212 -> 0.0208 and step 3 0.0073 -> 0.0068 (session 32). STREAMGR_TOPK_OCT sets it
# for A/B runs (3 under the simulator's 32 bins).
OCT = 3 if SIMULATED else int(os.environ.get("STREAMGR_TOPK_OCT", "6"))
OBASE = (127 - (NB >> OCT) // 2) << OCT
# Chunks of more keys than SAMPLE_MIN take the sampled floor (STREAMGR_TOPK_SAMPLE=0: never, for
# A/B runs); at or below a block the sample would be the whole chunk, and one bins round is
# cheaper. On the lent H200 (Python 3.12, sessions 37-39) every merge_select launch through it
# hung: CPython 3.12 had copied sample_floor's ``return least_okey(.. if b >= d else ..)`` into
# both arms of that per-thread choice, so a warp's lanes waited at different barriers
# (``or_max`` chooses without a branch; session 40). Off, step 2 took 0.0214 ms against
# 0.0180-0.0189 with it (session 40).
SAMPLE = os.environ.get("STREAMGR_TOPK_SAMPLE", "1") == "1"
SAMPLE_MIN = NT if SIMULATED else 2 * NT
# A chunk of one beam's children is scored with the beam read once (note_beam;
# STREAMGR_TOPK_BEAM=0: every candidate as any other, for A/B runs).
BEAM = os.environ.get("STREAMGR_TOPK_BEAM", "1") == "1"
ONE_MAX = 64 if SIMULATED else 8192  # okeys a block holds in shared memory: 32 KiB
UCAP = ONE_MAX // 2  # list keys held there instead (kx's two int32 halves: okey, candidate)


@cuda.jit(device=True, **INLINE)
def obin(kx, ref):
    """The bin (of NB, higher for higher scores) of the score whose okey's int32 bits are
    ``kx``, by its distance below the request's best score ``ref``: monotone in the score."""
    e = okey_float(int64(kx) & LOW32) - ref  # <= 0
    # 32-bit (each sum cast back: Numba widens int32 arithmetic)
    g = int32(int32(int32(_bits(e)) & int32(0x7FFFFFFF)) >> int32(23 - OCT))
    g = int32(g - int32(OBASE))
    return int32(int32(NB - 1) - min(max(g, int32(0)), int32(NB - 1)))


@cuda.jit(device=True, **INLINE)
def ubin(u, ref):
    """``obin`` of the okey ``u`` (unsigned 32-bit, as int64)."""
    return obin(bits32(u), ref)


@cuda.jit(device=True, **INLINE)
def okey32(u):
    """Okey ``u`` (unsigned 32-bit, as int64) less 2**31 as an int32: ordered as int32s are,
    for a shared atomic min (``least_okey``)."""
    return int32((u & LOW32) - HALF)


@cuda.jit(device=True, **INLINE)
def or_max(keep, m):
    """``m if keep else I32MAX`` (int32) by bit arithmetic, with no branch, for a value that a
    warp collective reads next (``warp_min_into``). Why: in ``return least_okey(m if keep else
    I32MAX, res)`` CPython 3.12 copies the call's short tail into both arms of the conditional
    expression, Numba compiles each copy, and the lanes of one warp then reach different
    shuffles and barriers: every merge launch through the sampled floor hung the H200 machine
    (Python 3.12) in sessions 37-39; its PTX held 64 ``bar.sync`` for the source's 63
    (session 40; ``tests/kernels/test_numba_collectives.py`` keeps the pattern out). No branch
    here, so nothing to copy, and on the H200 the four kernels that use it were as fast or
    faster."""
    return int32(m ^ ((m ^ I32MAX) & (int32(keep) - int32(1))))


@cuda.jit(device=True, **INLINE)
def least_okey(m, res):
    """The block's least okey from each thread's ``okey32`` ``m`` (``I32MAX`` for none): a warp
    min and one shared atomic into ``res[3]`` (``I32MAX`` on entry, published). Every thread
    calls it; it ends with one barrier."""
    return int64(warp_min_into(m, res, 3)) + HALF


@cuda.jit(device=True, **INLINE)
def rev_okey(u):
    """Okey ``u`` (unsigned 32-bit, as int64; -1 for none) as an int32 whose block min is the
    best okey (``best_okey``): ~x reverses ``okey32``'s int32 order without overflow;
    ``I32MAX`` for none."""
    return or_max(u >= 0, ~okey32(u))


@cuda.jit(device=True, **INLINE)
def best_okey(m, res):
    """The block's best okey from each thread's least ``rev_okey`` ``m`` (a warp min and one
    shared atomic into ``res[3]``, ``I32MAX`` on entry, published; one barrier instead of
    ``minmax``'s three). Every thread calls it."""
    return (int64(~warp_min_into(m, res, 3)) + HALF) & LOW32


@cuda.jit(device=True, **INLINE)
def obin_hist(hist, kx, n, ref):
    """``hist[:NT]`` = the counts of ``kx[:n]``'s okeys by ``obin``. Every thread calls it; it
    ends synchronized."""
    tid = cuda.threadIdx.x
    hist[tid] = 0
    cuda.syncthreads()
    for base in range(0, n, NT):
        i = base + tid
        hist_add(hist, obin(kx[min(i, n - 1)], ref), i < n)
    cuda.syncthreads()


@cuda.jit(device=True, **INLINE)
def chunk_begin(ctr, cell, best):
    """A scoring phase's start (``score_chunk``): stamp 14, and ``ctr`` zeroed (published by
    the phase's barriers); where ``best``, ``cell[3]`` set for the caller's ``best_okey`` and
    published (its atomics come before any later barrier)."""
    stamp(14)
    if cuda.threadIdx.x == 0:
        ctr[0] = 0
        if best:
            cell[3] = I32MAX
    if best:
        cuda.syncthreads()


@cuda.jit(device=True, **INLINE)
def chunk_end(lo, hi, red, best):
    """A scoring phase's end: the threads' (smallest real, largest) okeys reduced over the
    block, to every thread (its barriers publish the okeys; stamps 1, 2); where ``best``, left
    to the caller (the thread's own largest returned, the smallest as ``BIG``: none known)."""
    stamp(1)
    if best:
        lo = BIG
    else:
        lo, hi = minmax(lo, hi, red)
        stamp(2)
    return lo, hi


@cuda.jit(device=True, **INLINE)
def score_chunk(kx, c0, n, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, red, ctr,
                cell, best):
    """The selection kernels' first phases: ``ctr`` zeroed, the okeys of candidates ``c0 ..
    c0 + n - 1`` into ``kx`` (``note_beam`` where they are one beam's children, else
    ``note_all``) and the block's (smallest real, largest) okey (``best``: the thread's largest,
    for the caller to reduce, and ``BIG``), returned to every thread with the beam where the
    chunk is one beam's children (``put_abs``'s ``beam``, else -1)."""
    chunk_begin(ctr, cell, best)
    beam = int64(-1)
    if BEAM and div_f(c0, FM) == div_f(c0 + n - 1, FM):  # one beam's children (block-uniform)
        lo, hi, beam = note_beam(kx, c0, n, NT, r, F, FM, B, scores, nodes, logp, lse, sh, ptr,
                                 codes, off)
    elif LEVELS and n > 4 * NT:  # one round of eight a thread, a load level at a time
        lo, hi = note_levels(kx, c0, n, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes,
                             off)
    else:
        lo, hi = note_all(kx, c0, n, NT, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes,
                          off)
    lo, hi = chunk_end(lo, hi, red, best)
    return lo, hi, beam


@cuda.jit(device=True, **INLINE)
def sample_floor(kx, n, want, ref, hist, scan, res):
    """A floor okey ``T`` for ``kx[:n]`` (n > NT): thread t samples key ``t * n // NT``; ``T`` is
    the smallest sampled key in the bins from the sample's ``want * NT / n * 3 / 2 + 8``-th key
    up (the margin: where the chunk held fewer than ``want`` keys at or above ``T``, its sample
    would have run ~4 standard deviations high). Every thread calls it; it ends
    synchronized."""
    tid = cuda.threadIdx.x
    x = kx[(int64(tid) * n) // NT]
    b = obin(x, ref)
    hist[tid] = 0
    if tid == 0:
        res[3] = I32MAX  # the floor's atomic min (pick's barriers publish it; it uses res[:3])
    cuda.syncthreads()
    hist_add(hist, b, True)
    cuda.syncthreads()
    ws = min(int64(NT), ((want * NT + n - 1) // n) * 3 // 2 + 8)
    d, _, _ = pick(hist, NB, ws, scan, res, NT)
    # the floor: the picked bins' smallest sampled okey, by a 32-bit shared atomic min (one
    # barrier; a block min/max's three took step 2 0.0258 -> 0.0252 ms on the H200, session
    # 32); okeys are unsigned 32-bit: less 2**31 they order as int32 do
    return least_okey(or_max(b >= d, okey32(int64(x))), res)


@cuda.jit(device=True, **INLINE)
def list_above(kx, n, c0, t, want, out, ctr):
    """The keys of ``kx[:n]`` (``n <= ONE_MAX``) at or above the okey ``t`` as absolute keys
    (candidates ``c0 + i``) into ``out[:NT]`` (shared int64; in the order of the warps'
    atomics: what reads the list does not depend on it), and their count, returned to every
    thread. Each thread marks its keys (``tid + j * NT``) at or above ``t`` in a bit mask (a
    loop of constant trip count: unrolled, 32-bit compares), its warp reserves their slots at
    ``ctr[0]`` (0 on entry, published) at once, and it writes the marked keys alone (at step 1
    about one in sixteen); keys past ``NT`` are counted, not written. Ends synchronized, except
    where the count is not from ``want`` to ``NT`` (the list unused: ties or an unlucky
    sample): there ``ctr[0]`` is zeroed again for the caller's fallback, published by the
    caller's next barrier."""
    tid = cuda.threadIdx.x
    t32 = uint32(t)
    m = uint32(0)
    for j in range(ONE_MAX // NT):
        i = tid + j * NT
        if i < n and uint32(kx[uint32(i)]) >= t32:
            m |= uint32(1) << uint32(j)
    at = reserve_slots(int32(cuda.popc(m)), ctr)
    while m != 0:
        j = cuda.popc((m & (~m + uint32(1))) - uint32(1))  # the lowest marked
        m &= m - uint32(1)
        i = tid + j * NT
        if at < NT:
            out[at] = (int64(uint32(kx[uint32(i)])) << 31) | (MAXC - (c0 + i))
        at += 1
    cuda.syncthreads()
    cnt = int64(ctr[0])
    if cnt < want or cnt > NT:  # block-uniform
        cuda.syncthreads()  # every thread has read ctr
        if tid == 0:
            ctr[0] = 0
    return cnt


@cuda.jit(device=True, **INLINE)
def ukey(kx, j):
    """Listed key j as ``select_list`` holds it: okey in ``kx[j]``, candidate in
    ``kx[UCAP + j]``."""
    return ((int64(kx[j]) & LOW32) << 31) | (MAXC - int64(kx[UCAP + j]))


@cuda.jit(device=True, **INLINE)
def hold(kx, j, v):
    """Absolute key ``v`` as listed key j (``ukey``'s inverse)."""
    u = v >> 31
    kx[j] = bits32(u)
    kx[UCAP + j] = int32(key_c(v))


@cuda.jit(device=True, **INLINE)
def slot_rank(srt, hist, ref, k, KP, total, big):
    """(the key of this thread's slot, its rank; ``k`` where it has none) once the ``total``
    keys of the bins from the ``k``-th's up are in ``srt``: laid out by bin (``big`` 0;
    ``hist[b]``: bin b's segment end, as ``pick_segments`` and the placements left it), each
    ranked in its bin; else appended (``srt`` zeroed past them), sorted whole. Every thread
    calls it; its first barrier publishes ``srt`` (stamp 12: the keys placed)."""
    tid = cuda.threadIdx.x
    v = int64(0)
    rank = int64(k)
    cuda.syncthreads()
    if big == 0:
        stamp(12)
        if tid < total:
            v = srt[tid]
            rank = bin_rank(srt, v, obin(v >> 31, ref), hist, NB)
    else:
        sort_desc(srt, sort_span(total, KP))
        if tid < k:
            v = srt[tid]
            rank = int64(tid)
    return v, rank


@cuda.jit(device=True, **INLINE)
def select_list(kx, U, ref, k, KP, hist, srt, scan, res, ctr, r, F, FM, B, scores, nodes, logp,
                lse, sh, ptr, codes, off, cap, top, parent, child, code, beam):
    """Answer the request's ``k`` best from the ``U`` listed keys held in ``kx`` (``ukey``; a
    superset of the ``k`` best, ``ref`` the best's score): one bins round, each key of the bins
    from the ``k``-th's up ranked in its bin, or sorted whole where a bin holds over
    ``SEG_MAX``. False (nothing answered) where those bins hold over a block of keys (``beam``:
    ``put_abs``'s). Every thread calls it (stamps 9: bins counted and picked; 12: their keys
    placed)."""
    tid = cuda.threadIdx.x
    obin_hist(hist, kx, U, ref)
    d, need, nd, big = pick_segments(hist, NB, k, SEG_MAX, scan, res)
    stamp(9)
    total = k - need + nd
    if total > NT:
        return False
    if big == 0:  # the keys of the bins from d up laid out by bin
        for base in range(0, U, NT):
            j = min(base + tid, U - 1)
            b = obin(kx[j], ref)
            if base + tid < U and b >= d:
                srt[cuda.atomic.add(hist, b, 1)] = ukey(kx, j)
    else:  # a crowded bin: those keys appended, to be sorted whole
        if tid == 0:
            ctr[0] = 0
        srt[tid] = 0
        cuda.syncthreads()
        for base in range(0, U, NT):
            j = min(base + tid, U - 1)
            append(srt, ctr, 0, ukey(kx, j), base + tid < U and obin(kx[j], ref) >= d)
    # one key a thread (k <= total <= NT) and one put_abs site for both ways (each inlined site
    # adds seconds to the kernel's compile)
    v, rank = slot_rank(srt, hist, ref, k, KP, total, big)
    if rank < k:
        put_abs(v, rank, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top,
                parent, child, code, beam)
    return True
