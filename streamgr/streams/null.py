"""Transfers of a cache with no host tier (``cache.mode = "gpu-only"``): nothing is ever onloaded
or offloaded, so no pipeline threads, staging buffers or queues exist; asking one to move
bytes is a bug and says so."""

from __future__ import annotations

import queue

from .streams import ReadyHandles, StreamSet


class NullOnload:
    threaded = False
    bytes = 0

    def __init__(self, layers: int, streams: StreamSet) -> None:
        self.layers, self.streams = layers, streams
        self._ready = ReadyHandles(layers, streams)

    def submit(self, onload, after=None) -> ReadyHandles:
        if onload:
            raise RuntimeError("gpu-only cache asked to onload host chunks")
        return self._ready

    def close(self) -> None:
        pass


class NullOffload:
    threaded = False
    inflight = 0

    def __init__(self) -> None:
        self.completions: queue.SimpleQueue = queue.SimpleQueue()  # always empty

    def submit(self, jobs, after=None) -> None:
        if jobs:
            raise RuntimeError("gpu-only cache asked to offload device pages")

    def wait_idle(self, timeout: float | None = None) -> bool:
        return True

    def close(self, timeout: float | None = 60.0) -> bool:
        return True
