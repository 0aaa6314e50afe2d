"""Candidates scored from their block's beams in shared memory, for the grid selection's
``bin_hist`` (``trie_topk_bins``), with the request's reference score, the bins and the keeping
of each candidate's okey and bin that go with it (``best_bound``, ``gbin``, ``keep``).

A block's chunk spans at most ``NT`` beams, so it first loads each beam's score, log-sum row
statistics, first child and child count (``load_beams``: the two dependent loads of the beam's
node and its child range, once a beam); each candidate then loads its child's code and that
code's log-probability only, two dependent loads where ``trie_topk_keys.cand`` issues four.
Where the fan-out is at least ``UMIN`` = 128 (gen-ref's step 2: 177; flat: 8,192) the block owns
whole beams and scores them in *beam units* (``score_units``): 192 consecutive child slots of
one beam a warp, six a lane, two units at a time, everything about the beam warp-uniform, so
no candidate divides its index or reads its beam (bin_hist executed 8.72 -> 5.75 M
instructions at step 2 at beams of 1,024 on the H200, session 47). Else ``score8`` scores
eight consecutive candidates a thread a round with no branch, so that the round's loads issue
together (session 44: 13.4 us with selects, which LLVM turned into branches around each load,
-> 9.7 us). A unit's logits row is addressed once (``row_at``) and each slot's code and
log-probability at one multiply-add (``load_at``; session 59: LLVM had re-formed the 64-bit row
index at every slot, five SASS instructions an address). Scores equal ``cand``'s bit for bit
(a ``+0.0`` aside, which the keys cannot tell from ``-0.0``).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, int64, types, uint32, uint64

from .numba_common import INLINE, base_at, load_at, row_at
from .trie_topk import SIMULATED
from .trie_topk_dev import BIG, FULL, NT, NW, hist_add, minmax
from .trie_topk_index import (I32MIN, NEG_INF, beam_at, bits32, ix, okey_of, signed_order,
                              slot)
from .trie_topk_keys import KEY_NEG_INF, logp_of, okey, okey_float

# Score bins: the top bits of x - ref, by the logits' dtype (``gshift``): 12 (4,096 bins, 8 an
# octave) for bf16, 11 for fp32. Fewer bins make every pick over them cheaper (each block's own
# and the last one's) but crowd the k-th's bin: on the H200 (session 50) 11 bits took step 2 at
# beams of 1,024 from 0.0256-0.0262 to 0.0234-0.0235 ms with fp32 logits, but bf16's few
# distinct log-probabilities then crowded the k-th's bin into the radix fallback, 0.0275 ->
# 0.0314. GB: the most bins (host buffers and shared arrays are sized for it).
GBITS_BF16 = 8 if SIMULATED else 12
GBITS_F32 = 7 if SIMULATED else 11
GB = 1 << GBITS_BF16
GB1 = GB + 1  # bin_hist's counters: GB, the spare one for beam units' slots past the fan-out


def _gshift_of(is_bf16: bool) -> int:
    return 32 - (GBITS_BF16 if is_bf16 else GBITS_F32)


if SIMULATED:
    def gshift(logp):
        """The bins' shift for these log-probabilities' bits (int16: bf16 logits)."""
        return _gshift_of(logp.dtype == np.int16)
else:
    from numba.cuda.extending import intrinsic

    @intrinsic
    def gshift(typingctx, logp):
        """The bins' shift for these log-probabilities' bits (int16: bf16 logits), a constant
        of each compiled kernel (they are compiled per argument type), folded where used."""
        val = _gshift_of(logp.dtype == types.int16)

        def codegen(context, builder, sig, args):
            return context.get_constant(types.int64, val)
        return types.int64(logp), codegen


@cuda.jit(device=True, **INLINE)
def bins_of(gs):
    """The bins at shift ``gs`` (the spare bin of beam units past them)."""
    return int64(1) << (32 - gs)


@cuda.jit(device=True, **INLINE)
def zero_bins(ws, r, at, gs):
    """``ws[r, at:]``'s ``bins_of(gs)`` counts zeroed by the block, ``bins // NT`` stores a
    thread in a loop of constant count, unrolled: ``range(tid, bins, NT)``'s 64-bit trip-count
    code took ~0.5 us of a 1,024-thread block's issue (H200, session 58). Every thread calls
    it."""
    for e in range(bins_of(gs) // NT):
        ws[ix(r), ix(at + cuda.threadIdx.x + e * NT)] = 0


@cuda.jit(device=True, **INLINE)
def load_beams(r, b0, nb, B, scores, nodes, ptr, lse, sh, bs, bm, bl, bf, bc):
    """The block's beams ``b0 .. b0 + nb - 1`` (``nb`` <= NT) into shared memory, one a thread:
    score, the row's max and log-sum, first child and children (0 where the beam is dead), so
    that a candidate then loads its code and its log-probability only (two dependent loads
    where ``cand`` issues four). The caller's next barrier publishes them."""
    t = cuda.threadIdx.x
    if t < nb:
        b = uint32(b0 + t)
        s, first, cnt = beam_at(r, b, scores, nodes, ptr)
        row = ix(uint32(r) * uint32(B) + b)
        bs[t] = s
        bm[t] = lse[0, row]
        bl[t] = lse[ix(sh >> 4), row]
        bf[t] = int32(first)
        bc[t] = int32(cnt)


