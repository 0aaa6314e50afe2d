"""Every package of the source tree ships in the wheel, with the .cu sources and built-in specs."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {".".join(p.relative_to(ROOT).parts) for p in (ROOT / "streamgr").rglob("*")
             if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))}
    found.add("streamgr")
    assert found <= listed, f"not shipped: {sorted(found - listed)}"
    for pkg in found:  # each has an __init__ with a docstring saying what it is for
        init = ROOT / pkg.replace(".", "/") / "__init__.py"
        assert init.is_file() and init.read_text().lstrip().startswith('"""'), pkg
    assert cfg["package-dir"] == {"streamgr._cuda_kernels": "cuda_kernels",
                                  "streamgr._pipeline": "pipeline"}
    assert "*.cu" in cfg["package-data"]["streamgr._cuda_kernels"]
    assert "*.toml" in cfg["package-data"]["streamgr._pipeline"]
