"""The tensors of the hierarchical cache: device page store and host chunk store.

Device store ``[layers, pages, 2, page_tokens, heads, dim]`` on the GPU (a second CPU tensor when
there is none, so the whole cache runs in CI). Host store ``[chunks, layers, k, 2, page_tokens,
heads, dim]`` with ``k = chunk_tokens / page_tokens``: one chunk is the block of its ``k`` pages,
all layers, so onload/offload are block copies (see ``kernels.paged_kv``).
"""

from __future__ import annotations

import mmap

import numpy as np
import torch


def host_tensor(shape: tuple, dtype: torch.dtype, huge_pages: bool) -> torch.Tensor:
    """An uninitialized host tensor (memory committed lazily as it is written). ``huge_pages``:
    an anonymous mapping advised to transparent huge pages (Linux; elsewhere a plain mapping):
    page-locking a 56 GiB store in 2 MiB pages took 10.1 s on the lent H200 host against 27.1 s
    in 4 KiB pages (docs/benchmarks.md, session 7). The mapping lives as long as the tensor."""
    nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    if not huge_pages or nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    # numpy holds the mapping; the tensor holds the array: no close while a view is alive
    return torch.from_numpy(np.frombuffer(m, dtype=np.uint8)).view(dtype).view(shape)


class KVStores:
    def __init__(self, layers: int, heads: int, head_dim: int, page_tokens: int, chunk_tokens: int,
                 device_pages: int, host_chunks: int, dtype: torch.dtype, device: torch.device,
                 host_pinned: bool = False, host_huge_pages: bool = False) -> None:
        self.P, self.C = page_tokens, chunk_tokens
        self.chunk_pages = chunk_tokens // page_tokens
        self.layers = layers
        self.device = device
        self.pages = torch.empty(layers, device_pages, 2, page_tokens, heads, head_dim,
                                 dtype=dtype, device=device)
        # Host memory is committed lazily by the OS as chunks are written.
        self.host = host_tensor((host_chunks, layers, self.chunk_pages, 2, page_tokens, heads,
                                 head_dim), dtype, host_huge_pages) if host_chunks else None
        self._registered = False
        if host_pinned and device.type == "cuda" and self.host is not None:
            # Page-lock the store in place (torch's pinned allocator would round a 40 GiB store
            # up to 64 GiB); onload then DMAs straight from it.
            nbytes = self.host.numel() * self.host.element_size()
            err = torch.cuda.cudart().cudaHostRegister(self.host.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.1f} GiB failed ({err})")
            self._registered = True

    def close(self) -> None:
        """Unpin the host store (before its memory goes back)."""
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())
            self._registered = False

    @property
    def host_registered(self) -> bool:
        """The host store is page-locked in place: copies may DMA straight into its chunks."""
        return self._registered

    @property
    def chunk_bytes(self) -> int:
        return self.host[0].numel() * self.host.element_size() if self.host is not None else 0

    def token_bytes(self) -> int:
        return self.pages[:, 0, :, 0].numel() * self.pages.element_size()
