"""HSTU attention over a jagged batch: the torch reference every GPU kernel is checked against.

Layout (no padding to the longest user). For user ``b``:

- queries ``q[q_offsets[b]:q_offsets[b+1]]``: the user's *new* history tokens, then its candidates;
- keys/values ``k, v[kv_offsets[b]:kv_offsets[b+1]]``: the user's *whole* history (cached prefix
  and new tokens, in position order), then the candidates' own keys/values.

With ``C = num_candidates[b]``, ``hist = kv_len - C`` and ``new = q_len - C``, the new history
token ``i`` sits at absolute position ``hist - new + i`` and attends keys ``0..pos`` (causal);
candidate ``c`` attends every history key and its own key ``hist + c``, never another candidate.
Recompute is the case ``new == hist`` (queries and keys are the same tokens).

The attention is HSTU's pointwise form ``A = SiLU(alpha q k^T) / N`` with ``N`` a fixed configured
maximum length (not the batch's), so a cached token's K/V never change as history grows.
Shapes: ``q, k`` are ``[tokens, heads, dqk]``, ``v`` and the output ``[tokens, heads, dv]``.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from ..errors import StreamgrError

# History query rows per tile: bounds the [heads, tile, keys] score block (40k keys, 4 heads,
# bf16: 320 MiB) while keeping each matmul large enough to run near peak.
QUERY_TILE = 1024


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: Sequence[int],
           kv_offsets: Sequence[int], num_candidates: Sequence[int]) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise StreamgrError("hstu_attention: q, k, v must be [tokens, heads, dim]")
    if q.shape[1:] != k.shape[1:] or k.shape[:2] != v.shape[:2]:
        raise StreamgrError(f"hstu_attention: shapes q{tuple(q.shape)} k{tuple(k.shape)} "
                            f"v{tuple(v.shape)} do not agree")
    if not (q.dtype == k.dtype == v.dtype):
        raise StreamgrError("hstu_attention: q, k, v must share a dtype")
    b = len(num_candidates)
    if len(q_offsets) != b + 1 or len(kv_offsets) != b + 1:
        raise StreamgrError("hstu_attention: offsets must have batch + 1 entries")
    if q_offsets[-1] != q.shape[0] or kv_offsets[-1] != k.shape[0]:
        raise StreamgrError("hstu_attention: last offset must equal the token count")
    for i in range(b):
        ql, kl, c = q_offsets[i + 1] - q_offsets[i], kv_offsets[i + 1] - kv_offsets[i], num_candidates[i]
        if c < 0 or ql < c or kl < ql:
            raise StreamgrError(f"hstu_attention: user {i}: {ql} queries, {kl} keys, {c} "
                                f"candidates is not a valid layout")


def hstu_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             q_offsets: Sequence[int], kv_offsets: Sequence[int],
                             num_candidates: Sequence[int], alpha: float, max_len: int,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """Tiled torch implementation (see the module docstring for the layout).

    Offsets and candidate counts are host-side sequences so the loop never syncs the device.
    """
    _check(q, k, v, q_offsets, kv_offsets, num_candidates)
    heads, dv = v.shape[1], v.shape[2]
    if out is None:
        out = torch.empty(q.shape[0], heads, dv, dtype=v.dtype, device=v.device)
    inv_n = 1.0 / float(max_len)
    tri_cache: dict[int, torch.Tensor] = {}
    for b in range(len(num_candidates)):
        q0, q1, k0, k1 = q_offsets[b], q_offsets[b + 1], kv_offsets[b], kv_offsets[b + 1]
        c = num_candidates[b]
        hist, new = (k1 - k0) - c, (q1 - q0) - c
        start = hist - new  # absolute position of the first new token
        qh = q[q0:q1].transpose(0, 1)  # [H, q_len, d]
        kh = k[k0:k1].transpose(0, 1)
        vh = v[k0:k1].transpose(0, 1)
        for i0 in range(0, new, QUERY_TILE):
            i1 = min(new, i0 + QUERY_TILE)
            t = i1 - i0
            key_end = start + i1
            s = torch.matmul(qh[:, i0:i1], kh[:, :key_end].transpose(1, 2))
            a = F.silu(s * alpha)
            tri = tri_cache.get(t)
            if tri is None:
                tri = tri_cache[t] = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
            # Keys before the tile are visible to every row; only the diagonal block is causal.
            diag = a[:, :, start + i0:key_end]
            diag.masked_fill_(~tri, 0)
            o = torch.matmul(a, vh[:, :key_end]) * inv_n
            out[q0 + i0:q0 + i1] = o.transpose(0, 1)
        if c:
            qc = qh[:, new:]  # [H, C, d]
            o = torch.zeros(heads, c, dv, dtype=v.dtype, device=v.device)
            if hist:
                s = torch.matmul(qc, kh[:, :hist].transpose(1, 2))
                o = torch.matmul(F.silu(s * alpha), vh[:, :hist])
            own = F.silu((qc * kh[:, hist:]).sum(-1, keepdim=True) * alpha)
            o = (o + own * vh[:, hist:]) * inv_n
            out[q0 + new:q1] = o.transpose(0, 1)
    return out


def hstu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   q_offsets: Sequence[int], kv_offsets: Sequence[int],
                   num_candidates: Sequence[int], alpha: float, max_len: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch: the torch reference (GPU kernels register here as they land)."""
    return hstu_attention_reference(q, k, v, q_offsets, kv_offsets, num_candidates, alpha,
                                    max_len, out=out)
