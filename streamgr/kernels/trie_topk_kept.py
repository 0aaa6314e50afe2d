"""The grid selection of ``trie_topk`` in one launch (``kept_select``), where a block's beam
units fit four a warp and the blocks one wave of at most ``GMAX`` a request (``plan``: gen-ref's
step 2 at beams of 1,024, 8 blocks of 128 beams a request; at 48 requests, 2): instead of
``trie_topk_bins``' two launches, which keep one request's flat 2,097,152 (128 blocks).

Each block scores its beams' units as ``bin_hist`` does (``trie_topk_beams``), but holds the
scores in registers (24 a thread) instead of writing every candidate's okey to an [R, N] buffer
for a second launch to read back. Its own histogram then gives the bin ``d`` of its own
``k``-th best (``cursors``): a candidate below ``d`` trails ``k`` of the block's own, so it is
not among the request's ``k`` best. The block writes its counts from each bin up to ``cum``,
adds its bins from ``d`` up to the request's histogram and votes (one release atomic,
``add_release``); then it writes the rest (``k`` and the ties of ``d``: about ``k`` a block)
to its own segment of ``kept`` in bin order, best first (each bin's first slot from the scan,
then a shared atomic a key), and counts itself out (``PUT``, released). The request's last
block to vote picks the bin ``D`` of the ``k``-th best of the kept keys (they hold every key of
the answer, and ``D`` is at or above every block's ``d``) while the others write theirs, puts
only its own keys from ``D`` up while its loads of the blocks' counts are out, waits for the
others' ``PUT`` (acquiring it), takes each block's keys from ``D`` up, those past ``D``
first, by its counts (``counts_at``, ``wscan``), places them (``wfetch``, ``place``: these
in ``trie_topk_last``), ranks and answers them (``rank_answer``), or where ties crowd ``D``
radix-selects the rest from ``buf`` (``radix_rest``), and leaves the counters zero
(``counters.zeroed``). The wait is safe: the blocks it waits for voted before it, so they run.

Against the two launches this drops the second launch, the okey buffer's writes and reads
(11.6 MB each at gen-ref's step 2 at beams of 1,024), every block's pick and bound search and
the last block's reads of two global lists; the last block reads ~1,100 keys. On the H200
(session 48, graph-replayed) step 2 at beams of 1,024 took 0.0249 ms against 0.0282-0.0283
for the two launches, step 2 at 48 requests 0.0201 against 0.0250; the flat 2,097,152 took
0.0243 against 0.0228 at 128 blocks, so it keeps the two launches. Shared memory is dynamic
(``SMEM``): the scoring's beams and histogram and the last block's ranking arrays alias (37 KB,
where the two sets side by side would pass the 48 KB a launch takes without an opt-in).

What paid since (H200, step 2 at beams of 1,024): the puts, the last block's lists and the
answers indexed unsigned (``ix``: Numba's negative-index wraparound code was ~7 SASS
instructions an index), 0.0229 -> 0.0210 ms (session 53); the kept keys' least and best okeys
found along their placing (``lohi``), so that ``rank_answer`` skips ``minmax`` and its two
barriers, 0.0210-0.0214 -> 0.0208-0.0209 (session 54); each block's slots and counts set along
its own pick (``cursors``: one barrier fewer) and the picks' scans ending on their callers'
barriers, 0.0208-0.0212 -> 0.0204-0.0208 (session 55); each warp its own ``starts``
(``wstarts``, ``wfetch``: no barrier before the keys' loads), the answers' first load level
issued by the thread that fetched the keys (``first_level``) and the second at the ranking's
start, 0.0204-0.0206 -> 0.0201-0.0202 (session 56); the vote before the puts, the last block
picking ``D`` while the others put, 0.0196-0.0198 -> 0.0194-0.0196 and with sorted beams
0.0205-0.0206 -> 0.0196-0.0198 (step 2 at 48 requests, two blocks a request, 0.0167-0.0170 ->
0.0173-0.0178: its one other block's puts start a vote later), session 57; the last block's
polls of ``PUT`` acquiring (``add_acquire``) instead of a ``threadfence`` after them, its
zeroing of the request's histogram and ``rank_answer``'s answers without ``range`` loops
(their 64-bit trip-count code: each instruction all of a block's threads run costs ~8 cycles
of the SM's issue), 0.0197-0.0201 -> 0.0187-0.0189 ms, session 58; the scoring's logits and
codes loaded at addresses taken once a unit (``row_at``, ``load_at``: one ``IMAD.WIDE`` an
address where LLVM re-formed the 64-bit row index at each slot; the scoring 1,875 -> 1,502 SASS
instructions) and ``okey`` branchless, 0.0186 -> 0.0179 ms, session 59. Tried and dropped,
each slower (docs/benchmarks.md, sessions 48-57): the kept keys unordered, or written with
their answers; a request's blocks as a thread block cluster, or meeting at global barriers with
each block answering a share of the ranks (each barrier 2.2-2.8 us); lighter fences (the same);
a unit's atomics before its stores; the blocks' counts loaded with the request's histogram;
each block keeping from the request's counts as they came in, or after waiting for them; codes
loaded a pair ahead; the kept keys staged and written coalesced; fine bins (the scoring is near
issue-bound, ~32 SASS instructions a slot); ranking in the scoring's bins (~125 keys a bin near
``D``); ``D`` summed from the blocks' counts in windows of bins (where the scores cross ``ref``
the bins of tiny magnitudes, ~1,000, lie between a block's estimate and ``D``); the request's
histogram read while the vote is out; a compare against bin ``d``'s least score before a put
computes its bin, and ``lohi``'s warps kept in shared words and reduced after the barrier
instead of its atomics (both the same time); every block's counts at the pick's bins loaded
with the request's histogram, so that none waits for ``D`` (16 more loads a thread: +2.4 us);
each warp loading its units' beams from global memory (no ``load_beams`` barrier before the
codes' loads: 0.0213-0.0214 against 0.0205-0.0206 ms), the first pair's code loads issued
between ``best_bound``'s two reductions (+0.2 us), the last block reading the first ``SRT_N //
G`` slots of every block's segment before ``D`` is known, keeping those in bins from ``D`` up
(0.0219-0.0225 against 0.0205-0.0208), and the pick over the request's histogram with its
counts held in registers (the same time; bf16's ptxas spills 8 -> 28 bytes), session 55; a
unit's atomics before its stores again (the puts 2.35 -> 3.21 us: they are bound by the atomics
on the few bins near ``d``, not by each put's wait on its own), the scoring's histogram in two
copies by lane parity, the ranking over 2,048 linear bins, its in-bin loop two keys a step, the
codes' loads of the answers before the ranking's pick, the block scans with one barrier (every
warp scanning the warps' totals), the request's width loaded beside the vote (each the same or
0.1-1 us slower), and 12 score bits with fp32 (0.0228-0.0229 ms against 0.0201) or 10 (random
beams the same, sorted 0.0211-0.0212 against 0.0208-0.0210), session 56; the puts as a loop
over each thread's kept slots (0.0240-0.0245 ms against 0.0199-0.0200, with ``match_any`` per
bin 0.0231-0.0232), the vote and ``PUT`` behind ``threadfence`` (its ``CCTL.IVALL`` sends the
spilled scores' reloads to L2: 0.0200-0.0203), and each unit's best bin kept beside its slots
so the puts skip units wholly below ``d`` (0.0209-0.0210 against 0.0197-0.0198: the scoring's
extra work), session 57; a compare against bin ``D``'s least score before each of the last
block's (or every block's) puts, the first poll of ``PUT`` issued later, and ``cap[r]`` loaded
before ``bin_rank`` (each within the noise), session 58.
"""

