"""Page-locked host buffers reused across batches: rank uploads and scores, the onload's and
offload's page ids, the attention plans' work items.

A pinned allocation per batch costs more than its copy: on the lent H200 a ~1 MB
``pin_memory()`` on the compute thread took 5.2-5.9 ms while a host hit's onload was issuing
copies (torch.profiler, session 21), and held the batch's first layer that long.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

from ..errors import StreamgrError
from . import _cuda


class PinnedPool:
    """Page-locked host buffers, reused: steady serving allocates no pinned memory per batch.
    A buffer given back with an event (a copy out of or into it still queued) is handed out
    again only once that event completed."""

    KEEP = 8  # buffers kept free at most (batches in flight are at most 4)

    def __init__(self, dtype: torch.dtype, min_elems: int) -> None:
        self.dtype, self.min_elems = dtype, min_elems
        self._free: list[tuple[torch.Tensor, object]] = []
        self._lock = threading.Lock()

    def take(self, n: int, pinned: bool = True) -> torch.Tensor:
        """The first free buffer of at least ``n`` elements whose copy is done, or a new one
        (a quarter larger: batch sizes vary)."""
        with self._lock:  # (by index: list.remove would compare tensors with ==)
            i = next((i for i, (b, ev) in enumerate(self._free)
                      if b.numel() >= n and (ev is None or ev.query())), None)
            if i is not None:
                return self._free.pop(i)[0]
        return torch.empty(max(n + n // 4, self.min_elems), dtype=self.dtype, pin_memory=pinned)

    def give_back(self, buf: torch.Tensor | None, event=None) -> None:
        if buf is not None:
            with self._lock:
                if len(self._free) < self.KEEP:  # else dropped (torch's host allocator frees
                    self._free.append((buf, event))  # it once its recorded copies are done)

    def upload(self, arr: np.ndarray, device: torch.device) -> torch.Tensor:
        """``arr`` on ``device`` through one of the pool's buffers: packed into it, copied on
        the current stream without blocking, the buffer given back with that copy's event."""
        buf = self.take(arr.size)
        host = buf[:arr.size].view(arr.shape)
        np.copyto(host.numpy(), arr)
        dev = to_device(host, device)
        done = torch.cuda.Event()
        done.record()
        self.give_back(buf, done)
        return dev


def upload_by_sm_default() -> bool:
    """``STREAMGR_UPLOAD_BY_SM`` (default 0): the rank path's uploads read from page-locked
    memory by a kernel (1) instead of copied by the copy engine (0). On the H200 a host hit's
    uploads waited behind onload copies issued before them whenever the onload started first
    (onload thread, ``early``: the first layer's compute 10 ms late); read by the SMs they did
    not (session 25). The default path queues the uploads first, so it is off."""
    raw = os.environ.get("STREAMGR_UPLOAD_BY_SM", "0")
    if raw not in ("0", "1"):
        raise StreamgrError(f"STREAMGR_UPLOAD_BY_SM={raw!r}: 0 (copy-engine uploads) or 1 "
                            "(read by a kernel)")
    return raw == "1"


UPLOAD_BY_SM = upload_by_sm_default()  # (the probe's ``smup`` flag sets it per batch)
_LINEAR = {16: "linear_copy<uint4>", 8: "linear_copy<uint2>", 4: "linear_copy<unsigned int>"}


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A contiguous page-locked ``host`` tensor on ``device``, queued on the current stream
    without blocking: a copy-engine copy, or with :data:`UPLOAD_BY_SM` a kernel reading it in
    place (:func:`read_host`). The caller keeps ``host`` unchanged until the copy is done."""
    if UPLOAD_BY_SM and _cuda.usable_on(device) and host.is_pinned():
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        read_host(out, host)
        return out
    return host.to(device, non_blocking=True)


def read_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src`` for a device ``dst`` and a page-locked host ``src`` (contiguous, one
    dtype and size) by ``cuda_kernels/block_copy.cu``'s ``linear_copy`` on the current stream,
    the widest unit both addresses and the size allow; else :func:`read_host_reference`."""
    if dst.dtype != src.dtype or dst.numel() != src.numel() or not dst.is_contiguous() \
            or not src.is_contiguous():
        raise StreamgrError("read_host: contiguous tensors of one dtype and size required")
    nbytes = dst.numel() * dst.element_size()
    unit = _cuda.widest_unit(nbytes, _LINEAR, dst, src)
    if nbytes == 0 or unit is None or not (_cuda.usable(dst) and src.is_pinned()):
        read_host_reference(dst, src)
        return
    fn = _cuda.kernel("block_copy.cu", tuple(_LINEAR.values()), _LINEAR[unit])
    n = nbytes // unit
    blocks = max(1, min(264, -(-n // 1024)))  # ~4 units a thread in flight, 256 threads
    _cuda.launch(fn, (blocks,), (256,), (np.uint64(dst.data_ptr()), np.uint64(src.data_ptr()),
                                         np.int64(n)))


def read_host_reference(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The torch reference of :func:`read_host`: a copy on the current stream."""
    dst.copy_(src, non_blocking=True)


def raw_h2d():
    """``copy(dst, src, nbytes, stream)``: ``cudaMemcpyAsync`` host-to-device on raw pointers and
    a raw stream handle (CuPy's runtime binding), or None where CuPy is unavailable, the torch
    kernels are forced, or ``STREAMGR_ONLOAD_RAW=0`` (A/B runs). For a thread issuing hundreds
    of copies between views of long-lived buffers beside the forward's launches: one short C
    call a copy instead of a torch ``copy_`` (argument parsing, dispatch, views), so it holds
    the GIL far less. The caller owns lifetimes and ordering: both buffers must outlive the
    copy, and the source must be page-locked for the copy to be asynchronous."""
    if _cuda.FORCE_TORCH or os.environ.get("STREAMGR_ONLOAD_RAW", "1") == "0":
        return None
    cp = _cuda._cupy()
    if cp is None:
        return None
    rt = cp.cuda.runtime
    kind = rt.memcpyHostToDevice

    def copy(dst: int, src: int, nbytes: int, stream: int) -> None:
        rt.memcpyAsync(dst, src, nbytes, kind, stream)
    return copy
