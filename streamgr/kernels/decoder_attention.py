"""The SID decoder's self-attention: one query per beam over its few own keys (<= depth).

Step ``t`` of the beam search: each beam's new K/V are written at position ``t`` of the
step's self-K/V buffer and its query attends positions ``0..t`` with T5's relative-position
bias (no 1/sqrt(d), fp32 softmax). A batched GEMM of [1, d] x [d, <= depth] per row and head
runs slow tensor-core tiles, and the torch reference below costs a dozen elementwise kernels
(strided fp32 casts of K and V among them). The Numba CUDA kernel
(``decoder_attention_numba``: a warp per beam and head, pairs of bf16 per 32-bit load) does
the write and the attention in one launch per layer and step, on torch's stream, inside the
decode plans' CUDA graphs. bf16 CUDA tensors take it; everything else (fp32, whose results stay
bit-equal to Hugging Face's, and the CPU) takes the reference. ``NUMBA_ENABLE_CUDASIM=1`` runs
the kernel on the CPU for the tests.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from ..errors import StreamgrError

SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
MAX_T = 8  # positions a query can attend (SID depth); the kernel keeps them in registers


def attend_few(q, k, v, bias) -> torch.Tensor:
    """``q`` [N, H, d], ``k``/``v`` [T, N, H, d], ``bias`` [T, H] -> [N, H, d]: softmax over
    the T keys of fp32 dot products (+ bias), fp32 weighted sum, cast to ``v``'s dtype."""
    s = (q.float()[None] * k.float()).sum(-1)  # [T, N, H]
    p = F.softmax(s + bias[:, None, :], dim=0)
    return (p[..., None] * v.float()).sum(0).to(v.dtype)


def self_attend_reference(q, k_new, v_new, K, V, step: int, bias) -> torch.Tensor:
    """Write ``k_new``/``v_new`` [N, H, d] at ``K[step]``/``V[step]`` ([T, N, H, d] views),
    then ``attend_few`` over positions ``0..step``."""
    K[step] = k_new
    V[step] = v_new
    return attend_few(q, K[:step + 1], V[:step + 1], bias)


@functools.lru_cache(maxsize=None)
def _numba_cuda() -> bool:
    try:
        from numba import config, cuda
        # Small grids are by design here (a few requests' rows): Numba's per-launch
        # low-occupancy warning only floods a server's log.
        config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
        return cuda.is_available()
    except Exception:  # not installed, or its numpy is not one it supports
        return False


def usable(*tensors: torch.Tensor) -> bool:
    """The Numba kernel serves these tensors: bf16 on CUDA (or the simulator when asked)."""
    if os.environ.get("STREAMGR_KERNELS", "").lower() == "torch":
        return False
    return all(t.is_cuda and t.dtype == torch.bfloat16 for t in tensors) and _numba_cuda()


def self_attend(q, k_new, v_new, K, V, step: int, bias, impl: str | None = None):
    """``self_attend_reference`` by the Numba kernel where it applies (``impl="numba"`` forces
    it, e.g. under the simulator; ``"torch"`` the reference)."""
    T = K.shape[0]
    if q.dim() != 3 or K.dim() != 4 or K.shape[1:] != q.shape or V.shape != K.shape \
            or k_new.shape != q.shape or v_new.shape != q.shape or not 0 <= step < T \
            or bias.shape[0] < step + 1:
        raise StreamgrError(f"self_attend: q/k_new/v_new [N, H, d], K/V [T, N, H, d] with "
                            f"step < T, bias [>= step+1, H]; got q {tuple(q.shape)}, "
                            f"K {tuple(K.shape)}, step {step}")
    use = impl == "numba" or (impl is None and usable(q, k_new, v_new, K, V))
    if not use or step + 1 > MAX_T or q.shape[-1] % 2 or q.dtype != torch.bfloat16 \
            or not (K[0].is_contiguous() and V[0].is_contiguous()):
        return self_attend_reference(q, k_new, v_new, K, V, step, bias)
    from . import decoder_attention_numba as nb
    return nb.run(q, k_new, v_new, K, V, step, bias)
