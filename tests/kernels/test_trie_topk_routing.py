"""Host-side checks of the selection kernels' dispatch: the exact ``c // F`` they use, the
index range past which a step runs the stable reference, and which kernel serves which of
gen-ref's step shapes (``trie_topk_merge.plan``, ``trie_topk_quad.serves``,
``trie_topk_root.serves``) at the H200's sizes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import torch


def test_magic_division_is_exact():
    """The kernels' ``c // F`` without a division (``trie_topk_index.magic``), over fan-outs
    1..5,000 and the served ones, at the candidate indices where rounding would show first."""
    from streamgr.kernels.trie_topk_index import magic
    rng = np.random.default_rng(0)
    for F in list(range(1, 5001)) + [8192, 177, 2 ** 20 + 3, 2 ** 29 - 1]:
        fm = magic(F)
        m, sh = fm & ((1 << 40) - 1), fm >> 40
        assert m < 2 ** 32, F  # div_f multiplies 32 x 32 bits
        cs = [0, F - 1, F, F + 1, 2 ** 30 - 1] + [int(x) for x in rng.integers(0, 2 ** 30, 20)]
        for c in cs:
            assert (c * m) >> sh == c // F and c * m < 2 ** 63, (F, c)


def test_requests_past_the_kernels_index_range_take_the_stable_reference(monkeypatch):
    """More than 2**30 candidates a request (beams x fan-out) would overflow the kernels' key
    index and their exact c // F: such a step runs the stable reference (the kernels' order)
    instead of answering wrong; at the limit the kernels still serve."""
    from streamgr.kernels import trie_topk as tt
    from streamgr.kernels import trie_topk_numba as nb  # noqa: F401  (imported by the dispatch)
    calls = []
    monkeypatch.setattr(tt, "usable", lambda t: True)
    monkeypatch.setattr(tt, "trie_topk_reference",
                        lambda *a, stable: calls.append(("reference", stable)) or "ref")
    monkeypatch.setattr(nb, "run", lambda *a: calls.append(("numba", a[6])) or "numba")
    B = 1024
    scores, nodes = torch.zeros(1, B), torch.zeros(1, B, dtype=torch.int64)
    logp = torch.zeros(B, 8)
    ptr, codes, cap = torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), \
        torch.ones(1, dtype=torch.int64)
    fan = tt.NUMBA_MAX_N // B
    assert tt.trie_topk(scores, nodes, logp, ptr, codes, 0, fan, 4, cap, impl="numba") == "numba"
    assert tt.trie_topk(scores, nodes, logp, ptr, codes, 0, fan + 1, 4, cap,
                        impl="numba") == "ref"
    assert calls == [("numba", fan), ("reference", True)]


ROUTING = """
from streamgr.kernels import trie_topk_merge as tm
assert tm.plan(45312, 16, 256, 132) == (6144, 8), tm.plan(45312, 16, 256, 132)
assert tm.plan(45312, 8, 256, 132) == (5120, 9), tm.plan(45312, 8, 256, 132)
assert tm.plan(45312, 40, 256, 132) == (8192, 6), tm.plan(45312, 40, 256, 132)
assert max(R for R in range(1, 100) if tm.plan(45312, R, 256, 132)) == 44
for args in [(8192, 16, 256), (181248, 16, 1024), (2097152, 1, 256), (45312, 48, 256)]:
    assert tm.plan(*args, 132) is None, args
from streamgr.kernels import trie_topk_quad as q
assert q.serves(3072, 1024) and q.serves(4096, 513) and q.serves(1025, 600)
assert not q.serves(3072, 512) and not q.serves(1024, 1024) and not q.serves(4097, 1024)
from streamgr.kernels import trie_topk_root as rt
assert rt.serves(1, 8192) and rt.serves(1, 1025) and not rt.serves(1, 1024)
assert not rt.serves(1, 8193) and not rt.serves(2, 4096)
from streamgr.kernels import trie_topk_kept as kp
from streamgr.kernels.trie_topk_beams import units_of
u177, u8192 = units_of(177, True), units_of(8192, True)
assert (u177, u8192, units_of(127, True)) == (1, 43, 0)
assert kp.plan(16, 1024, 132, u177) == 128 and kp.plan(48, 256, 132, u177) == 128
assert kp.plan(8, 1024, 132, u177) == 64 and kp.plan(4, 200, 132, 1) == 7
assert kp.plan(64, 1024, 132, u177) is None  # 8 blocks a request: 512 blocks, four waves
assert kp.plan(1, 256, 132, u8192) is None  # 128 blocks of two beams: past GMAX
assert kp.plan(16, 1024, 132, 0) is None
print("ok")
"""


def test_merge_and_quad_routing_on_the_h200():
    """Where the one-launch merge serves (``trie_topk_merge.plan``; H200 measurements in
    docs/benchmarks.md, sessions 29-30, 42): gen-ref's step 2 at 16 requests in 8 chunks of
    6,144 (one block an SM; with the answers listed beside the keys as fast as 6 of 8,192 or
    faster, session 42), at 8 requests in 9 of 5,120 (the blocks' lists within the last
    block's), at 40 in 6 of 8,192, from 1 request up to 44 (two waves of blocks; at 48, 2.2
    waves, the grid launches were faster, session 46); not step 1 (one block of 8,192 was
    faster), not k over 512, not one request's flat 2,097,152. Four candidates a thread
    (``trie_topk_quad``) for 1,025-4,096 candidates wanting over 512 (gen-ref's step 3 at
    beams of 1,024); eight (``trie_topk_root``) for one beam of 1,025-8,192 children (step 1 at
    any width). The one launch of ``trie_topk_kept`` (``plan``: beams a block) for gen-ref's
    step 2 at beams of 1,024 (8 blocks of 128 beams a request) and at 48 requests (2 of 128),
    not where blocks of four units a warp would take more than one wave or 32 blocks a request
    (one request's flat 2,097,152: 128). In a process of its own without the simulator, whose
    block sizes differ."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    p = subprocess.run([sys.executable, "-c", ROUTING], env=env, capture_output=True, text=True,
                       timeout=120, cwd=root)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["ok"]


def test_logits_and_codes_reach_the_kernels_with_adjacent_elements():
    """The kernels read a logits row and the codes through ``numba_common.load_at`` (element
    ``n`` at ``n`` item sizes past the start), so the host side hands them over with unit
    stride in their last dimension: strided views are copied, contiguous ones passed as they
    are (no copy node in a captured plan)."""
    from streamgr.kernels.head_lse import LogProbs, row_lse_reference
    from streamgr.kernels.trie_topk_numba import _log_probs, unit_stride
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 40, generator=g).to(torch.bfloat16)
    lg = wide[:, ::2]  # inner stride 2
    sc = torch.randn(6)
    bits, stats, sh = _log_probs(LogProbs(lg, 20, row_lse_reference(lg, 20)), lambda t: t, sc)
    assert sh == 16 and bits.stride(-1) == 1
    assert torch.equal(bits, lg.contiguous().view(torch.int16))
    f32 = torch.randn(40, 6, generator=g).t()  # inner stride 6
    bits, _, sh = _log_probs(f32, lambda t: t, sc)
    assert sh == 0 and bits.stride(-1) == 1 and torch.equal(bits.view(torch.float32), f32)
    codes = torch.arange(30, dtype=torch.int32)
    assert unit_stride(codes) is codes  # contiguous: passed as it is
    every3 = unit_stride(codes[::3])
    assert torch.equal(every3, codes[::3]) and every3.stride(0) == 1