from __future__ import annotations

import os

import torch
from numba import cuda, float32, int32, int64, uint32

from .numba_common import INLINE, add_acquire, add_release, stamp
from .trie_topk import SIMULATED
from .trie_topk_beams import (GB, GB1, best_bound, bins_of, gbin, gshift, load_beams, pair_vals,
                              slot_bin, zero_bins)
from .trie_topk_dev import I32MAX, JIT_NT, NB, NT, NW, RED_N, SCAN_N, hist_add, pick, pick_scan
from .trie_topk_index import I32MIN, ix, okey_of
from .trie_topk_keys import MAXC, okey, put_abs
from .trie_topk_rank import SRT_N, first_level, held, radix_rest, rank_answer
from .trie_topk_last import GMAX, GMAX1, counts_at, fetch, lohi, place, starts, wfetch, wscan
from .counters import zeroed
from .kernel_cache import cached

# ws: the blocks done, and those whose keys are out; hg: the request's histogram, a buffer of its
# own (its row a plain view for the last block's pick: a slice ``ws[r, HG:]`` of one buffer
# took ~40 SASS instructions of 64-bit slice arithmetic a thread)
CNT = 0
PUT = 1  # the request's other blocks whose keys are out
W_LEN = 2
UPW = 4  # units a warp holds: 24 scores a thread in registers
KEPT = os.environ.get("STREAMGR_TOPK_KEPT", "1") == "1"  # 0: the two launches (A/B)
PER_MAX = GB // NT  # bins a thread owns in ``cursors`` at most
# dynamic shared memory (bytes): the scoring's five beam arrays then its histogram (GB1 int32),
# or the last block's srt and seg (SRT_N int64 each) then its ranking bins (NB int32)
BEAMS_B = 20 * NT
SMEM = max(BEAMS_B + 4 * GB1, 16 * SRT_N + 4 * NB)


