"""Shared test setup: the `gpu` marker skips without CUDA; small engine specs for speed."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run tools/gpu_check.sh on the GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def small_overrides(**extra):
    """rank-small shrunk further so engine tests run in milliseconds on CPU."""
    base = {"engine.device": "cpu", "model.dtype": "float32", "model.max_history": 64,
            "model.max_candidates": 16, "model.num_items": 200, "engine.max_wait_ms": 1.0}
    base.update(extra)
    return base
