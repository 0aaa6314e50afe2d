"""Numba CUDA kernel of ``decoder_attention.self_attend`` (its module docstring says what).

A half-warp per (beam, head), two to a warp, its lanes over the quads of ``d`` (4 bf16 in one
64-bit load; coalesced rows): it copies the step's new K/V row into the buffer, forms the
``step + 1`` scores (fp32 partials summed by shuffles within the half-warp; through shared
memory in the simulator, which has no shuffles), the softmax, and the weighted sum of the
values (bf16 -> fp32 is a 16-bit shift; fp32 -> bf16 rounds to nearest even, as torch does).
Arrays come from torch without copies (``__cuda_array_interface__``, no stream sync, so a CUDA
graph captures the launch); the kernel runs on torch's current stream.
"""

from __future__ import annotations

import functools
import math

import torch
from numba import cuda, float32, int64

from .numba_common import as_array as _arr
from .numba_common import INLINE, lane_sum, torch_stream
from .numba_common import pack as _pack
from .numba_common import quad_bf as _bf
from .decoder_attention import SIMULATED

TPB = 64 if SIMULATED else 256


def max_registers(T: int) -> int:
    """The register cap of the kernel for ``T`` keys. Numba's own choice (128) held the kernel
    to a quarter of the SM's warps. With q/k/v read at a row stride (slices of one fused GEMM)
    ptxas for sm_90 needs 40 for 1-2 keys and 48 for 3 (at 40 it spilled 24 bytes), so the cap
    grows by 8 a key past 2 and spills nothing; the kernel before the rewrite (a warp a row,
    4-byte loads) needed 56 and spilled up to 116 bytes a thread at 40."""
    return min(64, 40 + 8 * max(0, T - 2))
ROWS = TPB // 32  # warps per block: each serves two (beam, head) rows
HALF = 16  # lanes per row, each over the quads (4 bf16) of d
SLOTS = 2 * ROWS  # rows per block (a shared-memory shape must be a literal constant)

_row_sum = lane_sum(HALF)  # a row's 16 lanes


@cuda.jit(device=True, **INLINE)
def _dot4(a, b):
    return _bf(a, 0) * _bf(b, 0) + _bf(a, 1) * _bf(b, 1) + _bf(a, 2) * _bf(b, 2) \
        + _bf(a, 3) * _bf(b, 3)


def _make_kernel(T: int):
    """The kernel for step ``T - 1`` (``T`` keys). ``T`` is a constant of the compiled code, so
    the loops over keys unroll and the scores stay in registers; with the key count a kernel
    argument the scores lived in local memory behind runtime-indexed loops, and a copy with a
    one-key softmax ran several times its bandwidth bound (docs/benchmarks.md)."""
    step = T - 1

    @cuda.jit(**({} if SIMULATED else {"max_registers": max_registers(T)}))
    def kernel(q, kn, vn, K, V, anc, bias, H, N, Q, rs, out):
        """q, kn, vn: int64 quads of bf16, beam b's head h at b * rs + h * Q in each (Q = d / 4;
        rs, the rows' stride in quads, one for all three: slices of one fused projection); out:
        [rows * 2Q] int32 pairs; K, V: [>= T, >= rows * Q] quads; anc [>= step, >= N]:
        position p of beam b lies at row anc[p, b] * H + head. A half-warp per row: a warp
        serves beams 2w and 2w + 1 of one head, each lane a quad. (With a warp a row and
        4-byte loads, ~580 instructions a lane and row bounded it, by an estimate from its
        PTX; this one issues ~480 a lane for two rows: docs/benchmarks.md, session 14.)"""
        red = cuda.shared.array((SLOTS, HALF), float32)
        # Bit operations, no integer division anywhere (Numba's are 64-bit, ~100 instructions
        # each, and they dominated a kernel this small); loops step by hand for the same reason.
        lane = cuda.threadIdx.x & (HALF - 1)
        r = cuda.threadIdx.x >> 4  # this half-warp's row slot in the block
        h = cuda.blockIdx.y
        beam = cuda.blockIdx.x * SLOTS + r
        active = beam < N  # no early return: the simulator's reduction has block barriers
        base = (beam * H + h) * Q
        qb = beam * rs + h * Q  # (one offset for q, k, v: more spilled at 40 registers)
        s = cuda.local.array(T, float32)
        src = cuda.local.array(T, int64)  # each earlier position's row offset (parent pointers)
        for t in range(step):
            src[t] = (anc[t, beam] * H + h) * Q if active else 0
        # This lane's partial of every score first: the loads are independent, so they are
        # all in flight at once (a load, then a reduction, per key was latency-bound).
        for t in range(T):
            s[t] = float32(0.0)
        if active:
            j = lane
            while j < Q:
                a = q[qb + j]
                for t in range(T):
                    if t == step:  # the new key: into the buffer as it is read
                        b = kn[qb + j]
                        K[step, base + j] = b
                        V[step, base + j] = vn[qb + j]
                    else:
                        b = K[t, src[t] + j]
                    s[t] += _dot4(a, b)
                j += HALF
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
        z = float32(1.0) / z  # one division, not T (a full-precision division is ~20 of them)
        for t in range(T):
            s[t] = s[t] * z
        j = lane
        while j < Q:
            o0 = float32(0.0)
            o1 = float32(0.0)
            o2 = float32(0.0)
            o3 = float32(0.0)
            for t in range(T):
                v = vn[qb + j] if t == step else V[t, src[t] + j]
                o0 += s[t] * _bf(v, 0)
                o1 += s[t] * _bf(v, 1)
                o2 += s[t] * _bf(v, 2)
                o3 += s[t] * _bf(v, 3)
            out[2 * (base + j)] = _pack(o0, o1)
            out[2 * (base + j) + 1] = _pack(o2, o3)
            j += HALF
    return kernel


