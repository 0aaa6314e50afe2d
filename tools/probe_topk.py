"""Where the selection kernels' time goes: run ``bench_topk``'s shapes for Nsight Compute, and
summarize its per-source-line report.

1. On the GPU, each chosen shape's Numba selection runs twice, the second time inside an NVTX
   range named after the shape, so that ncu profiles only the warm launches::

    STREAMGR_NUMBA_LINEINFO=1 ncu --nvtx --nvtx-include "flat/" --section SourceCounters \\
        --page source --print-source cuda python3 tools/probe_topk.py flat > ncu_src.txt

   (``STREAMGR_NUMBA_LINEINFO=1`` keeps the kernels' source lines; without ``--page source``
   ncu prints its sections, e.g. ``--section SpeedOfLight`` for each kernel's duration.)
2. Anywhere: ``python3 tools/probe_topk.py --summarize ncu_src.txt [--top 14]`` prints, per
   kernel, the source lines with the most warp-stall samples (their share of the kernel's
   samples, and instructions executed). Numba attributes inlined device functions loosely (a
   kernel's own ``def`` or first lines often carry its inlined callees' samples).

3. On the GPU, ``python3 tools/probe_topk.py --timeline [shapes]``: the kernels compiled with
   phase stamps (``STREAMGR_NUMBA_STAMP``: thread 0's SM clock at each phase boundary, the
   global timer at the kernel's start and end), then per shape and kind of block (one-block
   requests; a merge's listing blocks and last blocks) each phase's median and slowest block in
   us, and the launch's span from its first block's start to its last block's end; for a pair
   of launches (the grid path) each one's span and the gap between them. ``--graph`` times the
   selection captured in a CUDA graph and replayed, as a decode plan runs it (eager, the gap
   holds Numba's host launch).

Shapes: ``s1`` (16 x 1 x 8,192, k 256), ``s2`` (16 x 256 x 177), ``s3`` (16 x 256 x 3),
``flat`` (1 x 256 x 8,192), ``s2b1024`` (16 x 1,024 x 177, k 1,024); all by default.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

SHAPES = {"s1": (16, 1, 8192, 256), "s2": (16, 256, 177, 256), "s3": (16, 256, 3, 256),
          "flat": (1, 256, 8192, 256), "s2b1024": (16, 1024, 177, 1024),
          "s3b1024": (16, 1024, 3, 1024), "s1b1024": (16, 1, 8192, 1024),
          "flatk": (1, 256, 8192, 1024)}
# a source row of ncu's "--page source --print-source cuda": line, source (60 wide), samples
ROW = re.compile(r"^(\d+)\s{2,}(.{1,60}?)\s{2,}([\d,.]+)\s+([\d,.]+)\s+([\d,.]+)\s+([\d,.]+)")


def summarize(text: str, top: int) -> list[str]:
    """The report's rows grouped by kernel (``Function Name:`` headers), the most sampled
    first."""
    kernels: dict[str, list[tuple[float, str, str, str]]] = {}
    name = None
    for line in text.splitlines():
        if line.startswith("Function Name:"):
            m = re.search(r"::(\w+)\[", line)
            name = m.group(1) if m else line[15:60]
            kernels.setdefault(name, [])
            continue
        m = ROW.match(line)
        if m and name is not None:
            kernels[name].append((float(m.group(3).replace(",", "")), m.group(1),
                                  m.group(2).strip(), m.group(6)))
    out = []
    for name, rows in kernels.items():
        total = sum(r[0] for r in rows) or 1.0
        out.append(f"{name}: {total:.0f} samples over {len(rows)} lines")
        for samples, line, src, instr in sorted(rows, reverse=True)[:top]:
            out.append(f"  {100 * samples / total:5.1f}%  L{line:>4}  {src}  (instructions "
                       f"{instr})")
    return out


def run(names: list[str]) -> None:
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_topk import DEV, level
    from streamgr.kernels import trie_topk as tt
    for name in names:
        R, B, F, k = SHAPES[name]
        case = level(R, B, F, seed=R + B + F + k)
        cap = torch.full((R,), k, device=DEV)
        tt.trie_topk(*case, k, cap, impl="numba")  # compiles
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(name)
        tt.trie_topk(*case, k, cap, impl="numba")
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


def timeline(names: list[str], reps: int, graph: bool = False) -> None:
    import os

    import torch
    buf = torch.zeros(8192 * 16, dtype=torch.int64, device="cuda")
    os.environ["STREAMGR_NUMBA_STAMP"] = str(buf.data_ptr())  # before any kernel module loads
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_topk import DEV, level
    from streamgr.kernels import numba_common as nc
    from streamgr.kernels import trie_topk as tt
    from streamgr.kernels.counters import Counters
    assert nc.STAMP == buf.data_ptr(), "a kernel module was imported before the stamp address"
    for name in names:
        R, B, F, k = SHAPES[name]
        case = level(R, B, F, seed=R + B + F + k)
        cap = torch.full((R,), k, device=DEV)
        call = lambda: tt.trie_topk(*case, k, cap, impl="numba")  # noqa: E731
        call()  # compiles
        if graph:  # as a decode plan replays it: the launches back to back, no host between
            counters = Counters()
            with counters.sizing():
                call()
            counters.allocate(DEV)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g), counters.serving():
                call()
            call = g.replay
        pairs = []  # (a run's stamped rows, which of them the second launch's)
        for _ in range(reps):
            buf.zero_()
            torch.cuda.synchronize()
            call()
            torch.cuda.synchronize()
            st = buf.view(-1, 16).cpu()
            on = st[:, 14] > 0
            pairs.append((st[on], on.nonzero().view(-1) >= nc.STAMP_SECOND))
        print(f"== {name} (R {R}, B {B}, F {F}, k {k}); {len(pairs[0][0])} blocks, {reps} runs"
              f"{', graph-replayed' if graph else ''}")
        for line in _phases([st for st, _ in pairs]) + _launches(pairs):
            print(line)


def _launches(pairs) -> list[str]:
    """Where a shape's selection is a pair of launches (the second's blocks stamp from
    ``STAMP_SECOND``): each launch's span (first start to last end, global timer) and the gap
    from the first's last end to the second's first start, medians over the runs whose every
    block stamped its end."""
    import torch
    first, gap, second = [], [], []
    for st, late in pairs:
        if not late.any() or late.all() or not (st[:, 15] > 0).all():
            continue
        a, b = st[~late], st[late]
        first.append((a[:, 15].max() - a[:, 14].min()).item() / 1e3)
        gap.append((b[:, 14].min() - a[:, 15].max()).item() / 1e3)
        second.append((b[:, 15].max() - b[:, 14].min()).item() / 1e3)
    if not first:
        return []
    med = lambda v: torch.tensor(v).median().item()  # noqa: E731
    return [f"  launches: first {med(first):.2f} us, gap {med(gap):.2f} us, second "
            f"{med(second):.2f} us (medians over {len(first)} runs)"]


def _phases(runs) -> list[str]:
    """Per kind of block (the set of slots it stamped), each phase's median and slowest us over
    blocks and runs (the clock's cycles over the timer's ns give its rate), and the span."""
    import torch
    kinds: dict[tuple, list] = {}
    spans = []
    for st in runs:
        if len(st) == 0:
            return ["  no stamps: this shape's kernels do not call stamp()"]
        if (st[:, 15] > 0).all():  # a span only where every block stamped its end
            spans.append((st[:, 15].max() - st[:, 14].min()).item() / 1e3)
        for row in st:
            if row[15] == 0:  # no end stamp: a path left unstamped
                kinds.setdefault(("unstamped end",), []).append(row)
                continue
            slots = tuple(int(s) for s in range(14) if row[s] != 0)
            kinds.setdefault(slots, []).append(row)
    out = [f"  launch span (first start -> last end): median {sorted(spans)[len(spans) // 2]:.2f} "
           f"us over {len(spans)} runs" if spans else
           "  launch span: no run whose every block stamped its end"]
    for slots, rows in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
        if slots == ("unstamped end",):
            out.append(f"  {len(rows)} block-runs ended on a path without an end stamp")
            continue
        t = torch.stack(rows).double()
        ghz = (t[:, 13] - t[:, 0]) / (t[:, 15] - t[:, 14]).clamp(min=1)
        out.append(f"  {len(rows)} block-runs stamping {list(slots)} (clock {ghz.median():.2f} "
                   f"GHz); whole block median {((t[:, 15] - t[:, 14]) / 1e3).median():.2f} us")
        for a, b in zip(slots, slots[1:]):
            us = (t[:, b] - t[:, a]) / ghz / 1e3
            out.append(f"    {a:>2} -> {b:>2}: median {us.median():6.2f} us, max {us.max():6.2f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shapes", nargs="*", help=f"of {', '.join(SHAPES)} (default: all)")
    ap.add_argument("--summarize", metavar="NCU_TXT")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--timeline", action="store_true", help="phase stamps (see 3. above)")
    ap.add_argument("--graph", action="store_true",
                    help="with --timeline: the selection captured in a CUDA graph and replayed")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    bad = [s for s in args.shapes if s not in SHAPES]
    if bad:
        ap.error(f"unknown shapes {bad}; choose from {list(SHAPES)}")
    if args.summarize:
        print("\n".join(summarize(Path(args.summarize).read_text(), args.top)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.timeline:
        timeline(args.shapes or list(SHAPES), args.reps, args.graph)
        return
    run(args.shapes or list(SHAPES))


if __name__ == "__main__":
    main()
