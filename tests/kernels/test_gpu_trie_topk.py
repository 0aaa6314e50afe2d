"""GPU: the Numba selection kernels against their torch reference, bit for bit: random tries
with fan-outs 1 to 8,192, ties, dead beams, beams 1 to 1,024, requests of different widths."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from streamgr.kernels import trie_topk as tt
from streamgr.kernels.counters import Counters

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def level(R, B, fan_max, V, seed, ties=False, dead=0.1, uniform=False):
    rng = np.random.default_rng(seed)
    n_nodes = max(B, 4)
    counts = np.full(n_nodes, fan_max) if uniform else rng.integers(0, fan_max + 1, size=n_nodes)
    counts[0] = fan_max  # the widest fan-out is reached
    ptr = np.concatenate([[0], np.cumsum(counts)])
    codes = np.concatenate([np.sort(rng.choice(V, size=c, replace=False)) for c in counts])
    nodes = rng.integers(n_nodes, size=(R, B))
    scores = rng.normal(size=(R, B)).astype(np.float32) * 3
    scores[rng.random((R, B)) < dead] = -np.inf
    logp = rng.normal(size=(R * B, V + 5)).astype(np.float32)
    if ties:
        logp = np.round(logp * 2) / 2
        scores = np.where(np.isfinite(scores), np.round(scores), scores).astype(np.float32)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(DEV)  # noqa: E731
    return t(scores), t(nodes), t(logp), t(ptr), t(codes.astype(np.int64)), 5, int(counts.max())


def assert_kernels_equal_reference(case, k, cap):
    """The Numba kernels' four outputs equal the stable reference's, bit for bit."""
    ref = tt.trie_topk_reference(*case, k, cap)
    got = tt.trie_topk(*case, k, cap, impl="numba")
    for name, a, b in zip(("top", "parent", "child", "code"), got, ref):
        assert torch.equal(a, b), name


def test_numba_is_used():
    assert tt.usable(torch.zeros(1, device=DEV)), "numba-cuda is not usable on this machine"


@pytest.mark.parametrize("R,B,fan,k,ties", [
    (1, 1, 1, 1, False), (3, 1, 8192, 256, False), (16, 256, 177, 256, False),
    # the merge's last block with four listed keys a thread (4 blocks of 8,192, each listing
    # 512-1,024: lists of 2,048-4,096, mostly over 3,072; trie_topk_held), with and without ties
    (2, 256, 128, 512, False), (3, 256, 128, 500, True),
    # the merge over 13 blocks (chunks of 4,096 at k 128), with and without ties
    (1, 256, 200, 128, False), (2, 256, 200, 100, True),
    (16, 256, 3, 256, True), (2, 1024, 40, 1024, False), (4, 64, 8192, 1024, True),
    (5, 37, 13, 100, True), (1, 256, 8192, 256, False)])
def test_trie_topk_equals_reference(R, B, fan, k, ties):
    case = level(R, B, fan, V=max(fan, 64) * 2, seed=R * 1000 + B + fan, ties=ties,
                 uniform=(B == 256 and fan in (128, 8192)))
    k = min(k, B * case[-1])
    cap = torch.randint(1, k + 1, (R,), device=DEV)
    cap[0] = k
    assert_kernels_equal_reference(case, k, cap)


def test_trie_topk_inside_a_cuda_graph():
    case = level(8, 256, 177, V=400, seed=3)
    cap = torch.full((8,), 256, device=DEV)
    out = tt.trie_topk(*case, 256, cap, impl="numba")  # compiles outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = tt.trie_topk(*case, 256, cap, impl="numba")
    case[2].normal_()  # new log-probabilities, then a replay
    g.replay()
    ref = tt.trie_topk_reference(*case, 256, cap)
    for a, b in zip(out, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("R,B,fan,k", [(8, 256, 177, 256), (40, 256, 177, 256),
                                       (48, 256, 177, 256), (1, 256, 8192, 256),
                                       (2, 1024, 40, 1024)])
def test_graph_counters_are_left_zero_across_replays(R, B, fan, k):
    """The merge (step 2, one wave and two) and grid paths (step 2 at 48 requests; flat; beams
    of 1,024) captured
    with a plan's own counters (``counters.Counters``, no fill node): each of five replays over
    new log-probabilities equals the reference, and the counters are zero after every one (a
    kernel that left one set would misroute the next replay's blocks)."""
    case = level(R, B, fan, V=max(fan, 64) * 2, seed=R + B + fan, uniform=fan == 8192)
    cap = torch.full((R,), k, device=DEV)
    counters = Counters()
    with counters.sizing():
        tt.trie_topk(*case, k, cap, impl="numba")  # compiles outside the capture
    assert counters.need > 0, "the case did not take the merge or grid path"
    counters.allocate(DEV)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), counters.serving():
        out = tt.trie_topk(*case, k, cap, impl="numba")
    assert counters.overflow == 0
    for _ in range(5):
        case[2].normal_()
        g.replay()
        ref = tt.trie_topk_reference(*case, k, cap)
        for name, a, b in zip(("top", "parent", "child", "code"), out, ref):
            assert torch.equal(a, b), name
        assert int(counters.buf.count_nonzero()) == 0


