"""Candidates and their keys for the selection kernels (``trie_topk_one``, ``trie_topk_bins``):
a candidate's score, child and code read from the trie and the
log-probabilities (``cand``), its order-preserving key, and its answer (``decode``).

A candidate ``c`` with fp32 score ``x`` becomes one int64 *key*: ``t << 31 | (MAXC - c)``, where
``t`` is the score's order-preserving 32 bits (``okey``) shifted so that the smallest real score
of the request gives 1 (every ``-inf`` gives 0). Keys are distinct (the low bits hold ``c``) and
compare as the stable order does: higher score first, then the lower ``c``. Shifting by the
request's minimum (``tmin``) and reading digits from the highest bit of ``tmax - tmin`` down makes
the first digit spread the request's scores over its bins instead of spending a round on the
sign and exponent bits they all share.

A request's candidates are ``c = b * F + j``; ``c // F`` is a multiply and a shift
(``magic``, ``div_f``), exact over the candidate range.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, int64, uint64

from .trie_topk import SIMULATED

MAXC = int64(0x7FFFFFFF)  # candidate indices below 2**31
LOW32 = int64(0xFFFFFFFF)
KEY_NEG_INF = int64(0x007FFFFF)  # okey(-inf)
M40 = int64((1 << 40) - 1)
NEG_INF = float32(-np.inf)

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
def okey_float(u):
    """The fp32 value of the order-preserving bits ``u`` (``okey``'s inverse)."""
    b = (u ^ int64(0x80000000)) if u >= int64(0x80000000) else (LOW32 ^ u)
    return _float(int32(b - (int64(1) << 32) if b >= (int64(1) << 31) else b))


@cuda.jit(device=True, inline=True)
def tkey(key32, c, tmin):
    """Candidate c's key from its okey and the request's smallest real okey."""
    t = key32 - tmin + 1 if key32 >= tmin else int64(0)
    return (t << 31) | (MAXC - c)


@cuda.jit(device=True, inline=True)
def cand(r, c, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off):
    """Candidate c of request r: (score, -inf where no child; child node; code), with every
    load issued at a clamped index and no branch (selects only), so that the loads of several
    candidates computed in a row overlap; indices are unsigned (no negative-index wraparound
    code: about a third of the instructions). ``FM`` is ``magic(F)``. ``logp`` holds raw bits:
    fp32 (int32, ``sh`` 0) or bf16 logits (int16, ``sh`` 16) read with ``lse`` [2, rows] (each
    row's max and log-sum): the fp32 ``(x - max) - logsum`` of ``LogProbs.gather``, bit for
    bit; with ``sh`` 0, ``lse`` is any [1, rows] float array, read and unused."""
    b = div_f(c, FM)  # c // F without a division
    j = c - b * F
    ur = uint64(r)
    ub = uint64(b)
    s = scores[ur, ub]
    n = nodes[ur, ub]
    alive = s > NEG_INF
    n = n if alive else int64(0)
    lo = ptr[uint64(n)]
    hi = ptr[uint64(n + 1)]
    real = alive & (j < hi - lo)
    ch = lo + j if real else int64(0)
    cd = codes[uint64(ch)]
    row = uint64(r * B + b)
    x = _float(int32(logp[row, uint64(off + cd)]) << sh)
    m = lse[0, row]
    ls = lse[uint64(sh >> 4), row]
    x = (x - m) - ls if sh else x
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
def note4(kx, i0, step, c0, r, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, lo,
          hi):
    """``note`` of the okeys of candidates ``c0 + i0 + j * step`` at ``kx[i0 + j * step]``
    (j < 4, those below N): their four load chains issued at clamped indices before any
    store, so that they overlap."""
    k0 = ckey(r, c0 + min(i0, N - 1), F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
    k1 = ckey(r, c0 + min(i0 + step, N - 1), F, FM, B, scores, nodes, logp, lse, sh, ptr, codes,
              off)
    k2 = ckey(r, c0 + min(i0 + 2 * step, N - 1), F, FM, B, scores, nodes, logp, lse, sh, ptr,
              codes, off)
    k3 = ckey(r, c0 + min(i0 + 3 * step, N - 1), F, FM, B, scores, nodes, logp, lse, sh, ptr,
              codes, off)
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
def note_all(kx, c0, n, nt, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off):
    """``kx[i]`` = the okey of candidate ``c0 + i`` for ``i < n``, by the block's ``nt``
    threads (four a thread at a time while more than a block's worth are left); returns the
    thread's (smallest real, largest) okey (``2**40``, -1 where it noted none)."""
    lo = int64(1) << 40
    hi = int64(-1)
    for base in range(0, n, 4 * nt):
        i0 = base + cuda.threadIdx.x
        if n - base <= nt:  # one candidate a thread left (block-uniform)
            if i0 < n:
                lo, hi = note(kx, i0, ckey(r, c0 + i0, F, FM, B, scores, nodes, logp, lse, sh,
                                           ptr, codes, off), lo, hi)
            continue
        lo, hi = note4(kx, i0, nt, c0, r, n, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes,
                       off, lo, hi)
    return lo, hi


@cuda.jit(device=True, inline=True)
def decode(srt, k, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top, parent,
           child, code):
    """The sorted keys' candidates: scores (recomputed: the same fp32 add), parent beams, child
    nodes and codes; ranks at or past the request's width ``cap[r]`` score -inf."""
    for i in range(cuda.threadIdx.x, k, cuda.blockDim.x):
        put(srt[i], i, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top,
            parent, child, code)


@cuda.jit(device=True, inline=True)
def put(v, i, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top, parent,
        child, code):
    """Rank i's answer from its key ``v`` (``decode``'s, for one key)."""
    c = MAXC - (v & MAXC)
    val, ch, cd = cand(r, c, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
    top[r, i] = val if i < cap[r] else NEG_INF
    parent[r, i] = div_f(c, FM)
    child[r, i] = ch
    code[r, i] = cd


@cuda.jit(device=True, inline=True)
def div_f(c, FM):
    """``c // F`` for ``FM = magic(F)``."""
    return (c * (FM & M40)) >> (FM >> 40)


def magic(F: int) -> int:
    """``c // F`` for 0 <= c < 2**30 as ``(c * m) >> s`` (Hacker's Delight, round-up method:
    exact, checked in the tests), packed as ``m | s << 40`` (m <= 2**32 + 1)."""
    sh = 31 + (F - 1).bit_length()
    return ((1 << sh) // F + 1) | (sh << 40)
