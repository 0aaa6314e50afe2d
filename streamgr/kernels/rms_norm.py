"""T5's RMS norm for half-precision CUDA activations: ``x * rsqrt(mean(x^2) + eps) * w`` in
fp32, rounded once. The Numba CUDA kernel (``rms_norm_numba``: a warp a row, 4 bf16 per 64-bit
load, the row held in registers) serves bf16 rows of a multiple of 4 up to ``MAX_D``; torch's
fused ``F.rms_norm`` everything else, or all of it with ``STREAMGR_RMS_NORM=torch`` (A/B runs).
In gen-ref's plans the 48 norms of a batch of 32 took 0.445 ms with torch's kernel and 0.337 ms
with this one (session 15, docs/benchmarks.md). The reference below is the arithmetic both are
held to.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..errors import StreamgrError
from .decoder_attention import SIMULATED, numba_cuda_available


MAX_D = 1024  # the Numba kernel holds a row in its warp's registers: 8 quads a lane at most


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (weight.float() * x.float() * torch.rsqrt(var + eps)).to(x.dtype)


def numba_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and x.shape[-1] % 4 == 0 and x.shape[-1] <= MAX_D and weight.shape == x.shape[-1:]
            and (SIMULATED or (x.is_cuda and weight.is_cuda and numba_cuda_available())))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             impl: str | None = None) -> torch.Tensor:
    """The fused path's norm: the Numba kernel where it applies (``impl`` or
    ``STREAMGR_RMS_NORM``: "numba", the default, or "torch"), else ``F.rms_norm``."""
    if weight.shape != x.shape[-1:]:
        raise StreamgrError(f"rms_norm: weight {tuple(weight.shape)} for rows of "
                            f"{x.shape[-1]}")
    impl = impl or os.environ.get("STREAMGR_RMS_NORM", "numba").lower()
    if impl == "numba" and numba_applies(x, weight):
        from . import rms_norm_numba as nb
        return nb.run(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)