@pytest.mark.parametrize("R,B,fan,k", [(3, 1, 8192, 256), (16, 256, 177, 256), (16, 256, 3, 256),
                                       (1, 256, 8192, 1024), (4, 1024, 40, 1024)])
def test_trie_topk_reads_bf16_logits_in_place(R, B, fan, k):
    """bf16 serving's lazy head (``LogProbs``: bf16 logits, each row's max and log-sum from the
    ``row_lse`` kernel): the kernels read the logits in place, equal bit for bit to the
    reference's ``LogProbs.gather``, on every path (one block, key buffer, grid passes)."""
    from streamgr.kernels.head_lse import head_log_probs
    case = list(level(R, B, fan, V=max(fan, 64) * 2, seed=R + B + fan))
    wide = torch.zeros(case[2].shape[0], case[2].shape[1] + 9, device=DEV, dtype=torch.bfloat16)
    logits = wide[:, 1:case[2].shape[1] + 1]  # an unaligned slice of a wider (padded) head
    logits.copy_(case[2] * 4)
    case[2] = head_log_probs(logits, logits.shape[1])
    assert type(case[2]).__name__ == "LogProbs"
    k = min(k, B * case[-1])
    cap = torch.full((R,), k, device=DEV)
    assert_kernels_equal_reference(case, k, cap)


@pytest.mark.parametrize("R,B,fan,k,const", [
    (4, 64, 300, 1000, True), (3, 512, 100, 700, True), (2, 8, 1024, 1024, True),
    (16, 1024, 3, 1024, False), (3, 1, 8192, 1024, False), (2, 4096, 2, 1024, False),
    (2, 4, 256, 1024, True), (3, 4, 256, 700, False), (3, 5, 205, 1000, False),
    (4, 64, 300, 256, True), (2, 16, 1024, 100, False), (8, 256, 177, 256, True),
    (40, 256, 177, 256, True), (48, 256, 177, 256, False), (60, 256, 177, 256, True)])
def test_trie_topk_all_tied_and_one_block_sizes(R, B, fan, k, const):
    """Every candidate's log-probability equal (``const``): the digits never separate the
    scores, so the grid path's last block selects more tied keys than it holds in shared memory
    and falls back to its buffer, and the one-block path resolves every key by its index; also
    the one-block path at its largest request (8,192 candidates) and k = 1,024; the sort path
    at its largest (1,024 candidates, tied and not) and one past it (1,025: four candidates a
    thread, ``trie_topk_quad``);
    the merge path with every key tied (each block's best by radix select; the list past the
    last block's bins, or past its shared memory) and untied at k = 100, and in two waves of
    blocks (40 requests; 48 and 60 take the grid launches since session 46)."""
    case = list(level(R, B, fan, V=max(fan, 64) * 2, seed=R * 7 + B + fan, dead=0.0,
                      uniform=const))
    if const:
        case[0].zero_()
        case[2].fill_(-1.5)
    k = min(k, B * case[-1])
    cap = torch.full((R,), k, device=DEV)
    assert_kernels_equal_reference(case, k, cap)


