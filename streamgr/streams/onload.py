"""The onload pipeline: host chunks -> pinned double buffers -> device onload buffer -> pages.

Transfers go layer-major (every chunk's layer 0 first, then layer 1, ...) so each layer's
event fires as early as possible. A staging buffer holds one chunk's worth of data (all layers
of one chunk, as MTServe aligns it); two of them ping-pong: a pool of worker threads fills one
with the next slices (plain memcpy from the host store) while the DMA engine drains the other
on the onload stream. After a layer's slices have landed, the scatter stream moves them from
the onload buffer into the users' pages and records that layer's event. The staged path runs
on an onload thread, so the model starts computing embeddings (and shallow layers) at once.
From a page-locked host store (GPU specs) the copies go straight from it with no staging, and
by default from the batch's own thread (``onload_inline``): submitted once the batch's own
uploads are queued (host-to-device copies of every stream share the copy engine in issue
order: the batch's small uploads must not wait behind its onload), then issued a few layers
ahead of the layer the model waits for, driven by those waits. On the onload thread instead
(``STREAMGR_ONLOAD_INLINE=0``), at most a window of them is in flight
(``onload_window_bytes``), for the same reason.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque

import numpy as np
from concurrent.futures import ThreadPoolExecutor

import torch

from ..errors import StreamgrError
from ..kernels import paged_kv
from ..kernels.pinned import PinnedPool, raw_h2d
from .streams import LayerOnloadHandles, ReadyHandles, StreamSet, threaded_transfers

log = logging.getLogger("streamgr.onload")


def onload_layer_group(layers: int) -> int:
    """Layers per host-to-device copy of a chunk from the page-locked store. 1 (the default):
    MTServe's layer-major order, each layer's event as early as possible. More (an A/B knob,
    ``STREAMGR_ONLOAD_LAYERS``): fewer, larger copies issued from Python, the layers of a group
    landing together; worth it only where the transfer, not compute, bounds a host-hit batch."""
    raw = os.environ.get("STREAMGR_ONLOAD_LAYERS", "1")
    if not raw.isdigit() or not 1 <= int(raw) <= layers:
        raise StreamgrError(f"STREAMGR_ONLOAD_LAYERS={raw!r}: layers per onload copy, 1 to "
                            f"{layers}")
    return int(raw)


def onload_inline() -> bool:
    """The direct path's copies issued from the batch's own thread, a few layers ahead of the
    layer the model is about to attend (``STREAMGR_ONLOAD_INLINE``, default 1; 0: from the
    onload thread, paced by a window, for A/B runs). Why: a second Python thread issuing copies
    beside the eager forward competed with it for the GIL (H200, session 22: the forward's
    host issue took 13.2 ms a host-hit batch with the thread against 8.9 with no onload, and
    the thread's first copy came ~2 ms after the batch handed it the job)."""
    raw = os.environ.get("STREAMGR_ONLOAD_INLINE", "1")
    if raw not in ("0", "1"):
        raise StreamgrError(f"STREAMGR_ONLOAD_INLINE={raw!r}: 1 (copies from the batch's "
                            f"thread) or 0 (from the onload thread)")
    return raw == "1"


# Layers whose copies an inline onload keeps issued ahead of the one the model waits for: the
# copy engine stays busy while the host issues the next layers' kernels.
INLINE_AHEAD = 2


def onload_window_bytes() -> int:
    """Bytes of onload copies in flight at most (``STREAMGR_ONLOAD_WINDOW_MB``, default 32; 0:
    no limit). Host-to-device copies from every stream share the copy engine in issue order
    (H200, session 21: a batch's attention plan, issued on the compute stream after a host
    hit's onload had queued ~900 MB, landed behind all of it, and the model waited ~12 ms).
    Paced this way, the batch's own uploads wait behind at most the window (~0.7 ms at 48
    GB/s), and the onload can still start before them."""
    raw = os.environ.get("STREAMGR_ONLOAD_WINDOW_MB", "32")
    if not raw.isdigit():
        raise StreamgrError(f"STREAMGR_ONLOAD_WINDOW_MB={raw!r}: megabytes of onload copies "
                            f"in flight at most (0: no limit)")
    return int(raw) << 20


class OnloadPipeline:
    def __init__(self, stores, streams: StreamSet, workers: int | None = None,
                 staging_chunks: int = 4, threaded: bool | None = None) -> None:
        workers = workers or min(16, os.cpu_count() or 4)
        self.stores, self.streams = stores, streams
        self.layers = stores.layers
        self._ready = ReadyHandles(self.layers, streams)  # every batch with nothing to onload
        host = stores.host
        self.slice_shape = tuple(host.shape[2:]) if host is not None else ()  # one chunk, one layer
        self.pin = streams.cuda
        # On its own thread (CUDA: overlaps the DMA with compute); inline on the CPU unless
        # asked (STREAMGR_THREADED_TRANSFERS=1: the CPU tests run the threaded path too).
        self.threaded = threaded_transfers(streams) if threaded is None else threaded
        self.staging_chunks = staging_chunks
        self.layer_group = onload_layer_group(self.layers)
        self.window_bytes = onload_window_bytes()
        self.inline = onload_inline()
        # The direct path's copies as raw cudaMemcpyAsync calls (CUDA with CuPy; None: torch's
        # copy_ between views): the issuing thread holds the GIL a few microseconds a copy.
        self.raw_copy = raw_h2d() if streams.cuda else None
        self._ids = PinnedPool(torch.int64, 1 << 14)  # page ids, one buffer a batch in flight
        self._staging: list[torch.Tensor] | None = None
        self._copied = [streams.event(), streams.event()]  # staging buffer i drained by the DMA
        self._workers = ThreadPoolExecutor(workers, thread_name_prefix="streamgr-onload-fill")
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="streamgr-onload")
        self._buffer: torch.Tensor | None = None  # device onload buffer, grown on demand
        self._last_scatter = streams.event()  # the previous batch's scatter: the buffer is free after
        self.bytes = 0
        self.delay_layers: dict[int, float] = {}  # tests: hold back these layers' copies (s)
        self.fail_next = False  # tests: make the next transfer fail
        self.trace_events: dict | None = None  # tests: {"landed_<layer>": timing event}

    def _staging_buffers(self) -> list[torch.Tensor]:
        if self._staging is None:
            n = self.layers * self.staging_chunks  # `layers` slices = one chunk, all layers
            self._staging = [torch.empty((n, *self.slice_shape), dtype=self.stores.host.dtype,
                                         pin_memory=self.streams.cuda) for _ in range(2)]
        return self._staging

    def _device_buffer(self, n_chunks: int) -> torch.Tensor:
        shape = (n_chunks, self.layers, *self.slice_shape)
        if self._buffer is None or self._buffer.shape[0] < n_chunks:
            with self.streams.use(self.streams.onload):
                self._buffer = torch.empty(shape, dtype=self.stores.pages.dtype,
                                           device=self.stores.device)
        return self._buffer[:n_chunks]

    @property
    def deferred(self) -> bool:
        """``submit`` issues the copies from the caller's thread as the model asks for layers
        (:func:`onload_inline`, the page-locked store's direct path): the caller submits once
        the batch's own uploads are queued, so they never wait behind the onload on the copy
        engine, and no window is needed."""
        host = self.stores.host
        return self.inline and self.pin and host is not None and host.is_pinned()

    def submit(self, onload: list[tuple[object, list[int], list[int]]],
               after=None) -> LayerOnloadHandles:
        """Start onloading ``[(user, chunk ids, page ids)]``; ``after``: an event the scatter must
        wait for (the previous batch's compute, which may still read pages being reused)."""
        if not onload:
            return self._ready
        handles = LayerOnloadHandles(self.layers, self.streams, {u for u, _, _ in onload})
        if self.deferred:
            handles.pump = _InlinePump(self, onload, after, handles)
            handles.pump(0)
            return handles
        if self.threaded:
            self._thread.submit(self._run, onload, after, handles)
        else:
            # Without a DMA engine there is nothing to overlap, and a second thread's torch ops
            # (with their own spinning OpenMP team) would only slow the compute thread down.
            self._run(onload, after, handles)
        return handles

    def _run(self, onload, after, handles: LayerOnloadHandles) -> None:
        try:
            self._transfer(onload, after, handles)
        except BaseException as err:  # noqa: BLE001 - the batch falls back to recompute
            log.exception("onload failed")
            handles.fail(err)

    def _begin(self, onload, after):
        """(chunks, device buffer, page ids on the device) of a batch's onload, its streams
        ordered behind the previous onload's scatter and ``after``."""
        s = self.streams
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected onload fault")
        chunks = [c for _, cs, _ in onload for c in cs]
        ids = np.fromiter((p for _, _, ps in onload for p in ps), dtype=np.int64)
        buf = self._device_buffer(len(chunks))
        s.onload.wait_event(self._last_scatter)  # the buffer's previous contents were scattered
        if after is not None:
            s.scatter.wait_event(after)
        with s.use(s.scatter):
            # From a pooled page-locked buffer on CUDA: a pageable copy syncs its stream first
            # (the scatter stream waits for the previous batch's compute: this thread would
            # stall on it before issuing any copy), and a pinned allocation per batch is slow.
            page_ids = (self._ids.upload(ids, self.stores.device) if s.cuda
                        else torch.from_numpy(ids))
        return chunks, buf, page_ids

    def _transfer(self, onload, after, handles: LayerOnloadHandles) -> None:
        chunks, buf, page_ids = self._begin(onload, after)
        s = self.streams
        host = self.stores.host
        if self.pin and host.is_pinned():  # a pinned host store needs no staging: DMA from it
            self._direct(chunks, buf, page_ids, handles)
            return
        units = [(l, i) for l in range(self.layers) for i in range(len(chunks))]
        staging = self._staging_buffers()  # (only this path stages)
        per = self.layers * self.staging_chunks  # slices per staging buffer
        # numpy views: np.copyto is a plain memcpy that releases the GIL (bf16 seen as int16).
        host_np = host.view(torch.int16).numpy()
        stage_np = [st.view(torch.int16).numpy() for st in staging]
        delayed: set[int] = set()
        for g0 in range(0, len(units), per):
            group = units[g0:g0 + per]
            for l in sorted({l for l, _ in group} - delayed):
                if self.delay_layers.get(l):
                    delayed.add(l)
                    time.sleep(self.delay_layers[l])
            which = (g0 // per) % 2
            stage = staging[which]
            self._copied[which].synchronize()  # the DMA finished reading this buffer
            # Workers fill the staging buffer; the other one is meanwhile being drained.
            dst_np = stage_np[which]
            fill = lambda j: np.copyto(dst_np[j], host_np[chunks[group[j][1]], group[j][0]])  # noqa: E731
            if s.cuda:
                list(self._workers.map(fill, range(len(group))))
            else:
                for j in range(len(group)):
                    fill(j)
            with s.use(s.onload):
                for j, (l, i) in enumerate(group):
                    buf[i, l].copy_(stage[j], non_blocking=True)
                    self.bytes += stage[j].numel() * stage[j].element_size()
                self._copied[which].record(s.onload)
            # Layers whose last slice is in this group are complete: scatter them.
            for l in sorted({l for l, i in group if i == len(chunks) - 1}):
                self._layer_landed(l, buf, page_ids, handles)
        self._last_scatter = handles.ready[-1]

    def _direct(self, chunks, buf, page_ids, handles) -> None:
        """DMA from the page-locked store, ``layer_group`` layers of a chunk per copy (they are
        contiguous in a chunk): layer-major by default, so the first layers land first."""
        s = self.streams
        pace = _Window(self.window_bytes if s.cuda else 0, s)
        with s.use(s.onload):
            copy, layer_bytes = self._direct_start(chunks, buf)
            for l0 in range(0, self.layers, self.layer_group):
                self._issue_group(copy, l0, len(chunks), layer_bytes, buf, page_ids, handles,
                                  pace)
        self._last_scatter = handles.ready[-1]

    def _issue_group(self, copy, l0: int, n: int, layer_bytes: int, buf, page_ids, handles,
                     pace: "_Window | None" = None) -> int:
        """The direct path's layer group from ``l0``: each of the ``n`` chunks' copies (paced
        by ``pace``), then each of its layers signalled; returns the next group's layer."""
        g, L = self.layer_group, self.layers
        if self.delay_layers.get(l0):
            time.sleep(self.delay_layers[l0])
        nb = min(g, L - l0) * layer_bytes
        for i in range(n):
            if pace is not None:
                pace.before(nb)
            copy(i, l0, nb)
            if pace is not None:
                pace.after(nb)
            self.bytes += nb
        for j in range(l0, min(l0 + g, L)):
            self._layer_landed(j, buf, page_ids, handles)
        return l0 + g

    def _direct_start(self, chunks, buf):
        """(``copy``, bytes of one layer of a chunk) for the direct path's copies of ``chunks``
        into ``buf``; the onload's start marked for a trace."""
        s = self.streams
        layer_bytes = int(np.prod(self.slice_shape)) * self.stores.host.element_size()
        if self.trace_events is not None:
            self.trace_events["onload_start"] = s.onload.record_event(s.event(timing=True))
            self.trace_events["host_onload_start"] = time.perf_counter()
        return self._chunk_copier(chunks, buf, layer_bytes), layer_bytes

    def _chunk_copier(self, chunks, buf, layer_bytes: int):
        """``copy(i, l, n)``: ``n`` bytes of chunk ``chunks[i]`` from layer ``l`` on, store to
        ``buf[i]``, on the current (onload) stream. Raw ``cudaMemcpyAsync`` on pointers where
        both are contiguous (the onload moved 33-36 GB/s beside an eager recompute with torch
        copies, 44-48 GB/s alone, H200 session 21: its thread waited for the GIL between
        copies while the forward's thread launched kernels); else torch copies between each
        chunk's layer-group views, made at its first copy and reused."""
        host, raw, g = self.stores.host, self.raw_copy, self.layer_group
        if raw is not None and host.is_contiguous() and buf.is_contiguous():
            src_at = [host.data_ptr() + c * host.stride(0) * host.element_size() for c in chunks]
            dst0, dst_step = buf.data_ptr(), buf.stride(0) * buf.element_size()
            stream = getattr(self.streams.onload, "cuda_stream", 0)  # (0: a test's CPU copier)

            def copy(i: int, l: int, n: int) -> None:
                try:
                    raw(dst0 + i * dst_step + l * layer_bytes, src_at[i] + l * layer_bytes, n,
                        stream)
                except Exception as err:
                    # This batch's onload fails (its users are recomputed, still right); later
                    # batches copy through torch instead of failing the same way.
                    log.warning("onload: raw cudaMemcpyAsync failed (%s); torch copies from "
                                "now on", err)
                    self.raw_copy = None
                    raise
            return copy
        src: list = [None] * len(chunks)
        dst: list = [None] * len(chunks)

        def copy(i: int, l: int, n: int) -> None:
            if src[i] is None:
                src[i], dst[i] = host[chunks[i]].split(g), buf[i].split(g)
            dst[i][l // g].copy_(src[i][l // g], non_blocking=True)
        return copy

    def _layer_landed(self, l: int, buf, page_ids, handles) -> None:
        """Layer ``l``'s copies are all issued: scatter them once landed; signal the layer."""
        s = self.streams
        landed = s.event(timing=self.trace_events is not None)
        landed.record(s.onload)
        if self.trace_events is not None:
            self.trace_events[f"landed_{l}"] = landed
        s.scatter.wait_event(landed)
        with s.use(s.scatter):
            paged_kv.onload_scatter(self.stores.pages, l, buf, page_ids)
        handles.ready[l].record(s.scatter)
        if self.trace_events is not None:
            self.trace_events[f"scattered_{l}"] = s.scatter.record_event(s.event(timing=True))
        handles.issued[l].set()

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self._workers.shutdown(wait=True)


class _InlinePump:
    """An inline onload's issuer (``OnloadPipeline.deferred``). ``pump(layer)``: the direct
    path's copies through layer ``layer + INLINE_AHEAD`` issued from the calling thread (those
    not issued yet), each finished layer's scatter and event after them; ``pump(None)``: stop,
    issuing nothing more (a failed batch). A failure fails the handles: the model's wait
    raises ``OnloadFault`` and the batch is recomputed."""

    def __init__(self, pipe: OnloadPipeline, onload, after, handles: LayerOnloadHandles):
        self.pipe, self.onload, self.after, self.handles = pipe, onload, after, handles
        self.next = 0  # the next layer to issue
        self.copy = None  # the chunk copier, made at the first call

    def __call__(self, layer: int | None) -> None:
        pipe, h = self.pipe, self.handles
        s, L = pipe.streams, pipe.layers
        if h.error is not None or self.next >= L:
            return
        if layer is None:
            pipe._last_scatter = s.scatter.record_event(s.event())  # what was issued
            h.fail(RuntimeError("onload abandoned with its batch"))
            return
        try:
            if self.copy is None:
                self._start()
            with s.use(s.onload):
                while self.next <= min(L - 1, layer + INLINE_AHEAD):
                    self.next = pipe._issue_group(self.copy, self.next, self.n, self.layer_bytes,
                                                  self.buf, self.page_ids, h)
            if self.next >= L:
                pipe._last_scatter = h.ready[-1]
        except BaseException as err:  # noqa: BLE001 - the batch falls back to recompute
            log.exception("onload failed")
            pipe._last_scatter = s.scatter.record_event(s.event())
            h.fail(err)

    def _start(self) -> None:
        chunks, self.buf, self.page_ids = self.pipe._begin(self.onload, self.after)
        self.n = len(chunks)
        self.copy, self.layer_bytes = self.pipe._direct_start(chunks, self.buf)


class _Window:
    """At most ``limit`` bytes of copies issued to the onload stream and not yet landed
    (:func:`onload_window_bytes`): an event every quarter window marks the bytes before it;
    the issuing thread waits (GIL released) for the oldest mark when the next copy would
    overflow. ``limit`` 0: no pacing."""

    def __init__(self, limit: int, streams: StreamSet) -> None:
        self.limit, self.streams = limit, streams
        self.issued = self.landed = self.marked = 0
        self.marks: deque = deque()  # (event, bytes issued before it)

    def before(self, n: int) -> None:
        while self.limit and self.marks and self.issued + n - self.landed > self.limit:
            event, upto = self.marks.popleft()
            event.synchronize()
            self.landed = upto

    def after(self, n: int) -> None:
        self.issued += n
        if self.limit and self.issued - self.marked >= self.limit // 4:
            self.marks.append((self.streams.onload.record_event(self.streams.event()),
                               self.issued))
            self.marked = self.issued
