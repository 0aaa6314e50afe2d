"""HSTU attention kernel alone, one layer, on the GPU: the split/direct kernel beside the previous
(WMMA) kernel and the torch reference.

Shapes (issue 12): cached = B users x HIST paged history tokens (page 32), 5 new + 256 candidates
each; recompute = B users x HIST tokens + 256 candidates; rank-ref heads (4 x 128), bf16. Each
shape first checks the kernel against the fp32 reference (relative error) and that the split and
direct plans agree bit for bit, then times CUDA-graph replays of 20 back-to-back layers (median of
rounds, CUDA events), so host launch time is out of the figure.

    python tools/bench_attention.py                 # the issue's shapes + a sweep
    python tools/bench_attention.py --quick         # the issue's shapes only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from graph_timing import graph_ms  # noqa: E402  (tools/, the script's own folder)
from streamgr.kernels.hstu_attention import (JaggedKV, hstu_attention_jagged,  # noqa: E402
                                             hstu_attention_jagged_reference)

DEV = torch.device("cuda")
H, D, P, CANDS, NEW = 4, 128, 32, 256, 5
PEAK_TFLOPS, PEAK_BW = 744.0, 4.8e12  # WORKLOADS.md bf16 GEMM; HBM3e datasheet


def case(B: int, hist: int, cached: bool, seed: int = 0, contiguous: bool = False):
    """A batch of the shape; ``contiguous``: a cached batch whose history K/V are rows of k/v
    (after the batch's own rows) instead of pages (A/B of the paged loads)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    rnd = lambda *s: (torch.randn(*s, device=DEV, generator=g) * 0.5).to(torch.bfloat16)  # noqa: E731
    new = NEW if cached else hist
    rows = new + CANDS
    extra = B * hist if cached and contiguous else 0
    q, k, v = rnd(B * rows, H, D), rnd(B * rows + extra, H, D), rnd(B * rows + extra, H, D)
    q_off = [i * rows for i in range(B + 1)]
    if cached and contiguous:
        desc = JaggedKV(q_off, [CANDS] * B, [hist] * B, [False] * B,
                        [B * rows + i * hist for i in range(B)], [[]] * B, P, None)
    elif cached:
        per = -(-hist // P)
        store = rnd(1, B * per + 1, 2, P, H, D)
        perm = torch.randperm(B * per, generator=torch.Generator().manual_seed(seed)).tolist()
        pages = [perm[i * per:(i + 1) * per] for i in range(B)]
        desc = JaggedKV(q_off, [CANDS] * B, [hist] * B, [True] * B, q_off[:-1], pages, P, store)
    else:
        desc = JaggedKV.recompute(q_off, [CANDS] * B)
    return q, k, v, desc


def flops(B, hist, cached):
    new = NEW if cached else hist  # (NEW: --new)
    start = hist - new
    keys = sum(start + i + 1 for i in range(new)) + CANDS * (hist + 1)
    return 4.0 * D * H * keys * B


def measure(B, hist, cached, with_ref=True, wmma=True, contiguous=False):
    q, k, v, desc = case(B, hist, cached, seed=B * 7919 + hist, contiguous=contiguous)
    alpha, n = 1.0 / np.sqrt(D), 2 * 20000 + 256
    out = {p: torch.empty_like(q) for p in ("auto", "split", "direct") + (("wmma",) if wmma else ())}
    for p in out:
        hstu_attention_jagged(q, k, v, desc, 0, alpha, n, out=out[p], plan=None if p == "auto" else p)
    ref = hstu_attention_jagged_reference(q.float(), k.float(), v.float(),
                                          JaggedKV(desc.q_offsets, desc.num_candidates,
                                                   desc.hist_lens, desc.paged, desc.kv_rows,
                                                   desc.pages, desc.page_tokens,
                                                   None if desc.store is None else desc.store.float()),
                                          0, alpha, n)
    err = {p: ((o.float() - ref).norm() / ref.norm()).item() for p, o in out.items()}
    bitwise = torch.equal(out["split"], out["direct"])
    row = {"batch": B, "hist": hist, "mode": "cached" if cached else "recompute",
           "plan": "split" if desc.cuda_plan(DEV, H).split else "direct",
           "rel_err": max(err["auto"], err["split"], err["direct"]),
           "rel_err_wmma": err.get("wmma", float("nan")),
           "split_eq_direct": bitwise}
    o = out["auto"]
    row["ms"] = graph_ms(lambda: hstu_attention_jagged(q, k, v, desc, 0, alpha, n, out=o))
    row["ms_wmma"] = graph_ms(lambda: hstu_attention_jagged(q, k, v, desc, 0, alpha, n, out=o,
                                                         plan="wmma"), reps=5, rounds=3) \
        if wmma else float("nan")
    if with_ref:
        qf = q
        t0 = time.perf_counter()
        for _ in range(3):
            hstu_attention_jagged_reference(qf, k, v, desc, 0, alpha, n)
        torch.cuda.synchronize()
        row["ms_torch"] = (time.perf_counter() - t0) / 3 * 1e3
    f = flops(B, hist, cached)
    row["tflops"] = f / row["ms"] / 1e9
    hist_bytes = B * hist * H * D * 2 * 2
    row["hist_GBps"] = hist_bytes / row["ms"] / 1e6
    row["pct_peak"] = 100 * max(row["tflops"] / PEAK_TFLOPS, hist_bytes / row["ms"] / 1e-3 / PEAK_BW)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the issue's shapes only")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--no-wmma", action="store_true", help="skip the previous (WMMA) kernel")
    ap.add_argument("--ncu", action="store_true",
                    help="no timing: each issue shape's kernel launched eagerly twice, for "
                         "`ncu -k regex:hstu_attn` to profile")
    ap.add_argument("--new", type=int, default=NEW,
                    help="new history tokens per user in the cached shapes (5: the issue's)")
    ap.add_argument("--contiguous", action="store_true",
                    help="cached shapes with contiguous history K/V instead of pages")
    args = ap.parse_args()
    globals()["NEW"] = args.new
    shapes = [(8, 6400, True), (1, 6400, True), (8, 6400, False), (1, 6400, False)]
    if args.ncu:
        for B, hist, cached in shapes[::2]:
            q, k, v, desc = case(B, hist, cached)
            o = torch.empty_like(q)
            for _ in range(2):
                hstu_attention_jagged(q, k, v, desc, 0, 1.0 / np.sqrt(D), 40256, out=o)
            torch.cuda.synchronize()
        return
    if not args.quick:
        shapes += [(b, h, c) for c in (True, False) for b in (1, 4, 16, 32)
                   for h in (256, 2000, 20000) if not (not c and b * h > 200000)]
    rows = []
    hdr = (f"{'mode':>9} {'B':>3} {'hist':>6} {'plan':>6} {'ms':>8} {'wmma ms':>8} {'torch ms':>9} "
           f"{'TFLOP/s':>8} {'hist GB/s':>9} {'%peak':>6} {'x wmma':>7} {'rel err':>8} bitwise")
    print(hdr)
    for B, hist, cached in shapes:
        r = measure(B, hist, cached, with_ref=B * hist <= 60000, wmma=not args.no_wmma,
                    contiguous=args.contiguous)
        rows.append(r)
        print(f"{r['mode']:>9} {B:>3} {hist:>6} {r['plan']:>6} {r['ms']:>8.4f} {r['ms_wmma']:>8.4f} "
              f"{r.get('ms_torch', float('nan')):>9.3f} {r['tflops']:>8.1f} {r['hist_GBps']:>9.0f} "
              f"{r['pct_peak']:>6.1f} {r['ms_wmma'] / r['ms']:>7.1f} {r['rel_err']:>8.1e} "
              f"{r['split_eq_direct']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    c8, c1, r8 = rows[0], rows[1], rows[2]
    ok = all(r["rel_err"] < 1e-2 and r["split_eq_direct"] for r in rows)
    print(f"attention: cached b8 {c8['ms']:.3f} ms (target <= 0.15), cached b1 {c1['ms']:.3f} ms "
          f"(<= 0.05), recompute b8 {r8['tflops']:.0f} TFLOP/s (>= 300); "
          f"{'all checks passed' if ok else 'CHECK FAILED'}")


if __name__ == "__main__":
    main()
