"""Loading and launching the CUDA sources of ``cuda_kernels/`` through CuPy's ``RawModule``.

Kernels run on torch's current stream (``cupy.cuda.ExternalStream``) and take raw device
pointers of torch tensors, so nothing is copied or synchronised between the two libraries.
Arguments follow CuPy's rules: pointers as ``numpy.uint64``, 32-bit ints as ``numpy.int32``
(a Python ``int`` would become ``long long``), floats as ``numpy.float32``.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from ..errors import StreamgrError

log = logging.getLogger("streamgr.kernels")

# STREAMGR_KERNELS=torch forces the torch references everywhere (for A/B checks and fallbacks).
FORCE_TORCH = os.environ.get("STREAMGR_KERNELS", "").lower() == "torch"
# STREAMGR_NVRTC_LINEINFO=1 compiles with -lineinfo, so ncu's source view can attribute stalls
# to lines of cuda_kernels/ (profiling only).
_LINEINFO = ("-lineinfo",) if os.environ.get("STREAMGR_NVRTC_LINEINFO") == "1" else ()


def source(name: str) -> str:
    """A kernel source with its local ``#include "x.cuh"`` lines replaced by those files' text:
    NVRTC needs no include path for them, and CuPy's compile cache (keyed by the source text)
    sees a change to a shared header."""
    here = Path(__file__).resolve().parent.parent.parent / "cuda_kernels" / name
    if here.is_file():
        text = here.read_text()
    else:
        text = resources.files("streamgr._cuda_kernels").joinpath(name).read_text()
    return _LOCAL_INCLUDE.sub(lambda m: source(m.group(1)), text)


_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"[ \t]*$', re.MULTILINE)


@functools.lru_cache(maxsize=None)
def _cupy():
    try:
        import cupy
    except Exception as err:  # not installed, or no CUDA runtime for it
        log.info("CuPy unavailable (%s): torch reference kernels only", err)
        return None
    return cupy


def usable(*tensors: torch.Tensor) -> bool:
    """CUDA kernels can run on these tensors (all on a CUDA device, CuPy importable)."""
    if FORCE_TORCH or not all(t.is_cuda for t in tensors):
        return False
    return _cupy() is not None


def usable_on(device: torch.device) -> bool:
    """:func:`usable` for tensors on ``device``, without one at hand."""
    return device.type == "cuda" and not FORCE_TORCH and _cupy() is not None


def widest_unit(nbytes: int, units, *tensors: torch.Tensor) -> int | None:
    """The widest copy unit of ``units`` (bytes, widest first) dividing ``nbytes`` and every
    tensor's address; None where none does."""
    return next((u for u in units if nbytes % u == 0
                 and all(t.data_ptr() % u == 0 for t in tensors)), None)


@functools.lru_cache(maxsize=None)
def _include_dirs() -> tuple[str, ...]:
    """CUDA toolkit include folders that hold ``crt/mma.h``: some NVRTC wheels ship a
    ``mma.h`` that includes it without shipping it."""
    import glob
    import sys
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    found = [f"{r}/include" for r in roots if r and os.path.isfile(f"{r}/include/crt/mma.h")]
    found += sorted({os.path.dirname(os.path.dirname(p)) for p in
                     glob.glob("/usr/local/cuda*/include/crt/mma.h")
                     + glob.glob(f"{sys.prefix}/lib/python3*/site-packages/nvidia/**/crt/mma.h",
                                 recursive=True)})
    return tuple(dict.fromkeys(found))


