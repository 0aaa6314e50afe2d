"""Pre-flight: refuse cache sizes the machine cannot hold, before allocating them.

A spec's page store (``cache.device_pages``) and host chunk store (``cache.host_chunks``) are
allocated whole at engine start; on a machine too small for them that would die in the
allocator (or start swapping) with a message naming nothing. This check names the sizes, what
the machine has, and the keys to change.
"""

from __future__ import annotations

import os

import torch

from ..errors import SpecError

# Leave this share of what is free for the model, activations and everything else.
HEADROOM = 0.9


def host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_cache_memory(cache, layers: int, heads: int, head_dim: int, dtype: torch.dtype,
                       device: torch.device, hierarchical: bool) -> None:
    """Raise ``SpecError`` when the page and chunk stores do not fit this machine."""
    token = layers * 2 * heads * head_dim * torch.empty((), dtype=dtype).element_size()
    dev_bytes = cache.device_pages * cache.page_tokens * token
    host_bytes = cache.host_chunks * cache.chunk_tokens * token if hierarchical else 0
    host_free = host_available_bytes()
    if device.type == "cuda":
        dev_free = torch.cuda.mem_get_info(device)[0]
        if dev_bytes > HEADROOM * dev_free:
            raise SpecError(
                f"cache.device_pages = {cache.device_pages:,} needs {_gib(dev_bytes)} of device "
                f"memory; {device} has {_gib(dev_free)} free: lower cache.device_pages (or "
                f"cache.page_tokens)")
    else:  # the "device" tier is host memory too
        host_bytes += dev_bytes
    if host_bytes > HEADROOM * host_free:
        keys = "cache.host_chunks" if hierarchical else ""
        if device.type != "cuda":
            keys = " / ".join(k for k in (keys, "cache.device_pages") if k)
        raise SpecError(
            f"the cache needs {_gib(host_bytes)} of host memory on {device} "
            f"(device_pages = {cache.device_pages:,}, host_chunks = "
            f"{cache.host_chunks if hierarchical else 0:,}); this machine has {_gib(host_free)} "
            f"available: lower {keys}, or use a smaller spec")