@pytest.mark.parametrize("R,spread", [(16, 3.0), (16, 0.2), (40, 3.0), (48, 3.0), (2, 1.0)])
def test_beams_sorted_best_first(R, spread):
    """Step 2 as serving runs it: beams sorted best first (the previous step's answer), so a
    request's best candidates crowd the merge path's first blocks, widely spread and nearly
    alike, in one and two waves of blocks (40 requests; 48 on the grid launches)."""
    case = list(level(R, 256, 177, V=400, seed=R + int(spread * 10), dead=0.05))
    case[0] = (case[0] / 3 * spread).sort(dim=1, descending=True).values
    assert_kernels_equal_reference(case, 256, torch.full((R,), 256, device=DEV))


@pytest.mark.parametrize("R,B,fan,k,const,bf16", [
    (16, 1024, 3, 1024, False, False), (16, 1024, 3, 1024, False, True),
    (3, 1024, 4, 1024, False, False), (3, 1024, 4, 600, False, False),
    (2, 16, 256, 1024, True, False), (2, 1365, 3, 513, True, False),
    (4, 700, 3, 1024, False, True)])
def test_four_candidates_a_thread(R, B, fan, k, const, bf16):
    """``trie_topk_quad`` (over a block of candidates, at most four, ``k`` over half a block):
    gen-ref's step 3 at beams of 1,024 (fp32 and bf16 logits read in place), exactly four
    blocks (4,096) at k 1,024 and 600, every key tied (the radix select over the registers'
    keys), 4,095 candidates at k 513, dead beams."""
    from streamgr.kernels import trie_topk_quad as quad
    case, cap = uniform_case(R, B, fan, k, const, bf16, seed=R * 11 + B + fan + k)
    assert quad.serves(B * case[-1], k)
    assert_kernels_equal_reference(case, k, cap)


def uniform_case(R, B, fan, k, const, bf16, seed):
    """(case, cap) of ``fan`` children a node: every key tied (``const``, no dead beams) or
    random with dead beams; bf16 logits read in place (``bf16``); widths from 1 to ``k``, the
    first request's ``k``."""
    from streamgr.kernels.head_lse import head_log_probs
    case = list(level(R, B, fan, V=max(fan, 64) * 2, seed=seed, dead=0.0 if const else 0.2,
                      uniform=True))
    if const:
        case[0].zero_()
        case[2].fill_(-1.5)
    if bf16:
        lg = (case[2] * 4).to(torch.bfloat16)
        case[2] = head_log_probs(lg, lg.shape[1])
    cap = torch.randint(1, k + 1, (R,), device=DEV)
    cap[0] = k
    return case, cap


@pytest.mark.parametrize("R,fan,k,const,bf16", [
    (16, 8192, 256, False, False), (16, 8192, 1024, False, True), (3, 5000, 300, False, False),
    (2, 1025, 1024, False, False), (2, 8192, 64, True, False), (4, 8192, 1, False, True),
    (5, 6000, 700, False, False)])
def test_one_beam_in_registers(R, fan, k, const, bf16):
    """``trie_topk_root`` (one beam of over a block of candidates, at most eight, held in
    registers): gen-ref's step 1 at k 256 and at beams of 1,024 (bf16 logits read in place),
    children not a whole number of blocks, one past a block at k 1,024, every key tied (the
    radix select over the registers' keys), k 1, dead beams (the random cases' -inf rows)."""
    from streamgr.kernels import trie_topk_root as root
    case, cap = uniform_case(R, 1, fan, k, const, bf16, seed=R * 13 + fan + k)
    assert root.serves(1, case[-1])
    assert_kernels_equal_reference(case, k, cap)


