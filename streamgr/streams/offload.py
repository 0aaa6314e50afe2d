"""The offload pipeline: filled chunks of device pages -> host chunks, after the batch.

Per job, on the offload stream (after the compute stream's event of the batch that filled the
chunks): the gather kernel collects the pages into a transient device buffer, which is copied
to a pinned host buffer; a completion thread then waits for that copy, a worker moves the
data into the host chunk store, and the job is reported done. Transient buffers exist only
while a job is in flight, and the manager's offload quota bounds the tokens in flight. Nothing
here touches the cache metadata: completions are queued for the runner's own thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels import paged_kv
from ..kernels.pinned import PinnedPool
from .streams import StreamSet, threaded_transfers

log = logging.getLogger("streamgr.offload")


@dataclass(frozen=True)
class OffloadDone:
    """A finished offload job, as the runner's thread applies it to the cache metadata:
    ``ok`` False means nothing was persisted (the chunks go back, the job is retried later)."""
    job: object  # cache.OffloadJob
    ok: bool
    nbytes: int
    seconds: float  # submit to completion
    error: str | None = None


class OffloadPipeline:
    def __init__(self, stores, streams: StreamSet, workers: int = 2,
                 threaded: bool | None = None) -> None:
        self.stores, self.streams = stores, streams
        # Completed on the completion thread (CUDA), or inline on the CPU unless asked
        # (STREAMGR_THREADED_TRANSFERS=1, see OnloadPipeline).
        self.threaded = threaded_transfers(streams) if threaded is None else threaded
        self.completions: queue.SimpleQueue = queue.SimpleQueue()  # OffloadDone
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = ThreadPoolExecutor(workers, thread_name_prefix="streamgr-offload")
        self._inflight = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._complete, name="streamgr-offload-done",
                                        daemon=True)
        self._thread.start()
        self._ids = PinnedPool(torch.int64, 1 << 12)  # jobs' page ids on their way up
        self.fail_next = False  # tests: make the next job fail

    @property
    def inflight(self) -> int:
        return self._inflight

    def submit(self, jobs, after=None) -> None:
        s = self.streams
        for job in jobs:
            with self._lock:
                self._inflight += 1
            t0 = time.perf_counter()
            try:
                if self.fail_next:
                    self.fail_next = False
                    raise RuntimeError("injected offload fault")
                if after is not None:
                    s.offload.wait_event(after)
                with s.use(s.offload):
                    # Page ids from a pooled page-locked buffer: a pageable copy syncs the
                    # offload stream first, which waits for the latest batch's compute, and
                    # this runs on the executor thread between batches: it would hold the
                    # next batch's submit until the batch before it had computed.
                    ids = (self._ids.upload(np.asarray(job.page_ids, dtype=np.int64),
                                            self.stores.device) if s.cuda
                           else torch.tensor(job.page_ids, dtype=torch.long))
                    dev = paged_kv.offload_gather(self.stores.pages, ids, self.stores.chunk_pages)
                    nbytes = dev.numel() * dev.element_size()
                    if self.stores.host_registered:  # page-locked store: DMA into its chunks
                        host = None  # (no staging buffer, no host-side copy of 16 MiB chunks)
                        for i, c in enumerate(job.chunk_ids):
                            self.stores.host[c].copy_(dev[i], non_blocking=True)
                    else:
                        host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=s.cuda)
                        host.copy_(dev, non_blocking=True)
                    done = s.event()
                    done.record(s.offload)
                if self.threaded:
                    self._pending.put((job, dev, host, done, t0, nbytes))
                else:  # no DMA to overlap: finish on this thread (see OnloadPipeline.submit)
                    done.synchronize()
                    if host is not None:
                        self.stores.host.index_copy_(0, torch.tensor(job.chunk_ids), host)
                    self._finish(job, t0, nbytes)
            except Exception as err:  # noqa: BLE001 - the range stays unpersisted and is retried
                log.exception("offload of user %r failed to start", job.key)
                self._finish(job, t0, error=err)

    def close(self, timeout: float | None = 60.0) -> bool:
        """Stop the completion thread once the jobs in flight are done (it holds the stores),
        waiting at most ``timeout`` s for them: a hung transfer cannot hang the close. Returns
        whether every job finished (those that did not stay unpersisted)."""
        idle = self.wait_idle(timeout)
        if not idle:
            log.warning("offload: %d jobs still in flight after %s s; closing without them",
                        self._inflight, timeout)
        self._pending.put(None)
        self._thread.join(None if idle else 0.1)  # a daemon: left behind if it is stuck
        self._workers.shutdown(wait=idle, cancel_futures=not idle)
        return idle

    def _complete(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            job, dev, host, done, t0, nbytes = item
            try:
                done.synchronize()
                del dev  # the transient device buffer is free once the copy has landed
                if host is not None:  # staged: into the (pageable) store on a worker
                    chunk_ids = torch.tensor(job.chunk_ids, dtype=torch.long)
                    self._workers.submit(self.stores.host.index_copy_, 0, chunk_ids,
                                         host).result()
                self._finish(job, t0, nbytes)
            except Exception as err:  # noqa: BLE001
                log.exception("offload of user %r failed", job.key)
                self._finish(job, t0, error=err)

    def _finish(self, job, t0: float, nbytes: int = 0,
                error: Exception | None = None) -> None:
        """Report ``job``: persisted (``nbytes`` of it) or failed (``error``)."""
        nbytes = nbytes if error is None else 0
        self.completions.put(OffloadDone(job, error is None, nbytes, time.perf_counter() - t0,
                                         None if error is None else repr(error)))
        with self._lock:
            self._inflight -= 1
            self._idle.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)
