"""T5 projection weights laid out for fewer, larger GEMMs (bf16 serving on CUDA).

``fuse_projections`` makes q, k and v of each self-attention views of one [3 inner, D] buffer,
and the cross-attention k and v of every decoder layer views of one [layers x 2 inner, D]
buffer. A layer's q/k/v is then one GEMM and a batch's cross K/V of all layers one GEMM: a
gen-ref decoder step's three [8,192 x 512] x [512 x 512] GEMMs had 128 output tiles each for
132 SMs (~14.5 us apiece on the H200, under 300 TFLOP/s). Views, as ``T5.align_head``'s:
weights written in place (a refit copies into the state dict's tensors) stay the fused
weights. Before each use ``qkv`` and ``cross_kv`` check that the views still share the buffer
(a module whose parameters were replaced runs the separate GEMMs), so the fusion can never
serve stale weights. The outputs are column slices of one GEMM's result (row stride 3 inner
or layers x 2 inner): the attention kernels read such views in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _fuse(linears) -> torch.Tensor:
    """One buffer holding the weights of ``linears`` (same shape) one after another; each
    linear's weight becomes a view of its rows."""
    w0 = linears[0].weight
    n = w0.shape[0]
    buf = torch.empty(len(linears) * n, w0.shape[1], dtype=w0.dtype, device=w0.device)
    for i, lin in enumerate(linears):
        buf[i * n:(i + 1) * n].copy_(lin.weight.detach())
        lin.weight = nn.Parameter(buf[i * n:(i + 1) * n], requires_grad=False)
    return buf


def _views_of(buf: torch.Tensor | None, linears) -> bool:
    """Every weight of ``linears`` is still its rows of ``buf``, in order."""
    if buf is None:
        return False
    n, D = linears[0].weight.shape
    step = n * D * buf.element_size()
    base = buf.data_ptr()
    return all(lin.weight.data_ptr() == base + i * step and lin.weight.shape == (n, D)
               and lin.weight.dtype == buf.dtype and lin.weight.is_contiguous()
               for i, lin in enumerate(linears))


def _cross_linears(model) -> list:
    return [lin for blk in model.decoder.block
            for lin in (blk.layer[1].EncDecAttention.k, blk.layer[1].EncDecAttention.v)]


def fuse_projections(model):
    """Lay ``model``'s projections out as fused buffers (see the module docstring); after its
    last move to a device or dtype (a move copies each parameter on its own)."""
    for stack in (model.encoder, model.decoder):
        for blk in stack.block:
            a = blk.layer[0].SelfAttention
            a._qkv = _fuse([a.q, a.k, a.v])
    model._cross_kv = _fuse(_cross_linears(model))
    return model


def _fusable(h: torch.Tensor) -> bool:
    """Half precision only: fp32 keeps the separate GEMMs, bit-equal to Hugging Face's."""
    return h.dtype in (torch.bfloat16, torch.float16)


def qkv(a, h: torch.Tensor):
    """(q, k, v) of the attention ``a`` on ``h`` [..., D], each [..., inner]: one GEMM over the
    fused buffer where it is intact (half precision), else three."""
    buf = getattr(a, "_qkv", None)
    if _fusable(h) and _views_of(buf, (a.q, a.k, a.v)):
        return F.linear(h, buf).chunk(3, dim=-1)
    return a.q(h), a.k(h), a.v(h)


def cross_kv(model, enc: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per decoder layer, the cross-attention (K, V) of ``enc`` [R, S, D], each [R, S, H, d]
    (views of one GEMM's output where the fused buffer is intact)."""
    R, S, _ = enc.shape
    H, d = model.cfg.num_heads, model.cfg.d_kv
    lins = _cross_linears(model)
    buf = getattr(model, "_cross_kv", None)
    if _fusable(enc) and _views_of(buf, lins):
        parts = F.linear(enc, buf).chunk(len(lins), dim=-1)
    else:
        parts = [lin(enc) for lin in lins]
    views = [p.view(R, S, H, d) for p in parts]
    return list(zip(views[0::2], views[1::2]))
