"""Timing device work for the kernel benchmarks: ``reps`` back-to-back calls captured as one
CUDA graph and replayed, timed with CUDA events, the median over ``rounds`` (host launch time
stays out of the figure). If the capture fails the calls are timed eagerly, and it says so.
The selection kernels' counters are the graph's own (``streamgr.kernels.counters``), as in the
decode plans, so no fill node is timed that serving does not run."""

from __future__ import annotations

import sys
from contextlib import nullcontext

import numpy as np
import torch

try:  # another tree's streamgr (A/B runs) may predate the counters
    from streamgr.kernels.counters import Counters
except ImportError:
    Counters = None


def graph_ms(fn, reps: int = 20, rounds: int = 7) -> float:
    """Median milliseconds of one ``fn()`` (run ``reps`` times first, outside the capture),
    with the selection kernels' counters a graph's own, as the decode plans capture them."""
    counters = Counters() if Counters else None
    with counters.sizing() if counters else nullcontext():
        for _ in range(reps):
            fn()
    torch.cuda.synchronize()
    if counters:
        counters.allocate(torch.cuda.current_device())
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph), counters.serving() if counters else nullcontext():
            for _ in range(reps):
                fn()
        run = graph.replay
    except Exception as err:  # eager timing then includes host launch time
        print(f"# graph capture failed ({err}); eager timing", file=sys.stderr)
        torch.cuda.synchronize()

        def run():
            for _ in range(reps):
                fn()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return float(np.median(times))
