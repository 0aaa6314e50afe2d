"""One-launch selection of ``trie_topk`` for requests of over a block and at most ``QN`` blocks of
candidates with ``k`` over half a block (gen-ref's step 3 at beams of 1,024: 3,072 candidates,
``k`` 1,024): one block of ``NT`` threads per request, ``QN`` candidates a thread held in
registers.

``trie_topk_one`` serves such a ``k`` with its radix rounds (two or three histogram rounds over
every key), then sorts the ``k`` keys whole (a bitonic network of 55 stages) and answers each by
reading its beam, child range and code again: on the H200 0.0270 ms against ``torch.topk``'s
0.0382 (1.41x), this kernel 0.0094 against 0.0356 (3.77x; session 35), 0.0072-0.0074 against
0.0376 (5.21x; session 46, with the scoring by beam and its ranks, scans and okey arithmetic in
32 bits). As in ``trie_topk_own``: each thread scores its ``QN`` candidates (their loads
overlap; where a request has at most a block of beams of at most ``QN`` children, as step 3,
they are beam t's children, ``score_beam``: the beam's loads once), keeps their
okeys in registers and their (child, code) in shared memory; the block's best okey is a warp min
and one shared atomic; one round of score bins below it (``obin``) and ``pick_segments`` give
the bin of the ``k``-th key; a second round bins the keys from that bin up linearly over their
distance below the best (``lbin``) and picks again. The keys from the picked bin up (at most
``k - 1 + SEG_MAX`` where none is crowded) are laid out by bin and ranked in their bins by the
threads of their slots (two a thread), and each answer is read from the key (score, parent)
and the held pair (child, code): no global read after the scoring. Where a bin is crowded
(ties, every candidate ``-inf``) the ``k`` best are radix-selected from the registers' keys
(10-bit digits from the key's top) and sorted whole; still exact, slower.
"""

from __future__ import annotations

import os

from numba import cuda, float32, int32, int64, uint32

from .kernel_cache import cached
from .numba_common import INLINE, STAMP, base_at, load_at, row_at, stamp
from .trie_topk_dev import (DIG, DM, I32MAX, JIT_NT, NB, NT, SCAN_N, SEG_MAX, append, bin_rank,
                            hist_add, pick, pick_segments)
from .trie_topk_index import beam_node, node_span, span_of
from .trie_topk_keys import (LOW32, MAXC, NEG_INF, _float, child_of, div_f, ix, key_c, logp_at,
                             logp_of, okey, okey_float)
from .trie_topk_rank import sort_k
from .trie_topk_sample import OBASE, OCT, best_okey, obin, rev_okey, ubin

# STREAMGR_TOPK_QUAD: 1 (the default) requests of NT < N <= QN * NT candidates with k over half a
# block here; 2 any k (A/B runs: below half a block trie_topk_one's sampled list serves them);
# 0 never (trie_topk_one's radix rounds).
QUAD = os.environ.get("STREAMGR_TOPK_QUAD", "1")
# The keys of the bins from the k-th's up binned again, linearly over their distance below the
# best, before they are laid out: obin's bins widen with the distance, and most of the k best of
# step 3 at beams of 1,024 are far from the best (23 keys a bin on average, up to 67, each key
# ranked against its bin's): on the H200 0.0124 -> 0.0098 ms so (session 35, call 3).
# STREAMGR_TOPK_QREBIN=0: one round (A/B runs).
REBIN = os.environ.get("STREAMGR_TOPK_QREBIN", "1") == "1"
# Requests of at most a block of beams of at most QN children (step 3: fan-out 3) scored by
# beam, thread t its beam t's children: one beam, child range and log-sum load a thread instead
# of one a candidate. STREAMGR_TOPK_QBEAM=0: by candidate always (A/B runs).
BEAMWISE = os.environ.get("STREAMGR_TOPK_QBEAM", "1") == "1"
QN = 4  # candidates a thread (the kernel's code holds four by name)
QMAX = QN * NT
LIST_N = NT + SEG_MAX  # the bins from the k-th's up hold at most k - 1 + SEG_MAX <= this
KEY_TOP = 63 - DIG  # the radix fallback's first digit: a key's bits 53..62 (keys < 2**63)


def serves(N: int, k: int) -> bool:
    """This kernel takes a request of ``N`` candidates and ``k`` wanted (host side)."""
    return QUAD != "0" and NT < N <= QMAX and (QUAD == "2" or 2 * k > NT)