AB_CHECK = """
import os, sys, torch
sys.path.insert(0, {root!r})
from tests.kernels.test_gpu_trie_topk import assert_kernels_equal_reference, level
from streamgr.kernels import trie_topk_one, trie_topk_sample
assert trie_topk_sample.SAMPLE == (os.environ.get("STREAMGR_TOPK_SAMPLE") != "0")
assert trie_topk_one.BINS == (os.environ.get("STREAMGR_TOPK_BINS") != "0")
from streamgr.kernels import trie_topk_merge
assert trie_topk_merge.MERGE == (os.environ.get("STREAMGR_TOPK_MERGE") != "0")
from streamgr.kernels import trie_topk_own, trie_topk_quad
assert trie_topk_own.OWN == (os.environ.get("STREAMGR_TOPK_OWN") != "0")
assert trie_topk_quad.QUAD == os.environ.get("STREAMGR_TOPK_QUAD", "1")
from streamgr.kernels import trie_topk_root
assert trie_topk_root.ROOT == (os.environ.get("STREAMGR_TOPK_ROOT") != "0")
from streamgr.kernels import trie_topk_levels
assert trie_topk_levels.LEVELS == (os.environ.get("STREAMGR_TOPK_LEVELS") == "1")
from streamgr.kernels import trie_topk_bins
assert trie_topk_bins.UNITS == (os.environ.get("STREAMGR_TOPK_UNITS") != "0")
for R, B, fan, k, ties in {cases!r}:
    case = level(R, B, fan, V=max(fan, 64) * 2, seed=R + B + fan, ties=ties)
    k = min(k, B * case[-1])
    assert_kernels_equal_reference(case, k, torch.full((R,), k, device="cuda"))
print("ok")
"""

# The cases each setting runs: those routed through the kernels it changes (each process compiles
# only the kernels it launches: every kernel in every process took the eight processes past 400 s
# on the H200 machine's CPUs, session 37). R, B, fan-out, k, ties.
STEP2 = [(16, 256, 177, 256, False)]  # the merge (chunks of 8,192)
GRID = [(1, 256, 8192, 256, False), (2, 1024, 40, 1024, True), (3, 512, 100, 700, False)]
OWN_CASES = [(16, 256, 3, 256, True), (3, 4, 256, 700, False), (1, 1, 1, 1, False),
             (5, 37, 13, 100, True)]  # at most a block of candidates
QUAD_CASES = [(16, 1024, 3, 1024, False), (2, 1000, 3, 600, True)]  # 1,025-4,096 wanting > 512
ONE_CASES = [(4, 1024, 5, 700, False), (2, 1000, 3, 100, False)]  # one block, 5,120 and 3,000
ROOT_CASES = [(16, 1, 8192, 256, False), (3, 1, 8192, 1024, True)]  # one beam's children
KEPT_CASES = [(16, 1024, 177, 1024, False), (48, 256, 177, 256, True)]  # trie_topk_kept's
AB_CASES = {("STREAMGR_TOPK_SAMPLE", "0"): STEP2 + ONE_CASES,
            ("STREAMGR_TOPK_BINS", "0"): ONE_CASES, ("STREAMGR_TOPK_MERGE", "0"): STEP2 + GRID,
            ("STREAMGR_TOPK_OWN", "0"): OWN_CASES, ("STREAMGR_TOPK_OWN", "1"): OWN_CASES,
            ("STREAMGR_TOPK_QUAD", "0"): QUAD_CASES,
            ("STREAMGR_TOPK_QUAD", "2"): QUAD_CASES + ONE_CASES,
            ("STREAMGR_TOPK_ROOT", "0"): ROOT_CASES,
            ("STREAMGR_TOPK_LEVELS", "1"): STEP2 + ONE_CASES,
            ("STREAMGR_TOPK_UNITS", "0"): GRID, ("STREAMGR_TOPK_KEPT", "0"): GRID}


