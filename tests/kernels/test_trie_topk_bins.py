"""The grid selection's binning helpers under the CUDA simulator: the last block's linear bins
(``trie_topk_rank.lin_bin``: linear in the score where its span is finite, so that a list of
scores across 0 spreads over the bins instead of crowding a few into the sort fallback) and
the bins' reference (``trie_topk_beams.best_bound``: the best any child can score)."""

from __future__ import annotations

import textwrap

from . import simulator as sim

SCRIPT = textwrap.dedent("""
    import numpy as np, sys
    sys.path.insert(0, {root!r})
    from numba import cuda, int64
    from streamgr.kernels.trie_topk_beams import best_bound
    from streamgr.kernels.trie_topk_dev import NB, NT, RED_N
    from streamgr.kernels.trie_topk_keys import okey
    from streamgr.kernels.trie_topk_rank import lin_bin

    @cuda.jit
    def bins(x, lo, hi, out):
        i = cuda.grid(1)
        if i < x.size:
            out[i] = lin_bin(okey(x[i]), okey(lo[0]), okey(hi[0]))

    @cuda.jit
    def bound(scores, lse, sh, out):
        red = cuda.shared.array(RED_N, int64)
        v = best_bound(scores, lse, sh, 0, scores.shape[1], red)
        if cuda.threadIdx.x == 0:
            out[0] = v

    def binned(x):
        out = np.zeros(len(x), np.int32)
        bins[(len(x) + 31) // 32, 32](x, x[-1:], x[:1], out)
        return out

    # gen-ref's bf16 bench lists: 1,100 scores from 0.4 down to -2.2 (across 0)
    x = np.sort(np.random.default_rng(0).uniform(-2.2, 0.4, 1100).astype(np.float32))[::-1]
    b = binned(x.copy())
    assert (np.diff(b) <= 0).all() and b[0] >= NB - 2 and b[-1] == 0, b
    assert np.bincount(b).max() <= 2 * len(x) // NB + 2, np.bincount(b)
    u = np.where(x < 0, ~x.view(np.uint32), x.view(np.uint32) | 0x80000000).astype(np.float64)
    by_okey = ((u - u[-1]) * ((NB - 1) / (u[0] - u[-1]))).astype(np.int64)
    assert np.bincount(by_okey).max() > len(x) // 3  # what the okeys' bins did
    # an infinite end: by okey, still monotone
    y = x.copy(); y[-1] = -np.inf
    c = binned(y)
    assert (np.diff(c) <= 0).all() and 0 <= c.min() and c.max() <= NB - 1, c
    # the reference: beam score less the row's log-sum (bf16 logits), the best beam (fp32)
    s = np.array([[0.5, 2.0, -np.inf, 1.0]], np.float32)
    lse = np.array([[9.0, 9.0, 9.0, 9.0], [1.0, 3.0, 0.5, 0.1]], np.float32)
    out = np.zeros(1, np.float32)
    bound[1, NT](s, lse, 16, out)
    assert out[0] == np.float32(1.0) - np.float32(0.1), out
    bound[1, NT](s, lse[:1], 0, out)
    assert out[0] == 2.0, out
    bound[1, NT](np.full((1, 4), -np.inf, np.float32), lse, 16, out)
    assert out[0] == 0.0, out
    print("ok")
""")


def test_linear_bins_and_the_reference_under_the_simulator():
    """Scores across 0 spread over the last block's bins (at most twice the mean in one, where
    bins linear in the okeys put a third of them in one); an infinite end keeps them monotone; the
    reference is the best beam score less its row's log-sum for bf16 logits, the best beam
    score for fp32 log-probabilities, 0 where every beam is dead."""
    assert sim.simulate(SCRIPT.format(root=sim.ROOT)) == ["ok"]
