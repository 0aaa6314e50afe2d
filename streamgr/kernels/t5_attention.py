"""The T5 encoder's self-attention with its relative-position bias computed inside the kernel,
and the decoder's cross-attention on the same kernel without the bias.

``softmax(q k^T + bias) v`` per (request, head), T5's way (no 1/sqrt(d), fp32 softmax), where
``bias[h, i, j] = table[h, j - i + S - 1]`` (a [heads, 2S - 1] table of distances) on real keys
and -inf on a request's padding. ``encoder_attention_reference`` is the torch expression (the
judge); ``encoder_attention`` runs a CUDA kernel for bf16 on CUDA with head dims 32 and 64, and the
reference elsewhere: on Hopper with head dim 64 ``cuda_kernels/t5_attention_wgmma.cu``
(FlashAttention-3's structure: a producer warpgroup, wgmma, ping-pong consumers), else
``cuda_kernels/t5_attention.cu`` (FlashAttention-2 on mma.sync); both read the bias from the
table. The dense [R, H, S, S] bias that cuDNN needed cost the encoder ~0.17 ms to
write per gen-ref batch and cuDNN ~120 us per layer to read (docs/benchmarks.md, session 13).

Inputs are [R, S, H, d] views (the projections' outputs, any request and token strides, unit
head and column strides); the output is [R, S, H, d] contiguous, the layout the output
projection reads. The table is rounded to the activations' dtype (bf16) as the dense bias was
(the kernel rounds as it reads, so a batch's four layers launch nothing else).

``cross_attention``: ``softmax(q k^T) v`` of each request's beams ([R, B, H, d] query rows)
against its encoder positions ([R, S, H, d] keys and values, padding masked), no bias, no
scaling: on Hopper the wgmma kernel without the distances, elsewhere the reference
(``cross_attention_reference``); the decoder's other paths keep cuDNN (``models/t5.attend``).
A request without a real key gets zeros here (cuDNN's additive finfo.min mask would average
its values; T5 serving always has the EOS key).
"""

from __future__ import annotations

import functools
import logging
import os

import numpy as np
import torch

from ..errors import StreamgrError
from . import _cuda

_SRC = "t5_attention.cu"
_DIMS = (32, 64)
_EXPRS = tuple(f"t5_attn_fwd<{d}>" for d in _DIMS)
_BM, _BN, _STAGES = 128, 64, 2  # the kernel's tile rows, keys and K/V stages
# STREAMGR_T5_ENCODER=cudnn keeps the encoder on cuDNN with the dense bias (A/B runs).
ENABLED = os.environ.get("STREAMGR_T5_ENCODER", "kernel") != "cudnn"
# The wgmma kernel (sm_90a): head dim 64, 128-key tiles, 3 K/V stages.
_WG_SRC = "t5_attention_wgmma.cu"
_WG_EXPRS = ("t5_attn_fwd_wg<64, true>", "t5_attn_fwd_wg<64, false>")
# Tile configurations (query rows a block, keys a tile, K/V stages), as the kernel's defines:
# 64-row blocks of one consumer warpgroup, two blocks an SM, won on the H200 (session 17,
# .device/ab_t5.py): the encoder's layer 0.1726 -> 0.1672 ms with 128-key tiles and 2 stages;
# the cross-attention 0.0533 -> 0.0512 ms with 64-key tiles and 4 stages.
_WG_CONFIG = {True: (64, 128, 2), False: (64, 64, 4)}  # bias (encoder) / none (cross)


def _wg_defines(bias: bool) -> tuple[str, ...]:
    bm, bn, st = _WG_CONFIG[bias]
    return (f"T5_WG_BM={bm}", f"T5_WG_BN={bn}", f"T5_WG_STAGES={st}")
# STREAMGR_T5_KERNEL: auto (wgmma where it applies, else mma.sync), mma, or wgmma (an error
# where it cannot run). Read per call, so tests can switch it.
KERNEL = os.environ.get("STREAMGR_T5_KERNEL", "auto")
log = logging.getLogger("streamgr.kernels")