@cuda.jit(device=True, **INLINE)
def pslot(r, c, F, FM, b0, B, bf, bc):
    """Candidate c's (beam slot of ``load_beams``, child node or 0 where it is none, logits
    row, mask: all ones where it is a child), by arithmetic alone: a select over a loaded
    value becomes a branch in LLVM's code (it sank each candidate's loads into one, and the
    round's loads then waited on each other, session 44)."""
    b, j = slot(c, F, FM)
    t = ix(uint32(b) - uint32(b0))
    m = uint32(0) - uint32(j < uint32(bc[t]))
    ch = (uint32(bf[t]) + j) & m
    return t, ch, ix(uint32(r) * uint32(B) + uint32(b)), m


@cuda.jit(device=True, **INLINE)
def pval(logp, row, cd, off, sh, t, m, bs, bm, bl):
    """The candidate's score from its code ``cd`` (``cand``'s; -inf where the mask says no
    child: an add, so that the log-probability's load has no branch around it)."""
    x = logp_of(logp[row, ix(uint32(off) + uint32(cd))], sh, bm[t], bl[t])
    return bs[t] + x + (float32(0.0) if m != 0 else NEG_INF)


@cuda.jit(device=True, **INLINE)
def score8(r, i, end, F, FM, b0, B, logp, sh, codes, off, bs, bm, bl, bf, bc):
    """Candidates ``i + m NT`` (m < 8; past ``end`` read as ``end - 1``; indices uint32) scored
    a load level at a time: the eight codes' loads, then the eight log-probabilities'."""
    e = uint32(end - 1)
    t0, c0, w0, m0 = pslot(r, min(i, e), F, FM, b0, B, bf, bc)
    t1, c1, w1, m1 = pslot(r, min(uint32(i + NT), e), F, FM, b0, B, bf, bc)
    t2, c2, w2, m2 = pslot(r, min(uint32(i + 2 * NT), e), F, FM, b0, B, bf, bc)
    t3, c3, w3, m3 = pslot(r, min(uint32(i + 3 * NT), e), F, FM, b0, B, bf, bc)
    t4, c4, w4, m4 = pslot(r, min(uint32(i + 4 * NT), e), F, FM, b0, B, bf, bc)
    t5, c5, w5, m5 = pslot(r, min(uint32(i + 5 * NT), e), F, FM, b0, B, bf, bc)
    t6, c6, w6, m6 = pslot(r, min(uint32(i + 6 * NT), e), F, FM, b0, B, bf, bc)
    t7, c7, w7, m7 = pslot(r, min(uint32(i + 7 * NT), e), F, FM, b0, B, bf, bc)
    d0 = codes[ix(c0)]
    d1 = codes[ix(c1)]
    d2 = codes[ix(c2)]
    d3 = codes[ix(c3)]
    d4 = codes[ix(c4)]
    d5 = codes[ix(c5)]
    d6 = codes[ix(c6)]
    d7 = codes[ix(c7)]
    return (pval(logp, w0, d0, off, sh, t0, m0, bs, bm, bl),
            pval(logp, w1, d1, off, sh, t1, m1, bs, bm, bl),
            pval(logp, w2, d2, off, sh, t2, m2, bs, bm, bl),
            pval(logp, w3, d3, off, sh, t3, m3, bs, bm, bl),
            pval(logp, w4, d4, off, sh, t4, m4, bs, bm, bl),
            pval(logp, w5, d5, off, sh, t5, m5, bs, bm, bl),
            pval(logp, w6, d6, off, sh, t6, m6, bs, bm, bl),
            pval(logp, w7, d7, off, sh, t7, m7, bs, bm, bl))


