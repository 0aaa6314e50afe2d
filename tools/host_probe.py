"""How fast this host runs Python: a fixed loop in a function, timed (ms). The lent GPU machines
differ: in session 8 the same loop at module level (slower: global names) took 469 ms on one
and 263-283 ms on others (275 ms on the CPU machine, where this function takes ~130 ms), and a
rank batch's ~1 ms of host work before its graph launch scales with it, so benchmarks print it
beside their figures (docs/benchmarks.md).

    python3 tools/host_probe.py
"""

from __future__ import annotations

import time


def probe_ms(n: int = 3_000_000) -> float:
    """Milliseconds for ``n`` iterations of ``s += i * i`` (best of three)."""
    best = float("inf")
    for _ in range(3):
        t, s = time.perf_counter(), 0
        for i in range(n):
            s += i * i
        best = min(best, time.perf_counter() - t)
    return best * 1e3


if __name__ == "__main__":
    print(f"host probe: {probe_ms():.1f} ms (3M iterations of s += i * i, best of 3)")
