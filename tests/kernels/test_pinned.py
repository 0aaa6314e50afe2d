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
