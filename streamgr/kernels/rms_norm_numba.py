"""Numba CUDA kernel of ``rms_norm.rms_norm`` (its module docstring says when it runs).

A warp per row, its lanes over the row's quads (4 bf16 in one 64-bit load): the sum of squares
in fp32 (shuffles across the warp; shared memory in the simulator), one ``rsqrt``, then each
element as ``w * x * rstd`` (the order of torch's layer-norm kernel) rounded to bf16 once. The
row is read twice; the second read mostly hits L1. Runs on torch's current stream, no sync, so
a CUDA graph captures it.
"""

from __future__ import annotations

import math

import torch
from numba import cuda, float32

from .numba_common import SIMULATED, as_array, lane_sum, pack, quad_bf, rsqrt, torch_stream

TPB = 64 if SIMULATED else 256
WARPS = TPB // 32  # rows per block
_JIT = {} if SIMULATED else {"max_registers": 32}

_warp_sum = lane_sum(32)


@cuda.jit(**_JIT)
def _rms(x, w, eps, inv_d, rows, Q, out):
    """x: [rows * Q] int64 quads of bf16; w: [Q] quads; out: [rows * 2Q] int32 pairs."""
    red = cuda.shared.array((WARPS, 32), float32)
    lane = cuda.threadIdx.x & 31
    r = cuda.threadIdx.x >> 5
    row = cuda.blockIdx.x * WARPS + r
    active = row < rows  # no early return before the reduction (the simulator's barriers)
    base = row * Q
    ss = float32(0.0)
    if active:
        j = lane
        while j < Q:
            v = x[base + j]
            a0, a1, a2, a3 = quad_bf(v, 0), quad_bf(v, 1), quad_bf(v, 2), quad_bf(v, 3)
            ss += a0 * a0 + a1 * a1 + a2 * a2 + a3 * a3
            j += 32
    ss = _warp_sum(ss, red, r, lane)
    if not active:
        return
    rstd = rsqrt(ss * inv_d + eps)
    j = lane
    while j < Q:
        v, g = x[base + j], w[j]
        out[2 * (base + j)] = pack(quad_bf(g, 0) * quad_bf(v, 0) * rstd,
                                   quad_bf(g, 1) * quad_bf(v, 1) * rstd)
        out[2 * (base + j) + 1] = pack(quad_bf(g, 2) * quad_bf(v, 2) * rstd,
                                       quad_bf(g, 3) * quad_bf(v, 3) * rstd)
        j += 32




def run(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    rows = x.numel() // d if d else 0
    xc = x.contiguous()
    out = torch.empty_like(xc)
    if rows == 0:
        return out
    quads = (as_array(t.view(-1).view(torch.int64)) for t in (xc, weight.contiguous()))
    args = (*quads, float32(eps), float32(1.0 / d), rows, d // 4,
            as_array(out.view(-1).view(torch.int32)))
    grid = max(1, math.ceil(rows / WARPS))
    if SIMULATED:
        _rms[grid, TPB](*args)
    else:
        _rms[grid, TPB, torch_stream(x.device)](*args)
    return out
