"""Candidates scored from their block's beams in shared memory, for the grid selection's
``bin_hist`` (``trie_topk_bins``): a block's chunk of consecutive candidates spans at most ``NT``
beams, so it first loads each beam's score, log-sum row statistics, first child and child count
(``load_beams``: the two dependent loads of the beam's node and its child range, once a beam);
each candidate then loads its child's code and that code's log-probability only, two dependent
loads where ``trie_topk_keys.cand`` issues four. ``score8`` scores eight candidates a thread a
round with no branch, so that the round's loads issue together: on the H200 (session 44) this
took step 2's scoring at beams of 1,024 (22,656 candidates a block) from 13.4 us with selects
(LLVM turned them into branches around each load) to 9.7 us. Scores equal ``cand``'s bit for
bit (a ``+0.0`` aside, which the keys cannot tell from ``-0.0``).
"""

from __future__ import annotations

from numba import cuda, float32, int32, uint32

from .numba_common import INLINE
from .trie_topk_dev import NT
from .trie_topk_index import NEG_INF, beam_at, ix, slot
from .trie_topk_keys import logp_of


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
