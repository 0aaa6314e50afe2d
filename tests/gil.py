"""Whether code lets the GIL go: a thread counting in Python advances only while the GIL is
free, so its count across a call says whether the call released it. Code on the event loop must
not (getting the GIL back waits for whichever thread runs Python then, up to the switch
interval per release; docs/benchmarks.md, sessions 13-14)."""

from __future__ import annotations

import sys
import threading


def rounds_that_let_the_gil_go(call, rounds: int) -> list[int]:
    """``call(k)`` for k in range(rounds) beside a counting thread: each round's count."""
    count, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.1)  # no forced switch within the ~10-50 ms measured (a release: one)
    th = threading.Thread(target=spin)
    th.start()
    try:
        advanced = []
        for k in range(rounds):
            c0 = count[0]
            call(k)
            advanced.append(count[0] - c0)
    finally:
        stop.set()
        th.join()
        sys.setswitchinterval(old)
    return advanced


def assert_keeps_the_gil(advanced: list[int]) -> None:
    # Only a forced switch (the other thread waited a whole interval) may interleave, once.
    assert sum(1 for a in advanced if a) <= 1, advanced
