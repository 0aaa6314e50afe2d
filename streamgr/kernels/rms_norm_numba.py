"""Numba CUDA kernel of ``rms_norm.rms_norm`` (its module docstring says when it runs).

A warp per row, its lanes over the row's quads (4 bf16 in one 64-bit load): a lane's quads are
all loaded before any is used and held in registers (a kernel per quads-per-lane count, so the
loop unrolls), the sum of squares in fp32 (shuffles across the warp; shared memory in the
simulator), one ``rsqrt``, then each element as ``w * x * rstd`` (the order of torch's
layer-norm kernel) rounded to bf16 once and stored as one 64-bit quad. The first version
looped over the row twice with one load in flight per lane and two 32-bit stores per quad:
8.5 us for a [8192, 512] row block in gen-ref's plans (session 15), ~1.9 TB/s. Runs on torch's
current stream, no sync, so a CUDA graph captures it.
"""

from __future__ import annotations

import functools
import math

import torch
from numba import cuda, float32, int64

from .numba_common import (INLINE, SIMULATED, as_array, bf16, lane_sum, quad_bf, rsqrt,
                           torch_stream)

TPB = 64 if SIMULATED else 256
WARPS = TPB // 32  # rows per block
_JIT = {} if SIMULATED else {"max_registers": 64}  # 8 quads a lane: 62, no spills

_warp_sum = lane_sum(32)


@cuda.jit(device=True, **INLINE)
def _quad(a, b, c, d):
    """Four fp32 as the int64 of their bf16 quad (``a`` the lowest bits)."""
    hi = bf16(d)
    hi = hi - 0x10000 if hi >= 0x8000 else hi  # signed: the shift below stays within int64
    return bf16(a) | (bf16(b) << 16) | (int64(bf16(c)) << 32) | (int64(hi) << 48)


@functools.lru_cache(maxsize=None)
def _make_kernel(qpl: int):
    """The kernel for rows of at most ``32 * qpl`` quads (``qpl`` quads held per lane)."""
    @cuda.jit(**_JIT)
    def _rms(x, w, eps, inv_d, rows, Q, out):
        """x: [rows * Q] int64 quads of bf16; w: [Q] quads; out: [rows * Q] int64 quads."""
        red = cuda.shared.array((WARPS, 32), float32)
        vals = cuda.local.array(qpl, int64)
        lane = cuda.threadIdx.x & 31
        r = cuda.threadIdx.x >> 5
        row = cuda.blockIdx.x * WARPS + r
        active = row < rows  # no early return before the reduction (the simulator's barriers)
        base = row * Q
        for k in range(qpl):  # every load issued before the first is used
            j = lane + 32 * k
            vals[k] = x[base + j] if active and j < Q else int64(0)
        ss = float32(0.0)
        for k in range(qpl):
            v = vals[k]
            a0, a1, a2, a3 = quad_bf(v, 0), quad_bf(v, 1), quad_bf(v, 2), quad_bf(v, 3)
            ss += a0 * a0 + a1 * a1 + a2 * a2 + a3 * a3
        ss = _warp_sum(ss, red, r, lane)
        if not active:
            return
        rstd = rsqrt(ss * inv_d + eps)
        for k in range(qpl):
            j = lane + 32 * k
            if j < Q:
                v, g = vals[k], w[j]
                out[base + j] = _quad(quad_bf(g, 0) * quad_bf(v, 0) * rstd,
                                      quad_bf(g, 1) * quad_bf(v, 1) * rstd,
                                      quad_bf(g, 2) * quad_bf(v, 2) * rstd,
                                      quad_bf(g, 3) * quad_bf(v, 3) * rstd)
    return _rms


def run(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    rows = x.numel() // d if d else 0
    xc = x.contiguous()
    out = torch.empty_like(xc)
    if rows == 0:
        return out
    quads = (as_array(t.view(-1).view(torch.int64)) for t in (xc, weight.contiguous()))
    args = (*quads, float32(eps), float32(1.0 / d), rows, d // 4,
            as_array(out.view(-1).view(torch.int64)))
    grid = max(1, math.ceil(rows / WARPS))
    kernel = _make_kernel(-(-(d // 4) // 32))
    if SIMULATED:
        kernel[grid, TPB](*args)
    else:
        kernel[grid, TPB, torch_stream(x.device)](*args)
    return out
