"""What every thread was doing while the event loop stalled: a watchdog for the benches.

The loop beats (``beat()``, from a coroutine that wakes every millisecond); a daemon thread
checks the beat every millisecond and, while it is more than ``over`` seconds old, snapshots
each thread's innermost frame and innermost frame of the package (``sys._current_frames``).
``report(stalls)`` then names, for the longest stalls, each thread's most common place during
it: a thread holding the GIL in a long C call shows where it is; the event loop shows where it
was parked. No dependencies.
"""

from __future__ import annotations

import collections
import sys
import threading
import time

from host_sampler import DaemonSampler  # tools/, beside this file


def _where(frame) -> str:
    inner = f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})"
    f = frame
    while f is not None and "streamgr" not in f.f_code.co_filename:
        f = f.f_back
    if f is None or f is frame:
        return inner
    return f"{inner} < {f.f_code.co_name} ({f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno})"


class StallWatch(DaemonSampler):
    def __init__(self, over: float = 0.008) -> None:
        super().__init__("stall-watch", self._run)
        self.over, self.snaps = over, []  # (time, {thread name: place})
        self._beat = time.perf_counter()

    def beat(self) -> None:
        self._beat = time.perf_counter()

    def _run(self) -> None:
        self.beat()  # (a watch built long before its ``with`` starts from now)
        me = threading.get_ident()
        while not self._stop.wait(0.001):
            now = time.perf_counter()
            if now - self._beat > self.over:
                names = {t.ident: t.name for t in threading.enumerate()}
                self.snaps.append((now, {names.get(i, str(i)): _where(f)
                                         for i, f in sys._current_frames().items() if i != me}))

    def report(self, stalls: list[tuple[float, float]], top: int = 4) -> str:
        """The ``top`` longest ``stalls`` ((start s, length s)), each thread's most common
        place among the snapshots taken during it."""
        lines = []
        for t0, lag in sorted(stalls, key=lambda s: -s[1])[:top]:
            snaps = [s for t, s in self.snaps if t0 <= t <= t0 + lag + 0.002]
            lines.append(f"stall {lag * 1e3:.1f} ms, {len(snaps)} snapshots:")
            for name in sorted({n for s in snaps for n in s}):
                place, n = collections.Counter(s[name] for s in snaps if name in s).most_common(1)[0]
                lines.append(f"  {name:<22} {n:>3}x {place}")
        return "\n".join(lines)
