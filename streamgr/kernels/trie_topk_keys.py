"""Candidates and their keys for the selection kernels (``trie_topk_one``, ``trie_topk_bins``):
a candidate's score, child and code read from the trie and the
log-probabilities (``cand``), its order-preserving key, and its answer (``decode``).

A candidate ``c`` with fp32 score ``x`` becomes one int64 *key*: ``t << 31 | (MAXC - c)``, where
``t`` is the score's order-preserving 32 bits (``okey``) shifted so that the smallest real score
of the request gives 1 (every ``-inf`` gives 0). Keys are distinct (the low bits hold ``c``) and
compare as the stable order does: higher score first, then the lower ``c``. Shifting by the
request's minimum (``tmin``) and reading digits from the highest bit of ``tmax - tmin`` down makes
the first digit spread the request's scores over its bins instead of spending a round on the
sign and exponent bits they all share. A candidate's index arithmetic and place in the trie
are ``trie_topk_index``'s (its names imported here for the kernels that import this module).
"""

from __future__ import annotations

import os

import numpy as np
from numba import cuda, float32, int32, int64, uint32, uint64

from .numba_common import INLINE
from .trie_topk import SIMULATED
from .trie_topk_index import LOW32, NEG_INF, beam_of, bits32, child_of, div_f, ix

MAXC = int64(0x7FFFFFFF)  # candidate indices below 2**31
KEY_NEG_INF = int64(0x007FFFFF)  # okey(-inf)
NONE_LO = int64(1) << 40  # a (smallest real okey) where there is none
NO_LO = uint32(0xFFFFFFFF)  # note's form of it
# Answers from absolute keys take their score from the key (``put_abs``: no log-probability
# read); STREAMGR_TOPK_KEYDEC=0 recomputes it as ``put`` does, for A/B runs (the merge's last
# block, ``trie_topk_held``, reads its answers' scores from the keys either way, except where a
# bin is crowded, and the grid's, ``trie_topk_rank.rank_answer``, always).
KEYDEC = os.environ.get("STREAMGR_TOPK_KEYDEC", "1") == "1"

if SIMULATED:
    def _bits(x):
        return int(np.float32(x).view(np.int32))

    def _float(bits):
        return np.int32(bits).view(np.float32)
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, **INLINE)
    def _bits(x):
        return libdevice.float_as_int(x)

    @cuda.jit(device=True, **INLINE)
    def _float(bits):
        return libdevice.int_as_float(bits)


@cuda.jit(device=True, **INLINE)
def okey(val):
    """The fp32 score's order-preserving 32 bits as an int64 (-0.0 as +0.0: they tie), computed
    in 32 bits."""
    b = int32(_bits(val + float32(0.0)))
    return int64(uint32(b ^ ((b >> 31) | int32(-0x80000000))))  # ~b below 0, else b | top bit


@cuda.jit(device=True, **INLINE)
def key_c(v):
    """The candidate index of key ``v`` (its low 31 bits hold ``MAXC - c``)."""
    return MAXC - (v & MAXC)


@cuda.jit(device=True, **INLINE)
def okey_float(u):
    """The fp32 value of the order-preserving bits ``u`` (``okey``'s inverse)."""
    x = bits32(u)  # in 32 bits: the top bit flipped where it is set, else every bit
    return _float(int32(x ^ int32(-0x80000000)) if x < 0 else int32(~x))


@cuda.jit(device=True, **INLINE)
def tkey(key32, c, tmin):
    """Candidate c's key from its okey and the request's smallest real okey."""
    t = key32 - tmin + 1 if key32 >= tmin else int64(0)
    return (t << 31) | (MAXC - c)


@cuda.jit(device=True, **INLINE)
def logp_at(logp, row, col, sh, m, ls):
    """The log-probability at ``logp[row, col]`` (raw bits, ``sh`` as in ``cand``; ``m``, ``ls``
    the row's max and log-sum, used where ``sh`` is 16)."""
    return logp_of(logp[row, ix(col)], sh, m, ls)


@cuda.jit(device=True, **INLINE)
def logp_of(bits, sh, m, ls):
    """``logp_at``'s log-probability from its raw bits already loaded (kernels that issue a
    round's loads before any of this math)."""
    x = _float(int32(bits) << sh)
    return (x - m) - ls if sh else x


