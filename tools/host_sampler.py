"""Where the host's Python time goes, across threads: a sampling profiler for the benches.

A daemon thread looks at every other thread's current frame every ``interval`` seconds
(``sys._current_frames``) and counts, per thread name, the innermost frame of the package's own
code (or the innermost frame, if none is ours) and each function on the stack (inclusive).
Threads parked in a wait (an event, a lock, a selector, a queue) are counted apart as
waiting, so the table shows where threads *run* (holding or wanting the GIL). Cheap enough to
leave on for a whole bench run (~1,000 samples/s); no dependencies.
"""

from __future__ import annotations

import collections
import sys
import threading

# Frames (function names) of a thread that is blocked, not computing.
_WAITS = {"wait", "_wait_for_tstate_lock", "select", "poll", "get", "synchronize", "acquire",
          "sleep", "_worker"}  # _worker: an idle pool thread, in SimpleQueue.get (C)


class DaemonSampler:
    """A daemon thread running ``body`` from ``with`` until the block ends (``_stop`` set)."""

    def __init__(self, name: str, body) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=body, name=name, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class HostSampler(DaemonSampler):
    def __init__(self, interval: float = 0.001) -> None:
        super().__init__("host-sampler", self._run)
        self.interval = interval
        self.leaf: collections.Counter = collections.Counter()
        self.inclusive: collections.Counter = collections.Counter()
        self.threads: collections.Counter = collections.Counter()
        self.samples = 0

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            self.samples += 1
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, str(ident)).split("_")[0]
                if frame.f_code.co_name in _WAITS:
                    self.threads[(name, "waiting")] += 1
                    continue
                self.threads[(name, "running")] += 1
                ours, seen = None, set()
                f = frame
                while f is not None:
                    code = f.f_code
                    key = (name, f"{code.co_name} ({code.co_filename.rsplit('/', 2)[-1]}:"
                                 f"{code.co_firstlineno})")
                    if key not in seen:
                        self.inclusive[key] += 1
                        seen.add(key)
                    if ours is None and "streamgr" in code.co_filename:
                        ours = (name, f"{code.co_name} ({code.co_filename.rsplit('/', 2)[-1]}:"
                                      f"{f.f_lineno})")
                    f = f.f_back
                self.leaf[ours or (name, f"{frame.f_code.co_name} "
                                         f"({frame.f_code.co_filename.rsplit('/', 1)[-1]})")] += 1

    def table(self, top: int = 25) -> str:
        n = max(self.samples, 1)
        lines = [f"host samples: {self.samples} ({self.interval * 1e3:g} ms apart); "
                 "% of samples per thread state:"]
        lines += [f"  {t:<22}{state:<9}{c / n:>7.1%}" for (t, state), c in self.threads.most_common()]
        lines.append("innermost streamgr line while running (% of samples):")
        lines += [f"  {t:<22}{c / n:>7.1%}  {where}" for (t, where), c in self.leaf.most_common(top)]
        lines.append("functions on the stack while running, inclusive (% of samples):")
        lines += [f"  {t:<22}{c / n:>7.1%}  {where}" for (t, where), c in
                  self.inclusive.most_common(top)]
        return "\n".join(lines)

