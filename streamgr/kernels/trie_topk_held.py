"""The merge's last block (``trie_topk_merge``) selecting from its request's list with the list
held in registers, each listed key's answer (child node and code) listed beside it.

``select_list`` (``trie_topk_sample``) holds the list in shared memory, bins it, places the keys
of the bins from the ``k``-th's up, ranks them, and only then decodes each answer: its beam's
node, the node's child range and the child's code, three dependent global loads after
everything else (on the H200 the rank-and-answer phase of step 2's last block took 1.33-1.40
us, session 41). Here each thread keeps its (up to four) listed keys in registers with their
answers, which the listing blocks wrote beside the keys (``ua``: ``trie_topk_merge.aux_of``,
read where the scoring had just brought the beam, child range and code into the SM's L1): it
places each key with its answer beside it (shared memory, by slot), so the slot's ranked key
is answered with no load at all. Session 41's version loaded the answers here, one load level
per phase while the block binned and picked; on the H200 that placement phase took 1.26 us,
this one 0.60-0.64, and the listing blocks' list phase 3.46-3.55 -> 3.62-3.72 (phase stamps,
session 42); graph-replayed, step 2 within the runs' noise of it (docs/benchmarks.md).
Where a bin is crowded the keys are sorted whole and answered as ``select_list`` answers them
(``put_abs``, which loads). Same keys, same order: the answers are ``select_list``'s, bit for
bit."""

from __future__ import annotations

from numba import cuda, int32, int64, uint32

from .numba_common import INLINE, stamp
from .trie_topk_bitonic import sort_desc, sort_span
from .trie_topk_dev import NB, NT, SEG_MAX, append, hist_add, pick_segments
from .trie_topk_keys import (KEY_NEG_INF, LOW32, NEG_INF, decode, div_f, ix, key_c, okey_float,
                             put_abs)
from .trie_topk_rank import radix_rest, sort_k
from .trie_topk_sample import UCAP, best_okey, obin, rev_okey, slot_rank


@cuda.jit(device=True, **INLINE)
def count_key(hist, v, ok, ref):
    hist_add(hist, obin(v >> 31, ref), ok)


@cuda.jit(device=True, **INLINE)
def place_key(srt, held, hist, v, ok, d, ref, aux):
    """Key ``v`` (where ``ok``) into its bin's segment of ``srt`` if its bin is from ``d`` up,
    its answer ``aux`` (child node << 32 | code, ``trie_topk_merge.aux_of``) into ``held`` at
    the same slot (``held[s]``, ``held[UCAP + s]``)."""
    b = obin(v >> 31, ref)
    if ok and b >= d:
        s = cuda.atomic.add(hist, b, 1)
        srt[s] = v
        held[s] = int32(uint32(aux >> 32))
        held[UCAP + s] = int32(aux & LOW32)


@cuda.jit(device=True, **INLINE)
def answer_held(v, rank, r, FM, capr, held, top, parent, child, code):
    """The answer of rank ``rank`` from its key ``v`` and the pair held at this thread's slot
    (``put_abs``'s values, without its loads)."""
    tid = cuda.threadIdx.x
    rr, kk = ix(r), ix(rank)
    top[rr, kk] = okey_float(v >> 31) if rank < capr else NEG_INF
    parent[rr, kk] = div_f(key_c(v), FM)
    child[rr, kk] = int64(uint32(held[tid]))
    code[rr, kk] = int64(held[UCAP + tid])


