"""Paged K/V movement: append, gather, onload scatter and offload gather (torch references).

Layouts (MTServe section 4.1):

- device page store ``[layers, pages, 2, page_tokens, heads, dim]`` (``2`` = K, V);
- a host chunk of ``chunk_tokens = k * page_tokens`` tokens, all layers, is laid out as the ``k``
  pages it fills: ``[layers, k, 2, page_tokens, heads, dim]``, so onload and offload are plain
  block copies and only the device side scatters/gathers pages.

Token ``t`` of a user lives in page ``pages[t // page_tokens]`` at offset ``t % page_tokens``.
GPU kernels (``cuda_kernels/paged_kv.cu``) register in the dispatchers as they land.
"""

from __future__ import annotations

import torch

from ..errors import StreamgrError


def _check_store(store: torch.Tensor) -> None:
    if store.dim() != 6 or store.shape[2] != 2:
        raise StreamgrError(f"page store must be [layers, pages, 2, page_tokens, heads, dim], "
                            f"got {tuple(store.shape)}")


def _check_index(page_idx: torch.Tensor, offset: torch.Tensor, n: int | None = None) -> None:
    if page_idx.dim() != 1 or page_idx.shape != offset.shape:
        raise StreamgrError("page_idx and offset must be 1-D and of one length")
    if n is not None and page_idx.shape[0] != n:
        raise StreamgrError(f"{page_idx.shape[0]} slots for {n} tokens")


def append_kv(store: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
              page_idx: torch.Tensor, offset: torch.Tensor) -> None:
    """Write tokens' ``k, v`` ``[n, heads, dim]`` into their page slots of one layer."""
    _check_store(store)
    _check_index(page_idx, offset, k.shape[0])
    if k.shape != v.shape or k.shape[1:] != store.shape[4:]:
        raise StreamgrError(f"k{tuple(k.shape)}/v{tuple(v.shape)} do not fit pages of "
                            f"{tuple(store.shape[4:])}")
    layer_store = store[layer]
    layer_store[page_idx, 0, offset] = k.to(store.dtype)
    layer_store[page_idx, 1, offset] = v.to(store.dtype)


def gather_kv(store: torch.Tensor, layer: int, page_idx: torch.Tensor,
              offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Read tokens' ``k, v`` ``[n, heads, dim]`` of one layer from their page slots."""
    _check_store(store)
    _check_index(page_idx, offset)
    layer_store = store[layer]
    return layer_store[page_idx, 0, offset], layer_store[page_idx, 1, offset]


def onload_scatter(store: torch.Tensor, layer: int, buffer: torch.Tensor,
                   page_ids: torch.Tensor) -> None:
    """Scatter one layer of an onload buffer ``[n_chunks, layers, k, 2, P, H, D]`` into pages
    ``page_ids`` (``n_chunks * k`` of them, in token order)."""
    _check_store(store)
    if buffer.dim() != 7 or buffer.shape[3:] != store.shape[2:] or buffer.shape[1] != store.shape[0]:
        raise StreamgrError(f"onload buffer {tuple(buffer.shape)} does not match store "
                            f"{tuple(store.shape)}")
    pages = buffer[:, layer].reshape(-1, *store.shape[2:])
    if pages.shape[0] != page_ids.shape[0]:
        raise StreamgrError(f"{pages.shape[0]} pages of data for {page_ids.shape[0]} page ids")
    store[layer].index_copy_(0, page_ids, pages)


def offload_gather(store: torch.Tensor, page_ids: torch.Tensor, chunk_pages: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Gather pages (``n_chunks * chunk_pages`` ids, token order) of every layer into a
    contiguous ``[n_chunks, layers, chunk_pages, 2, P, H, D]`` buffer (host chunk layout)."""
    _check_store(store)
    n = page_ids.shape[0]
    if n % chunk_pages:
        raise StreamgrError(f"{n} pages is not a whole number of {chunk_pages}-page chunks")
    g = store.index_select(1, page_ids)  # [L, n, 2, P, H, D]
    g = g.view(store.shape[0], n // chunk_pages, chunk_pages, *store.shape[2:]).transpose(0, 1)
    if out is None:
        return g.contiguous()
    out.copy_(g)
    return out
