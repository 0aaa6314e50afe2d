"""The CUDA stream set of the cached rank path, per-layer onload handles, and CPU stand-ins.

Streams (MTServe section 4.4): ``compute`` (the model), ``onload`` (host -> device copies of
cached K/V), ``scatter`` (onload buffer -> device pages), ``offload`` (device pages -> host).
Dependencies between them are CUDA events, never a device-wide synchronize. Without a GPU the
same code runs: streams are no-op contexts and events are always complete.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time

import torch


class NullEvent:
    """An event on the CPU: work is synchronous, so it is complete once recorded."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: "NullEvent") -> float:
        return 0.0


class NullStream:
    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None):
        return event or NullEvent()

    def synchronize(self) -> None:
        pass


class StreamSet:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            # The batch's own work (compute, and the onload it waits for) at high priority;
            # offload runs after the replies, beside the next batch, at the default one: the
            # block scheduler then serves the batch on the critical path first.
            self.compute, self.onload, self.scatter = (
                torch.cuda.Stream(device, priority=-1) for _ in range(3))
            self.offload = torch.cuda.Stream(device)
        else:
            self.compute = self.onload = self.scatter = self.offload = NullStream()

    def event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing) if self.cuda else NullEvent()

    def use(self, stream):
        """Make ``stream`` current (torch allocations and kernels then go to it)."""
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def fence_transfers(self) -> None:
        """Device work issued to ``compute`` from now on waits for every onload copy and
        scatter issued so far: pages an aborted batch was onloading can then be reused
        without a stale scatter landing in them after their new owner's writes."""
        self.compute.wait_stream(self.onload)
        self.compute.wait_stream(self.scatter)


def threaded_transfers(streams: "StreamSet") -> bool:
    """Onload/offload on their threads: on CUDA, or when ``STREAMGR_THREADED_TRANSFERS=1``
    (``=0`` turns them inline even on CUDA, for A/B runs)."""
    flag = os.environ.get("STREAMGR_THREADED_TRANSFERS", "")
    return streams.cuda if flag not in ("0", "1") else flag == "1"


@functools.lru_cache(maxsize=None)
def _build_stream(index: int) -> "torch.cuda.Stream":
    return torch.cuda.Stream(device=index)


def off_stream(device, fn, *args):
    """``fn(*args)`` with its device work on a side stream of its own, finished before this
    returns: for builds on a worker thread beside serving (a live update's weights moved to
    the GPU, a trie's tables, its plans' warm-up searches). On the legacy default stream, which
    the executor's batches use, each of those copies (hundreds of MB, pageable) and searches
    would queue between two batches and hold up every request behind them.
    ``STREAMGR_BUILD_STREAM=0`` keeps them on the default stream (A/B benchmarks). One side
    stream per device for every build: memory a build allocated returns, once freed, to that
    stream's pool in the caching allocator, where the next build (the next refit's weights)
    takes it again; a new stream per build (torch hands out 32 in turn) left each refit's
    freed ~170 MB (gen-ref) in another stream's pool and allocated afresh."""
    if getattr(device, "type", "cpu") != "cuda" or os.environ.get("STREAMGR_BUILD_STREAM") == "0":
        return fn(*args)
    index = torch.device(device).index
    side = _build_stream(torch.cuda.current_device() if index is None else index)
    with torch.cuda.stream(side):
        out = fn(*args)
    side.synchronize()  # this (worker) thread waits; the batches' stream never does
    return out


# How long the compute thread waits for a layer's onload copies to be issued, and a failed batch
# for its onload thread to stop, before calling the transfer hung (read at call time).
TRANSFER_TIMEOUT_S = 60.0


class OnloadFault(RuntimeError):
    """A host-to-device transfer (or its pinned staging) failed for these users."""

    def __init__(self, users: set, cause: BaseException) -> None:
        super().__init__(f"onload failed for {len(users)} user(s): {cause!r}")
        self.users, self.cause = users, cause


class LayerOnloadHandles:
    """Per layer: a host flag set once the layer's copies and scatter are *issued*, and the CUDA
    event that completes when they have *landed*. Layer ``l`` of the model waits on its own
    event only, so shallow layers compute while deep layers' K/V still cross PCIe."""

    def __init__(self, layers: int, streams: StreamSet, users: set) -> None:
        self.streams = streams
        self.users = users
        self.issued = [threading.Event() for _ in range(layers)]
        self.ready = [streams.event() for _ in range(layers)]
        self.error: BaseException | None = None
        # An inline onload's issuer (``onload._InlinePump``): the waits drive it from the
        # model's thread; None where a transfer thread issues the copies.
        self.pump = None

    def fail(self, err: BaseException) -> None:
        self.error = err
        for e in self.issued:
            e.set()

    def wait(self, layer: int) -> None:
        """Make the compute stream wait for ``layer``'s K/V (blocks the host only until the
        copies are issued, never until they land)."""
        if self.pump is not None:
            self.pump(layer)
        self._raise_if_failed(self.issued[layer].wait(TRANSFER_TIMEOUT_S), f"layer {layer}'s onload")
        self.streams.compute.wait_event(self.ready[layer])

    def settle(self, timeout: float | None = None) -> bool:
        """Wait (host) until the transfer thread has issued or given up every layer, without
        raising; False if that took longer than ``timeout`` s (default ``TRANSFER_TIMEOUT_S``;
        the thread may still issue copies)."""
        if self.pump is not None:  # issued from this thread: nothing more will be
            self.pump(None)
        timeout = TRANSFER_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + timeout
        for e in self.issued:
            if not e.wait(max(0.0, deadline - time.monotonic())):
                return False
        return True

    def done(self) -> None:
        """Wait (host) until every layer is issued; raise if the transfer failed or hung."""
        if self.pump is not None:
            self.pump(len(self.issued) - 1)
        self._raise_if_failed(self.settle(), "onload")

    def _raise_if_failed(self, issued: bool, what: str) -> None:
        if not issued:
            raise OnloadFault(self.users, TimeoutError(
                f"{what} not issued within {TRANSFER_TIMEOUT_S} s"))
        if self.error is not None:
            raise OnloadFault(self.users, self.error)


class ReadyHandles(LayerOnloadHandles):
    """Handles of a batch with nothing to onload. Nothing ever records its events or fails
    it, so one instance serves every such batch of a pipeline."""

    def __init__(self, layers: int, streams: StreamSet) -> None:
        super().__init__(layers, streams, set())
        for e in self.issued:
            e.set()