@cuda.jit(device=True, **INLINE)
def select_held(ul, ua, U, k, KP, held, hist, srt, scan, res, ctr, r, F, FM, B, scores, nodes,
                logp, lse, sh, ptr, codes, off, cap, top, parent, child, code):
    """Answer request r's ``k`` best from its ``U`` (``k <= U <= UCAP``) listed keys
    ``ul[r, :U]`` and their answers ``ua[r, :U]``, as ``select_list`` does. ``res[3]``
    ``I32MAX`` and ``ctr[0]`` 0 on entry (published). False (nothing answered; ``held``
    overwritten) where every key is ``-inf`` or the bins from the ``k``-th's up hold over a
    block of keys. Every thread calls it (stamps 5: the list's best; 9: bins counted and
    picked; 12: keys placed)."""
    tid = cuda.threadIdx.x
    # the list's loads issued at once, clamped in bounds (clamped copies are list keys too)
    a0, a1, a2, a3 = tid < U, tid + NT < U, tid + 2 * NT < U, tid + 3 * NT < U
    i0, i1 = min(tid, U - 1), min(tid + NT, U - 1)
    i2, i3 = min(tid + 2 * NT, U - 1), min(tid + 3 * NT, U - 1)
    v0, v1, v2, v3 = ul[r, i0], ul[r, i1], ul[r, i2], ul[r, i3]
    x0, x1, x2, x3 = ua[r, i0], ua[r, i1], ua[r, i2], ua[r, i3]
    hi = best_okey(rev_okey(max(max(v0, v1), max(v2, v3)) >> 31), res)
    stamp(5)
    if hi <= KEY_NEG_INF:  # block-uniform: only -inf keys
        return False
    ref = okey_float(hi)
    hist[tid] = 0
    cuda.syncthreads()
    count_key(hist, v0, a0, ref)
    count_key(hist, v1, a1, ref)
    count_key(hist, v2, a2, ref)
    count_key(hist, v3, a3, ref)
    cuda.syncthreads()
    d, need, nd, big = pick_segments(hist, NB, k, SEG_MAX, scan, res)
    stamp(9)
    total = k - need + nd
    if total > NT:  # block-uniform
        return False
    if big == 0:  # the keys of the bins from d up laid out by bin, each with its answer
        place_key(srt, held, hist, v0, a0, d, ref, x0)
        place_key(srt, held, hist, v1, a1, d, ref, x1)
        place_key(srt, held, hist, v2, a2, d, ref, x2)
        place_key(srt, held, hist, v3, a3, d, ref, x3)
    else:  # a crowded bin: those keys appended, to be sorted whole (answered by put_abs)
        srt[tid] = 0
        cuda.syncthreads()
        append(srt, ctr, 0, v0, a0 & (obin(v0 >> 31, ref) >= d))
        append(srt, ctr, 0, v1, a1 & (obin(v1 >> 31, ref) >= d))
        append(srt, ctr, 0, v2, a2 & (obin(v2 >> 31, ref) >= d))
        append(srt, ctr, 0, v3, a3 & (obin(v3 >> 31, ref) >= d))
    v, rank = slot_rank(srt, hist, ref, k, KP, total, big)  # its first barrier publishes
    if rank < k:
        if big == 0:
            answer_held(v, rank, r, FM, cap[r], held, top, parent, child, code)
        else:
            put_abs(v, rank, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap,
                    top, parent, child, code, -1)
    return True


@cuda.jit(device=True, **INLINE)
def select_global(ul, U, k, KP, hist, srt, scan, res, red, ctr, r, F, FM, B, scores, nodes, logp,
                  lse, sh, ptr, codes, off, cap, top, parent, child, code):
    """Answer request r's ``k`` best from its ``U >= k`` listed keys ``ul[r, :U]`` in global
    memory, whatever they hold (ties, only ``-inf``, ``k`` over half a block): sorted whole where
    they fit a block, else a radix select of the ``k`` over the list's bits below those all its
    keys share, then sorted; decoded as every path does. ``ctr[0]`` 0 on entry (published).
    Every thread calls it."""
    tid = cuda.threadIdx.x
    if U <= NT:  # the whole list sorted
        srt[tid] = ul[r, tid] if tid < U else int64(0)
        cuda.syncthreads()
        sort_desc(srt, sort_span(U, KP))
    else:
        radix_rest(ul, r, U, k, hist, scan, res, red, srt, ctr)
        sort_k(srt, k, KP)
    decode(srt, k, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top, parent,
           child, code)
