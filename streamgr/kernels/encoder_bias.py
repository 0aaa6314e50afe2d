"""The T5 encoder's dense attention bias: relative-position bias plus key padding.

The encoder's fused attention takes one additive bias [rows, heads, S, S]: the relative
position bias (a function of ``j - i`` only, so a [heads, 2S - 1] table of distances) where
key ``j`` of row ``r`` is real, and the most negative finite value where it is padding.
``encoder_bias_reference`` builds it with torch (each query row a window of the table, then a
broadcast add of the padding); ``encoder_bias`` writes it with one CUDA kernel
(``cuda_kernels/encoder_bias.cu``: 16-byte stores; torch's broadcast add ran as a generic
strided kernel) for bf16 on CUDA, bit-equal to the reference; other dtypes and devices take
the reference. Timings: ``tools/bench_encoder_bias.py``, docs/benchmarks.md.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import StreamgrError
from . import _cuda

_SRC, _EXPR = "encoder_bias.cu", ("encoder_bias_bf16",)
# The bits of bf16's most negative finite value (the padding's bias).
_BF16_MIN_BITS = torch.tensor(torch.finfo(torch.bfloat16).min,
                              dtype=torch.bfloat16).view(torch.int16).item() & 0xFFFF


def encoder_bias_reference(table: torch.Tensor, keep: torch.Tensor,
                           dtype: torch.dtype) -> torch.Tensor:
    """``table`` [H, 2S - 1] fp32 (index ``j - i + S - 1``), ``keep`` [R, S] bool ->
    [R, H, S, S] of ``dtype``: ``table`` where kept, ``finfo(dtype).min`` on padded keys."""
    S = keep.shape[1]
    pos = table.unfold(1, S, 1).flip(1)[None].to(dtype)  # row i: table[:, S-1-i : 2S-1-i]
    pad = torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype)[:, None, None, :]
    return pos + pad


def encoder_bias(table: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``encoder_bias_reference`` by the CUDA kernel where it applies (bf16, CUDA, S a
    multiple of 8), else by the reference."""
    R, S = keep.shape
    if table.dim() != 2 or table.shape[1] != 2 * S - 1:
        raise StreamgrError(f"encoder_bias: table [H, {2 * S - 1}] for keys of {S} positions, "
                            f"got {tuple(table.shape)}")
    H = table.shape[0]
    if dtype != torch.bfloat16 or S % 8 or R == 0 or R * H >= 65536 \
            or not _cuda.usable(table, keep):  # (R * H is the grid's y dimension)
        return encoder_bias_reference(table, keep, dtype)
    t = table.float().contiguous()
    k = keep.contiguous().view(torch.uint8)
    if k.data_ptr() % 8:  # the kernel reads 8 mask bytes at a time
        k = k.clone()
    out = torch.empty(R, H, S, S, dtype=dtype, device=table.device)
    fn = _cuda.kernel(_SRC, _EXPR, _EXPR[0])
    _cuda.launch(fn, (-(-S * S // 8 // 256), R * H), (256,),
                 (_cuda.ptr(t), _cuda.ptr(k), np.int32(H), np.int32(S),
                  np.uint16(_BF16_MIN_BITS), _cuda.ptr(out)))
    return out
