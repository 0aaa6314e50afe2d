"""Zeroed global counters for kernels whose blocks meet through atomics (the selection's grid and
merge launches: blocks done, list slots reserved, a request's histogram), without a memset node
in every CUDA graph that replays them.

A kernel that takes its counters from ``zeroed`` leaves them zero when it completes (the block
that reads a counter last writes it back to zero). Eagerly each call gets a fresh
``torch.zeros`` (one fill kernel, as before). Under a ``Counters`` arena a captured graph gets
slices of one buffer zeroed once, before the capture, and outside the graphs' shared memory pool
(another plan's intermediates must never land on it); each of the graph's launches takes its own
slice, in call order, so the replays find them zero. On the H200 a fill node cost ~1.2 us of the
selection's 18 us at gen-ref's step 2 (docs/benchmarks.md, sessions 29 and 40).

The arena is sized by running the same calls once first (``sizing``: the warm-up a capture does
anyway), then ``allocate`` and ``serving`` around the capture. A call past the sized words gets
``torch.zeros`` (a fill node: correct, only slower). A replay that a device fault interrupts
leaves counters set, but such a fault also leaves the CUDA context unusable, so no later replay
of that graph runs. The active arena is per thread (captures run on the thread that owns them).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

_local = threading.local()
ALIGN = 4  # words: each slice starts on a 32-byte sector


class Counters:
    """One graph's counter words: ``need`` sized by a ``sizing`` pass, ``buf`` once allocated."""

    def __init__(self) -> None:
        self.need = 0
        self.buf: torch.Tensor | None = None
        self.at = 0
        self.overflow = 0  # calls that got a fill of their own under ``serving``
        self._mode = None

    def take(self, shape: tuple[int, ...], device) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= int(s)
        words = -(-n // ALIGN) * ALIGN
        if self._mode == "serving" and self.buf is not None and self.at + words <= len(self.buf) \
                and self.buf.device == _device(device):
            out = self.buf[self.at:self.at + n].view(shape)
            self.at += words
            return out
        if self._mode == "sizing":
            self.need += words
        else:
            self.overflow += 1
        return torch.zeros(shape, dtype=torch.int64, device=device)

    def allocate(self, device) -> None:
        """The sized words, zeroed now (call it outside any capture)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("Counters.allocate inside a CUDA graph capture")
        self.buf = torch.zeros(max(self.need, ALIGN), dtype=torch.int64, device=device)

    @contextmanager
    def _active(self, mode: str):
        prev = getattr(_local, "arena", None)
        _local.arena, self._mode, self.at = self, mode, 0
        try:
            yield self
        finally:
            _local.arena, self._mode = prev, None

    def sizing(self):
        """Calls inside count the words they take (and get fresh zeros)."""
        self.need = 0
        return self._active("sizing")

    def serving(self):
        """Calls inside take slices of ``buf`` in order (each entry starts from its first)."""
        return self._active("serving")


def _device(device) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def zeroed(shape: tuple[int, ...], device) -> torch.Tensor:
    """int64 counters, zero when the kernel starts; the kernel must leave them zero."""
    arena = getattr(_local, "arena", None)
    if arena is None:
        return torch.zeros(shape, dtype=torch.int64, device=device)
    return arena.take(shape, device)