@functools.lru_cache(maxsize=None)
def module(name: str, name_expressions: tuple[str, ...], defines: tuple[str, ...] = ()):
    """Compile with NVRTC; where NVRTC lacks a header, with nvcc (the toolkit's own headers).
    ``defines``: ``NAME=VALUE`` macros (a kernel's compile-time configuration)."""
    cupy = _cupy()
    flags = ("-std=c++17",) + _LINEINFO + tuple(f"-D{d}" for d in defines)
    opts = flags + tuple(f"-I{d}" for d in _include_dirs())
    mod = cupy.RawModule(code=source(name), options=opts, name_expressions=list(name_expressions))
    try:
        mod.get_function(name_expressions[0])  # compiles now, so a failure shows here
        return mod
    except cupy.cuda.compiler.CompileException as err:
        log.warning("NVRTC could not compile %s (%s); using nvcc", name, str(err).splitlines()[0])
    mod = cupy.RawModule(code=source(name), options=flags, backend="nvcc",
                         name_expressions=list(name_expressions))
    mod.get_function(name_expressions[0])
    return mod


@functools.lru_cache(maxsize=None)
def arch_module(name: str, name_expressions: tuple[str, ...], arch: str,
                defines: tuple[str, ...] = ()):
    """A module compiled for an architecture-specific target such as ``sm_90a`` (wgmma), which
    CuPy's own compile cannot ask for (it appends ``-arch=sm_<cc>``): NVRTC to a cubin, loaded
    by path. Returns the module and the lowered name of each expression."""
    import tempfile
    from cupy.cuda import compiler
    cupy = _cupy()
    flags = ("-std=c++17", f"-arch={arch}") + _LINEINFO + tuple(f"-D{d}" for d in defines) \
        + tuple(f"-I{d}" for d in _include_dirs())
    program = getattr(compiler, "_NVRTCProgram", None)  # CuPy 13-14's NVRTC wrapper
    if program is None:
        raise StreamgrError(f"{name}: this CuPy ({cupy.__version__}) has no NVRTC program "
                            f"hook to compile for {arch}; use the default kernels")
    prog = program(source(name), name, name_expressions=list(name_expressions), method="cubin")
    cubin, mapping = prog.compile(flags)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        mod = cupy.RawModule(path=f.name)
        mod.get_function(mapping[name_expressions[0]])  # loads now
    finally:
        os.unlink(f.name)
    return mod, mapping


@functools.lru_cache(maxsize=None)
def arch_kernel(name: str, name_expressions: tuple[str, ...], expr: str, arch: str,
                defines: tuple[str, ...] = ()):
    """One kernel of :func:`arch_module`, the same object every call (see :func:`kernel`)."""
    mod, mapping = arch_module(name, name_expressions, arch, defines)
    return mod.get_function(mapping[expr])


@functools.lru_cache(maxsize=None)
def kernel(name: str, name_expressions: tuple[str, ...], expr: str, defines: tuple[str, ...] = ()):
    """One kernel, the same object every call (``launch`` remembers its shared-memory opt-in by
    object; a fresh object per call could reuse a freed one's id and skip the opt-in)."""
    return module(name, name_expressions, defines).get_function(expr)


def ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


_SMEM_OPTED: dict[int, int] = {}  # id(kernel) -> dynamic shared memory it may use


def launch(fn, grid, block, args, shared_mem: int = 0) -> None:
    if shared_mem > 48 * 1024 and _SMEM_OPTED.get(id(fn), 0) < shared_mem:
        fn.max_dynamic_shared_size_bytes = shared_mem  # opt in above the 48 KiB default
        _SMEM_OPTED[id(fn)] = shared_mem
    fn(grid, block, args, shared_mem=shared_mem, stream=_external_stream(_current_stream()))


def _current_stream() -> int:
    """The raw handle of torch's current stream on the current device. (Building the
    ``torch.cuda.Stream`` object took ~8 us and entering CuPy's stream context ~1 us more, out
    of ~18 us per launch on the lent H200's host; the raw getter takes ~0.2 us.)"""
    try:
        return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
    except AttributeError:  # a torch without the private getter
        return torch.cuda.current_stream().cuda_stream


@functools.lru_cache(maxsize=64)
def _external_stream(handle: int):
    """CuPy's view of a torch stream (cached: one per stream handle)."""
    import warnings
    cupy = _cupy()
    with warnings.catch_warnings():  # ExternalStream is deprecated in CuPy 14 but still right
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(handle)