# Beam units (``bin_hist`` where F >= UMIN): a unit is UNIT = 32 UW consecutive child slots of
# one beam, a warp's; lane l holds slots l, l + 32, .. (UW of them). Everything about the beam
# is warp-uniform (one shared-memory read a unit, no candidate division, no per-candidate
# beam reads): about a third of score8's instructions a candidate. A warp scores two units at
# once, so that twelve loads a level are in flight a thread.
UW = 6
UNIT = 32 * UW
# Below UMIN score8's rounds instead: at 128 a unit's 192 slots are two thirds used, so a real
# candidate costs ~1.5 slots of ~40 instructions, still under score8's ~70 and keep's ~23; the
# fan-outs timed with units are gen-ref's 177 and the flat 8,192 (session 47)
UMIN = 128


@cuda.jit(device=True, **INLINE)
def unit_at(u, nu, upb, F, b0, r, B, bs, bm, bl, bf, bc):
    """Unit ``u`` of the block's ``nu`` (``upb`` a beam; beam slots of ``load_beams``) as this
    lane sees it: (beam score, row max, row log-sum, lane's first child, its child slots left
    ``cnt - j``, its slots left ``F - j`` (0 where the unit is past ``nu``: nothing stored),
    its first candidate ``b F + j``, logits row). Past ``nu`` it reads unit ``nu - 1``'s beam
    (loads in bounds)."""
    live = u < nu
    uu = uint32(u if live else nu - 1)
    t = uu if upb == 1 else uu // uint32(upb)
    j = (uu - t * uint32(upb)) * uint32(UNIT) + uint32(cuda.threadIdx.x & 31)
    b = uint32(b0) + t
    return (bs[t], bm[t], bl[t], uint32(bf[t]) + j, int32(int32(bc[t]) - int32(j)),
            int32(int32(F) - int32(j)) if live else int32(0), b * uint32(F) + j,
            ix(uint32(r) * uint32(B) + b))


@cuda.jit(device=True, **INLINE)
def code_at(codes, f, n, i):
    """Slot ``i``'s code (child ``f + 32 i`` where ``32 i < n``, else child 0's: in bounds)."""
    m = uint32(0) - uint32(int32(32 * i) < n)
    return load_at(codes, base_at(codes), (f + uint32(32 * i)) & m)


@cuda.jit(device=True, **INLINE)
def codes6(codes, f, n):
    """The six slots' codes. (Unclamped loads at offsets where every slot's child is in bounds
    compiled to the clamped ones' instructions: LLVM merges the two branches' addresses.)"""
    return (code_at(codes, f, n, 0), code_at(codes, f, n, 1), code_at(codes, f, n, 2),
            code_at(codes, f, n, 3), code_at(codes, f, n, 4), code_at(codes, f, n, 5))


@cuda.jit(device=True, **INLINE)
def unit_val(logp, at, cd, sh, s, m, ls, n, i):
    """Slot ``i``'s score, as ``pval``'s (-inf past the beam's children: an add), its
    log-probability ``cd`` past ``at`` (``row_at``: the row and ``off`` taken once a unit)."""
    x = logp_of(load_at(logp, at, uint32(cd)), sh, m, ls)
    return s + x + (float32(0.0) if int32(32 * i) < n else NEG_INF)