@cuda.jit(device=True, **INLINE)
def score(r, c, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off):
    """Candidate c's (okey, ``-1`` past ``N``; (child + 1) << 32 | code to hold, 0 where it
    is not a child: the reference answers child 0, code 0 there). No store: the caller holds
    the four candidates' pairs after all four are scored, since a shared store between them
    would order the next candidate's loads after it (LLVM cannot tell Numba's generic global
    pointers from shared ones)."""
    cc = int64(min(c, N - 1))
    b, s, real, ch, cd = child_of(r, cc, F, FM, scores, nodes, ptr, codes)
    row = ix(uint32(r) * uint32(B) + uint32(b))
    x = logp_at(logp, row, uint32(off) + uint32(cd), sh, lse[0, row], lse[ix(sh >> 4), row])
    val = s + x if real else NEG_INF
    pk = ((ch + 1) << 32) | (cd & LOW32) if real else int64(0)
    return (okey(val) if c < N else int64(-1)), pk


@cuda.jit(device=True, **INLINE)
def child_key(i, ok, base, N, s, first, cnt, at, logp, sh, m, ls, codes):
    """``score``'s (okey, held pair) and candidate index (``N`` where slot ``i`` is none) of
    child slot ``i`` of a beam scored ``s`` (``first``, ``cnt``: its child range; ``at`` its
    log-probabilities' row from ``off``, ``row_at``'s; ``m``, ``ls`` their max and log-sum),
    whose candidates start at ``base``; ``ok``: the slot is a candidate."""
    real = uint32(i) < cnt
    ch = first + uint32(i) if real else uint32(0)
    cd = load_at(codes, base_at(codes), ch)
    x = logp_of(load_at(logp, at, uint32(cd)), sh, m, ls)
    val = s + x if real else NEG_INF
    pk = ((int64(ch) + 1) << 32) | (cd & LOW32) if real else int64(0)
    return (okey(val) if ok else int64(-1)), pk, (int64(base + uint32(i)) if ok else N)


@cuda.jit(device=True, **INLINE)
def score_beam(r, t, N, F, B, scores, nodes, logp, lse, sh, ptr, codes, off):
    """Thread t's candidates where the request has at most a block of beams of at most ``QN``
    children: beam t's children ``t F + i`` (``child_key``), its score, node, child range and
    the row's log-sum loaded once."""
    has = uint32(t) < uint32(B)
    b = uint32(t) if has else uint32(0)
    s, n = beam_node(r, b, scores, nodes)
    row = ix(uint32(r) * uint32(B) + b)
    m, ls = lse[0, row], lse[ix(sh >> 4), row]
    at = row_at(logp, row, ix(off))
    lo, hi = node_span(s, n, ptr)
    first, cnt = span_of(s, lo, hi)
    base = uint32(t) * uint32(F)
    u0, p0, c0 = child_key(0, has, base, N, s, first, cnt, at, logp, sh, m, ls, codes)
    u1, p1, c1 = child_key(1, has and F > 1, base, N, s, first, cnt, at, logp, sh, m, ls, codes)
    u2, p2, c2 = child_key(2, has and F > 2, base, N, s, first, cnt, at, logp, sh, m, ls, codes)
    u3, p3, c3 = int64(-1), int64(0), N
    if F > 3:  # block-uniform: step 3's fan-out of 3 issues no fourth child's loads
        u3, p3, c3 = child_key(3, has, base, N, s, first, cnt, at, logp, sh, m, ls, codes)
    return u0, u1, u2, u3, p0, p1, p2, p3, c0, c1, c2, c3


@cuda.jit(device=True, **INLINE)
def hold(held, c, N, pk):
    """Candidate c's pair into ``held`` (``score``'s)."""
    if c < N:
        held[c] = pk


@cuda.jit(device=True, **INLINE)
def key_of(u, c):
    """The absolute key of okey ``u`` (``-1``: no candidate) of candidate c, ``-1`` for none."""
    return (u << 31) | (MAXC - c) if u >= 0 else int64(-1)


