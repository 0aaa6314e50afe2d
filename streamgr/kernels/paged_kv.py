"""Paged K/V movement: append, onload scatter and offload gather (kernels and torch references).

Layouts (MTServe section 4.1):

- device page store ``[layers, pages, 2, page_tokens, heads, dim]`` (``2`` = K, V);
- a host chunk of ``chunk_tokens = k * page_tokens`` tokens, all layers, is laid out as the ``k``
  pages it fills: ``[layers, k, 2, page_tokens, heads, dim]``, so onload and offload are plain
  block copies and only the device side scatters/gathers pages.

Token ``t`` of a user lives in page ``pages[t // page_tokens]`` at offset ``t % page_tokens``.
GPU kernels: ``cuda_kernels/block_copy.cu`` (block copies, page scatter) and
``cuda_kernels/paged_append.cu`` (the fused append); the torch references run elsewhere.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import StreamgrError
from . import _cuda

_COPY_SRC = "block_copy.cu"
_COPY_UNITS = {16: "uint4", 4: "unsigned int", 2: "unsigned short"}
_COPY_EXPRS = tuple(f"block_copy<{t}>" for t in _COPY_UNITS.values()) + ("page_scatter<uint4>",)


def block_copy(dst: torch.Tensor, src: torch.Tensor, dst_index: torch.Tensor,
               src_index: torch.Tensor, block_elems: int) -> None:
    """``dst`` block ``dst_index[i]`` <- ``src`` block ``src_index[i]`` (blocks of
    ``block_elems`` elements, counted from each tensor's first element). Both tensors are
    viewed flat; the CUDA kernel picks the widest copy unit that every address allows."""
    if dst.dtype != src.dtype or not dst.is_contiguous() or not src.is_contiguous():
        raise StreamgrError("block_copy: contiguous tensors of one dtype required")
    n = dst_index.shape[0]
    if src_index.shape[0] != n:
        raise StreamgrError("block_copy: index lengths differ")
    if n == 0:
        return
    if _cuda.usable(dst, src, dst_index, src_index):
        es = dst.element_size()
        nbytes = block_elems * es
        unit = _cuda.widest_unit(nbytes, _COPY_UNITS, dst, src) if es in (2, 4) else None
        if unit is not None:
            fn = _cuda.kernel(_COPY_SRC, _COPY_EXPRS, f"block_copy<{_COPY_UNITS[unit]}>")
            per = nbytes // unit
            threads = min(256, max(32, 1 << (per - 1).bit_length()))
            parts = max(1, min(64, per // 1024))  # ~16 KiB of 16-byte units per CUDA block
            _cuda.launch(fn, (min(n, 2**31 - 1), parts), (threads,), (
                _cuda.ptr(dst), _cuda.ptr(src), _cuda.ptr(dst_index.contiguous()),
                _cuda.ptr(src_index.contiguous()), np.int64(n), np.int64(per)))
            return
    block_copy_reference(dst, src, dst_index, src_index, block_elems)


def block_copy_reference(dst: torch.Tensor, src: torch.Tensor, dst_index: torch.Tensor,
                         src_index: torch.Tensor, block_elems: int) -> None:
    d = dst.view(-1)[: dst.numel() // block_elems * block_elems].view(-1, block_elems)
    s = src.reshape(-1)[: src.numel() // block_elems * block_elems].view(-1, block_elems)
    d.index_copy_(0, dst_index, s.index_select(0, src_index))


def _check_store(store: torch.Tensor) -> None:
    if store.dim() != 6 or store.shape[2] != 2:
        raise StreamgrError(f"page store must be [layers, pages, 2, page_tokens, heads, dim], "
                            f"got {tuple(store.shape)}")


def _check_index(page_idx: torch.Tensor, offset: torch.Tensor, n: int | None = None) -> None:
    if page_idx.dim() != 1 or page_idx.shape != offset.shape:
        raise StreamgrError("page_idx and offset must be 1-D and of one length")
    if n is not None and page_idx.shape[0] != n:
        raise StreamgrError(f"{page_idx.shape[0]} slots for {n} tokens")


def _vec_stride(t: torch.Tensor) -> int | None:
    """Row stride of ``t`` [n, H, D] in 16-byte units when its rows can be copied as such."""
    es = t.element_size()
    if (t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2]
            or (t.stride(0) * es) % 16 or t.data_ptr() % 16 or (t.shape[1] * t.shape[2] * es) % 16):
        return None
    return t.stride(0) * es // 16


def append_rows(store: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
                rows: torch.Tensor, page_idx: torch.Tensor, offset: torch.Tensor) -> None:
    """Write rows ``rows`` of one layer's ``k, v`` ``[T, heads, dim]`` (strided views of a fused
    projection allowed) into page slots ``(page_idx, offset)``; entries whose page is negative
    are padding and write nothing. One CUDA launch for K and V (``paged_append.cu``)."""
    _check_store(store)
    _check_index(page_idx, offset)
    if rows.shape != page_idx.shape:
        raise StreamgrError("append_rows: rows, page_idx and offset must have one length")
    if k.shape[1:] != store.shape[4:] or v.shape != k.shape or k.dtype != store.dtype:
        raise StreamgrError(f"k{tuple(k.shape)}/v{tuple(v.shape)} {k.dtype} do not fit pages "
                            f"of {tuple(store.shape[4:])} {store.dtype}")
    n = rows.shape[0]
    if n == 0:
        return
    ks, vs = _vec_stride(k), _vec_stride(v)
    if (ks is not None and vs is not None and _cuda.usable(store, k, v, rows)
            and store.is_contiguous() and store.data_ptr() % 16 == 0
            and rows.dtype == page_idx.dtype == offset.dtype == torch.int64):
        fn = _cuda.kernel("paged_append.cu", ("paged_append",), "paged_append")
        row_vecs = k.shape[1] * k.shape[2] * k.element_size() // 16
        _cuda.launch(fn, (-(-2 * n // 8),), (256,), (
            _cuda.ptr(store), _cuda.ptr(k), _cuda.ptr(v), _cuda.ptr(rows.contiguous()),
            _cuda.ptr(page_idx.contiguous()), _cuda.ptr(offset.contiguous()), np.int32(n),
            np.int64(store.shape[1]), np.int32(layer), np.int32(store.shape[3]),
            np.int32(row_vecs), np.int64(ks), np.int64(vs)))
        return
    append_rows_reference(store, layer, k, v, rows, page_idx, offset)


def append_rows_reference(store, layer, k, v, rows, page_idx, offset) -> None:
    keep = page_idx >= 0
    rows, page_idx, offset = rows[keep], page_idx[keep], offset[keep]
    layer_store = store[layer]
    layer_store[page_idx, 0, offset] = k[rows].to(store.dtype)
    layer_store[page_idx, 1, offset] = v[rows].to(store.dtype)


def onload_scatter(store: torch.Tensor, layer: int, buffer: torch.Tensor,
                   page_ids: torch.Tensor) -> None:
    """Scatter one layer of an onload buffer ``[n_chunks, layers, k, 2, P, H, D]`` into pages
    ``page_ids`` (``n_chunks * k`` of them, in token order)."""
    _check_store(store)
    if buffer.dim() != 7 or buffer.shape[3:] != store.shape[2:] or buffer.shape[1] != store.shape[0]:
        raise StreamgrError(f"onload buffer {tuple(buffer.shape)} does not match store "
                            f"{tuple(store.shape)}")
    n_chunks, layers, k = buffer.shape[:3]
    if n_chunks * k != page_ids.shape[0]:
        raise StreamgrError(f"{n_chunks * k} pages of data for {page_ids.shape[0]} page ids")
    page_bytes = store[0, 0].numel() * store.element_size()
    if (_cuda.usable(store, buffer, page_ids) and buffer.is_contiguous() and store.is_contiguous()
            and page_bytes % 16 == 0 and buffer.data_ptr() % 16 == 0 and store.data_ptr() % 16 == 0):
        # The page arithmetic happens in the kernel: no index tensors per call.
        fn = _cuda.kernel(_COPY_SRC, _COPY_EXPRS, "page_scatter<uint4>")
        per, n = page_bytes // 16, n_chunks * k
        parts = max(1, min(64, per // 1024))
        _cuda.launch(fn, (min(n, 2**31 - 1), parts), (256,), (
            _cuda.ptr(store), _cuda.ptr(buffer), _cuda.ptr(page_ids.contiguous()), np.int64(n),
            np.int64(per), np.int32(layer), np.int32(layers), np.int32(k),
            np.int64(store.shape[1])))
        return
    store[layer].index_copy_(0, page_ids, buffer[:, layer].reshape(-1, *store.shape[2:]))


def offload_gather(store: torch.Tensor, page_ids: torch.Tensor, chunk_pages: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Gather pages (``n_chunks * chunk_pages`` ids, token order) of every layer into a
    contiguous ``[n_chunks, layers, chunk_pages, 2, P, H, D]`` buffer (host chunk layout)."""
    _check_store(store)
    n = page_ids.shape[0]
    if n % chunk_pages:
        raise StreamgrError(f"{n} pages is not a whole number of {chunk_pages}-page chunks")
    L = store.shape[0]
    if out is None:
        out = torch.empty(n // chunk_pages, L, chunk_pages, *store.shape[2:], dtype=store.dtype,
                          device=store.device)
    if _cuda.usable(store, out) and out.is_contiguous():
        # Destination block (c, l, j) <- page page_ids[c*k + j] of layer l.
        ll = torch.arange(L, device=store.device).repeat_interleave(n)
        i = torch.arange(n, device=store.device).repeat(L)
        c, j = i // chunk_pages, i % chunk_pages
        dst = (c * L + ll) * chunk_pages + j
        src = ll * store.shape[1] + page_ids.repeat(L)
        block_copy(out, store, dst, src, store[0, 0].numel())
        return out
    g = store.index_select(1, page_ids)  # [L, n, 2, P, H, D]
    out.copy_(g.view(L, n // chunk_pages, chunk_pages, *store.shape[2:]).transpose(0, 1))
    return out
