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


def test_read_host_checks_its_tensors_and_copies_on_the_cpu():
    from streamgr.errors import StreamgrError
    from streamgr.kernels.pinned import read_host
    src = torch.arange(10, dtype=torch.int64)
    dst = torch.zeros(10, dtype=torch.int64)
    read_host(dst, src)  # no GPU: the reference
    assert torch.equal(dst, src)
    for bad in (torch.zeros(9, dtype=torch.int64), torch.zeros(10, dtype=torch.int32),
                torch.zeros(20, dtype=torch.int64)[::2]):
        with pytest.raises(StreamgrError, match="read_host"):
            read_host(bad, src)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_read_host_equals_a_copy_on_sizes_and_unaligned_slices(dtype):
    """The kernel reading page-locked memory in place against ``copy_``: fresh random data,
    sizes around the copy units and the blocks' parts, slices at odd offsets (narrower units,
    or the reference where no unit fits), queued behind a spin on a side stream."""
    from streamgr.kernels.pinned import read_host
    g = torch.Generator().manual_seed(int(dtype.itemsize))
    host = torch.randint(-100, 100, (1 << 20,), generator=g).to(dtype).pin_memory()
    stream = torch.cuda.Stream()
    for off, n in [(0, 1), (0, 7), (0, 16), (1, 33), (3, 1000), (8, 4097), (0, 1 << 19),
                   (5, (1 << 20) - 5), (2, 0)]:
        src = host[off:off + n]
        dst = torch.full((n,), 7, dtype=dtype, device="cuda")
        with torch.cuda.stream(stream):
            torch.cuda._sleep(2_000_000)
            read_host(dst, src)
        stream.synchronize()
        assert torch.equal(dst.cpu(), src), (off, n)


@pytest.mark.gpu
def test_uploads_by_the_sms_equal_the_copy_engines(monkeypatch):
    """``UPLOAD_BY_SM`` (the probe's ``smup``): the pool's uploads and ``to_device`` read by a
    kernel give the same tensors as copies."""
    from streamgr.kernels import pinned
    dev = torch.device("cuda")
    monkeypatch.setattr(pinned, "UPLOAD_BY_SM", True)
    pool = PinnedPool(torch.int64, 4)
    rng = np.random.default_rng(1)
    for shape in [(3, 5), (7,), (3, 1000), (1,), (2, 33)]:
        arr = rng.integers(-2 ** 40, 2 ** 40, size=shape, dtype=np.int64)
        np.testing.assert_array_equal(pool.upload(arr, dev).cpu().numpy(), arr)
    host = torch.arange(12345, dtype=torch.int64).pin_memory()
    assert torch.equal(pinned.to_device(host[3:], dev).cpu(), host[3:])


def test_the_upload_knob_takes_0_or_1(monkeypatch):
    from streamgr.errors import StreamgrError
    from streamgr.kernels.pinned import upload_by_sm_default
    monkeypatch.delenv("STREAMGR_UPLOAD_BY_SM", raising=False)
    assert upload_by_sm_default() is False
    monkeypatch.setenv("STREAMGR_UPLOAD_BY_SM", "1")
    assert upload_by_sm_default() is True
    monkeypatch.setenv("STREAMGR_UPLOAD_BY_SM", "yes")
    with pytest.raises(StreamgrError, match="STREAMGR_UPLOAD_BY_SM"):
        upload_by_sm_default()


def test_widest_unit_divides_the_size_and_every_address():
    """The copy unit block_copy and read_host launch with: the widest of the given units that
    the byte count and each tensor's address allow (views at odd offsets narrow it)."""
    from streamgr.kernels._cuda import widest_unit
    base = torch.zeros(64, dtype=torch.int16)  # torch aligns a fresh allocation to 64 bytes
    assert widest_unit(32, (16, 4, 2), base, base) == 16
    assert widest_unit(32, (16, 4, 2), base, base[2:]) == 4  # 4 bytes in
    assert widest_unit(32, (16, 4, 2), base[1:], base) == 2  # 2 bytes in
    assert widest_unit(6, (16, 4, 2), base, base) == 2
    assert widest_unit(6, (16, 8, 4), base, base) is None
