"""Every CUDA source compiles for sm_90 with the machine's nvcc (nothing it builds runs here).

nvcc is required, not optional: CI's machines have it, and a machine without it fails here
with a message instead of skipping, so an uncompiled kernel cannot pass unnoticed."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SOURCES = sorted((Path(__file__).resolve().parents[2] / "cuda_kernels").glob("*.cu"))


def test_there_are_sources():
    assert {p.name for p in SOURCES} >= {"block_copy.cu", "hstu_attention.cu"}


def nvcc() -> str:
    found = shutil.which("nvcc") or next(
        (str(p) for p in (Path("/usr/local/cuda/bin/nvcc"),) if p.exists()), None)
    assert found, "nvcc not found (PATH or /usr/local/cuda/bin): install the CUDA toolkit"
    return found


@pytest.mark.slow
@pytest.mark.parametrize("src", SOURCES, ids=[p.name for p in SOURCES])
def test_compiles_for_sm90(src, tmp_path):
    """sm_90, and sm_90a for a source that says it is for that target (wgmma): its sm_90
    build is an empty body, its sm_90a build the kernel that runs, holding warpgroup MMAs (its
    feature macro is set there; a guard that never opened would compile an empty kernel
    without complaint). The PTX is the builds' own intermediate (one nvcc run an arch)."""
    if "// arch: sm_90a" not in src.read_text():
        compile_checked(src, tmp_path, "sm_90")
        return
    ptx = {arch: compile_checked(src, tmp_path, arch) for arch in ("sm_90", "sm_90a")}
    assert ptx["sm_90a"].count("wgmma.mma_async") >= 6 and "wgmma" not in ptx["sm_90"]


def test_the_wgmma_sources_are_checked_for_wgmma():
    assert {p.name for p in SOURCES if "// arch: sm_90a" in p.read_text()} >= {
        "hstu_attention_wgmma.cu", "t5_attention_wgmma.cu"}


def compile_checked(src, tmp_path, arch, defines=()) -> str:
    """Builds ``src`` for ``arch`` (no spills, no serialized wgmma); returns its PTX."""
    keep = tmp_path / f"keep.{arch}"
    keep.mkdir()
    out = keep / f"{src.stem}.cubin"
    p = subprocess.run([nvcc(), f"-arch={arch}", "-std=c++17", "-cubin", "-Xptxas", "-v",
                        "-keep", f"-keep-dir={keep}", *(f"-D{d}" for d in defines),
                        "-o", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert out.stat().st_size > 0
    spills = re.findall(r"(\d+) bytes spill stores", p.stderr)
    assert spills and all(n == "0" for n in spills), p.stderr  # no kernel spills registers
    assert "C751" not in p.stderr, p.stderr  # ptxas serialized no wgmma (C7511-C7515)
    return (keep / f"{src.stem}.ptx").read_text()


@pytest.mark.parametrize("bias", [True, False])
def test_the_served_t5_configurations_compile(tmp_path, bias):
    """The tile configurations the T5 wrapper serves (64-row blocks, two an SM) build for
    sm_90a without spills and with warpgroup MMAs, as the default one does."""
    from streamgr.kernels import t5_attention as ta
    src = next(p for p in SOURCES if p.name == "t5_attention_wgmma.cu")
    ptx = compile_checked(src, tmp_path, "sm_90a", ta._wg_defines(bias))
    assert ptx.count("wgmma.mma_async") >= 6


def test_local_headers_are_inlined_for_nvrtc():
    """The loader hands NVRTC one text: a kernel's local `#include "x.cuh"` replaced by the
    header (CuPy's cache is keyed by that text, so a header change recompiles)."""
    from streamgr.kernels import _cuda
    for name in ("hstu_attention.cu", "hstu_attention_wgmma.cu", "t5_attention_wgmma.cu"):
        text = _cuda.source(name)
        assert '#include "' not in text and text.count("float silu_n(") == 1, name

