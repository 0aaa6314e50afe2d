"""What the Numba CUDA kernels share. On the host: torch tensors as Numba arrays without copies
(``__cuda_array_interface__``, no stream sync, so a CUDA graph captures the launch) and torch's
current stream as a Numba stream. On the device, for kernels that read bf16 tensors as 32- or
64-bit words (torch's bf16 has no Numba type): bf16 <-> fp32 by bits (a 16-bit shift one way,
round to nearest even the other, as torch does) and sums across a row's lanes. Under the
simulator (``NUMBA_ENABLE_CUDASIM=1``) kernels run as Python: arrays are numpy's, bit casts go
through numpy, and the sums through shared memory (it has no warp shuffles)."""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import cuda, int32, int64

from .decoder_attention import SIMULATED


def as_array(t: torch.Tensor):
    """``t`` as the kernels' argument: a Numba device array view (numpy under the simulator)."""
    return t.numpy() if SIMULATED else cuda.as_cuda_array(t, sync=False)


@functools.lru_cache(maxsize=64)
def _external(handle: int):
    return cuda.external_stream(handle)


def torch_stream(device):
    """torch's current stream on ``device`` as a Numba stream (cached per handle)."""
    return _external(torch.cuda.current_stream(device).cuda_stream)

if SIMULATED:
    def as_float(bits):
        return np.array([int(bits) & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]

    def as_bits(x):
        return int(np.array([x], dtype=np.float32).view(np.uint32)[0])

    def rsqrt(x):
        return np.float32(1.0) / np.sqrt(np.float32(x))
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def as_float(bits):
        return libdevice.int_as_float(int32(bits))

    @cuda.jit(device=True, inline=True)
    def as_bits(x):
        return int64(libdevice.float_as_int(x)) & 0xFFFFFFFF

    @cuda.jit(device=True, inline=True)
    def rsqrt(x):
        return libdevice.rsqrtf(x)


@cuda.jit(device=True, inline=True)
def bf16(x):  # fp32 -> bf16 bits, round to nearest even (finite inputs)
    u = as_bits(x)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


@cuda.jit(device=True, inline=True)
def pack(a, b):
    """Two fp32 as the int32 of their bf16 pair (``a`` the low half)."""
    v = (bf16(b) << 16) | bf16(a)
    return int32(v - (1 << 32) if v >= (1 << 31) else v)


@cuda.jit(device=True, inline=True)
def quad_bf(quad, k):  # the k-th bf16 of a 64-bit quad (little-endian), as fp32
    if k == 0:
        return as_float((int64(quad) & 0xFFFF) << 16)
    return as_float((int64(quad) >> (16 * k - 16)) & 0xFFFF0000)


def lane_sum(width: int):
    """A device function ``(x, red, r, lane)``: the sum of ``x`` over the ``width`` (16 or
    32) lanes of row slot ``r``, in every one of them. Shuffles within the row's lanes on the
    GPU; through ``red[r, :width]`` (shared, fp32) with block barriers in the simulator, so
    every thread of the block must call it (no early return before)."""
    if SIMULATED:
        @cuda.jit(device=True)
        def total(x, red, r, lane):
            red[r, lane] = x
            cuda.syncthreads()
            w = width // 2
            while w > 0:
                if lane < w:
                    red[r, lane] += red[r, lane + w]
                cuda.syncthreads()
                w //= 2
            out = red[r, 0]
            cuda.syncthreads()  # all have read it before the next call overwrites it
            return out
        return total

    @cuda.jit(device=True, inline=True)
    def total(x, red, r, lane):  # a butterfly: every lane of the row gets the sum
        w = width // 2
        while w > 0:
            x += cuda.shfl_xor_sync(0xFFFFFFFF, x, w)
            w //= 2
        return x
    return total
