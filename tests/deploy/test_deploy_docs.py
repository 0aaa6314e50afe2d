"""docs/deploy.md's KubeRay RayService parses, and its Serve config (like the one
`streamgr ray-config` prints) validates against Ray's own schema and names a real builder."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
schema = pytest.importorskip("ray.serve.schema")

DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"


def _check_serve_config(cfg: dict) -> None:
    schema.ServeDeploySchema.model_validate(cfg)
    for app in cfg["applications"]:
        mod, _, name = app["import_path"].partition(":")
        assert callable(getattr(importlib.import_module(mod), name))


def test_rayservice_example_parses_and_its_serve_config_validates():
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    service = next(yaml.safe_load(b) for b in blocks if "RayService" in b)
    assert service["kind"] == "RayService" and service["apiVersion"] == "ray.io/v1"
    workers = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert workers and "nvidia.com/gpu" in workers[0]["template"]["spec"]["containers"][0][
        "resources"]["limits"]
    _check_serve_config(yaml.safe_load(service["spec"]["serveConfigV2"]))


def test_ray_config_command_prints_a_valid_serve_config():
    out = subprocess.run([sys.executable, "-m", "streamgr", "ray-config", "rank-small",
                          "--replicas", "3", "--set", "cache.mode=gpu-only"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    _check_serve_config(cfg)
    assert cfg["applications"][0]["args"]["replicas"] == 3
    bad = subprocess.run([sys.executable, "-m", "streamgr", "ray-config", "rank-small", "--set",
                          "cache.nope=1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "cache.nope" in bad.stderr
