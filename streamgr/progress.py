"""A dependency-free progress bar on stderr for long work (replays, demos, conversions).

On a terminal it redraws one line; elsewhere (CI logs, pipes) it prints a line every 10%.
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int | None, label: str, stream=None, min_interval: float = 0.2,
                 enabled: bool = True) -> None:
        self.total, self.label = total, label
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.enabled = enabled
        self.n = 0
        self.t0 = time.monotonic()
        self._last = 0.0
        self._last_decile = -1
        self.min_interval = min_interval

    def update(self, n: int = 1) -> None:
        self.n += n
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            if now - self._last >= self.min_interval:
                self._last = now
                self.stream.write("\r" + self._line(now))
                self.stream.flush()
        elif self.total:
            decile = int(10 * self.n / self.total)
            if decile != self._last_decile:
                self._last_decile = decile
                self.stream.write(self._line(now) + "\n")
                self.stream.flush()

    def _line(self, now: float) -> str:
        rate = self.n / max(now - self.t0, 1e-9)
        if self.total:
            frac = min(self.n / self.total, 1.0)
            bar = "#" * int(24 * frac) + "-" * (24 - int(24 * frac))
            eta = (self.total - self.n) / rate if rate > 0 else 0.0
            return f"{self.label} [{bar}] {self.n}/{self.total} {rate:,.0f}/s eta {eta:.0f}s"
        return f"{self.label} {self.n:,} {rate:,.0f}/s"

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\r" + self._line(time.monotonic()) + "\n")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
