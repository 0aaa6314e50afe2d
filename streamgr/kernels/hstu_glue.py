"""An HSTU layer's glue around its GEMMs and attention on the GPU (``cuda_kernels/hstu_norm.cu``),
each beside its torch reference.

The end of a layer, ``x + W_o (LayerNorm(attn) * u) + b_o``, in two kernels.

Unfused it is four kernels and three extra round trips of a [rows, width] tensor through
memory: the norm, the multiply by ``u``, the output GEMM with its bias, the residual add. Here
``cuda_kernels/hstu_norm.cu`` writes ``y = LayerNorm(attn) * u`` and ``xb = x + b_o`` in one
launch and the GEMM adds ``xb`` in its epilogue (``torch.addmm``, cuBLAS's beta = 1). Rounding:
``y`` is rounded to bf16 after the norm and after the multiply (as the unfused ops round it);
the GEMM's sum meets ``xb`` in fp32 and is rounded once (the unfused path rounds ``W_o y + b_o``
first), so results agree with the torch reference within bf16 tolerance, not bit for bit, and
every GPU path (cached, recompute, plans) goes through the same kernels: cached == recompute
still holds. The GEMM adds into ``xb`` in place (``addmm_``): the out-of-place ``addmm`` first
copies ``xb`` into its result (a 35 us copy per layer of a recompute batch of 8 on the H200).

``u`` may arrive before its SiLU (``u_raw``): the kernel then applies it as it reads ``u``,
and the projection's SiLU pass (:func:`silu`) covers the v, q, k blocks only, a quarter less
traffic. Both SiLUs use the fast exponential and division (torch's exact form made the pass
compute-bound), within a bf16 unit of ``F.silu``; every GPU path uses them, so cached scores
still equal recompute's bit for bit. The layer's input norm (:func:`layer_norm`) and the
token embedding (:func:`embed`: torch's where/lookup/add take seven launches and, on a slow host,
~0.5 ms of launch gaps per batch) are one kernel each too.

On the CPU, for other dtypes or unaligned shapes: the torch references.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import _cuda

_SRC = "hstu_norm.cu"
_EXPRS = ("hstu_norm_mul", "hstu_layer_norm", "hstu_silu", "hstu_embed")
# STREAMGR_FUSED_FINISH=0: torch's unfused ops on the GPU too (A/B runs of whole benchmarks)
ENABLED = os.environ.get("STREAMGR_FUSED_FINISH", "1") != "0"
ROWS_PER_BLOCK = 8  # one warp per row, 256 threads


def finish_reference(x: torch.Tensor, attn: torch.Tensor, u: torch.Tensor, norm: nn.LayerNorm,
                     output: nn.Linear, u_raw: bool = False) -> torch.Tensor:
    """``x + output(norm(attn) * u)``: ``x`` [T, M], ``attn`` and ``u`` [T, N]; ``u_raw``:
    ``u`` is still before its SiLU."""
    return x + output(norm(attn) * (F.silu(u) if u_raw else u))


def _vec_rows(t: torch.Tensor) -> int | None:
    """Row stride in 16-byte vectors if the kernel can read ``t`` [T, C] in place."""
    if t.dim() != 2 or t.stride(1) != 1 or t.shape[1] % 8 or t.stride(0) % 8 \
            or t.data_ptr() % 16:
        return None
    return t.stride(0) // 8


def _params_ok(*params: torch.Tensor | None) -> bool:
    """Weights the kernels read as 16-byte vectors: present, bf16, contiguous and aligned."""
    return all(p is not None and p.dtype == torch.bfloat16 and p.is_contiguous()
               and p.data_ptr() % 16 == 0 for p in params)


def _bf16_rows(*ts: torch.Tensor) -> bool:
    """The kernels can read/write these [T, C] tensors in place (bf16, GPU, 16-byte rows)."""
    return (ENABLED and all(t.dtype == torch.bfloat16 for t in ts) and _cuda.usable(*ts)
            and all(_vec_rows(t) is not None for t in ts))


def _launch_rows(name: str, rows: int, args: tuple) -> None:
    """One of the kernels over ``rows`` rows, a warp per row."""
    if rows:
        _cuda.launch(_cuda.kernel(_SRC, _EXPRS, name), (-(-rows // ROWS_PER_BLOCK),),
                     (32 * ROWS_PER_BLOCK,), args)


def fused_ok(x: torch.Tensor, attn: torch.Tensor | None, u: torch.Tensor, norm: nn.LayerNorm,
             output: nn.Linear) -> bool:
    """Whether :func:`finish` runs the kernel here: bf16 on a GPU with CuPy, an affine norm and
    a biased projection, 16-byte aligned rows of widths that are multiples of 8 (``attn``
    None: the attention's contiguous output, checked when it exists)."""
    ts = (x, u) if attn is None else (x, attn, u)
    return (_params_ok(norm.weight, norm.bias, output.weight, output.bias) and _bf16_rows(*ts)
            and x.is_contiguous() and (attn is None or attn.is_contiguous()))


def norm_mul(x: torch.Tensor, attn: torch.Tensor, u: torch.Tensor, norm: nn.LayerNorm,
             out_bias: torch.Tensor, u_raw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel: ``y = bf16(bf16(norm(attn)) * u)`` and ``xb = bf16(x + out_bias)``
    (``u_raw``: ``bf16(SiLU(u))`` in place of ``u``)."""
    T, N = attn.shape
    M = x.shape[1]
    y = torch.empty((T, N), dtype=attn.dtype, device=attn.device)
    xb = torch.empty_like(x)
    _launch_rows("hstu_norm_mul", T, (
        _cuda.ptr(attn), _cuda.ptr(u), np.int64(_vec_rows(u)), _cuda.ptr(norm.weight),
        _cuda.ptr(norm.bias), _cuda.ptr(x), _cuda.ptr(out_bias), _cuda.ptr(y), _cuda.ptr(xb),
        np.int64(T), np.int32(N // 8), np.int32(M // 8), np.float32(norm.eps),
        np.int32(1 if u_raw else 0)))
    return y, xb


def finish(x: torch.Tensor, attn: torch.Tensor, u: torch.Tensor, norm: nn.LayerNorm,
           output: nn.Linear, u_raw: bool = False) -> torch.Tensor:
    """``x + output(norm(attn) * u)``: the fused kernel and one GEMM where :func:`fused_ok`,
    the torch reference otherwise (``u_raw``: ``u`` before its SiLU)."""
    if not fused_ok(x, attn, u, norm, output):
        return finish_reference(x, attn, u, norm, output, u_raw)
    y, xb = norm_mul(x, attn, u, norm, output.bias, u_raw)
    return xb.addmm_(y, output.weight.t())


def layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """``norm(x)`` for ``x`` [T, M] (one kernel on the GPU, torch's ``LayerNorm`` otherwise)."""
    if x.dim() != 2 or not _bf16_rows(x) or not _params_ok(norm.weight, norm.bias):
        return norm(x)
    T, M = x.shape
    y = torch.empty((T, M), dtype=x.dtype, device=x.device)
    _launch_rows("hstu_layer_norm", T, (
        _cuda.ptr(x), np.int64(_vec_rows(x)), _cuda.ptr(norm.weight), _cuda.ptr(norm.bias),
        _cuda.ptr(y), np.int64(T), np.int32(M // 8), np.float32(norm.eps)))
    return y


def silu(t: torch.Tensor) -> torch.Tensor:
    """``F.silu(t)`` of a [T, C] tensor (a column block of a wider one is read in place), as a
    contiguous tensor."""
    if t.dim() != 2 or not _bf16_rows(t):
        return F.silu(t).contiguous()
    T, C = t.shape
    out = torch.empty((T, C), dtype=t.dtype, device=t.device)
    if C:
        _launch_rows("hstu_silu", T, (_cuda.ptr(t), np.int64(_vec_rows(t)), _cuda.ptr(out),
                                      np.int64(T), np.int32(C // 8)))
    return out


def embed_reference(ids: torch.Tensor, is_action: torch.Tensor, positions: torch.Tensor,
                    items: nn.Embedding, actions: nn.Embedding,
                    position: nn.Embedding) -> torch.Tensor:
    """Each token's item or action embedding plus its position's."""
    it = items(torch.where(is_action, 0, ids))
    ac = actions(torch.where(is_action, ids, 0))
    return torch.where(is_action[:, None], ac, it) + position(positions)


def embed(ids: torch.Tensor, is_action: torch.Tensor, positions: torch.Tensor,
          items: nn.Embedding, actions: nn.Embedding, position: nn.Embedding) -> torch.Tensor:
    """:func:`embed_reference` in one kernel on the GPU (bit for bit the same: a select and one
    bf16 add); ``ids`` and ``positions`` int64, ``is_action`` bool, all [T]."""
    tables = (items.weight, actions.weight, position.weight)
    if (not _bf16_rows(*tables) or not _params_ok(*tables) or ids.dtype != torch.int64
            or positions.dtype != torch.int64 or is_action.dtype != torch.bool or not _cuda.usable(ids, is_action, positions)
            or any(t.dim() != 1 or t.stride(0) != 1 for t in (ids, is_action, positions))):
        return embed_reference(ids, is_action, positions, items, actions, position)
    T, M = ids.shape[0], items.weight.shape[1]
    out = torch.empty((T, M), dtype=items.weight.dtype, device=ids.device)
    if M:
        _launch_rows("hstu_embed", T, (
            _cuda.ptr(ids), _cuda.ptr(is_action), _cuda.ptr(positions), _cuda.ptr(items.weight),
            _cuda.ptr(actions.weight), _cuda.ptr(position.weight), _cuda.ptr(out), np.int64(T),
            np.int32(M // 8)))
    return out
