"""Scoring of a merge block's chunk that spans a few beams (gen-ref's step 2 at beams of 256:
8,192 candidates over ~47 beams of 177 children) through a table of those beams in shared
memory (``trie_topk_merge``).

``note_all`` finds each candidate's beam, its score, node, child range and log-sum in global
memory: four dependent load levels a candidate and ~125 SASS instructions (much of it 64-bit
index arithmetic), so a block of 8,192 is issue-bound on its SM. Here one thread a beam reads
the beam once into the table (``beam_table``: first child, children, score, the row's max and
log-sum), and each candidate reads its beam's row from shared memory, then its code and its
log-probability (``bkey``: the same fp32 operations as ``cand``, so the same bits): two
dependent global loads a candidate instead of four levels. The SASS is no shorter (~130
instructions a candidate, most of them the 64-bit index arithmetic Numba emits for the table,
the beam division and the logits' strides), so what it saves is load latency alone; not yet
timed on the H200, it is off unless ``STREAMGR_TOPK_TAB=1`` (the simulator tests run it).
"""

from __future__ import annotations

import os

from numba import cuda, int64, uint64

from .trie_topk import SIMULATED
from .trie_topk_keys import beam_of, bkey, div_f, note, note_upto4
from .trie_topk_sample import chunk_begin, chunk_end

TAB = os.environ.get("STREAMGR_TOPK_TAB", "0") == "1"
BT = 8 if SIMULATED else 64  # beams a table holds (64: 1.25 KiB of the merge block's shared)
TI_N, TF_N = 2 * BT, 3 * BT  # the table's int64 and float32 cells (literal shared shapes)


@cuda.jit(device=True, inline=True)
def fits_table(c0, n, FM):
    """True where candidates ``c0 .. c0 + n - 1`` span from two to ``BT`` beams."""
    nb = div_f(c0 + n - 1, FM) - div_f(c0, FM)
    return TAB and 0 < nb and nb < BT


@cuda.jit(device=True, inline=True)
def beam_table(ti, tf, c0, n, r, F, FM, B, scores, nodes, lse, sh, ptr):
    """Table row q of the chunk's beam ``b0 + q``: ``ti[2q]`` its first child, ``ti[2q + 1]``
    its children (0 where dead), ``tf[3q]`` its score, ``tf[3q + 1]`` and ``tf[3q + 2]`` its
    row's max and log-sum (as ``cand`` reads them). Returns ``b0``; ends synchronized."""
    b0 = div_f(c0, FM)
    for q in range(cuda.threadIdx.x, div_f(c0 + n - 1, FM) - b0 + 1, cuda.blockDim.x):
        _, _, s, first, cnt = beam_of(r, (b0 + q) * F, F, FM, scores, nodes, ptr)
        row = uint64(r * B + b0 + q)
        ti[2 * q] = first
        ti[2 * q + 1] = cnt
        tf[3 * q] = s
        tf[3 * q + 1] = lse[0, row]
        tf[3 * q + 2] = lse[uint64(sh >> 4), row]
    cuda.syncthreads()
    return b0


@cuda.jit(device=True, inline=True)
def tab_key(c, b0, F, FM, r, B, ti, tf, logp, sh, codes, off):
    """The okey of candidate c through the table (``beam_table``) of the beams from ``b0``."""
    b = div_f(c, FM)
    q = uint64(b - b0)
    return bkey(c - b * F, ti[2 * q + 1], ti[2 * q], tf[3 * q], uint64(r * B + b), tf[3 * q + 1],
                tf[3 * q + 2], logp, sh, codes, off)


@cuda.jit(device=True, inline=True)
def score_tab(kx, c0, n, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, red, ctr,
              ti, tf):
    """``score_chunk`` for a chunk that ``fits_table``: ``ctr`` zeroed, the okeys into ``kx``
    (four candidates a thread at a time while more than a block's worth are left, as
    ``note_all``) and the block's (smallest real, largest) okey to every thread (stamps 14, 1,
    2)."""
    chunk_begin(ctr)
    nt = cuda.blockDim.x
    b0 = beam_table(ti, tf, c0, n, r, F, FM, B, scores, nodes, lse, sh, ptr)
    lo = int64(1) << 40
    hi = int64(-1)
    for base in range(0, n, 4 * nt):
        i0 = base + cuda.threadIdx.x
        if n - base <= nt:  # one candidate a thread left (block-uniform)
            if i0 < n:
                lo, hi = note(kx, i0, tab_key(c0 + i0, b0, F, FM, r, B, ti, tf, logp, sh, codes,
                                              off), lo, hi)
            continue
        k0 = tab_key(c0 + min(i0, n - 1), b0, F, FM, r, B, ti, tf, logp, sh, codes, off)
        k1 = tab_key(c0 + min(i0 + nt, n - 1), b0, F, FM, r, B, ti, tf, logp, sh, codes, off)
        k2 = tab_key(c0 + min(i0 + 2 * nt, n - 1), b0, F, FM, r, B, ti, tf, logp, sh, codes, off)
        k3 = tab_key(c0 + min(i0 + 3 * nt, n - 1), b0, F, FM, r, B, ti, tf, logp, sh, codes, off)
        lo, hi = note_upto4(kx, i0, nt, n, k0, k1, k2, k3, lo, hi)
    return chunk_end(lo, hi, red)