_kernel = functools.lru_cache(maxsize=None)(_make_kernel)  # one compiled kernel per key count




def _rows(*xs: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    """[N, H, d] bf16 tensors with packed heads as (each one's flat int64 quads from its first
    row to the end of its last, their common row stride in quads): in place where they share
    one row stride (the column slices of one q|k|v GEMM, or contiguous tensors), else
    contiguous copies."""
    N, H, d = xs[0].shape
    rs = xs[0].stride(0) if N > 1 else H * d
    if not all(x.stride(2) == 1 and x.stride(1) == d and x.storage_offset() % 4 == 0
               and (N < 2 or x.stride(0) == rs) for x in xs) or rs % 4 or rs < H * d:
        xs, rs = tuple(x.contiguous() for x in xs), H * d
    n = (N - 1) * rs + H * d if N else 0
    return [x.as_strided((n,), (1,)).view(torch.int64) for x in xs], rs // 4


def run(q, k_new, v_new, K, V, step: int, bias, anc=None):
    """``self_attend_reference`` by the kernel: bf16, ``d % 4 == 0``, each position's K/V slab
    contiguous (``decoder_attention.self_attend`` checks)."""
    N, H, d = q.shape
    T, M = K.shape[0], K.shape[1]
    out = torch.empty(N, H, d, dtype=q.dtype, device=q.device)
    # Rows (beam, head) flat: [M, H, d] slabs are contiguous inside each position.
    # q, k_new, v_new in place: rows at any stride (column slices of one q|k|v GEMM).
    args, rs = _rows(q, k_new, v_new)
    args += [x.view(T, M * H * d).view(torch.int64) for x in (K, V)]  # views: writes land
    if anc is None:  # every position's row is the beam's own
        anc = torch.arange(N, device=q.device).expand(max(step, 1), N)
    a = anc[:max(step, 1)].long().contiguous()
    b = bias.float().contiguous()
    o = out.view(N * H * d).view(torch.int32)
    grid = (max(1, math.ceil(N / SLOTS)), H)
    if SIMULATED:  # the simulator moves only contiguous arrays: K/V go through copies
        kc, vc = args[3].contiguous(), args[4].contiguous()
        _kernel(step + 1)[grid, TPB](*(_arr(x) for x in args[:3] + [kc, vc, a]), _arr(b), H,
                                     N, d // 4, rs, _arr(o))
        args[3].copy_(kc)
        args[4].copy_(vc)
        return out
    fn = _kernel(step + 1)[grid, TPB, torch_stream(q.device)]
    fn(*(_arr(x) for x in args + [a]), _arr(b), H, N, d // 4, rs, _arr(o))
    return out
