"""Where a selection candidate sits: its 32-bit index arithmetic and its place in the trie.

A request's candidates are ``c = b * F + j`` (beam ``b``, child slot ``j``); ``c // F`` is a
multiply and a shift (``magic``, ``div_f``), exact over the candidate range. Indices stay 32-bit
and are widened unsigned only where an array takes them (``ix``): Numba's 64-bit index
arithmetic, with its negative-index wraparound code, was most of a candidate's instructions.

A beam's place in the trie is two dependent load levels: its score and node (``beam_node``),
then the node's child range (``node_span``, counted by ``span_of``); the child's code is a
third. ``beam_at`` reads the first two at once; a kernel with barriers to hide them behind
issues a level a phase and uses each only after the next barrier (``trie_topk_rank.rank_answer``:
a use right after its load waits the load's whole round trip).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, int64, uint32, uint64

from .numba_common import INLINE

LOW32 = int64(0xFFFFFFFF)
I32MIN = int32(-0x80000000)
NEG_INF = float32(-np.inf)


@cuda.jit(device=True, **INLINE)
def ix(x):
    """An index below 2**32 as the unsigned 64 bits an array takes: zero-extended from 32, so
    the arithmetic that made it can stay 32-bit and no negative-index wraparound is emitted."""
    return uint64(uint32(x))


@cuda.jit(device=True, **INLINE)
def bits32(u):
    """The int32 whose bits are ``u``'s (``0 <= u < 2**32``, as an okey): how a key's 32 bits
    are stored in an int32 array."""
    return int32(u - (int64(1) << 32) if u >= (int64(1) << 31) else u)


@cuda.jit(device=True, **INLINE)
def signed_order(u):
    """Okey ``u`` (``0 <= u < 2**32``) as the int32 whose signed order is the okeys' (the top
    bit flipped): a block's min or max of okeys then takes one 32-bit shuffle a step."""
    return int32(bits32(u) ^ I32MIN)


@cuda.jit(device=True, **INLINE)
def okey_of(s):
    """``signed_order``'s inverse: the okey, as an int64."""
    return int64(uint32(s ^ I32MIN))


@cuda.jit(device=True, **INLINE)
def div_f(c, FM):
    """``c // F`` for ``FM = magic(F)``: one 32 x 32 -> 64-bit multiply (c < 2**30, and the
    multiplier is below 2**32) and a shift."""
    return int64((ix(c) * uint64(FM & LOW32)) >> uint64(FM >> 40))


def magic(F: int) -> int:
    """``c // F`` for 0 <= c < 2**30 as ``(c * m) >> s`` (Hacker's Delight, round-up method:
    exact, checked in the tests), packed as ``m | s << 40`` (m < 2**32 for F < 2**32, so that
    ``div_f`` multiplies 32 x 32 bits)."""
    sh = 31 + (F - 1).bit_length()
    return ((1 << sh) // F + 1) | (sh << 40)


@cuda.jit(device=True, **INLINE)
def slot(c, F, FM):
    """Candidate c's beam ``c // F`` (int64) and child slot ``c % F`` (uint32)."""
    b = div_f(c, FM)
    return b, uint32(uint32(c) - uint32(b) * uint32(F))


@cuda.jit(device=True, **INLINE)
def beam_node(r, b, scores, nodes):
    """Beam b's score and trie node, as loaded (the first load level)."""
    return scores[ix(r), ix(b)], nodes[ix(r), ix(b)]


@cuda.jit(device=True, **INLINE)
def node_span(s, n, ptr):
    """The child range's two bounds of node ``n`` of a beam scored ``s`` (``beam_node``'s),
    as loaded (the second level; node 0's where the beam is dead)."""
    m = uint32(n) if s > NEG_INF else uint32(0)
    return ptr[ix(m)], ptr[ix(m + uint32(1))]


@cuda.jit(device=True, **INLINE)
def span_of(s, lo, hi):
    """(first child, number of children) from ``node_span``'s bounds (uint32; no children
    where the beam is dead)."""
    first = uint32(lo)
    return first, uint32(uint32(hi) - first) if s > NEG_INF else uint32(0)


@cuda.jit(device=True, **INLINE)
def beam_at(r, b, scores, nodes, ptr):
    """Beam b's score, first child and number of children (uint32; 0 where it is dead)."""
    s, n = beam_node(r, b, scores, nodes)
    lo, hi = node_span(s, n, ptr)
    first, cnt = span_of(s, lo, hi)
    return s, first, cnt


@cuda.jit(device=True, **INLINE)
def beam_of(r, c, F, FM, scores, nodes, ptr):
    """Candidate c's beam ``b``, its child slot ``j``, the beam's score, first child and number
    of children (0 where the beam is dead). Indices are 32-bit (a request's candidates, the
    trie's nodes and children below 2**31), returned widened."""
    b = div_f(c, FM)  # (``slot`` here changed the merge's and one-block kernels' SASS: kept)
    j = uint32(uint32(c) - uint32(b) * uint32(F))
    s, first, cnt = beam_at(r, b, scores, nodes, ptr)
    return b, int64(j), s, int64(first), int64(cnt)


@cuda.jit(device=True, **INLINE)
def child_of(r, c, F, FM, scores, nodes, ptr, codes):
    """Candidate c's (beam, the beam's score, whether it is a child, child node, code): child
    node and code 0 where it is not, every load at a valid index."""
    b, j, s, lo, cnt = beam_of(r, c, F, FM, scores, nodes, ptr)
    real = uint32(j) < uint32(cnt)
    ch = uint32(uint32(lo) + uint32(j)) if real else uint32(0)
    return b, s, real, int64(ch), int64(codes[ix(ch)])
