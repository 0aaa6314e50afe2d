"""The merge's last block (``trie_topk_merge``) selecting from its request's list with the list
held in registers, and each listed key's answer (child node and code) fetched while the block
bins the list, so that no answer waits on a global load.

``select_list`` (``trie_topk_sample``) holds the list in shared memory, bins it, places the keys
of the bins from the ``k``-th's up, ranks them, and only then decodes each answer: its beam's
node, the node's child range and the child's code, three dependent global loads after
everything else (on the H200 the rank-and-answer phase of step 2's last block took 1.33-1.40
us, session 41). Here each thread keeps its (up to four) listed keys in registers and, for
the first three, issues those loads one level per phase: the beams' scores and nodes with the
list's best, the child ranges with the bins, the codes after the pick (a fourth key, in lists
of over 3,072, loads its three levels at once; four held across the phases spilled 12 bytes
under the 64-register cap, three spill none). A thread places each of its keys with its child
and code beside it (shared memory, by slot), so the slot's ranked key is answered from there.
On the H200 step 2 took 0.0173-0.0174 -> 0.0157-0.0160 ms against the code before it in the
same call, 48 requests 0.0341-0.0343 -> 0.0329-0.0333; its last block's placement 1.48-1.56 ->
1.27 us and its bins 2.02 -> 1.40 (phase stamps, session 41).
Where a bin is crowded the keys are sorted whole and answered as ``select_list`` answers them
(``put_abs``, which loads). Same keys, same order: the answers are ``select_list``'s, bit for
bit.
"""

from __future__ import annotations

from numba import cuda, int32, int64, uint32

from .numba_common import INLINE, stamp
from .trie_topk_dev import NB, NT, SEG_MAX, append, hist_add, pick_segments
from .trie_topk_keys import KEY_NEG_INF, MAXC, NEG_INF, div_f, ix, okey_float, put_abs
from .trie_topk_sample import UCAP, best_okey, obin, rev_okey, slot_rank


@cuda.jit(device=True, **INLINE)
def beam_loads(r, v, FM, scores, nodes):
    """Level 1 of list key ``v``'s answer: its beam's score and node, loaded (not yet used)."""
    b = div_f(MAXC - (v & MAXC), FM)
    return scores[ix(r), ix(b)], nodes[ix(r), ix(b)]


@cuda.jit(device=True, **INLINE)
def range_loads(s, n, ptr):
    """Level 2: the beam's child range (``ptr`` at its node and the next; node 0 where the beam
    is dead, as ``beam_of`` reads it), loaded (not yet used)."""
    m = uint32(n) if s > NEG_INF else uint32(0)
    return ptr[ix(m)], ptr[ix(m + uint32(1))]


@cuda.jit(device=True, **INLINE)
def code_load(v, s, first, end, F, FM, codes):
    """Level 3: (child node, code loaded, whether it is a child) of list key ``v``, as
    ``child_of`` computes them (child and code 0 where it is not)."""
    c = MAXC - (v & MAXC)
    j = uint32(uint32(c) - uint32(div_f(c, FM)) * uint32(F))
    cnt = uint32(uint32(end) - uint32(first)) if s > NEG_INF else uint32(0)
    real = j < cnt
    ch = uint32(uint32(first) + j) if real else uint32(0)
    return ch, codes[ix(ch)], real


@cuda.jit(device=True, **INLINE)
def count_key(hist, v, ok, ref):
    hist_add(hist, obin(v >> 31, ref), ok)


@cuda.jit(device=True, **INLINE)
def place_key(srt, held, hist, v, ok, d, ref, ch, cd, real):
    """Key ``v`` (where ``ok``) into its bin's segment of ``srt`` if its bin is from ``d`` up,
    its child and code into ``held`` at the same slot (``held[s]``, ``held[UCAP + s]``)."""
    b = obin(v >> 31, ref)
    if ok and b >= d:
        s = cuda.atomic.add(hist, b, 1)
        srt[s] = v
        held[s] = int32(ch)
        held[UCAP + s] = int32(cd) if real else int32(0)


@cuda.jit(device=True, **INLINE)
def answer_held(v, rank, r, FM, capr, held, top, parent, child, code):
    """The answer of rank ``rank`` from its key ``v`` and the pair held at this thread's slot
    (``put_abs``'s values, without its loads)."""
    tid = cuda.threadIdx.x
    rr, kk = ix(r), ix(rank)
    top[rr, kk] = okey_float(v >> 31) if rank < capr else NEG_INF
    parent[rr, kk] = div_f(MAXC - (v & MAXC), FM)
    child[rr, kk] = int64(uint32(held[tid]))
    code[rr, kk] = int64(held[UCAP + tid])


@cuda.jit(device=True, **INLINE)
def select_held(ul, U, k, KP, held, hist, srt, scan, res, ctr, r, F, FM, B, scores, nodes, logp,
                lse, sh, ptr, codes, off, cap, top, parent, child, code):
    """Answer request r's ``k`` best from its ``U`` (``k <= U <= UCAP``) listed keys
    ``ul[r, :U]``, as ``select_list`` does. ``res[3]`` ``I32MAX`` and ``ctr[0]`` 0 on entry
    (published). False (nothing answered; ``held`` overwritten) where every key is ``-inf`` or
    the bins from the ``k``-th's up hold over a block of keys. Every thread calls it (stamps 5:
    the list's best; 9: bins counted and picked; 12: keys placed)."""
    tid = cuda.threadIdx.x
    # the list's loads issued at once, clamped in bounds (clamped copies are list keys too)
    a0, a1, a2, a3 = tid < U, tid + NT < U, tid + 2 * NT < U, tid + 3 * NT < U
    v0 = ul[r, min(tid, U - 1)]
    v1 = ul[r, min(tid + NT, U - 1)]
    v2 = ul[r, min(tid + 2 * NT, U - 1)]
    v3 = ul[r, min(tid + 3 * NT, U - 1)]
    s0, n0 = beam_loads(r, v0, FM, scores, nodes)
    s1, n1 = beam_loads(r, v1, FM, scores, nodes)
    s2, n2 = beam_loads(r, v2, FM, scores, nodes)
    hi = best_okey(rev_okey(max(max(v0, v1), max(v2, v3)) >> 31), res)
    stamp(5)
    if hi <= KEY_NEG_INF:  # block-uniform: only -inf keys
        return False
    ref = okey_float(hi)
    f0, e0 = range_loads(s0, n0, ptr)
    f1, e1 = range_loads(s1, n1, ptr)
    f2, e2 = range_loads(s2, n2, ptr)
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
    h0, c0, r0 = code_load(v0, s0, f0, e0, F, FM, codes)
    h1, c1, r1 = code_load(v1, s1, f1, e1, F, FM, codes)
    h2, c2, r2 = code_load(v2, s2, f2, e2, F, FM, codes)
    if a3:  # a fourth key a thread (lists over 3 NT keys, rare): its levels at once
        s3, n3 = beam_loads(r, v3, FM, scores, nodes)
        f3, e3 = range_loads(s3, n3, ptr)
        h3, c3, r3 = code_load(v3, s3, f3, e3, F, FM, codes)
    else:
        h3, c3, r3 = uint32(0), int64(0), False
    if big == 0:  # the keys of the bins from d up laid out by bin, each with its answer's pair
        place_key(srt, held, hist, v0, a0, d, ref, h0, c0, r0)
        place_key(srt, held, hist, v1, a1, d, ref, h1, c1, r1)
        place_key(srt, held, hist, v2, a2, d, ref, h2, c2, r2)
        place_key(srt, held, hist, v3, a3, d, ref, h3, c3, r3)
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
