"""Numba CUDA kernel of ``decoder_attention.self_attend`` (its module docstring says what).

One warp per (beam, head), its lanes over the pairs of ``d`` (coalesced rows): it copies the
step's new K/V row into the buffer, forms the ``step + 1`` scores (fp32 partials summed through
shared memory: the simulator has no warp shuffles), the softmax, and the weighted sum of the
values, reading bf16 as 32-bit pairs (bf16 -> fp32 is a 16-bit shift; fp32 -> bf16 rounds to nearest even, as
torch does). Arrays come from torch without copies (``__cuda_array_interface__``, no stream
sync, so a CUDA graph captures the launch); the kernel runs on torch's current stream.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
import torch
from numba import cuda, float32, int32, int64

from .decoder_attention import SIMULATED

TPB = 64 if SIMULATED else 256
# 40 registers: Numba's own choice (128) held the kernel to a quarter of the SM's warps. At 40,
# ptxas spills 56-116 bytes a thread (T = 2, 3; it needs 56 unbounded, which allows 32 warps an
# SM against 48): in the plans the kernel moves 1.5-1.7 TB/s (session 14's profile), so
# STREAMGR_DECODER_ATTN_REGS (read when a kernel is first built) is there to A/B 40 and 56.
_JIT = {} if SIMULATED else {"max_registers": int(os.environ.get("STREAMGR_DECODER_ATTN_REGS",
                                                                 "40"))}
ROWS = TPB // 32  # (beam, head) rows per block: a warp each, lanes over the pairs of d

if SIMULATED:  # kernels are Python there: bit casts through numpy
    def _as_float(bits):
        return np.array([int(bits) & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]

    def _as_bits(x):
        return int(np.array([x], dtype=np.float32).view(np.uint32)[0])
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def _as_float(bits):
        return libdevice.int_as_float(int32(bits))

    @cuda.jit(device=True, inline=True)
    def _as_bits(x):
        return int64(libdevice.float_as_int(x)) & 0xFFFFFFFF


@cuda.jit(device=True, inline=True)
def _lo(pair):  # the first bf16 of a 32-bit pair (little-endian), as fp32
    return _as_float((int64(pair) & 0xFFFF) << 16)


@cuda.jit(device=True, inline=True)
def _hi(pair):
    return _as_float(int64(pair) & 0xFFFF0000)


@cuda.jit(device=True, inline=True)
def _bf16(x):  # fp32 -> bf16 bits, round to nearest even (finite inputs)
    u = _as_bits(x)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


@cuda.jit(device=True, inline=True)
def _pack(a, b):
    v = (_bf16(b) << 16) | _bf16(a)
    return int32(v - (1 << 32) if v >= (1 << 31) else v)


if SIMULATED:  # no warp shuffles in the simulator: the row's 32 partials through shared memory
    @cuda.jit(device=True)
    def _row_sum(x, red, r, lane):
        red[r, lane] = x
        cuda.syncthreads()
        w = 16
        while w > 0:
            if lane < w:
                red[r, lane] += red[r, lane + w]
            cuda.syncthreads()
            w //= 2
        total = red[r, 0]
        cuda.syncthreads()  # all have read it before the next call overwrites it
        return total
else:
    @cuda.jit(device=True, inline=True)
    def _row_sum(x, red, r, lane):  # butterfly over the warp: every lane gets the sum
        x += cuda.shfl_xor_sync(0xFFFFFFFF, x, 16)
        x += cuda.shfl_xor_sync(0xFFFFFFFF, x, 8)
        x += cuda.shfl_xor_sync(0xFFFFFFFF, x, 4)
        x += cuda.shfl_xor_sync(0xFFFFFFFF, x, 2)
        x += cuda.shfl_xor_sync(0xFFFFFFFF, x, 1)
        return x


def _make_kernel(T: int):
    """The kernel for step ``T - 1`` (``T`` keys). ``T`` is a constant of the compiled code, so
    the loops over keys unroll and the scores stay in registers; with the key count a kernel
    argument the scores lived in local memory behind runtime-indexed loops, and a copy with a
    one-key softmax ran several times its bandwidth bound (docs/benchmarks.md)."""
    step = T - 1

    @cuda.jit(**_JIT)
    def kernel(q, kn, vn, K, V, anc, bias, H, out):
        """q, kn, vn, out: [rows, P] int32 pairs (row = beam * H + head); K, V: [>= T, >= rows,
        P]; anc [>= step, >= beams]: position p of beam b lies at row anc[p, b] * H + head."""
        red = cuda.shared.array((ROWS, 32), float32)
        lane = cuda.threadIdx.x % 32
        r = cuda.threadIdx.x // 32
        rows, P = q.shape[0], q.shape[1]
        # Grid (beams / ROWS, heads): no integer division anywhere (Numba's are 64-bit, ~100
        # instructions each, and they dominated a kernel this small). Loops step by hand for
        # the same reason (a range with a step divides for its trip count).
        h = cuda.blockIdx.y
        beam = cuda.blockIdx.x * ROWS + r
        i = beam * H + h
        active = i < rows  # no early return: the simulator's reduction has block barriers
        s = cuda.local.array(T, float32)
        src = cuda.local.array(T, int64)  # each earlier position's row (parent pointers)
        for t in range(step):
            src[t] = anc[t, beam] * H + h if active else 0
        # This lane's partial of every score first: the loads are independent, so they are
        # all in flight at once (a load, then a reduction, per key was latency-bound).
        for t in range(T):
            s[t] = float32(0.0)
        if active:
            j = lane
            while j < P:
                a = q[i, j]
                for t in range(T):
                    if t == step:  # the new key: into the buffer as it is read
                        b = kn[i, j]
                        K[step, i, j] = b
                        V[step, i, j] = vn[i, j]
                    else:
                        b = K[t, src[t], j]
                    s[t] += _lo(a) * _lo(b) + _hi(a) * _hi(b)
                j += 32
        for t in range(T):
            s[t] = _row_sum(s[t], red, r, lane) + (bias[t, h] if active else float32(0.0))
        if not active:
            return
        m = s[0]
        for t in range(1, T):
            m = max(m, s[t])
        z = float32(0.0)
        for t in range(T):
            s[t] = math.exp(s[t] - m)
            z += s[t]
        for t in range(T):
            s[t] = s[t] / z
        j = lane
        while j < P:
            o0 = float32(0.0)
            o1 = float32(0.0)
            for t in range(T):
                v = vn[i, j] if t == step else V[t, src[t], j]
                o0 += s[t] * _lo(v)
                o1 += s[t] * _hi(v)
            out[i, j] = _pack(o0, o1)
            j += 32
    return kernel


_kernel = functools.lru_cache(maxsize=None)(_make_kernel)  # one compiled kernel per key count


@functools.lru_cache(maxsize=64)
def _stream(handle: int):
    return cuda.external_stream(handle)


def _arr(t: torch.Tensor):
    return t.numpy() if SIMULATED else cuda.as_cuda_array(t, sync=False)


def _pairs(t: torch.Tensor) -> torch.Tensor:
    """A bf16 tensor (unit stride last) as int32 pairs of its last dimension."""
    return t.view(torch.int32)


def run(q, k_new, v_new, K, V, step: int, bias, anc=None):
    N, H, d = q.shape
    T, M = K.shape[0], K.shape[1]
    out = torch.empty(N, H, d, dtype=q.dtype, device=q.device)
    # Rows (beam, head) flat: [M, H, d] slabs are contiguous inside each position.
    args = [_pairs(x.contiguous().view(N * H, d)) for x in (q, k_new, v_new)]
    args += [_pairs(x.view(T, M * H, d)) for x in (K, V)]  # a view (writes land), or raises
    if anc is None:  # every position's row is the beam's own
        anc = torch.arange(N, device=q.device).expand(max(step, 1), N)
    a = anc[:max(step, 1)].long().contiguous()
    b = bias.float().contiguous()
    o = _pairs(out.view(N * H, d))
    grid = (max(1, math.ceil(N / ROWS)), H)
    if SIMULATED:  # the simulator moves only contiguous arrays: K/V go through copies
        kc, vc = args[3].contiguous(), args[4].contiguous()
        _kernel(step + 1)[grid, TPB](*(_arr(x) for x in args[:3] + [kc, vc, a]), _arr(b), H,
                                     _arr(o))
        args[3].copy_(kc)
        args[4].copy_(vc)
        return out
    fn = _kernel(step + 1)[grid, TPB, _stream(torch.cuda.current_stream(q.device).cuda_stream)]
    fn(*(_arr(x) for x in args + [a]), _arr(b), H, _arr(o))
    return out
