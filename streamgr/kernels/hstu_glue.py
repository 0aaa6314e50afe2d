"""The end of an HSTU layer, ``x + W_o (LayerNorm(attn) * u) + b_o``, in two kernels on the GPU.

Unfused it is four kernels and three extra round trips of a [rows, width] tensor through
memory: the norm, the multiply by ``u``, the output GEMM with its bias, the residual add. Here
``cuda_kernels/hstu_norm.cu`` writes ``y = LayerNorm(attn) * u`` and ``xb = x + b_o`` in one
launch and the GEMM adds ``xb`` in its epilogue (``torch.addmm``, cuBLAS's beta = 1). Rounding:
``y`` is rounded to bf16 after the norm and after the multiply (as the unfused ops round it);
the GEMM's sum meets ``xb`` in fp32 and is rounded once (the unfused path rounds ``W_o y + b_o``
first), so results agree with the torch reference within bf16 tolerance, not bit for bit, and
every GPU path (cached, recompute, plans) goes through the same kernels: cached == recompute
still holds. On the CPU, for other dtypes or unaligned shapes: the torch reference.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from . import _cuda

_SRC, _EXPRS = "hstu_norm.cu", ("hstu_norm_mul",)
# STREAMGR_FUSED_FINISH=0: torch's unfused ops on the GPU too (A/B runs of whole benchmarks)
ENABLED = os.environ.get("STREAMGR_FUSED_FINISH", "1") != "0"
ROWS_PER_BLOCK = 8  # one warp per row, 256 threads


def finish_reference(x: torch.Tensor, attn: torch.Tensor, u: torch.Tensor, norm: nn.LayerNorm,
                     output: nn.Linear) -> torch.Tensor:
    """``x + output(norm(attn) * u)``: ``x`` [T, M], ``attn`` and ``u`` [T, N]."""
    return x + output(norm(attn) * u)


def _vec_rows(t: torch.Tensor) -> int | None:
    """Row stride in 16-byte vectors if the kernel can read ``t`` [T, C] in place."""
    if t.dim() != 2 or t.stride(1) != 1 or t.shape[1] % 8 or t.stride(0) % 8 \
            or t.data_ptr() % 16:
        return None
    return t.stride(0) // 8


def fused_ok(x: torch.Tensor, attn: torch.Tensor, u: torch.Tensor, norm: nn.LayerNorm,
             output: nn.Linear) -> bool:
    """Whether :func:`finish` runs the kernel here: bf16 on a GPU with CuPy, an affine norm and
    a biased projection, 16-byte aligned rows of widths that are multiples of 8."""
    params = (norm.weight, norm.bias, output.weight, output.bias)
    if not ENABLED or any(p is None or p.dtype != torch.bfloat16 for p in params):
        return False
    if any(t.dtype != torch.bfloat16 for t in (x, attn, u)) or not _cuda.usable(x, attn, u):
        return False
    return (x.is_contiguous() and attn.is_contiguous() and _vec_rows(x) is not None
            and _vec_rows(attn) is not None and _vec_rows(u) is not None
            and all(p.is_contiguous() and p.data_ptr() % 16 == 0 for p in params))


def norm_mul(x: torch.Tensor, attn: torch.Tensor, u: torch.Tensor, norm: nn.LayerNorm,
             out_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel: ``y = bf16(bf16(norm(attn)) * u)`` and ``xb = bf16(x + out_bias)``."""
    T, N = attn.shape
    M = x.shape[1]
    y = torch.empty((T, N), dtype=attn.dtype, device=attn.device)
    xb = torch.empty_like(x)
    if T:
        fn = _cuda.kernel(_SRC, _EXPRS, _EXPRS[0])
        _cuda.launch(fn, (-(-T // ROWS_PER_BLOCK),), (32 * ROWS_PER_BLOCK,), (
            _cuda.ptr(attn), _cuda.ptr(u), np.int64(_vec_rows(u)), _cuda.ptr(norm.weight),
            _cuda.ptr(norm.bias), _cuda.ptr(x), _cuda.ptr(out_bias), _cuda.ptr(y),
            _cuda.ptr(xb), np.int64(T), np.int32(N // 8), np.int32(M // 8),
            np.float32(norm.eps)))
    return y, xb


def finish(x: torch.Tensor, attn: torch.Tensor, u: torch.Tensor, norm: nn.LayerNorm,
           output: nn.Linear) -> torch.Tensor:
    """``x + output(norm(attn) * u)``: the fused kernel and one GEMM where :func:`fused_ok`,
    the torch reference otherwise."""
    if not fused_ok(x, attn, u, norm, output):
        return finish_reference(x, attn, u, norm, output)
    y, xb = norm_mul(x, attn, u, norm, output.bias)
    return torch.addmm(xb, y, output.weight.t())