@cuda.jit(device=True, **INLINE)
def count4(hist, b0, b1, b2, b3, t0, t1, t2, t3):
    """A thread's four bins counted where taken (both bins rounds); ends synchronized."""
    hist_add(hist, b0, t0)
    hist_add(hist, b1, t1)
    hist_add(hist, b2, t2)
    hist_add(hist, b3, t3)
    cuda.syncthreads()


@cuda.jit(device=True, **INLINE)
def rebin_scale(d):
    """``NB`` over the distance below the best score at which ``obin``'s bin ``d`` (> 0) ends:
    every key of the bins from ``d`` up is closer than that distance."""
    g = int32(NB - 1 - d + 1 + OBASE) << int32(23 - OCT)
    return float32(NB) / _float(g)


@cuda.jit(device=True, **INLINE)
def lbin(u, ref, scale):
    """The linear bin of okey ``u``: its score's distance below the best ``ref`` times
    ``scale`` (bins of equal width up to bin ``d``'s end), higher for higher scores: monotone,
    each step of the float math rounding monotonically."""
    x = min((ref - okey_float(u)) * scale, float32(NB - 1))
    return int32(NB - 1) - int32(x)


@cuda.jit(device=True, **INLINE)
def relin(u, b, d, ref, scale):
    """The linear bin of okey ``u`` whose ``obin`` is ``b``, where ``b`` is from ``d`` up
    (else -1: out of the running)."""
    return lbin(u, ref, scale) if u >= 0 and b >= d else int32(-1)


@cuda.jit(device=True, **INLINE)
def place(lst, hist, u, c, b, d):
    """Key of okey ``u`` into its bin's segment of ``lst`` where its bin is from ``d`` up."""
    if u >= 0 and b >= d:
        lst[cuda.atomic.add(hist, b, 1)] = key_of(u, c)


@cuda.jit(device=True, **INLINE)
def answer(v, rank, r, FM, capr, held, top, parent, child, code):
    """The answer of rank ``rank`` from its key ``v`` and the held (child + 1, code); ``capr``
    the request's width."""
    c = key_c(v)
    p = held[ix(c)]
    rr, kk = ix(r), ix(rank)  # unsigned: no negative-index wraparound selects a store
    top[rr, kk] = okey_float(v >> 31) if rank < capr else NEG_INF
    parent[rr, kk] = div_f(c, FM)
    child[rr, kk] = (p >> 32) - 1 if p != 0 else int64(0)
    code[rr, kk] = p & LOW32


@cuda.jit(device=True, **INLINE)
def rank_slot(lst, hist, s, total, ref, scale, k, r, FM, capr, held, top, parent, child, code):
    """Slot ``s`` of the ``total`` laid-out keys, if it is one, ranked in its bin (``lbin``
    where the keys were binned again, ``scale`` > 0, else ``obin``) and answered if in the
    ``k`` best."""
    if s < total:
        v = lst[s]
        b = lbin(v >> 31, ref, scale) if scale > 0 else obin(v >> 31, ref)
        rank = bin_rank(lst, v, b, hist, NB)
        if rank < k:
            answer(v, rank, r, FM, capr, held, top, parent, child, code)


@cuda.jit(device=True, **INLINE)
def radix_count(hist, v, prefix, fixed, shift):
    """``radix``'s histogram add for a register key ``v`` (``-1``: none)."""
    hist_add(hist, int32((v >> shift) & DM), v >= 0 and (v >> fixed) == (prefix >> fixed))


@cuda.jit(device=True, **INLINE)
def radix_take(lst, ctr, v, prefix, shift):
    """``collect``'s append for a register key ``v`` (``-1``: none): the keys whose bits from
    the last digit's ``shift`` up reach the picked digits' (a higher digit picked earlier wins
    at once)."""
    append(lst, ctr, 0, v, v >= 0 and (v >> shift) >= (prefix >> shift))


