"""kernels/pinned.py: pooled page-locked buffers hand a buffer out again only once the copy
given back with it is done, and ``upload`` puts an array on the device through them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamgr.kernels.pinned import PinnedPool


class _Event:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_a_buffer_comes_back_only_once_its_copy_is_done():
    pool = PinnedPool(torch.int64, 16)
    a = pool.take(10, pinned=False)
    assert a.numel() >= 16  # the floor
    busy = _Event(False)
    pool.give_back(a, busy)
    b = pool.take(10, pinned=False)
    assert b.data_ptr() != a.data_ptr()  # a's copy still queued: a new buffer
    busy.done = True
    assert pool.take(10, pinned=False).data_ptr() == a.data_ptr()
    pool.give_back(b)  # no event: free at once
    big = pool.take(1000, pinned=False)  # b is too small for it
    assert big.numel() >= 1000 and big.data_ptr() != b.data_ptr()
    for _ in range(3 * PinnedPool.KEEP):
        pool.give_back(torch.empty(16, dtype=torch.int64))
    assert len(pool._free) == PinnedPool.KEEP  # the rest left to the allocator


@pytest.mark.gpu
def test_upload_puts_arrays_on_the_device_and_reuses_its_buffers():
    dev = torch.device("cuda")
    pool = PinnedPool(torch.int64, 4)
    rng = np.random.default_rng(0)
    seen = set()
    for shape in [(3, 5), (3, 0), (7,), (3, 1000), (1,), (2, 33)]:
        arr = rng.integers(-2 ** 40, 2 ** 40, size=shape, dtype=np.int64)
        got = pool.upload(arr, dev)
        assert got.device.type == "cuda" and tuple(got.shape) == shape
        np.testing.assert_array_equal(got.cpu().numpy(), arr)
        torch.cuda.synchronize()
        seen.update(b.data_ptr() for b, _ in pool._free)
    assert len(seen) < 6  # buffers came back and were handed out again
    ints = PinnedPool(torch.int32, 4)
    arr = np.arange(10, dtype=np.int32)[1:]  # an unaligned slice
    np.testing.assert_array_equal(ints.upload(arr, dev).cpu().numpy(), arr)


def test_raw_copies_can_be_turned_off(monkeypatch):
    from streamgr.kernels import pinned
    monkeypatch.setenv("STREAMGR_ONLOAD_RAW", "0")
    assert pinned.raw_h2d() is None
    monkeypatch.setenv("STREAMGR_ONLOAD_RAW", "1")
    monkeypatch.setattr(pinned._cuda, "FORCE_TORCH", True)
    assert pinned.raw_h2d() is None


@pytest.mark.gpu
def test_raw_h2d_copies_page_locked_slices_to_device_offsets_on_a_stream():
    """``raw_h2d``'s copies land at the byte offsets asked for (odd element offsets and
    lengths included), in order with the stream's other work, and touch nothing else."""
    from streamgr.kernels.pinned import raw_h2d
    copy = raw_h2d()
    assert copy is not None  # CuPy is there on the GPU machine
    host = torch.arange(4096, dtype=torch.int16).pin_memory()
    dev = torch.full((4096,), -1, dtype=torch.int16, device="cuda")
    want = torch.full((4096,), -1, dtype=torch.int16)
    stream = torch.cuda.Stream()
    es = host.element_size()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(10_000_000)  # the copies queue behind a spin: asynchronous
        for dst, src, n in [(0, 100, 7), (513, 0, 1000), (3000, 4000, 96), (2048, 2048, 1)]:
            copy(dev.data_ptr() + dst * es, host.data_ptr() + src * es, n * es, stream.cuda_stream)
            want[dst:dst + n] = host[src:src + n]
        dev.add_(0)  # a kernel after them on the stream
    stream.synchronize()
    assert torch.equal(dev.cpu(), want)