@cuda.jit(device=True, **INLINE)
def vals6(logp, row, off, sh, s, m, ls, n, d0, d1, d2, d3, d4, d5):
    at = row_at(logp, row, ix(off))
    return (unit_val(logp, at, d0, sh, s, m, ls, n, 0),
            unit_val(logp, at, d1, sh, s, m, ls, n, 1),
            unit_val(logp, at, d2, sh, s, m, ls, n, 2),
            unit_val(logp, at, d3, sh, s, m, ls, n, 3),
            unit_val(logp, at, d4, sh, s, m, ls, n, 4),
            unit_val(logp, at, d5, sh, s, m, ls, n, 5))


def units_of(F: int, enabled: bool) -> int:
    """Units a beam (0: score8's rounds) for fan-out ``F``."""
    return -(-F // UNIT) if enabled and F >= UMIN else 0


@cuda.jit(device=True, **INLINE)
def best_bound(scores, lse, sh, r, B, red):
    """The request's best beam score less its row's log-sum where the log-probabilities are
    bf16 logits read with their row statistics (``sh`` 16: the best any of the beam's children
    can score, as a child's log-probability is at most ``-logsum``), else its best beam score
    (0 where every beam is dead): the bins' reference, where they are finest. (With bf16
    logits the best beam score sat ~5.7 above every candidate, where a bin spans 0.5: on the
    H200 bf16 flat at k 1,024 went 0.0325 -> 0.0270 ms and step 2 at 48 requests 0.0340 ->
    0.0296 with this reference, session 48.) In 32 bits on the GPU (the okeys' order as
    signed ints, ``signed_order``: one shuffle a step, where ``minmax``'s int64 min and max
    took four), two barriers. (A one-barrier
    version, each thread reading the warps' 32 maxima, measured 0.9 us slower than three at
    step 2 at beams of 1,024 on the H200, session 44.)"""
    tid = cuda.threadIdx.x
    if SIMULATED:
        top = int64(-1)
        for b in range(tid, B, NT):
            top = max(top, okey(bound_of(scores, lse, sh, r, B, b)))
        _, top = minmax(BIG, top, red)
    else:
        hi = I32MIN  # okey 0 (below every real score's) in the signed order
        b = tid
        while b < B:
            hi = max(hi, signed_order(okey(bound_of(scores, lse, sh, r, B, b))))
            b = int32(b + NT)
        for o in (16, 8, 4, 2, 1):
            hi = max(hi, cuda.shfl_xor_sync(FULL, hi, o))
        if (tid & 31) == 0:
            red[tid >> 5] = hi
        cuda.syncthreads()
        if tid < 32:
            hi = int32(red[tid]) if tid < NW else I32MIN
            for o in (16, 8, 4, 2, 1):
                hi = max(hi, cuda.shfl_xor_sync(FULL, hi, o))
            if tid == 0:
                red[NW] = hi
        cuda.syncthreads()
        top = okey_of(int32(red[NW]))
    return okey_float(top) if top > KEY_NEG_INF else float32(0.0)


@cuda.jit(device=True, **INLINE)
def bound_of(scores, lse, sh, r, B, b):
    """Beam b's score, less its row's log-sum where ``sh`` is 16 (``lse`` row ``sh >> 4``: in
    bounds either way)."""
    s = scores[ix(r), ix(b)]
    ls = lse[ix(sh >> 4), ix(uint32(r) * uint32(B) + uint32(b))]
    return s - ls if sh else s


@cuda.jit(device=True, **INLINE)
def gbin(x, ref, gs):
    """The bin of score ``x`` (higher bins hold higher scores) at shift ``gs``."""
    return int32(okey(x - ref) >> gs)


@cuda.jit(device=True, **INLINE)
def keep(keys, hist, r, i, end, x, ref, gs):
    """Candidate i's okey into ``keys`` and its bin into the block's histogram (every lane).
    Past ``end`` the store goes to ``end - 1`` with its own key (``score8`` scored it there):
    no branch around the store."""
    kx = okey(x)
    keys[ix(r), ix(min(i, uint32(end - 1)))] = bits32(kx)
    hist_add(hist, gbin(x, ref, gs), i < end)


@cuda.jit(device=True, **INLINE)
def keep6(keys, hist, r, c, v, ref, gs, x0, x1, x2, x3, x4, x5):
    """A unit's six slots (``unit_at``'s lane view: first candidate ``c``, ``v`` slots left)
    into ``keys`` and the histogram, as ``keep``'s."""
    keep_slot(keys, hist, r, c, v, ref, gs, x0, 0)
    keep_slot(keys, hist, r, c, v, ref, gs, x1, 1)
    keep_slot(keys, hist, r, c, v, ref, gs, x2, 2)
    keep_slot(keys, hist, r, c, v, ref, gs, x3, 3)
    keep_slot(keys, hist, r, c, v, ref, gs, x4, 4)
    keep_slot(keys, hist, r, c, v, ref, gs, x5, 5)


@cuda.jit(device=True, **INLINE)
def keep_slot(keys, hist, r, c, v, ref, gs, x, i):
    """Slot ``i`` of a unit as ``keep`` keeps a candidate; a slot past the fan-out (``32 i >=
    v``) stores nothing and counts in the spare bin (an add with no branch around it)."""
    kx = bits32(okey(x))
    if int32(32 * i) < v:
        keys[ix(r), ix(c) + uint64(32 * i)] = kx
    hist_add(hist, slot_bin(x, ref, v, i, gs), True)


@cuda.jit(device=True, **INLINE)
def slot_bin(x, ref, v, i, gs):
    """The histogram bin of a unit's slot ``i`` (score ``x``, ``v`` slots left): ``gbin``'s,
    or the spare bin (``bins_of(gs)``) past the fan-out."""
    return gbin(x, ref, gs) if int32(32 * i) < v else int32(bins_of(gs))


@cuda.jit(device=True, **INLINE)
def score_units(r, nb, upb, F, b0, B, logp, sh, codes, off, bs, bm, bl, bf, bc, keys, hist, ref,
                gs):
    """The block's beam units (``upb`` a beam, ``nb`` beams), two a warp at a time (twelve loads
    a level in flight a thread; four at a time measured slower on the H200, session 47), into
    ``keys`` and the histogram. ``sh`` is a constant at each call (``bin_hist`` calls it once
    for each), so that the log-probabilities' conversion has no select between the two forms."""
    tid = cuda.threadIdx.x
    nu = int32(nb * upb)
    u = int32(tid >> 5)
    while u < nu:
        x0, x1, x2, x3, x4, x5, y0, y1, y2, y3, y4, y5, v0, c0, v1, c1 = pair_vals(
            u, nu, upb, F, b0, r, B, logp, sh, codes, off, bs, bm, bl, bf, bc)
        keep6(keys, hist, r, c0, v0, ref, gs, x0, x1, x2, x3, x4, x5)
        keep6(keys, hist, r, c1, v1, ref, gs, y0, y1, y2, y3, y4, y5)
        u = int32(u + 2 * NW)


@cuda.jit(device=True, **INLINE)
def pair_vals(u, nu, upb, F, b0, r, B, logp, sh, codes, off, bs, bm, bl, bf, bc):
    """Units ``u`` and ``u + NW`` scored, a load level at a time for both (the codes', then
    the log-probabilities'): their twelve scores, and each unit's slots left and first
    candidate (``unit_at``)."""
    s0, m0, l0, f0, n0, v0, c0, w0 = unit_at(u, nu, upb, F, b0, r, B, bs, bm, bl, bf, bc)
    s1, m1, l1, f1, n1, v1, c1, w1 = unit_at(u + NW, nu, upb, F, b0, r, B, bs, bm, bl, bf, bc)
    a0, a1, a2, a3, a4, a5 = codes6(codes, f0, n0)
    e0, e1, e2, e3, e4, e5 = codes6(codes, f1, n1)
    x0, x1, x2, x3, x4, x5 = vals6(logp, w0, off, sh, s0, m0, l0, n0, a0, a1, a2, a3, a4, a5)
    y0, y1, y2, y3, y4, y5 = vals6(logp, w1, off, sh, s1, m1, l1, n1, e0, e1, e2, e3, e4, e5)
    return x0, x1, x2, x3, x4, x5, y0, y1, y2, y3, y4, y5, v0, c0, v1, c1