@cached
@cuda.jit(**JIT_NT)
def quad_select(N, k, KP, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap, top,
                parent, child, code):
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    hist = cuda.shared.array(NB, int32)
    lst = cuda.shared.array(LIST_N, int64)
    held = cuda.shared.array(QMAX, int64)
    scan = cuda.shared.array(SCAN_N, int32)
    res = cuda.shared.array(4, int32)
    ctr = cuda.shared.array(1, int32)
    stamp(14)
    capr = cap[r]  # with the scoring's loads, not alone at the answers (no change seen, s35)
    if BEAMWISE and F <= QN and B <= NT:  # block-uniform
        u0, u1, u2, u3, p0, p1, p2, p3, c0, c1, c2, c3 = score_beam(
            r, tid, N, F, B, scores, nodes, logp, lse, sh, ptr, codes, off)
    else:
        c0, c1, c2, c3 = int64(tid), int64(tid + NT), int64(tid + 2 * NT), int64(tid + 3 * NT)
        u0, p0 = score(r, c0, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
        u1, p1 = score(r, c1, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
        u2, p2 = score(r, c2, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
        u3, p3 = score(r, c3, N, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off)
    hold(held, c0, N, p0)
    hold(held, c1, N, p1)
    hold(held, c2, N, p2)
    hold(held, c3, N, p3)
    hist[tid] = 0
    if tid == 0:
        res[3] = I32MAX
        ctr[0] = 0
    cuda.syncthreads()
    hi = best_okey(min(min(rev_okey(u0), rev_okey(u1)), min(rev_okey(u2), rev_okey(u3))), res)
    stamp(1)
    ref = okey_float(hi)
    b0, b1, b2, b3 = ubin(u0, ref), ubin(u1, ref), ubin(u2, ref), ubin(u3, ref)
    count4(hist, b0, b1, b2, b3, u0 >= 0, u1 >= 0, u2 >= 0, u3 >= 0)
    d, need, nd, big = pick_segments(hist, NB, k, SEG_MAX, scan, res)
    stamp(9)
    scale = float32(0.0)  # > 0: the keys binned again, linearly (lbin)
    if REBIN and d > 0:  # block-uniform: every key from bin d up is a finite distance below
        scale = rebin_scale(d)
        b0, b1 = relin(u0, b0, d, ref, scale), relin(u1, b1, d, ref, scale)
        b2, b3 = relin(u2, b2, d, ref, scale), relin(u3, b3, d, ref, scale)
        hist[tid] = 0
        cuda.syncthreads()
        count4(hist, b0, b1, b2, b3, b0 >= 0, b1 >= 0, b2 >= 0, b3 >= 0)
        d, need, nd, big = pick_segments(hist, NB, k, SEG_MAX, scan, res)
        stamp(10)
    total = k - need + nd  # <= k - 1 + SEG_MAX where no bin is crowded
    if big == 0:  # the keys of the bins from d up laid out by bin, two slots a thread ranked
        place(lst, hist, u0, c0, b0, d)
        place(lst, hist, u1, c1, b1, d)
        place(lst, hist, u2, c2, b2, d)
        place(lst, hist, u3, c3, b3, d)
        cuda.syncthreads()
        stamp(12)
        # total <= LIST_N: two slots a thread at most, each its own site (range()'s 64-bit
        # trip count cost more than the second slot's test)
        rank_slot(lst, hist, tid, total, ref, scale, k, r, FM, capr, held, top, parent, child,
                  code)
        rank_slot(lst, hist, tid + NT, total, ref, scale, k, r, FM, capr, held, top, parent,
                  child, code)
    else:  # a crowded bin: radix select over the registers' keys, then a sort of the k
        v0, v1, v2, v3 = key_of(u0, c0), key_of(u1, c1), key_of(u2, c2), key_of(u3, c3)
        prefix, fixed, shift, want = int64(0), int64(63), int64(KEY_TOP), int64(k)
        while True:
            hist[tid] = 0
            cuda.syncthreads()
            radix_count(hist, v0, prefix, fixed, shift)
            radix_count(hist, v1, prefix, fixed, shift)
            radix_count(hist, v2, prefix, fixed, shift)
            radix_count(hist, v3, prefix, fixed, shift)
            cuda.syncthreads()
            dd, need, inbin = pick(hist, NB, want, scan, res, NT)
            prefix |= dd << shift
            if need == inbin or shift == 0:
                break
            want = need
            fixed = shift
            shift = shift - DIG if shift > DIG else int64(0)
        radix_take(lst, ctr, v0, prefix, shift)
        radix_take(lst, ctr, v1, prefix, shift)
        radix_take(lst, ctr, v2, prefix, shift)
        radix_take(lst, ctr, v3, prefix, shift)
        sort_k(lst, k, KP)
        if tid < k:
            answer(lst[tid], int64(tid), r, FM, capr, held, top, parent, child, code)
    if STAMP:
        cuda.syncthreads()
        stamp(15)
