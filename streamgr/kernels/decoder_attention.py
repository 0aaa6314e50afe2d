"""The SID decoder's self-attention: one query per beam over its few own keys (<= depth).

Step ``t`` of the beam search: each beam's new K/V are written at position ``t`` of the
self-K/V buffer and its query attends positions ``0..t`` with T5's relative-position bias (no
1/sqrt(d), fp32 softmax). The buffer keeps every position's rows where the step that wrote
them left them; ``anc[p, i]`` names the row at position ``p`` of beam ``i``'s ancestor (parent
pointers), so the survivors of a step are never copied (the compaction that copied each
position's K/V for them cost ~0.24 ms per gen-ref batch of 32). A batched GEMM of [1, d] x [d, <= depth] per row and head
runs slow tensor-core tiles, and the torch reference below costs a dozen elementwise kernels
(strided fp32 casts of K and V among them). The Numba CUDA kernel
(``decoder_attention_numba``: a half-warp per beam and head, 4 bf16 per 64-bit load) does
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


def self_attend_reference(q, k_new, v_new, K, V, step: int, bias, anc=None) -> torch.Tensor:
    """Write ``k_new``/``v_new`` [N, H, d] at rows ``0..N-1`` of ``K[step]``/``V[step]`` ([T,
    >= N, H, d] views), then ``attend_few`` over positions ``0..step``, position ``p < step`` of
    row ``i`` at row ``anc[p, i]`` (``anc`` [>= step, >= N] integers; None: row ``i``)."""
    N = q.shape[0]
    K[step, :N] = k_new
    V[step, :N] = v_new
    if anc is None:
        return attend_few(q, K[:step + 1, :N], V[:step + 1, :N], bias)
    rows = [anc[p, :N] for p in range(step)]
    keys = torch.stack([K[p, r] for p, r in enumerate(rows)] + [k_new])
    vals = torch.stack([V[p, r] for p, r in enumerate(rows)] + [v_new])
    return attend_few(q, keys, vals, bias)


@functools.lru_cache(maxsize=None)
def numba_cuda_available() -> bool:
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
    return (all(t.is_cuda and t.dtype == torch.bfloat16 for t in tensors)
            and numba_cuda_available())


def self_attend(q, k_new, v_new, K, V, step: int, bias, anc=None, impl: str | None = None):
    """``self_attend_reference`` by the Numba kernel where it applies (``impl="numba"`` forces
    it, e.g. under the simulator; ``"torch"`` the reference)."""
    T, N = K.shape[0], q.shape[0]
    if q.dim() != 3 or K.dim() != 4 or K.shape[2:] != q.shape[1:] or K.shape[1] < N \
            or V.shape != K.shape or k_new.shape != q.shape or v_new.shape != q.shape \
            or not 0 <= step < T or bias.shape[0] < step + 1 or (anc is not None and (
                anc.dim() != 2 or anc.shape[0] < step or anc.shape[1] < N)):
        raise StreamgrError(f"self_attend: q/k_new/v_new [N, H, d], K/V [T, >= N, H, d] with "
                            f"step < T, bias [>= step+1, H], anc [>= step, >= N]; got q "
                            f"{tuple(q.shape)}, K {tuple(K.shape)}, step {step}")
    use = impl == "numba" or (impl is None and usable(q, k_new, v_new, K, V))
    if not use or step + 1 > MAX_T or q.shape[-1] % 4 or q.dtype != torch.bfloat16 \
            or not (K[0].is_contiguous() and V[0].is_contiguous()) \
            or any(x.stride(0) % 4 or x.storage_offset() % 4 for x in (K, V)):  # 8-byte loads
        return self_attend_reference(q, k_new, v_new, K, V, step, bias, anc)
    from . import decoder_attention_numba as nb
    return nb.run(q, k_new, v_new, K, V, step, bias, anc)
