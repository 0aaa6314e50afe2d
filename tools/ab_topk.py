"""A/B timing of the selection kernels: this tree's against other trees' (or A/B settings) in one
run, on the shapes of ``bench_topk`` and a few more, graph-replayed (``graph_timing``), every
row first checked equal to the stable reference, bit for bit.

    python3 tools/ab_topk.py s2 s2r48 s3b                       # this tree alone
    python3 tools/ab_topk.py --tree head=/tmp/head s2 s2r48     # and another tree's streamgr
    python3 tools/ab_topk.py --env kept0=STREAMGR_TOPK_KEPT=0 s2b s2r48

Each variant runs in a process of its own (the kernels' settings are read at import), the
variants alternating for ``--rounds`` rounds, so a machine's drift hits them alike; the table
gives each variant's range over the rounds and ``torch.topk`` on the same [R, B x F] grid.
Shapes (R requests, B beams, F fan-out, k): see ``SHAPES``; ``s2s`` ones have each request's
beam scores sorted best first, as a beam search hands them on. ``x``: the median ``torch.topk``
over this tree's fastest round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPES = {"s1": (16, 1, 8192, 256), "s1b": (16, 1, 8192, 1024), "s1r48": (48, 1, 8192, 256),
          "s2": (16, 256, 177, 256), "s2s": (16, 256, 177, 256), "s2r48": (48, 256, 177, 256),
          "s2sr48": (48, 256, 177, 256), "s2r40": (40, 256, 177, 256), "s2r24": (24, 256, 177, 256),
          "s3": (16, 256, 3, 256), "s3b": (16, 1024, 3, 1024),
          "flat": (1, 256, 8192, 256), "flatk": (1, 256, 8192, 1024),
          "s2b": (16, 1024, 177, 1024), "s2sb": (16, 1024, 177, 1024)}


def child(names: list[str]) -> None:
    """In a variant's process: each shape's (numba ms, torch.topk ms, equal) as JSON."""
    root = os.environ.get("AB_ROOT")
    if root:
        sys.path.insert(0, root)
    # this variant's streamgr imported first: bench_topk puts this repository's root at the
    # front of sys.path before it imports streamgr (until session 44 every --tree variant
    # ran this tree's package)
    import streamgr
    assert not root or Path(streamgr.__file__).resolve().is_relative_to(Path(root).resolve())
    sys.path.insert(0, str(HERE))
    import torch
    from bench_topk import DEV, against_topk, level
    out = {}
    for name in names:
        R, B, F, k = SHAPES[name]
        case = list(level(R, B, F, seed=R + B + F + k))
        if os.environ.get("AB_CODES"):  # the trie's codes in another dtype (int32, int16)
            case[4] = case[4].to(getattr(torch, os.environ["AB_CODES"]))
        if "s2s" in name:
            case[0] = case[0].sort(dim=1, descending=True).values
        out[name] = against_topk(case, k, torch.full((R,), k, device=DEV))
    print("AB " + json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--tree", action="append", default=[], metavar="TAG=PATH",
                    help="another tree whose streamgr package to time")
    ap.add_argument("--env", action="append", default=[], metavar="TAG=NAME=VALUE[,..]",
                    help="this tree with settings")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    bad = [s for s in args.shapes if s not in SHAPES]
    if bad:
        ap.error(f"unknown shapes {bad}; of {', '.join(SHAPES)}")
    if args.child:
        return child(args.shapes)
    variants = [("new", {})]
    for spec in args.tree:
        tag, path = spec.split("=", 1)
        variants.append((tag, {"AB_ROOT": str(Path(path).resolve())}))
    for spec in args.env:
        tag, sets = spec.split("=", 1)
        variants.append((tag, dict(kv.split("=", 1) for kv in sets.split(","))))
    runs: dict[str, list[dict]] = {tag: [] for tag, _ in variants}
    for rnd in range(args.rounds):
        for tag, env in variants:
            p = subprocess.run([sys.executable, __file__, "--child", *args.shapes],
                               env=dict(os.environ, **env), capture_output=True, text=True)
            line = [x for x in p.stdout.splitlines() if x.startswith("AB ")]
            if p.returncode != 0 or not line:
                print(f"# {tag} round {rnd}: failed\n{p.stderr[-2000:]}", flush=True)
                continue
            runs[tag].append(json.loads(line[0][3:]))
            print(f"# {tag} round {rnd} done", flush=True)
    print("| shape | " + " | ".join(f"{t} ms" for t, _ in variants) + " | torch.topk ms | x |")
    print("|---" * (len(variants) + 3) + "|")
    for name in args.shapes:
        cells, topk = [], []
        for tag, _ in variants:
            ts = [r[name] for r in runs[tag] if name in r]
            if not ts:
                cells.append("-")
                continue
            lo, hi = min(t[0] for t in ts), max(t[0] for t in ts)
            eq = "" if all(t[2] for t in ts) else " NOT EQUAL"
            cells.append((f"{lo:.4f}" if f"{lo:.4f}" == f"{hi:.4f}" else f"{lo:.4f}-{hi:.4f}")
                         + eq)
            topk += [t[1] for t in ts]
        new = [r[name][0] for r in runs["new"] if name in r]
        x = f"{sorted(topk)[len(topk) // 2] / min(new):.2f}" if new and topk else "-"
        tk = f"{sorted(topk)[len(topk) // 2]:.4f}" if topk else "-"
        print(f"| {name} {SHAPES[name]} | " + " | ".join(cells) + f" | {tk} | {x} |")


if __name__ == "__main__":
    main()