@cuda.jit(device=True, **INLINE)
def cand(r, c, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off):
    """Candidate c of request r: (score, -inf where no child; child node; code), with every
    load issued at a clamped index and no branch (selects only), so that the loads of several
    candidates computed in a row overlap; indices are unsigned (no negative-index wraparound
    code: about a third of the instructions). ``FM`` is ``magic(F)``. ``logp`` holds raw bits:
    fp32 (int32, ``sh`` 0) or bf16 logits (int16, ``sh`` 16) read with ``lse`` [2, rows] (each
    row's max and log-sum): the fp32 ``(x - max) - logsum`` of ``LogProbs.gather``, bit for
    bit; with ``sh`` 0, ``lse`` is any [1, rows] float array, read and unused."""
    b, s, real, ch, cd = child_of(r, c, F, FM, scores, nodes, ptr, codes)
    row = ix(uint32(r) * uint32(B) + uint32(b))
    x = logp_at(logp, row, uint32(off) + uint32(cd), sh, lse[0, row], lse[ix(sh >> 4), row])
    if real:
        return s + x, ch, cd
    return NEG_INF, int64(0), int64(0)


@cuda.jit(device=True, **INLINE)
def ckey(r, c, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off):
    v, _, _ = cand(r, c, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
    return okey(v)


@cuda.jit(device=True, **INLINE)
def note(kx, i, key, lo, hi):
    """``kx[i]`` = the okey ``key`` as int32 bits; the running (smallest real less one, largest)
    okey, both uint32 (from ``note_start``; ``note_end`` widens them): 64-bit min/max took
    about a tenth of a candidate's instructions."""
    kx[i] = bits32(key)
    hi = max(hi, uint32(key))
    lo = min(lo, uint32(key - 1) if key > KEY_NEG_INF else NO_LO)  # key - 1 < NO_LO
    return lo, hi


@cuda.jit(device=True, **INLINE)
def note_start():
    """``note``'s running (lo, hi) before any key."""
    return NO_LO, uint32(0)


@cuda.jit(device=True, **INLINE)
def note_end(lo, hi, n):
    """The thread's (smallest real, largest) okey as int64 from ``note``'s, for a chunk of ``n``
    candidates noted from ``threadIdx.x`` up: ``2**40`` where it noted no real one, -1 where it
    noted none."""
    return (int64(lo) + 1 if lo != NO_LO else NONE_LO,
            int64(hi) if cuda.threadIdx.x < n else int64(-1))


@cuda.jit(device=True, **INLINE)
def note8(kx, i0, nt, k0, k1, k2, k3, k4, k5, k6, k7, lo, hi):
    """``note`` of a round of eight okeys, at ``kx[i0 + j * nt]`` (computed first, so that
    their loads were in flight together)."""
    lo, hi = note(kx, i0, k0, lo, hi)
    lo, hi = note(kx, i0 + nt, k1, lo, hi)
    lo, hi = note(kx, i0 + 2 * nt, k2, lo, hi)
    lo, hi = note(kx, i0 + 3 * nt, k3, lo, hi)
    lo, hi = note(kx, i0 + 4 * nt, k4, lo, hi)
    lo, hi = note(kx, i0 + 5 * nt, k5, lo, hi)
    lo, hi = note(kx, i0 + 6 * nt, k6, lo, hi)
    return note(kx, i0 + 7 * nt, k7, lo, hi)


@cuda.jit(device=True, **INLINE)
def note_upto4(kx, i0, step, n, k0, k1, k2, k3, lo, hi):
    """``note`` of a round of four okeys at ``kx[i0 + j * step]``, those below ``n``."""
    if i0 < n:
        lo, hi = note(kx, i0, k0, lo, hi)
    if i0 + step < n:
        lo, hi = note(kx, i0 + step, k1, lo, hi)
    if i0 + 2 * step < n:
        lo, hi = note(kx, i0 + 2 * step, k2, lo, hi)
    if i0 + 3 * step < n:
        lo, hi = note(kx, i0 + 3 * step, k3, lo, hi)
    return lo, hi


@cuda.jit(device=True, **INLINE)
def at(c0, i, n):
    """Candidate ``c0 + min(i, n - 1)`` (a clamped load index), in 32 bits."""
    return int64(uint32(uint32(c0) + min(uint32(i), uint32(n - 1))))


@cuda.jit(device=True, **INLINE)
def note4(kx, i0, step, c0, r, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, lo,
          hi):
    """``note`` of the okeys of candidates ``c0 + i0 + j * step`` at ``kx[i0 + j * step]``
    (j < 4, those below N): their four load chains issued at clamped indices before any
    store, so that they overlap."""
    k0 = ckey(r, at(c0, i0, N), F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
    k1 = ckey(r, at(c0, i0 + step, N), F, FM, B, scores, nodes, logp, lse, sh, ptr, codes,
              off)
    k2 = ckey(r, at(c0, i0 + 2 * step, N), F, FM, B, scores, nodes, logp, lse, sh, ptr,
              codes, off)
    k3 = ckey(r, at(c0, i0 + 3 * step, N), F, FM, B, scores, nodes, logp, lse, sh, ptr,
              codes, off)
    return note_upto4(kx, i0, step, N, k0, k1, k2, k3, lo, hi)


@cuda.jit(device=True, **INLINE)
def note_all(kx, c0, n, nt, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off):
    """``kx[i]`` = the okey of candidate ``c0 + i`` for ``i < n``, by the block's ``nt``
    threads (four a thread at a time while more than two blocks' worth are left, so that no
    round of four runs half empty; eight, as
    ``note_beam`` takes them, measured slower on the H200: step 2 0.0258 against 0.0252 ms,
    session 32); returns the thread's (smallest real, largest) okey (``2**40``, -1 where it
    noted none)."""
    lo, hi = note_start()
    base = 0
    while base < n:  # block-uniform
        i0 = base + cuda.threadIdx.x
        if n - base <= 2 * nt:  # rounds of one a thread for the last two blocks' worth or less
            if i0 < n:
                lo, hi = note(kx, i0, ckey(r, c0 + i0, F, FM, B, scores, nodes, logp, lse, sh,
                                           ptr, codes, off), lo, hi)
            base += nt
        else:
            lo, hi = note4(kx, i0, nt, c0, r, n, F, FM, B, scores, nodes, logp, lse, sh, ptr,
                           codes, off, lo, hi)
            base += 4 * nt
    return note_end(lo, hi, n)


@cuda.jit(device=True, **INLINE)
def bcode(j, cnt, lo, codes):
    """The code of child ``j`` of a beam of ``cnt`` children from ``lo`` (``codes[0]`` where
    it is none: a valid load), for ``bval``. Its index stays 64-bit: with a 32-bit one ptxas
    interleaved a round's code and log-probability loads (see ``note_beam``)."""
    return codes[uint64(lo + j if j < cnt else int64(0))]


@cuda.jit(device=True, **INLINE)
def bval(cd, j, cnt, s, row, m, ls, logp, sh, off):
    """The okey of child ``j`` of code ``cd`` (``bcode``) of a beam read once (``note_beam``):
    its score ``s``, ``cnt`` children, its log-probabilities' row ``row`` with their max and
    log-sum (``m``, ``ls``); the same fp32 operations as ``cand``, so the same bits."""
    y = s + logp_at(logp, row, uint32(off) + uint32(cd), sh, m, ls)
    return okey(y if uint32(j) < uint32(cnt) else NEG_INF)


@cuda.jit(device=True, **INLINE)
def bkey(j, cnt, lo, s, row, m, ls, logp, sh, codes, off):
    """``bval`` of ``bcode``: child ``j``'s okey."""
    return bval(bcode(j, cnt, lo, codes), j, cnt, s, row, m, ls, logp, sh, off)


@cuda.jit(device=True, **INLINE)
def note_beam(kx, c0, n, nt, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off):
    """``note_all`` for a chunk inside one beam (``c0 // F == (c0 + n - 1) // F``; step 1's
    8,192 children of one beam): the beam's score, node, child range and log-sum read once, so a
    candidate costs two dependent loads (its code, its log-probability) instead of four levels,
    eight candidates a thread in flight while whole rounds of eight remain (step 1: one round),
    else four. ``bkey`` computes its okey without a branch: with one (``okey(...) if real``),
    the compiler sank each candidate's loads into it and issued them one candidate after
    another (cuobjdump, session 31). Returns the thread's (smallest real, largest) okey and the
    beam as ``put_abs`` takes it (``first << 32 | cnt``)."""
    b, j0, s, first, cnt = beam_of(r, c0, F, FM, scores, nodes, ptr)
    row = uint64(r * B + b)
    m = lse[0, row]
    ls = lse[uint64(sh >> 4), row]
    lo, hi = note_start()
    base = 0
    while n - base >= 8 * nt:  # eight a thread: every load of the round in flight at once
        i0 = base + cuda.threadIdx.x
        # the round's eight codes, then their log-probabilities (bcode's 64-bit index: with a
        # 32-bit one, ptxas issued two codes, their two log-probabilities, then the other six
        # codes, a load level more: step 1's scoring 3.35 -> 4.19 us on the H200, session 33)
        j = j0 + i0
        d0 = bcode(j, cnt, first, codes)
        d1 = bcode(j + nt, cnt, first, codes)
        d2 = bcode(j + 2 * nt, cnt, first, codes)
        d3 = bcode(j + 3 * nt, cnt, first, codes)
        d4 = bcode(j + 4 * nt, cnt, first, codes)
        d5 = bcode(j + 5 * nt, cnt, first, codes)
        d6 = bcode(j + 6 * nt, cnt, first, codes)
        d7 = bcode(j + 7 * nt, cnt, first, codes)
        k0 = bval(d0, j, cnt, s, row, m, ls, logp, sh, off)
        k1 = bval(d1, j + nt, cnt, s, row, m, ls, logp, sh, off)
        k2 = bval(d2, j + 2 * nt, cnt, s, row, m, ls, logp, sh, off)
        k3 = bval(d3, j + 3 * nt, cnt, s, row, m, ls, logp, sh, off)
        k4 = bval(d4, j + 4 * nt, cnt, s, row, m, ls, logp, sh, off)
        k5 = bval(d5, j + 5 * nt, cnt, s, row, m, ls, logp, sh, off)
        k6 = bval(d6, j + 6 * nt, cnt, s, row, m, ls, logp, sh, off)
        k7 = bval(d7, j + 7 * nt, cnt, s, row, m, ls, logp, sh, off)
        lo, hi = note8(kx, i0, nt, k0, k1, k2, k3, k4, k5, k6, k7, lo, hi)
        base += 8 * nt
    for base in range(base, n, 4 * nt):
        i0 = base + cuda.threadIdx.x
        if n - base <= nt:  # one candidate a thread left (block-uniform)
            if i0 < n:
                lo, hi = note(kx, i0, bkey(j0 + i0, cnt, first, s, row, m, ls, logp, sh, codes,
                                           off), lo, hi)
            continue
        k0 = bkey(j0 + i0, cnt, first, s, row, m, ls, logp, sh, codes, off)
        k1 = bkey(j0 + i0 + nt, cnt, first, s, row, m, ls, logp, sh, codes, off)
        k2 = bkey(j0 + i0 + 2 * nt, cnt, first, s, row, m, ls, logp, sh, codes, off)
        k3 = bkey(j0 + i0 + 3 * nt, cnt, first, s, row, m, ls, logp, sh, codes, off)
        lo, hi = note_upto4(kx, i0, nt, n, k0, k1, k2, k3, lo, hi)
    lo, hi = note_end(lo, hi, n)
    return lo, hi, (first << 32) | cnt


@cuda.jit(device=True, **INLINE)
def decode(srt, k, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top, parent,
           child, code):
    """The sorted keys' candidates: scores (recomputed: the same fp32 add), parent beams, child
    nodes and codes; ranks at or past the request's width ``cap[r]`` score -inf."""
    for i in range(cuda.threadIdx.x, k, cuda.blockDim.x):
        put(srt[i], i, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top,
            parent, child, code)


@cuda.jit(device=True, **INLINE)
def put(v, i, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top, parent,
        child, code):
    """Rank i's answer from its key ``v`` (``decode``'s, for one key)."""
    c = key_c(v)
    val, ch, cd = cand(r, c, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
    store(r, i, val if i < cap[r] else NEG_INF, div_f(c, FM), ch, cd, top, parent, child,
          code)


@cuda.jit(device=True, **INLINE)
def put_abs(v, i, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top, parent,
            child, code, beam):
    """``put`` for an absolute key (``okey << 31 | MAXC - c``, of the lists): the score is the
    key's okey read back (the same fp32 bits; -0.0 comes back +0.0, its equal), so the answer
    reads the beam, its child range and the code, and no log-probability (a dependent load
    fewer). Where every candidate is one beam's child (``beam`` = its ``first << 32 | cnt``,
    as ``note_beam`` read them; -1 otherwise) it reads the code alone (two levels fewer)."""
    if not KEYDEC:
        put(v, i, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top, parent,
            child, code)
        return
    c = key_c(v)
    if beam >= 0:  # block-uniform (on the H200 step 1 0.0163 -> 0.0159 ms, session 32)
        b = div_f(c, FM)
        j = c - b * F
        real = j < (beam & LOW32)
        ch = (beam >> 32) + j if real else int64(0)
        cd = codes[uint64(ch)]
    else:
        b, _, real, ch, cd = child_of(r, c, F, FM, scores, nodes, ptr, codes)
    answer(v, i, r, b, real, ch, cd, cap[r], top, parent, child, code)


@cuda.jit(device=True, **INLINE)
def answer(v, i, r, b, real, ch, cd, w, top, parent, child, code):
    """Rank i's answer from its absolute key ``v``: the score its okey (``-inf`` at or past the
    request's width ``w``), parent beam ``b``, child node ``ch`` and code ``cd`` (0 where the
    candidate is no child)."""
    store(r, i, okey_float(v >> 31) if i < w else NEG_INF, b, ch, cd if real else int64(0), top,
          parent, child, code)


@cuda.jit(device=True, **INLINE)
def store(r, i, val, b, ch, cd, top, parent, child, code):
    """Rank i's answer written: score, parent beam, child node and code. Unsigned indices: no
    negative-index wraparound code (on the H200 step 2 at beams of 1,024 0.0213 -> 0.0210 ms,
    session 53)."""
    top[ix(r), ix(i)] = val
    parent[ix(r), ix(i)] = b
    child[ix(r), ix(i)] = ch
    code[ix(r), ix(i)] = cd
