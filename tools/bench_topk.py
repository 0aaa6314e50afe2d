"""Trie-constrained selection on the GPU: the Numba kernels (kernels/trie_topk.py) against
``torch.topk`` over the same candidate grid and against the torch reference step, on gen-ref's
per-step shapes (16 requests; fan-outs 8,192 / 177 / 3; beams 256 and 1,024, where step 1 wants
1,024 of the root's 8,192), one request's flat [1, 256 x 8,192], and steps 1 and 2 at 48
requests (gen-ref's serving batches). Each row first checks the kernels equal the reference (bit
for bit), then times CUDA-graph replays (20 per graph, median of rounds). The last two columns
are bf16 serving's step as it runs (the log-probabilities a lazy ``LogProbs`` over bf16 logits,
as the head leaves them): the whole selection by the Numba kernels, which read the logits in
place, against the torch step the engine serves with by default (gathers, then ``torch.topk``).

    python tools/bench_topk.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from graph_timing import graph_ms  # noqa: E402  (tools/, the script's own folder)
from streamgr.kernels import trie_topk as tt  # noqa: E402

DEV = torch.device("cuda")
HBM = 4.8e12


def level(R, B, F, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    ptr = torch.arange(0, (B + 1) * F, F, device=DEV)  # node b has F children
    codes = torch.arange(F, device=DEV, dtype=torch.int32).repeat(B)  # as SidTrie.tables'
    nodes = torch.arange(B, device=DEV).repeat(R, 1)
    scores = torch.randn(R, B, device=DEV, generator=g)
    logp = torch.randn(R * B, F + 3, device=DEV, generator=g)
    return scores, nodes, logp, ptr, codes, 3, F


def against_topk(case, k, cap):
    """(the Numba selection's ms, ``torch.topk``'s ms on a grid of the same [R, B x F], whether
    the selection equals the stable reference bit for bit), graph-replayed."""
    R, B = case[0].shape
    got = tt.trie_topk(*case, k, cap, impl="numba")
    ref = tt.trie_topk_reference(*case, k, cap)
    equal = all(torch.equal(a, b) for a, b in zip(got, ref))
    grid = torch.randn(R, B * case[-1], device=DEV)
    t_nb = graph_ms(lambda: tt.trie_topk(*case, k, cap, impl="numba"))
    t_topk = graph_ms(lambda: grid.topk(k, dim=1))
    return t_nb, t_topk, equal


def main() -> None:
    shapes = [("step 1 (root)", 16, 1, 8192, 256), ("step 2", 16, 256, 177, 256),
              ("step 3", 16, 256, 3, 256), ("flat one request", 1, 256, 8192, 256),
              ("flat one request", 1, 256, 8192, 1024), ("step 2, beams 1024", 16, 1024, 177, 1024),
              ("step 3, beams 1024", 16, 1024, 3, 1024),
              ("step 1, beams 1024", 16, 1, 8192, 1024),
              ("step 1, 48 requests", 48, 1, 8192, 256),
              ("step 2, 48 requests", 48, 256, 177, 256)]
    print(f"{'shape':>22} {'R':>3} {'B':>5} {'F':>5} {'k':>5} {'numba ms':>9} {'topk ms':>8} "
          f"{'ref ms':>8} {'x topk':>7} {'x ref':>6} {'GB/s':>6} equal {'bf16 nb':>8} "
          f"{'bf16 torch':>10} {'x':>5}")
    from streamgr.kernels.head_lse import head_log_probs
    worst, serving = [], []
    for name, R, B, F, k in shapes:
        case = level(R, B, F, seed=R + B + F + k)
        cap = torch.full((R,), k, device=DEV)
        t_nb, t_topk, equal = against_topk(case, k, cap)
        t_ref = graph_ms(lambda: _torch_step(case, k, cap))
        gbs = R * B * F * 4 / t_nb / 1e6
        worst.append(t_topk / t_nb)
        lg = case[2].to(torch.bfloat16)
        lazy = (*case[:2], head_log_probs(lg, lg.shape[1]), *case[3:])
        got = tt.trie_topk(*lazy, k, cap, impl="numba")
        ref = tt.trie_topk_reference(*lazy, k, cap)
        equal = equal and all(torch.equal(a, b) for a, b in zip(got, ref))
        t_lnb = graph_ms(lambda: tt.trie_topk(*lazy, k, cap, impl="numba"))
        t_ltorch = graph_ms(lambda: tt.trie_topk(*lazy, k, cap, impl="topk"))
        serving.append(t_ltorch / t_lnb)
        print(f"{name:>22} {R:>3} {B:>5} {F:>5} {k:>5} {t_nb:>9.4f} {t_topk:>8.4f} {t_ref:>8.4f} "
              f"{t_topk / t_nb:>7.2f} {t_ref / t_nb:>6.2f} {gbs:>6.0f} {equal!s:>5} "
              f"{t_lnb:>8.4f} {t_ltorch:>10.4f} {t_ltorch / t_lnb:>5.2f}", flush=True)
    print(f"bench_topk: numba selection vs torch.topk {min(worst):.2f}x-{max(worst):.2f}x "
          f"(target >= 5x); bf16 serving step, numba vs the torch step "
          f"{min(serving):.2f}x-{max(serving):.2f}x")


def _torch_step(case, k, cap):
    """Today's torch step: the child grid, gathered scores and torch.topk (unstable ties)."""
    scores, nodes, logp, ptr, codes, off, F = case
    R, B = scores.shape
    n = nodes.view(-1)
    lo = ptr[n]
    cnt = ptr[n + 1] - lo
    slot = torch.arange(F, device=DEV)
    real = slot[None, :] < cnt[:, None]
    child = torch.where(real, lo[:, None] + slot[None, :], 0)
    code = codes[child]
    cand = scores.view(-1, 1) + logp.gather(1, off + code)
    cand = cand.masked_fill(~real, float("-inf")).view(R, B * F)
    return cand.topk(k, dim=1)


if __name__ == "__main__":
    main()