def _ab_check(name: str, value: str, cases, timeout: float) -> None:
    """``AB_CHECK`` over ``cases`` in a process of its own with ``name=value`` set."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = AB_CHECK.format(root=root, cases=cases)
    p = subprocess.run([sys.executable, "-c", script],
                       env=dict(os.environ, **{name: value}), capture_output=True, text=True,
                       timeout=timeout, cwd=root)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["ok"]


@pytest.mark.parametrize("name,value", list(AB_CASES))
def test_kernels_under_their_ab_settings(name, value):
    """The A/B settings (read at import, so each in its own process) keep the reference's
    answers: ``STREAMGR_TOPK_SAMPLE=0`` (no sampled floor: the merge's and the one-block path's
    chunks counted by bins), ``STREAMGR_TOPK_BINS=0`` (the one-block path's radix rounds without the
    bins round), ``STREAMGR_TOPK_MERGE=0`` (no one-launch merge: steps 1 and 2 on the one-block and
    grid paths), ``STREAMGR_TOPK_OWN=0`` (requests of at most a block of candidates on the
    one-block path instead of one candidate a thread), ``STREAMGR_TOPK_OWN=1`` (each thread
    ranking its own key and answering from its registers), ``STREAMGR_TOPK_QUAD=0`` (requests
    of up to four blocks wanting over half a block on the one-block path's radix rounds),
    ``=2`` (four candidates a thread for any ``k``), ``STREAMGR_TOPK_ROOT=0`` (one beam's
    children on the one-block path, or four a thread), ``STREAMGR_TOPK_LEVELS=1`` (chunks of
    five to eight blocks scored a load level at a time, ``trie_topk_levels``),
    ``STREAMGR_TOPK_UNITS=0`` (the grid's scoring in rounds of eight candidates a thread
    instead of beam units), ``STREAMGR_TOPK_KEPT=0`` (the two grid launches where the one
    launch of ``trie_topk_kept`` serves)."""
    _ab_check(name, value, AB_CASES[name, value], 600)


def test_the_merge_with_the_sampled_floor_finishes():
    """Step 2 through the merge's sampled floor (the default) finishes and equals the reference,
    in a process of its own under a timeout: every such launch hung the lent H200 in sessions
    37-39 (CPython 3.12 had copied ``least_okey``'s call, shuffles and barrier, into both arms
    of the per-thread choice of each thread's floor candidate; ``trie_topk_sample.or_max`` chooses
    it without a branch). A hang here fails in 300 s instead of stalling the suite."""
    _ab_check("STREAMGR_TOPK_SAMPLE", "1", STEP2 + [(1, 256, 177, 256, False)], 300)


@pytest.mark.parametrize("R,B,fan,k,kind", [
    (16, 1024, 177, 1024, "random"), (16, 1024, 177, 1024, "sorted"), (1, 256, 8192, 256, "random"),
    (1, 256, 8192, 1024, "bf16"), (2, 1024, 177, 1024, "const"), (3, 1024, 177, 700, "dead"),
    (2, 1024, 100, 600, "ties"), (3, 1024, 177, 513, "random"), (1, 5000, 3, 1000, "random"),
    (4, 200, 128, 1000, "random")])
def test_grid_equals_reference(R, B, fan, k, kind):
    """The grid paths: the one launch of ``trie_topk_kept`` where beam units fit and the two of
    ``trie_topk_bins`` elsewhere. Gen-ref's step 2 at beams of 1,024 (random, and beams sorted
    best first so the best candidates crowd the first blocks), one request's flat 2,097,152 at
    k 256 and (bf16 logits) 1,024, every key tied (the radix fallback over a crowded bin), most
    beams dead, ties, k just over half a block, a fan-out of 3 (chunks of at most ``NT - 2``
    beams: more blocks than SMs; the two launches), and blocks of fewer than k candidates (seven
    beams of 128 against k 1,000: each block of the one launch keeps all of its own)."""
    from streamgr.kernels import trie_topk_merge as tm
    case, cap = uniform_case(R, B, fan, k, kind == "const", kind == "bf16",
                             seed=R * 17 + B + fan + k)
    if kind == "sorted":
        case[0] = case[0].sort(dim=1, descending=True).values
    if kind == "dead":  # the widths of the step before: beams past them dead
        case[0][:, 3:] = float("-inf")
    if kind == "ties":
        case[2] = (case[2] * 2).round() / 2
        case[0] = case[0].round()
    assert tm.plan_for(B * case[-1], R, k, DEV) is None  # not the merge's
    assert_kernels_equal_reference(case, k, cap)


def test_grid_replays_with_its_counters_left_zero():
    """A captured replay of the grid launches on fresh logits equals the reference and leaves
    the plan's counters zero (the next replay's start)."""
    R, B, fan, k = 2, 1024, 177, 700
    case, cap = uniform_case(R, B, fan, k, False, False, seed=99)
    counters = Counters()
    with counters.sizing():
        tt.trie_topk(*case, k, cap, impl="numba")
    counters.allocate(DEV)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), counters.serving():
        out = tt.trie_topk(*case, k, cap, impl="numba")
    case[2].normal_()
    g.replay()
    for name, a, b in zip(("top", "parent", "child", "code"), out,
                          tt.trie_topk_reference(*case, k, cap)):
        assert torch.equal(a, b), name
    assert int(counters.buf.count_nonzero()) == 0


def _okey(x):
    """trie_topk_keys.okey on the host (float32 array -> uint32 order-preserving bits)."""
    b = (np.asarray(x, np.float32) + np.float32(0.0)).view(np.uint32)
    return np.where(b >> 31 == 1, ~b, b | np.uint32(0x80000000)).astype(np.uint32)


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16_bins", "fp32_bins"])
def test_okey_from_equals_a_bisection(bf16):
    """``trie_topk_bins.okey_from`` (a warp's 32-point search for the least okey whose bin
    reaches ``g``) equals a host bisection over the same monotone ``gbin``, for bins across
    the range (the lowest, the -inf keys' and past the highest) and references of both
    signs, at the bins' shift of either logits dtype."""
    from numba import cuda, float32 as nf32, int64 as ni64
    from streamgr.kernels import trie_topk_beams as tb, trie_topk_bins as bn
    from streamgr.kernels.numba_common import as_array, torch_stream
    shift = tb._gshift_of(bf16)
    nbins = 1 << (32 - shift)

    @cuda.jit
    def kern(gs, refs, out):
        i = cuda.blockIdx.x
        t = bn.okey_from(ni64(gs[i]), nf32(refs[i]), ni64(shift))
        if cuda.threadIdx.x == 0:
            out[i] = t

    def gbin(u, ref):  # the host's bn.gbin(okey_float(u), ref)
        b = np.uint32(u)
        bits = (b ^ np.uint32(0x80000000)) if b >> 31 else ~b
        return int(_okey(bits.view(np.float32) - np.float32(ref)) >> np.uint32(shift))

    def bisect(g, ref):
        lo, hi = int(bn.KEY_NEG_INF), int(bn.OKEY_TOP)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if gbin(mid, ref) >= g else (mid + 1, hi)
        return lo

    cases = [(g, ref) for ref in (0.0, 3.25, -7.5, 1e-30) for g in
             (0, 1, gbin(int(bn.KEY_NEG_INF), ref), 1000, 1023, 1024, 1025, 2047, 2048, 2049,
              3000, nbins - 1, nbins)]
    gs = torch.tensor([c[0] for c in cases], dtype=torch.int64, device=DEV)
    refs = torch.tensor([c[1] for c in cases], dtype=torch.float32, device=DEV)
    out = torch.zeros(len(cases), dtype=torch.int64, device=DEV)
    kern[len(cases), 32, torch_stream(DEV)](as_array(gs), as_array(refs), as_array(out))
    torch.cuda.synchronize()
    assert out.tolist() == [bisect(g, ref) for g, ref in cases]
