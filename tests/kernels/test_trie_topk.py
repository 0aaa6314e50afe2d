"""Trie-constrained top-k selection: the torch reference against a plain per-request loop, and
the Numba kernels against the reference under the CUDA simulator (a subprocess with
NUMBA_ENABLE_CUDASIM=1: small sizes, so every pass and path runs on small inputs)."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch

from streamgr.kernels.trie_topk import trie_topk_reference

from . import simulator as sim


def random_case(seed, R=3, B=5, V=None, fan=(1, 6), ties=False, dead=0.2):
    """A random level: nodes with 0..fan children (codes increasing, of a vocabulary of ``V``,
    by default 40 or room for the widest fan-out), beams on them; a ``dead`` share of the beams
    is -inf."""
    V = V or max(40, fan[1] + 8)
    rng = np.random.default_rng(seed)
    n_nodes = 7
    counts = rng.integers(fan[0] - 1, fan[1] + 1, size=n_nodes).clip(0)
    ptr = np.concatenate([[0], np.cumsum(counts)])
    codes = np.concatenate([np.sort(rng.choice(V - 3, size=c, replace=False)) for c in counts]
                           or [np.zeros(0, int)]).astype(np.int64)
    nodes = rng.integers(n_nodes, size=(R, B))
    scores = rng.normal(size=(R, B)).astype(np.float32)
    scores[rng.random((R, B)) < dead] = -np.inf
    logp = rng.normal(size=(R * B, V)).astype(np.float32)
    if ties == "const":  # every score equal: the order is the candidate index alone
        logp[:] = -1.5
        scores = np.where(np.isfinite(scores), 0, scores).astype(np.float32)
    elif ties:  # many equal scores: the order must fall back to the lower candidate index
        logp = np.round(logp)
        scores = np.where(np.isfinite(scores), np.round(scores), scores).astype(np.float32)
    F = int(counts.max()) if len(counts) else 1
    return (torch.from_numpy(scores), torch.from_numpy(nodes), torch.from_numpy(logp),
            torch.from_numpy(ptr), torch.from_numpy(codes), 3, max(F, 1))


def loop_reference(scores, nodes, logp, ptr, codes, off, F, k, cap):
    out = []
    for r in range(scores.shape[0]):
        cands = []  # (score, c, parent, child, code)
        for b in range(scores.shape[1]):
            s = float(scores[r, b])
            n = int(nodes[r, b])
            lo, hi = int(ptr[n]), int(ptr[n + 1])
            for j in range(F):
                c = b * F + j
                if np.isfinite(s) and j < hi - lo:
                    ch = lo + j
                    cands.append((s + float(logp[r * scores.shape[1] + b, off + codes[ch]]), c, b, ch))
                else:
                    cands.append((-np.inf, c, b, 0))
        cands.sort(key=lambda x: (-x[0], x[1]))
        out.append([(x[0] if i < int(cap[r]) else -np.inf, x[2], x[3]) for i, x in enumerate(cands[:k])])
    return out


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("ties", [False, True])
def test_reference_equals_a_plain_loop(seed, ties):
    scores, nodes, logp, ptr, codes, off, F = random_case(seed, ties=ties)
    k = min(7, scores.shape[1] * F)
    cap = torch.tensor([k, 3, 1])
    top, parent, child, code = trie_topk_reference(scores, nodes, logp, ptr, codes, off, F, k, cap)
    want = loop_reference(scores, nodes, logp, ptr, codes, off, F, k, cap)
    for r, row in enumerate(want):
        for i, (v, b, ch) in enumerate(row):
            assert float(top[r, i]) == pytest.approx(v) or (np.isinf(v) and np.isinf(float(top[r, i])))
            assert int(parent[r, i]) == b
            if np.isfinite(float(top[r, i])):
                assert int(child[r, i]) == ch and int(code[r, i]) == int(codes[ch])


SIM = textwrap.dedent("""
    import numpy as np, os, torch, sys
    sys.path.insert(0, {root!r})
    from tests.kernels.test_trie_topk import counted, random_case
    from streamgr.kernels.head_lse import LogProbs, row_lse_reference
    from streamgr.kernels.trie_topk import trie_topk, trie_topk_reference
    from streamgr.kernels import trie_topk_merge as tm
    n = 0
    for seed, ties, B, fan, k, *more in {cases!r}:
        R, dead = more[:2] if more else (2, 0.2)
        case = random_case(seed, R=R, B=B, fan=fan, ties=ties, dead=dead)
        scores, nodes, logp, ptr, codes, off, F = case
        k = min(k, B * F)
        # the merge cases (R and the dead share added) run the merge path, the others not (a
        # one-block case with them marks itself "one")
        merge = len(more) == 2
        assert (tm.plan_for(B * F, R, k, None) is not None) == merge, (seed, B * F, k)
        cap = torch.tensor([k] + [max(1, k // 2)] * (R - 1))
        # bf16 logits read in place with each row's max and log-sum (the lazy head of
        # bf16 serving), on one case of each path (the simulator is slow)
        lg = (logp * 3).to(torch.bfloat16)
        lazy = [LogProbs(lg, lg.shape[1], row_lse_reference(lg, lg.shape[1]))] \
            if seed in (1, 2, 28, 40, 65) else []
        # int32 codes (as SidTrie.tables holds them on the device) on one case of a path
        c32 = [(logp, codes.to(torch.int32))] if seed in (2, 16, 28, 65) else []
        for lp, cd in [(logp, codes)] + [(x, codes) for x in lazy] + c32:
            case = (scores, nodes, lp, ptr, cd, off, F)
            ref = trie_topk_reference(*case, k, cap)
            got = trie_topk(*case, k, cap, impl="numba")
            for a, b in zip(got, ref):
                assert torch.equal(a, b), (seed, ties, B, fan, k, type(lp), cd.dtype, a, b)
        if str(seed) in os.environ.get("SIM_COUNTED", "").split(","):
            counted((scores, nodes, logp, ptr, codes, off, F), k, cap, seed)
        n += 1
    print("ok", n)
""")


def counted(case, k, cap, seed):
    """Case ``seed`` (a grid or merge one) twice on one arena of counters (``Counters``: what
    a decode plan's graph replays), over new log-probabilities: each call equals the reference
    and leaves every counter zero; a kernel that left one set would misroute the next call's
    blocks (its last-block election or its list slots)."""
    from streamgr.kernels.counters import Counters
    from streamgr.kernels.trie_topk import trie_topk
    scores, nodes, logp, ptr, codes, off, F = case
    counters = Counters()
    counters.need = 1 << 16  # room for any case here (a sizing pass is one more run)
    counters.allocate("cpu")
    g = torch.Generator().manual_seed(seed)
    for rep in range(2):
        logp = logp[torch.randperm(logp.shape[0], generator=g)]
        case = (scores, nodes, logp, ptr, codes, off, F)
        with counters.serving():
            got = trie_topk(*case, k, cap, impl="numba")
        assert counters.overflow == 0 and counters.at > 0, (seed, counters.at)
        for a, b in zip(got, trie_topk_reference(*case, k, cap)):
            assert torch.equal(a, b), (seed, rep, a, b)
        assert int(counters.buf.count_nonzero()) == 0, (seed, rep, counters.buf)


# (seed, ties, beams, fan-out range, k) with the simulator's sizes (blocks of 32 threads, 5-bit
# digits and 32 bins, ONE_MAX = 64, 128 a grid block): one candidate a thread (beams x F <= 32:
# seeds 0, 4, 5, 7, 12, 13, 27-29, bf16 logits on 28; ranked in their bins, or sorted whole
# where a bin holds over SEG_MAX = 4, as every tie of 27 and 29's every beam dead do), one
# block (beams x F <= 64 binned, falling back to the radix where the bins from the k-th up hold
# more than 32), dead beams in
# every case, k = 1, every candidate wanted (a bin that settles the set at once); of the binned,
# the bins' keys ranked in their bins (seeds 14, 15: no bin over SEG_MAX = 4 keys) and sorted
# whole (seeds 1, 15: one over it) ...
ONE_BLOCK = [(0, False, 3, (1, 5), 4), (1, True, 6, (2, 8), 8), (4, False, 9, (0, 3), 1),
             (5, False, 1, (6, 6), 6), (7, False, 10, (3, 3), 30), (10, True, 7, (6, 9), 20),
             (12, False, 2, (1, 1), 2), (13, False, 1, (1, 1), 1),
             (14, False, 8, (4, 8), 12), (15, False, 6, (8, 8), 16),
             (27, "const", 4, (6, 8), 8), (28, True, 5, (4, 6), 10),
             (29, False, 4, (3, 5), 6, 2, 1.0, "one")]
# ... and the grid launches (> 64 candidates; 256 bins; chunks of at most 30 beams, the
# simulator's NT - 2): the last block's list sorted a key a thread (2, 9) or two (8: ties, 50
# keys), or outgrowing two blocks' worth (61: every score equal, its radix select from the list
# in global memory), k = 1, a fan-out of 1 (62: chunks of 31, five blocks a request); and where
# the fan-out takes beam units (F >= 128) the one launch of trie_topk_kept (up to four units a
# warp): one a beam (65, bf16 logits too, twice on one arena of counters), two (66: ties, F up
# to 260), every score equal (67: D's keys outgrow the last block, the radix select from buf).
GRID = [(2, False, 40, (4, 12), 16), (8, True, 30, (4, 10), 32), (9, False, 40, (5, 10), 1),
        (61, "const", 24, (4, 8), 20), (62, False, 140, (1, 1), 20),
        (65, False, 3, (130, 180), 20), (66, True, 2, (200, 260), 24),
        (67, "const", 3, (130, 140), 20)]
# ... and the one-launch merge (2-4 blocks of <= 64 candidates a request, the last block's list
# held up to 32 keys; fields R and the dead share added): the list ranked in its bins (16), sorted
# where a bin is crowded (21), selected from global memory where it outgrows 32 (23) or holds
# only -inf (22), blocks whose every beam is dead (19), k = 1 (20), each block's own best by radix
# select where every score ties (21), blocks in two waves of the simulator's 4 "SMs" (24).
MERGE = [(16, False, 12, (6, 6), 4, 1, 0.1),
         (19, False, 20, (4, 4), 4, 2, 0.85),
         (20, False, 10, (6, 8), 1, 2, 0.2), (21, "const", 30, (6, 8), 6, 1, 0.0),
         (22, False, 20, (4, 4), 4, 2, 1.0), (23, True, 30, (6, 8), 6, 1, 0.0),
         (24, False, 40, (6, 8), 4, 1, 0.1), (26, False, 2, (90, 100), 4, 1, 0.1)]


# ... and without the sampled floor (STREAMGR_TOPK_SAMPLE=0, an A/B setting; a process of its
# own): the one-block cases over the simulator's block of candidates (7 x 9, 8 x 8, 6 x 8), the
# merge's list ranked in its bins, every score tied, two waves of blocks; in the same process
# STREAMGR_TOPK_KEPT=0 (an A/B setting): bin_hist's beam units, two a beam (66), on the two
# grid launches, which the one launch of trie_topk_kept serves in the grid cases' process.
UNSAMPLED = ([c for c in ONE_BLOCK if c[0] in (10, 14, 15)]
             + [c for c in MERGE if c[0] in (16, 21, 24)] + [c for c in GRID if c[0] == 66])


# ... and one candidate a thread with each thread ranking its own key, answered from its
# registers (STREAMGR_TOPK_OWN=1, an A/B setting; run in the grid cases' process; the one-block
# cases' process runs the default, 2): the ranks in their bins, the crowded bins sorted, every
# beam dead, bf16 logits.
OWN1 = [(0, False, 3, (1, 5), 4), (27, "const", 4, (6, 8), 8), (28, True, 5, (4, 6), 10),
        (29, False, 4, (3, 5), 6, 2, 1.0, "one"), (7, False, 10, (3, 3), 30)]
# ... and four candidates a thread (trie_topk_quad: over a block, at most four, k over half a
# block; run in the one-block cases' process): the bins' keys ranked in their bins (40, bf16
# logits too; 64 at exactly four blocks, 34 keys ranked by 32 threads, its second request
# crowded), every score equal and every beam dead (32, 33: a crowded bin, the radix select over
# the registers' keys; test_quad_rebin_crowded_under_the_simulator crowds the second round).
QUAD = [(40, False, 12, (3, 3), 17), (64, False, 32, (4, 4), 32, 2, 0.1, "quad"),
        (32, "const", 10, (6, 8), 20), (33, False, 20, (4, 4), 17, 2, 1.0, "quad")]
# ... trie_topk_one's radix rounds for k over half a block, now behind trie_topk_quad (run with
# STREAMGR_TOPK_QUAD=0 in the grid cases' process), and trie_topk_quad for any k
# (STREAMGR_TOPK_QUAD=2, an A/B setting, in the merge cases' process: k below half a block).
ONE_RADIX = [(10, True, 7, (6, 9), 20)]
# ... and trie_topk_one for one beam of over a block of children (note_beam's rounds of four a
# thread, as step 1's before trie_topk_root; run with STREAMGR_TOPK_ROOT=0 in the grid cases'
# process).
ONE_BEAM = [(25, True, 1, (40, 60), 6)]
QUAD_ANY_K = [(35, False, 12, (3, 3), 5, 2, 0.2, "quad"), (36, True, 9, (4, 6), 3, 2, 0.2, "quad")]


def simulate(script: str, cases=None, **env) -> list[str]:
    """``script`` (formatted with the repository root and ``cases``) run under the CUDA
    simulator with ``env`` added (``simulator.simulate``): its stdout's words."""
    return sim.simulate(script.format(root=sim.ROOT, cases=cases), **env)


@pytest.mark.parametrize("cases,env", [
    (ONE_BLOCK + QUAD, {"STREAMGR_TOPK_OWN": "2"}),
    (GRID + OWN1 + ONE_RADIX + ONE_BEAM, {"STREAMGR_TOPK_OWN": "1", "STREAMGR_TOPK_QUAD": "0",
                                          "STREAMGR_TOPK_ROOT": "0", "SIM_COUNTED": "2,65"}),
    (MERGE + QUAD_ANY_K, {"STREAMGR_TOPK_OWN": "2", "STREAMGR_TOPK_QUAD": "2",
                          "SIM_COUNTED": "16"}),
    (UNSAMPLED, {"STREAMGR_TOPK_OWN": "2", "STREAMGR_TOPK_SAMPLE": "0",
                 "STREAMGR_TOPK_KEPT": "0"})],
    ids=["one_block", "grid", "merge", "unsampled"])
@pytest.mark.slow
def test_numba_kernels_under_the_simulator(cases, env):
    """The one-candidate-a-thread, four-a-thread, one-block, grid and merge kernels equal the
    reference on small shapes (a process each: the simulator is set at import), the one-block
    and merge kernels also without the sampled floor (``STREAMGR_TOPK_SAMPLE=0``), the two grid
    launches' beam units where the one launch would serve (``STREAMGR_TOPK_KEPT=0``); two grid
    cases (the two launches, the one) and one merge case also twice on one arena of counters,
    left zero (``counted``)."""
    assert simulate(SIM, cases=cases, **env) == ["ok", str(len(cases))]


NOTE = textwrap.dedent("""
    import numpy as np, torch, sys
    sys.path.insert(0, {root!r})
    from numba import cuda, int32, int64
    from tests.kernels.test_trie_topk import random_case
    from streamgr.kernels import trie_topk_keys as K
    from streamgr.kernels.trie_topk_index import magic
    from streamgr.kernels.head_lse import LogProbs, row_lse_reference
    from streamgr.kernels.numba_common import as_array as a
    from streamgr.kernels.trie_topk_numba import _log_probs
    NT = 4

    @cuda.jit
    def both(out, kxs, c0, n, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off):
        kx = cuda.shared.array(128, int32)
        ky = cuda.shared.array(128, int32)
        t = cuda.threadIdx.x
        lo, hi, beam = K.note_beam(kx, c0, n, NT, 1, F, FM, B, scores, nodes, logp, lse, sh,
                                   ptr, codes, off)
        lo2, hi2 = K.note_all(ky, c0, n, NT, 1, F, FM, B, scores, nodes, logp, lse, sh, ptr,
                              codes, off)
        out[t, 0], out[t, 1], out[t, 2], out[t, 3], out[t, 4] = lo, hi, lo2, hi2, beam
        cuda.syncthreads()
        for i in range(t, n, NT):
            kxs[0, i] = kx[i]
            kxs[1, i] = ky[i]

    def levels(seeds, B, fan):
        # each seed's level (dead share as given) with fp32 and with bf16 log-probabilities:
        # (seed, case, the scores as the kernels read them, the log-probabilities' bits)
        for seed, dead in seeds:
            case = random_case(seed, R=2, B=B, fan=fan, dead=dead)
            logp = case[2]
            lg = (logp * 3).to(torch.bfloat16)
            for lp in (logp, LogProbs(lg, lg.shape[1], row_lse_reference(lg, lg.shape[1]))):
                sc = case[0].float().contiguous()
                yield seed, case, sc, _log_probs(lp, a, sc)

    n_runs = 0
    for seed, (scores, nodes, _, ptr, codes, off, F), sc, bits in levels(
            ((30, 0.0), (31, 0.5), (32, 1.0)), 3, (70, 90)):
        for c0, n in ((0, F), (F, F), (2 * F + 5, F - 9), (1, 33), (7, 36), (F + 2, 1)):
            out = np.zeros((NT, 5), np.int64)
            kxs = np.zeros((2, 128), np.int32)
            both[1, NT](out, kxs, c0, n, F, magic(F), 3, a(sc), a(nodes), *bits, a(ptr),
                        a(codes), off)
            assert (out[:, :2] == out[:, 2:4]).all(), (seed, c0, n, out)
            b = c0 // F  # the beam put_abs is handed: its first child << 32 | children
            nd = int(nodes[1, b]) if np.isfinite(float(scores[1, b])) else 0  # dead: 0
            cnt = int(ptr[nd + 1] - ptr[nd]) if np.isfinite(float(scores[1, b])) else 0
            first = int(ptr[nd])
            assert (out[:, 4] == (first << 32 | cnt)).all(), (seed, c0, n, out[:, 4])
            assert (kxs[0, :n] == kxs[1, :n]).all(), (seed, c0, n, kxs[:, :n])
            n_runs += 1
    print("ok", n_runs)
""")


def test_one_beam_scoring_equals_the_general_loop_under_the_simulator():
    """``note_beam`` (a chunk inside one beam: the beam read once, eight or four candidates a
    thread in flight) writes the okeys and per-thread (smallest real, largest) okeys that
    ``note_all`` does, and the beam's first child and children, on chunks from a beam's start
    and middle whose lengths take the rounds of eight, of four and the one-a-thread tail (4
    threads here), with fp32 and bf16 log-probabilities and live, mixed and dead beams."""
    assert simulate(NOTE) == ["ok", "36"]


CROWD = textwrap.dedent("""
    import numpy as np, torch, sys
    sys.path.insert(0, {root!r})
    from streamgr.kernels.trie_topk import trie_topk, trie_topk_reference
    from streamgr.kernels import trie_topk_quad as q
    B, k = 40, 17  # one child a beam: 40 candidates (over the simulator's block of 32)
    rng = np.random.default_rng(5)
    far = -rng.uniform(5, 9, B)  # beyond obin's window (2**2): its lowest bin
    # request 0: the best at 0; six keys 0.25-0.34 below it, two in each of three of obin's
    # bins there (1/32 wide: none crowded) but all in one linear bin (3.75/32 wide); nine more
    # down to 3.4, so that the 17th key's obin bin ends at 3.75 (its last before the window's)
    s0 = far.copy()
    s0[:16] = [0, -0.255, -0.26, -0.29, -0.295, -0.32, -0.325] + list(-np.linspace(0.6, 3.4, 9))
    s0[16] = -3.6
    rng.shuffle(s0)
    s1 = -rng.uniform(0, 3, B)  # request 1: spread, no crowd
    scores = torch.tensor(np.stack([s0, s1]), dtype=torch.float32)
    nodes = torch.arange(B).repeat(2, 1)
    ptr, codes = torch.arange(B + 1), torch.zeros(B, dtype=torch.int64)
    logp = torch.zeros(2 * B, 4)
    case = (scores, nodes, logp, ptr, codes, 1, 1)
    cap = torch.tensor([k, 9])
    assert q.serves(B, k)
    got = trie_topk(*case, k, cap, impl="numba")
    for a, b in zip(got, trie_topk_reference(*case, k, cap)):
        assert torch.equal(a, b), (a, b)
    print("ok")
""")


def test_quad_rebin_crowded_under_the_simulator():
    """``trie_topk_quad``'s linear bins can crowd where ``obin``'s did not (keys close below
    the best, the k-th far): there the radix select over the registers' keys answers."""
    assert simulate(CROWD) == ["ok"]


ROOT = textwrap.dedent("""
    import numpy as np, torch, sys
    sys.path.insert(0, {root!r})
    from tests.kernels.test_trie_topk import random_case
    from streamgr.kernels.head_lse import LogProbs, row_lse_reference
    from streamgr.kernels.trie_topk import trie_topk, trie_topk_reference
    from streamgr.kernels import trie_topk_root as rt
    from streamgr.kernels.trie_topk_dev import NT

    def check(case, k, cap, what):
        got = trie_topk(*case, k, cap, impl="numba")
        for a, b in zip(got, trie_topk_reference(*case, k, cap)):
            assert torch.equal(a, b), (what, a, b)

    n = 0
    # (seed, ties, fan-out range, k, dead share): the linear bins from the cutoff up ranked (k 6
    # and 8, counts past NT's rounds; 52: exactly RN blocks, 256, at k 32), crowded bins (the
    # simulator's 32 bins crowd at larger k; ties, every score equal, a dead beam: the radix
    # select over the registers' keys), bf16 logits on the first
    for seed, ties, fan, k, dead in [(50, False, (90, 110), 6, 0.3),
                                     (51, False, (150, 200), 8, 0.0),
                                     (52, False, (256, 256), 32, 0.0),
                                     (53, True, (60, 100), 12, 0.3),
                                     (54, "const", (40, 70), 20, 0.5)]:
        case = random_case(seed, R=2, B=1, fan=fan, ties=ties, dead=dead)
        F = case[-1]
        assert rt.serves(1, F), F
        cap = torch.tensor([k, max(1, k // 2)])
        check(case, min(k, F), cap, seed)
        if seed == 50:
            lg = (case[2] * 3).to(torch.bfloat16)
            lazy = LogProbs(lg, lg.shape[1], row_lse_reference(lg, lg.shape[1]))
            check((*case[:2], lazy, *case[3:]), k, cap, "bf16")
        n += 1
    # the sample ran high: the sampled candidates (tid + (tid % RN) * NT) score best, so fewer
    # than k keys reach the bin of the sample's scaled k-th (each key counted again)
    N, k = rt.RMAX, 32
    rng = np.random.default_rng(9)
    logp = -rng.uniform(4, 8, size=(1, N + 1)).astype(np.float32)
    t = np.arange(NT)
    logp[0, 1 + t + (t % rt.RN) * NT] = -rng.uniform(0, 1, NT)
    case = (torch.zeros(1, 1), torch.zeros(1, 1, dtype=torch.int64), torch.from_numpy(logp),
            torch.tensor([0, N]), torch.arange(N), 1, N)
    check(case, k, torch.tensor([k]), "high")
    print("ok", n + 1)
""")


@pytest.mark.slow
def test_root_kernel_under_the_simulator():
    """``trie_topk_root`` (one beam, over a block of candidates and at most ``RN`` blocks, held
    in registers) equals the reference: the linear bins from the sampled cutoff up, a sample
    that ran high and crowded bins (the radix select over the registers), dead beams, bf16
    logits."""
    assert simulate(ROOT) == ["ok", "6"]
