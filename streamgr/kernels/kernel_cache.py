"""An on-disk cache of the compiled Numba selection kernels (``STREAMGR_KERNEL_CACHE=<dir>``).

Why: a GPU engine compiles its selection kernels on first use (5-15 s each since their device
functions inline in LLVM, session 39; a minute or more for the merge and one-block kernels
before), so a server's start or a fresh worker waits on NVVM and the linker before it serves.
Numba's own ``cache=True`` keys an entry on the kernel's source file's time stamp and its
bytecode only: an edit to an inlined device function in another module, or a
``STREAMGR_TOPK_*`` setting read at import into a module constant, would load a stale kernel.
Here every entry lives under a directory named by one stamp over everything that shapes the
kernels: the bytes of every module of this package, every ``STREAMGR_*`` setting, and the Python,
Numba and numba-cuda versions (the device's compute capability is in Numba's own index key). A
changed stamp is a new directory, so nothing stale is ever loaded; old directories are left for
the operator to delete.

Off by default (unset or empty), and a no-op under the CUDA simulator. The entries hold the
cubins, so a load skips NVVM and the linker both.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from functools import lru_cache
from pathlib import Path

ENV = "STREAMGR_KERNEL_CACHE"
KERNELS = Path(__file__).resolve().parent


def cache_dir() -> str:
    """The cache's root directory, or '' where caching is off."""
    return os.environ.get(ENV, "").strip()


def stamp(files: list[Path], env: dict[str, str]) -> str:
    """Hex digest over the files' names and bytes, the ``STREAMGR_*`` items of ``env`` (the
    cache's own root excluded: moving the cache keeps its entries) and the toolchain's
    versions."""
    import numba
    import numba_cuda

    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    for k in sorted(env):
        if k.startswith("STREAMGR_") and k != ENV:
            h.update(f"{k}={env[k]}\0".encode())
    h.update(f"{sys.version}|{platform.machine()}|{numba.__version__}|"
             f"{numba_cuda.__version__}".encode())
    return h.hexdigest()[:20]


@lru_cache(maxsize=1)
def current_stamp() -> str:
    """This process's stamp: the package's kernel modules and settings as imported."""
    return stamp(sorted(KERNELS.glob("*.py")), dict(os.environ))


@lru_cache(maxsize=1)
def _classes():
    """The cache class, built once on first use (numba-cuda's caching module is private API)."""
    from numba.cuda.core.caching import _CacheLocator
    from numba.cuda.dispatcher import CUDACache, CUDACacheImpl

    class Locator(_CacheLocator):
        """Every kernel's entries under ``<root>/<stamp>``; the stamp is also the source
        stamp Numba checks on load."""

        def __init__(self, py_func, py_file):
            self._path = os.path.join(cache_dir(), current_stamp())
            self._line = py_func.__code__.co_firstlineno

        def get_cache_path(self):
            return self._path

        def get_source_stamp(self):
            return current_stamp()

        def get_disambiguator(self):
            return str(self._line)

        @classmethod
        def from_function(cls, py_func, py_file):
            return cls(py_func, py_file)

    class Impl(CUDACacheImpl):
        _locator_classes = [Locator]

    class KernelCache(CUDACache):
        _impl_class = Impl

    return KernelCache


def cached(kernel):
    """``kernel`` (a ``cuda.jit`` dispatcher) with its compiled overloads saved to and loaded
    from the cache where ``STREAMGR_KERNEL_CACHE`` is set; unchanged otherwise and under the
    simulator."""
    if cache_dir() and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        kernel._cache = _classes()(kernel.py_func)
    return kernel