@cuda.jit(device=True, **INLINE)
def pair_scores(u, nu, upb, F, b0, r, B, logp, sh, codes, off, bs, bm, bl, bf, bc, hist, ref,
                gs):
    """Units ``u`` and ``u + NW`` scored (``pair_vals``, as ``score_units`` scores them) and
    counted in ``hist``, their scores kept in registers rather than stored."""
    x0, x1, x2, x3, x4, x5, y0, y1, y2, y3, y4, y5, v0, c0, v1, c1 = pair_vals(
        u, nu, upb, F, b0, r, B, logp, sh, codes, off, bs, bm, bl, bf, bc)
    bins6(hist, v0, ref, gs, x0, x1, x2, x3, x4, x5)
    bins6(hist, v1, ref, gs, y0, y1, y2, y3, y4, y5)
    return x0, x1, x2, x3, x4, x5, y0, y1, y2, y3, y4, y5, v0, c0, v1, c1


@cuda.jit(device=True, **INLINE)
def quad_scores(u, nu, upb, F, b0, r, B, logp, sh, codes, off, bs, bm, bl, bf, bc, hist, ref,
                gs):
    """The thread's four units (``u``, ``u + NW``, then ``u + 2 NW``, ``u + 3 NW``) by
    ``pair_scores``: each pair's twelve scores, slots left and first candidates."""
    return (pair_scores(u, nu, upb, F, b0, r, B, logp, sh, codes, off, bs, bm, bl, bf, bc,
                        hist, ref, gs),
            pair_scores(u + 2 * NW, nu, upb, F, b0, r, B, logp, sh, codes, off, bs, bm, bl, bf,
                        bc, hist, ref, gs))


@cuda.jit(device=True, **INLINE)
def bins6(hist, v, ref, gs, x0, x1, x2, x3, x4, x5):
    """A unit's six slots into the histogram (slots past the fan-out into the spare bin)."""
    hist_add(hist, slot_bin(x0, ref, v, 0, gs), True)
    hist_add(hist, slot_bin(x1, ref, v, 1, gs), True)
    hist_add(hist, slot_bin(x2, ref, v, 2, gs), True)
    hist_add(hist, slot_bin(x3, ref, v, 3, gs), True)
    hist_add(hist, slot_bin(x4, ref, v, 4, gs), True)
    hist_add(hist, slot_bin(x5, ref, v, 5, gs), True)


