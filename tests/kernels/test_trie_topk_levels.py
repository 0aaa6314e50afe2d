"""``trie_topk_levels.note_levels`` (a chunk of five to eight blocks of candidates scored in one
round, a load level at a time) against ``note_all`` (two rounds of four chains) under the CUDA
simulator: the same okeys and per-thread (smallest real, largest) okeys, bit for bit."""

import textwrap

import pytest

from tests.kernels.test_trie_topk import simulate

LEVELS = textwrap.dedent("""
    import numpy as np, torch, sys
    sys.path.insert(0, {root!r})
    from numba import cuda, int32
    from tests.kernels.test_trie_topk import random_case
    from streamgr.kernels import trie_topk_keys as K, trie_topk_levels as L
    from streamgr.kernels.trie_topk_index import magic
    from streamgr.kernels.head_lse import LogProbs, row_lse_reference
    from streamgr.kernels.numba_common import as_array as a
    from streamgr.kernels.trie_topk_dev import NT
    from streamgr.kernels.trie_topk_numba import _log_probs
    assert NT == 32 and L.LEVELS and 4 * NT < 129 and 256 <= L.LN * NT  # the chunks below

    @cuda.jit
    def both(out, kxs, c0, n, F, FM, B, scores, nodes, logp, lse, sh, ptr, codes, off):
        kx = cuda.shared.array(256, int32)
        ky = cuda.shared.array(256, int32)
        t = cuda.threadIdx.x
        lo, hi = L.note_levels(kx, c0, n, 1, F, FM, B, scores, nodes, logp, lse, sh, ptr,
                               codes, off)
        lo2, hi2 = K.note_all(ky, c0, n, NT, 1, F, FM, B, scores, nodes, logp, lse, sh, ptr,
                              codes, off)
        out[t, 0], out[t, 1], out[t, 2], out[t, 3] = lo, hi, lo2, hi2
        cuda.syncthreads()
        for i in range(t, n, NT):
            kxs[0, i] = kx[i]
            kxs[1, i] = ky[i]

    runs, real, none = 0, 0, 0
    for seed, dead in ((40, 0.0), (41, 0.4), (42, 1.0)):
        scores, nodes, logp, ptr, codes, off, F = random_case(seed, R=2, B=6, fan=(50, 80),
                                                              dead=dead)
        assert 6 * F >= 300
        lg = (logp * 3).to(torch.bfloat16)
        for lp in (logp, LogProbs(lg, lg.shape[1], row_lse_reference(lg, lg.shape[1]))):
            sc = scores.float().contiguous()
            bits = _log_probs(lp, a, sc)
            for c0, n in ((0, 256), (3, 129), (44, 256), (100, 200), (171, 129)):
                out = np.zeros((NT, 4), np.int64)
                kxs = np.zeros((2, 256), np.int32)
                both[1, NT](out, kxs, c0, n, F, magic(F), 6, a(sc), a(nodes), *bits,
                            a(ptr), a(codes), off)
                assert (out[:, :2] == out[:, 2:]).all(), (seed, c0, n, out)
                assert (kxs[0, :n] == kxs[1, :n]).all(), (seed, c0, n, kxs[:, :n])
                real += int((kxs[0, :n] != int(K.KEY_NEG_INF)).sum())  # okey(-inf): no child
                none += int((kxs[0, :n] == int(K.KEY_NEG_INF)).sum())
                runs += 1
    print("ok", runs, real > 0, none > 0)
""")


@pytest.mark.slow
def test_levels_equal_two_rounds_under_the_simulator():
    """Chunks of 129-256 candidates (five to eight of the simulator's 32-thread blocks) from a
    request's start and middle, over beams with and without children in range, all beams
    live, some dead, all dead, fp32 and bf16 log-probabilities."""
    assert simulate(LEVELS, STREAMGR_TOPK_LEVELS="1") == ["ok", "30", "True", "True"]
