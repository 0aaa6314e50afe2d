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

Shapes: ``s1`` (16 x 1 x 8,192, k 256), ``s2`` (16 x 256 x 177), ``s3`` (16 x 256 x 3),
``flat`` (1 x 256 x 8,192), ``s2b1024`` (16 x 1,024 x 177, k 1,024); all by default.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

SHAPES = {"s1": (16, 1, 8192, 256), "s2": (16, 256, 177, 256), "s3": (16, 256, 3, 256),
          "flat": (1, 256, 8192, 256), "s2b1024": (16, 1024, 177, 1024)}
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shapes", nargs="*", help=f"of {', '.join(SHAPES)} (default: all)")
    ap.add_argument("--summarize", metavar="NCU_TXT")
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args()
    bad = [s for s in args.shapes if s not in SHAPES]
    if bad:
        ap.error(f"unknown shapes {bad}; choose from {list(SHAPES)}")
    if args.summarize:
        print("\n".join(summarize(Path(args.summarize).read_text(), args.top)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    run(args.shapes or list(SHAPES))


if __name__ == "__main__":
    main()
