"""Whether code lets the GIL go: a thread counting in Python advances only while the GIL is
free, so its count across a call says whether the call released it. Code on the event loop must
not (getting the GIL back waits for whichever thread runs Python then, up to the switch
interval per release; docs/benchmarks.md, sessions 13-14)."""

from __future__ import annotations

import gc
import sys
import threading


def rounds_that_let_the_gil_go(call, rounds: int) -> list[int]:
    """``call(k)`` for k in range(rounds) beside a counting thread: each round's count. The
    switch interval is raised to 0.3 s for it: the other thread can then force a switch only
    after waiting that long, which rounds of milliseconds never reach even on a loaded machine
    (at 0.1 s, CI's parallel workers stretched them past it); a release still lets it run at
    once, and costs up to the interval to get the GIL back, so rounds stop after two did."""
    count, stop = [0], threading.Event()
    # Earlier tests' garbage (engines with threads, sockets) collected during a round runs
    # finalizers that let the GIL go (a join, a close): collected now, and no collection
    # while the rounds run (a suite run failed on two such rounds, session 15).
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()

    def spin():
        while not stop.is_set():
            count[0] += 1
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.3)
    th = threading.Thread(target=spin)
    th.start()
    try:
        advanced = []
        for k in range(rounds):
            c0 = count[0]
            call(k)
            advanced.append(count[0] - c0)
            if sum(1 for a in advanced if a) >= 2:
                break
    finally:
        stop.set()
        th.join()
        sys.setswitchinterval(old)
        if was_enabled:
            gc.enable()
    return advanced


def assert_keeps_the_gil(advanced: list[int]) -> None:
    # Only a forced switch (the other thread waited a whole interval) may interleave, once.
    assert sum(1 for a in advanced if a) <= 1, advanced
