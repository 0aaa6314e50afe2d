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

import os
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import StreamgrError
from . import _cuda, hstu_attention_cuda

# STREAMGR_HSTU_PLAN=wmma|split|direct pins the CUDA path (A/B runs of whole benchmarks).
DEFAULT_PLAN = os.environ.get("STREAMGR_HSTU_PLAN") or None

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


# -- the jagged batch over pages ------------------------------------------------------------------

@dataclass
class JaggedKV:
    """Where each user's history keys live for one batch (the same for every layer).

    Queries (and the rows of this batch's ``k``/``v``) are, per user, its new history tokens then
    its candidates, from ``q_offsets[b]``. History keys ``0..hist_lens[b]-1`` live in pages
    (``pages[b]``, ``page_tokens`` per page, in ``store[layer]``) when ``paged[b]``, else in rows
    ``kv_rows[b] + j`` of ``k``/``v`` (recompute: the new tokens are the whole history).
    """

    q_offsets: list[int]
    num_candidates: list[int]
    hist_lens: list[int]
    paged: list[bool]
    kv_rows: list[int]
    pages: list[list[int]]
    page_tokens: int = 1
    store: torch.Tensor | None = None  # [layers, pages, 2, page_tokens, heads, dim]
    _cache: dict = field(default_factory=dict)

    @classmethod
    def recompute(cls, q_offsets: list[int], num_candidates: list[int]) -> "JaggedKV":
        hist = [q_offsets[i + 1] - q_offsets[i] - c for i, c in enumerate(num_candidates)]
        n = len(num_candidates)
        return cls(q_offsets, num_candidates, hist, [False] * n, list(q_offsets[:-1]), [[]] * n)

    @property
    def new_lens(self) -> list[int]:
        return [self.q_offsets[i + 1] - self.q_offsets[i] - c
                for i, c in enumerate(self.num_candidates)]

    # Index tensors are built once per batch and reused by every layer.
    def reference_index(self, device: torch.device):
        if "ref" not in self._cache:
            P = self.page_tokens
            g_page, g_off, perm, kv_off = [], [], [], [0]
            g_total = sum(h for h, p in zip(self.hist_lens, self.paged) if p)
            g = 0
            for b, (hist, paged, c) in enumerate(zip(self.hist_lens, self.paged, self.num_candidates)):
                q0 = self.q_offsets[b]
                new = self.q_offsets[b + 1] - q0 - c
                if paged:
                    pos = np.arange(hist)
                    g_page.append(np.asarray(self.pages[b], dtype=np.int64)[pos // P])
                    g_off.append(pos % P)
                    perm.append(np.arange(g, g + hist))
                    g += hist
                else:
                    perm.append(np.arange(self.kv_rows[b], self.kv_rows[b] + hist) + g_total)
                perm.append(np.arange(q0 + new, q0 + new + c) + g_total)
                kv_off.append(kv_off[-1] + hist + c)
            cat = lambda xs: torch.from_numpy(  # noqa: E731
                np.concatenate(xs) if xs else np.zeros(0, np.int64)).to(device)
            self._cache["ref"] = (cat(g_page), cat(g_off), cat(perm), kv_off)
        return self._cache["ref"]

    def cuda_plan(self, device: torch.device, heads: int, force: str | None = None,
                  dim: int = 0, cand_only: bool = False):
        """The CUDA work items of this batch (built once, reused by every layer); ``dim``:
        the head dim (tiles with tails need 64 or more); ``cand_only``: the row tiles that hold
        a candidate only (the last layer's)."""
        key = ("cuda", heads, force, dim, cand_only)
        if key not in self._cache:
            self._cache[key] = hstu_attention_cuda.plan(self, device, heads, force, dim,
                                                        cand_only)
        return self._cache[key]


def kernel_runs(device: torch.device, dtype: torch.dtype, dim: int,
                store: torch.Tensor | None = None) -> bool:
    """:func:`hstu_attention_jagged` runs the CUDA kernel's plans (not the reference, not the
    previous ``wmma`` kernel) for activations of ``dtype`` and head dim ``dim`` on ``device``
    (over pages of ``store``): rows outside the plan are left alone, so a batch may carry
    padding rows."""
    return (dtype == torch.bfloat16 and dim in (32, 64, 128) and device.type == "cuda"
            and DEFAULT_PLAN != "wmma"
            and _cuda.usable_on(device)
            and (store is None or store.dtype == torch.bfloat16))


def prepare_plans(desc: JaggedKV, device: torch.device, dtype: torch.dtype, heads: int,
                  dim: int) -> None:
    """The batch's CUDA work items (every layer's and the last layer's) built and uploaded now,
    as :func:`hstu_attention_jagged` would at its first call: a caller about to queue other
    host-to-device copies (a host hit's onload) keeps these small ones ahead of them on the copy
    engine. Nothing where the reference or the previous kernel will run."""
    if not kernel_runs(device, dtype, dim, desc.store):
        return
    for cand_only in (False, True):
        desc.cuda_plan(device, heads, DEFAULT_PLAN, dim, cand_only)


def hstu_attention_jagged_reference(q, k, v, desc: JaggedKV, layer: int, alpha: float,
                                    max_len: int) -> torch.Tensor:
    """Gather each user's history K/V (pages or rows) next to its candidates, then the
    contiguous reference."""
    g_page, g_off, perm, kv_off = desc.reference_index(q.device)
    if desc.store is not None and g_page.numel():
        ls = desc.store[layer]
        gk, gv = ls[g_page, 0, g_off].to(k.dtype), ls[g_page, 1, g_off].to(v.dtype)
        k_all, v_all = torch.cat([gk, k]).index_select(0, perm), torch.cat([gv, v]).index_select(0, perm)
    else:
        k_all, v_all = k.index_select(0, perm), v.index_select(0, perm)
    return hstu_attention_reference(q, k_all, v_all, desc.q_offsets, kv_off,
                                    desc.num_candidates, alpha, max_len)


def hstu_attention_jagged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, desc: JaggedKV,
                          layer: int, alpha: float, max_len: int,
                          out: torch.Tensor | None = None, plan: str | None = None,
                          cand_only: bool = False) -> torch.Tensor:
    """HSTU attention of a jagged batch whose history K/V are paged or contiguous.

    ``q, k, v``: ``[rows, heads, dim]``, rows laid out as ``desc.q_offsets`` says (strided views
    of one projection are read in place); the new history tokens' K/V must already be in their
    pages for paged users. CUDA kernel for bf16 with dim 32/64/128 on a GPU (``plan`` forces
    ``"split"`` or ``"direct"`` work items, ``"wmma"`` the previous kernel: tests and benches);
    the torch reference otherwise. ``cand_only``: only the candidates' rows are read
    afterwards (the model's last layer); the kernel then leaves the other rows unwritten.
    """
    D = q.shape[-1]
    if (q.dtype == torch.bfloat16 and D in (32, 64, 128) and _cuda.usable(q, k, v)
            and (desc.store is None or desc.store.dtype == torch.bfloat16)):
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        elif not out.is_contiguous() or out.shape != q.shape or out.dtype != q.dtype:
            raise StreamgrError("hstu_attention_jagged: out must be contiguous, shaped like q")
        plan = plan or DEFAULT_PLAN
        if plan == "wmma":
            hstu_attention_cuda.run_wmma(q, k, v, desc, layer, alpha, max_len, out)
            return out
        H = q.shape[1]
        if any(hstu_attention_cuda.row_stride(t, H, D) is None for t in (q, k, v)):
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        p = desc.cuda_plan(q.device, H, plan, D, cand_only)
        hstu_attention_cuda.run(q, k, v, desc, layer, alpha, max_len, out, p)
        return out
    res = hstu_attention_jagged_reference(q, k, v, desc, layer, alpha, max_len)
    if out is not None:
        out.copy_(res)
        return out
    return res