def _check(q, k, v, table, keep) -> tuple[int, int, int, int]:
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise StreamgrError(f"encoder_attention: q, k, v must be [R, S, H, d] alike, got "
                            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    R, S, H, d = q.shape
    if table.shape != (H, 2 * S - 1) or keep.shape != (R, S):
        raise StreamgrError(f"encoder_attention: table [{H}, {2 * S - 1}] and keep [{R}, {S}] "
                            f"expected, got {tuple(table.shape)}, {tuple(keep.shape)}")
    return R, S, H, d


def encoder_attention_reference(q, k, v, table, keep) -> torch.Tensor:
    """[R, S, H, d] in ``q``'s dtype; the products and softmax in fp32."""
    R, S, H, d = _check(q, k, v, table, keep)
    idx = torch.arange(S, device=q.device)
    bias = table.to(q.dtype).float()[:, idx[None, :] - idx[:, None] + S - 1]  # [H, S, S]
    s = torch.einsum("rihd,rjhd->rhij", q.float(), k.float()) + bias[None]
    s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a request with no real key: zeros
    return torch.einsum("rhij,rjhd->rihd", p, v.float()).to(q.dtype)


_SMEM_MAX = 200 * 1024  # the distances and key mask grow with S: ~18,600 positions at most


def kernel_applies(x: torch.Tensor, d: int, S: int) -> bool:
    """The CUDA kernel runs for activations like ``x`` with head dim ``d`` and ``S`` positions
    (bf16 CUDA, head dim 32 or 64, its shared memory within bounds; the views' strides are
    checked per call)."""
    return (ENABLED and x.is_cuda and x.dtype == torch.bfloat16 and d in _DIMS
            and smem_bytes(S, d) <= _SMEM_MAX and _cuda.usable(x))


def smem_bytes(S: int, d: int) -> int:
    sr = -(-S // _BN) * _BN
    return (_BM + 2 * _STAGES * _BN) * (d + 8) * 2 + (_BM + 2 * sr) * 4


def wg_smem_bytes(S: int, d: int, bias: bool = True) -> int:
    """The wgmma kernel's dynamic shared memory: alignment slack, Q, the K/V stages, the
    mbarriers, the distances, the key mask and a flag per key tile."""
    bm, bn, st = _WG_CONFIG[bias]
    sr = -(-S // bn) * bn
    return 1024 + (bm + 2 * st * bn) * d * 2 + (2 * st + 2) * 8 + (bm + 2 * sr + sr // bn) * 4


@functools.lru_cache(maxsize=None)
def _wgmma_builds(index: int) -> bool:
    """The device is sm_90 and the wgmma kernel compiles for it (once per device)."""
    if torch.cuda.get_device_capability(index) != (9, 0):
        return False
    try:
        for bias in (True, False):
            _cuda.arch_module(_WG_SRC, _WG_EXPRS, "sm_90a", _wg_defines(bias))
        return True
    except Exception as err:  # noqa: BLE001 - e.g. a CuPy without the NVRTC hook for sm_90a
        log.warning("the wgmma T5 attention did not build (%s): mma.sync", err)
        return False


def _use_wgmma(x: torch.Tensor, d: int, S: int) -> bool:
    if KERNEL not in ("auto", "mma", "wgmma"):
        raise StreamgrError(f"STREAMGR_T5_KERNEL={KERNEL!r}: auto, mma or wgmma")
    if KERNEL == "mma":
        return False
    ok = d == 64 and wg_smem_bytes(S, d) <= _SMEM_MAX and _wgmma_builds(x.device.index or 0)
    if KERNEL == "wgmma" and not ok:
        raise StreamgrError("STREAMGR_T5_KERNEL=wgmma needs an sm_90 GPU, head dim 64 and "
                            f"S <= ~14,000 (got d={d}, S={S})")
    return ok


def encoder_attention(q, k, v, table, keep, out: torch.Tensor | None = None) -> torch.Tensor:
    """``encoder_attention_reference`` by the CUDA kernel where it applies, else by the
    reference. ``out``: an optional [R, S, H, d] contiguous destination."""
    R, S, H, d = _check(q, k, v, table, keep)
    if out is not None and (out.shape != (R, S, H, d) or not out.is_contiguous()
                            or out.dtype != q.dtype):
        raise StreamgrError(f"encoder_attention: out must be a contiguous [{R}, {S}, {H}, {d}] "
                            f"{q.dtype}")
    ok = kernel_applies(q, d, S) and k.dtype == v.dtype == q.dtype and _strided_ok(q, k, v) \
        and keep.is_cuda and table.is_cuda and R < 65536 and H < 65536
    if not ok or R == 0 or S == 0:
        ref = encoder_attention_reference(q, k, v, table, keep)
        return ref if out is None else out.copy_(ref)
    if out is None:
        out = torch.empty(R, S, H, d, dtype=q.dtype, device=q.device)
    tab = table.float().contiguous()  # (the kernel rounds it to bf16 as it reads it)
    kp = keep.contiguous().view(torch.uint8)
    wg = _use_wgmma(q, d, S)
    if wg:
        fn = _cuda.arch_kernel(_WG_SRC, _WG_EXPRS, _WG_EXPRS[0], "sm_90a", _wg_defines(True))
        bm = _WG_CONFIG[True][0]
        block, smem = (128 + 2 * bm,), wg_smem_bytes(S, d)
    else:
        fn = _cuda.kernel(_SRC, _EXPRS, _EXPRS[_DIMS.index(d)])
        bm, block, smem = _BM, (128,), smem_bytes(S, d)
    _cuda.launch(fn, (-(-S // bm), H, R), block, (
        _cuda.ptr(q), _cuda.ptr(k), _cuda.ptr(v),
        np.int64(q.stride(0)), np.int64(q.stride(1)), np.int64(k.stride(0)),
        np.int64(k.stride(1)), np.int64(v.stride(0)), np.int64(v.stride(1)),
        _cuda.ptr(tab), _cuda.ptr(kp), *((np.int32(S),) if wg else ()),
        np.int32(S), np.int32(H), _cuda.ptr(out)), shared_mem=smem)
    return out


def cross_attention_reference(q, k, v, keep) -> torch.Tensor:
    """[R, B, H, d] in ``q``'s dtype: each request's B query rows against its S keys ([R, S,
    H, d] ``k``, ``v``; ``keep`` [R, S] True on real keys), products and softmax in fp32."""
    s = torch.einsum("rihd,rjhd->rhij", q.float(), k.float())
    s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("rhij,rjhd->rihd", p, v.float()).to(q.dtype)


def _strided_ok(*ts: torch.Tensor) -> bool:
    """Views the kernels read in place: unit column stride, heads packed, 16-byte aligned."""
    return all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] and t.data_ptr() % 16 == 0
               and t.stride(0) % 8 == 0 and t.stride(1) % 8 == 0 for t in ts)


# The decoder takes the kernel for steps with at least this many beams a request: at one beam
# (a search's first step) cuDNN read the keys at ~3.2 TB/s, 15.9 us against the kernel's 21.5
# for gen-ref's 32 x 784 positions; at 256 beams the kernel 53.4 us, cuDNN 67.1 (H200,
# tools/bench_t5_attention.py, docs/benchmarks.md session 17).
CROSS_MIN_ROWS = 64


def cross_kernel_applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    """``cross_attention`` runs the wgmma kernel for these views (else the reference)."""
    R, B, H, d = q.shape
    return (ENABLED and KERNEL != "mma" and q.is_cuda and q.dtype == torch.bfloat16
            and k.dtype == q.dtype and d == 64 and R < 65536 and H < 65536
            and wg_smem_bytes(k.shape[1], d, False) <= _SMEM_MAX and _cuda.usable(q)
            and _wgmma_builds(q.device.index or 0))


def cross_attention(q, k, v, keep, out: torch.Tensor | None = None) -> torch.Tensor:
    """``cross_attention_reference`` by the wgmma kernel where it applies. ``q`` [R, B, H, d],
    ``k``/``v`` [R, S, H, d] (views with any request and row strides), ``keep`` [R, S] bool;
    ``out``: an optional contiguous [R, B, H, d] destination."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or k.shape[0] != q.shape[0] \
            or k.shape[2:] != q.shape[2:] or keep.shape != k.shape[:2]:
        raise StreamgrError(f"cross_attention: q [R, B, H, d], k/v [R, S, H, d], keep [R, S] "
                            f"expected, got {tuple(q.shape)}, {tuple(k.shape)}, "
                            f"{tuple(v.shape)}, {tuple(keep.shape)}")
    R, B, H, d = q.shape
    S = k.shape[1]
    if out is not None and (out.shape != q.shape or not out.is_contiguous()
                            or out.dtype != q.dtype):
        raise StreamgrError(f"cross_attention: out must be a contiguous {tuple(q.shape)} "
                            f"{q.dtype}")
    if not (cross_kernel_applies(q, k) and v.dtype == q.dtype and _strided_ok(q, k, v)
            and keep.is_cuda) or R == 0 or B == 0 or S == 0:
        ref = cross_attention_reference(q, k, v, keep)
        return ref if out is None else out.copy_(ref)
    if out is None:
        out = torch.empty(R, B, H, d, dtype=q.dtype, device=q.device)
    fn = _cuda.arch_kernel(_WG_SRC, _WG_EXPRS, _WG_EXPRS[1], "sm_90a", _wg_defines(False))
    bm = _WG_CONFIG[False][0]
    kp = keep.contiguous().view(torch.uint8)
    _cuda.launch(fn, (-(-B // bm), H, R), (128 + 2 * bm,), (
        _cuda.ptr(q), _cuda.ptr(k), _cuda.ptr(v),
        np.int64(q.stride(0)), np.int64(q.stride(1)), np.int64(k.stride(0)),
        np.int64(k.stride(1)), np.int64(v.stride(0)), np.int64(v.stride(1)),
        _cuda.ptr(kp),  # the table argument, unused without the bias
        _cuda.ptr(kp), np.int32(B), np.int32(S), np.int32(H), _cuda.ptr(out)),
        shared_mem=wg_smem_bytes(S, d, False))
    return out
