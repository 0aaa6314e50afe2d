"""Timing device work for the kernel benchmarks: ``reps`` back-to-back calls captured as one
CUDA graph and replayed, timed with CUDA events, the median over ``rounds`` (host launch time
stays out of the figure). If the capture fails the calls are timed eagerly, and it says so."""

from __future__ import annotations

import sys

import numpy as np
import torch


def graph_ms(fn, reps: int = 20, rounds: int = 7) -> float:
    """Median milliseconds of one ``fn()`` (run once first, outside the capture)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
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