@cuda.jit(device=True, **INLINE)
def cursors(hist, k, scan, res, cum, hg, r, blk, gs):
    """The bin ``d`` of the block's ``k``-th best (0 where it holds fewer: every key kept), as
    ``pick`` finds it (``pick_scan``), and along that search, for every bin ``g``: ``hist[g]``
    becomes the keys in bins above it (the bin's first slot in the block's segment, keys
    ordered by bin, best first) and ``cum[r, blk, g]`` the keys in it and above (bins below
    ``d`` get theirs too, unused); after the one barrier that publishes ``d`` and the slots,
    the counts of the bins from ``d`` up go to the request's histogram (``bins_of(gs)`` bins).
    Threads own ``bins // NT`` each, the highest first, their counts held in registers
    (``PER_MAX``). Setting the slots only from ``d`` up, after ``d``'s barrier, took one
    barrier more: on the H200 step 2 at beams of 1,024 0.0208-0.0213 -> 0.0205-0.0206 ms
    (session 55). ``res[0]`` is 0 on entry. Every thread calls it; it ends synchronized."""
    nbins = bins_of(gs)
    ex, hi = pick_scan(hist, nbins, k, scan, res, NT, False)
    hs = cuda.local.array(PER_MAX, int32)
    for e in range(nbins // NT):
        g = hi - e
        h = hist[g]
        hs[e] = h
        hist[g] = ex
        cum[ix(r), ix(blk), ix(g)] = int32(ex + h)
        ex = int32(ex + h)
    cuda.syncthreads()
    d = res[0]
    for e in range(nbins // NT):
        g = hi - e
        if g >= d and hs[e] != 0:
            cuda.atomic.add(hg, (ix(r), ix(g)), int64(hs[e]))
    return d


@cuda.jit(device=True, **INLINE)
def put1(kept, r, seg, hist, c, v, ref, gs, d, x, i):
    """Slot ``i``'s absolute key (``okey << 31 | MAXC - c``) into its bin's next slot of the
    block's segment (``kept[r, seg:]``) where it is a candidate's in bin ``d`` or above."""
    g = gbin(x, ref, gs)
    if int32(32 * i) < v and g >= d:
        p = uint32(seg) + uint32(cuda.atomic.add(hist, g, 1))  # unsigned: no wraparound code
        kept[ix(r), ix(p)] = (okey(x) << 31) | (MAXC - int64(uint32(c + uint32(32 * i))))


@cuda.jit(device=True, **INLINE)
def put6(kept, r, seg, hist, c, v, ref, gs, d, x0, x1, x2, x3, x4, x5):
    put1(kept, r, seg, hist, c, v, ref, gs, d, x0, 0)
    put1(kept, r, seg, hist, c, v, ref, gs, d, x1, 1)
    put1(kept, r, seg, hist, c, v, ref, gs, d, x2, 2)
    put1(kept, r, seg, hist, c, v, ref, gs, d, x3, 3)
    put1(kept, r, seg, hist, c, v, ref, gs, d, x4, 4)
    put1(kept, r, seg, hist, c, v, ref, gs, d, x5, 5)


@cuda.jit(device=True, **INLINE)
def put_units(kept, r, seg, hist, ref, gs, d, P, Q):
    """The thread's four units' keys from bin ``d`` up (``put6``; ``quad_scores``' P and Q)."""
    x0, x1, x2, x3, x4, x5, y0, y1, y2, y3, y4, y5, v0, c0, v1, c1 = P
    z0, z1, z2, z3, z4, z5, q0, q1, q2, q3, q4, q5, v2, c2, v3, c3 = Q
    put6(kept, r, seg, hist, c0, v0, ref, gs, d, x0, x1, x2, x3, x4, x5)
    put6(kept, r, seg, hist, c1, v1, ref, gs, d, y0, y1, y2, y3, y4, y5)
    put6(kept, r, seg, hist, c2, v2, ref, gs, d, z0, z1, z2, z3, z4, z5)
    put6(kept, r, seg, hist, c3, v3, ref, gs, d, q0, q1, q2, q3, q4, q5)


@cached
@cuda.jit(**JIT_NT)
def kept_select(N, k, KP, upb, bpb, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, ws,
                hg, kept, cum, buf, cap, top, parent, child, code):
    r = cuda.blockIdx.y
    blk = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    stamp(14)
    dyn_f = cuda.shared.array(0, float32)
    dyn_i = cuda.shared.array(0, int32)
    dyn_l = cuda.shared.array(0, int64)
    bs = dyn_f[0:NT]
    bm = dyn_f[NT:2 * NT]
    bl = dyn_f[2 * NT:3 * NT]
    bf = dyn_i[3 * NT:4 * NT]
    bc = dyn_i[4 * NT:5 * NT]
    hist = dyn_i[5 * NT:5 * NT + GB1]
    scan = cuda.shared.array(SCAN_N, int32)
    res = cuda.shared.array(4, int32)
    red = cuda.shared.array(RED_N, int64)
    flag = cuda.shared.array(1, int32)
    cnt = cuda.shared.array(2, int32)
    pre = cuda.shared.array(GMAX1, int32)
    pa = cuda.shared.array(GMAX1, int32)
    mm = cuda.shared.array(2, int32)
    gs = gshift(logp)  # the bins' shift (their count): a constant of the compiled kernel
    nbins = bins_of(gs)
    i = tid
    while i <= nbins:
        hist[i] = 0
        i = int32(i + NT)
    if tid == 0:
        res[0] = 0  # cursors' pick leaves it where the block holds fewer than k: keep them all
    b0 = blk * bpb
    nb = min(bpb, B - b0)
    load_beams(r, b0, nb, B, scores, nodes, ptr, lse, sh, bs, bm, bl, bf, bc)
    ref = best_bound(scores, lse, sh, r, B, red)  # its barriers publish the hist and beams
    stamp(1)
    nu = int32(nb * upb)
    u = int32(tid >> 5)
    if sh == 16:  # a constant at each call: the conversion folded, as in bin_hist
        P, Q = quad_scores(u, nu, upb, F, b0, r, B, logp, 16, codes, off, bs, bm, bl, bf, bc,
                           hist, ref, gs)
    else:
        P, Q = quad_scores(u, nu, upb, F, b0, r, B, logp, 0, codes, off, bs, bm, bl, bf, bc,
                           hist, ref, gs)
    cuda.syncthreads()
    stamp(2)
    d = cursors(hist, k, scan, res, cum, hg, r, blk, gs)
    stamp(3)
    seg = int64(blk) * (bpb * F)  # the block's segment: its chunk's candidates' span
    cuda.syncthreads()  # every thread's cum and bins before the vote's release
    if tid == 0:
        flag[0] = add_release(ws, r, CNT, int64(1)) == cuda.gridDim.x - 1
        mm[0] = I32MAX  # the kept keys' least and best okeys, in the signed order (``lohi``),
        mm[1] = I32MIN  # set before the barrier the last block's lohi follows
    cuda.syncthreads()
    stamp(4)
    if not flag[0]:  # its keys from its own d up, then counted out (PUT) for the last block
        put_units(kept, r, seg, hist, ref, gs, d, P, Q)
        cuda.syncthreads()
        if tid == 0:
            add_release(ws, r, PUT, int64(1))
        stamp(15)
        return
    # no acquire fence: the vote saw every other block's release, and this SM holds no line of
    # hg or of their cum rows (it only added to hg and wrote its own row; L1 starts a launch
    # empty), so the loads below read them from L2. (With ``threadfence`` for the releases, a
    # fence here timed 0.0200-0.0203 ms against 0.0198-0.0203 without; the released atomics
    # then 0.0195-0.0196: H200, step 2 at beams of 1,024, session 57 calls 6 and 7)
    d, need, nd = pick(hg[ix(r)], nbins, k, scan, res, NT)  # D: the request's k-th's bin
    d = int32(d)
    stamp(5)
    above = int32(k - need)  # keys past D
    total = int32(above + nd)
    small = total <= SRT_N
    srt = dyn_l[0:SRT_N]  # the scoring's arrays are dead: the ranking's alias them
    seg2 = dyn_l[SRT_N:2 * SRT_N]
    hist2 = dyn_i[4 * SRT_N:4 * SRT_N + NB]
    if tid == 0:  # left zero for the next launch (every block read it before it voted)
        ws[r, CNT] = 0
        cnt[0] = above  # radix_rest's appends (where D is crowded)
    if small:
        hist2[tid] = 0  # (radix_rest's otherwise: rank_answer zeroes it after) NB == NT
    zero_bins(hg, r, 0, gs)
    gb = cuda.gridDim.x
    wpre = wpa = wna = n_all = n_a = int32(0)
    if small and not SIMULATED:  # every warp its own starts, in its lanes: no barrier
        n_all, n_a = counts_at(cum, r, tid & 31, gb, d, nbins)
    else:
        starts(cum, r, gb, d, pre, pa, scan, nbins)
        cuda.syncthreads()
    put_units(kept, r, seg, hist, ref, gs, d, P, Q)  # its own keys while the counts come
    if small and not SIMULATED:
        wpre, wpa, wna = wscan(n_all, n_a, tid & 31)
    if tid == 0:  # the other blocks' keys are out once each has added itself to PUT (they
        # voted before this block: they run, none waits on it). The polls acquire (their keys,
        # read below): no threadfence, whose MEMBAR.SC waited for this block's own stores
        seen = add_acquire(ws, r, PUT, int64(0))
        while seen < gb - 1:
            seen = add_acquire(ws, r, PUT, int64(0))
        ws[r, PUT] = 0  # left zero for the next launch
    cuda.syncthreads()
    stamp(6)
    ch = bpb * F
    lo = int64(-1)  # rank_answer's minmax (where ties crowd D: the keys come from buf)
    hi = int64(-1)
    if small:  # two keys a thread at most: both loads issued before either is placed
        if SIMULATED:
            key0, a0, dn0 = fetch(kept, r, ch, pre, pa, gb, min(tid, total - 1))
            key1, a1, dn1 = fetch(kept, r, ch, pre, pa, gb, min(tid + NT, total - 1))
        else:
            key0, a0, dn0 = wfetch(kept, r, ch, wpre, wpa, wna, min(tid, total - 1))
            key1, a1, dn1 = wfetch(kept, r, ch, wpre, wpa, wna, min(tid + NT, total - 1))
        has0 = tid < total
        has1 = tid + NT < total
        # the thread ranks the keys it fetched: their answers' first load level goes out now
        j0, j1, s0, n0, s1, n1 = first_level(key0, key1, has0, has1, r, F, FM, scores, nodes)
        if has0:  # (srt holds them too, for the sort where ties crowd a ranking bin)
            place(srt, buf, r, key0, a0, dn0, above, True)
        if has1:
            place(srt, buf, r, key1, a1, dn1, above, True)
        lohi(key0, key1, has0, has1, mm)
    else:
        for i in range(tid, total, NT):
            key0, a0, dn0 = fetch(kept, r, ch, pre, pa, gb, i)
            place(srt, buf, r, key0, a0, dn0, above, False)
    cuda.syncthreads()
    if small:  # published by the barrier: rank_answer skips its minmax (two barriers)
        lo = okey_of(mm[0])
        hi = okey_of(mm[1])
    stamp(7)
    if not small:  # ties crowd D: the rest of the k from buf (appended at cnt[0] = above)
        radix_rest(buf, r, nd, need, hist2, scan, res, red, srt, cnt)
        total = k
        key0, key1, has0, has1 = held(srt, total)
        j0, j1, s0, n0, s1, n1 = first_level(key0, key1, has0, has1, r, F, FM, scores, nodes)
    stamp(8)
    if not rank_answer(srt, seg2, hist2, scan, res, red, total, k, KP, r, F, FM, scores, nodes,
                       ptr, codes, cap, top, parent, child, code, 0, lo, hi, key0, key1, has0,
                       has1, j0, j1, s0, n0, s1, n1):
        for i in range(tid, k, NT):  # sorted where ties crowd a bin: answers from the keys
            put_abs(srt[i], i, r, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off, cap,
                    top, parent, child, code, int64(-1))
    stamp(15)


def plan(R: int, B: int, sms: int, upb: int) -> int | None:
    """Beams a block where ``kept_select`` serves R requests of B beams of ``upb`` beam units
    (0: none) on ``sms`` SMs, else None: at most ``UPW NW`` units a block, as many beams as
    leave one wave of blocks where the requests fill the GPU (``trie_topk_bins.chunk``'s
    rule; the simulator has no waves to keep to), at most ``GMAX`` blocks a request (one
    request's flat 2,097,152 takes 128: the two launches, which were faster there, session
    48)."""
    if not KEPT or not 0 < upb <= UPW * NW:
        return None
    per = max(1, sms // max(R, 1))
    bpb = max(1, min(-(-B // per), (UPW * NW) // upb))
    g = -(-B // bpb)
    return bpb if g <= GMAX and (SIMULATED or R * g <= sms) else None


def run(launch, R, N, k, KP, upb, F, FM, B, sc, nd, lp, trie, outs, dev, arr, bpb):
    """The one launch for R requests of B beams of fan-out F (``upb`` units a beam, ``bpb``
    beams a block), on a workspace of counters (``zeroed``) and [R, N] int64 lists: the kept
    keys, and D's keys where ties crowd it (written only then)."""
    g = -(-B // bpb)
    assert g <= GMAX, (g, GMAX)
    ws = zeroed((R, W_LEN), dev)
    hg = zeroed((R, GB), dev)
    kept = torch.empty(R, N, dtype=torch.int64, device=dev)
    cum = torch.empty(R, g, GB, dtype=torch.int32, device=dev)
    buf = torch.empty(R, N, dtype=torch.int64, device=dev)
    launch(kept_select, (g, R), NT, SMEM)(N, k, KP, upb, bpb, F, FM, B, sc, nd, *lp, *trie,
                                          arr(ws), arr(hg), arr(kept), arr(cum), arr(buf), *outs)
