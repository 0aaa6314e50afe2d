"""Shared test setup: the `gpu` marker skips without CUDA; small engine specs for speed."""

from __future__ import annotations

import os
import signal
import warnings

import pytest
import torch

# Under pytest-xdist, each worker's share of the cores: torch's intra-op pool of every worker
# at full width oversubscribes the machine, and tests whose batches hand work between threads
# (onload/offload pipelines) then waited for time slices: on CI's 2-core VM with 2 workers,
# some took 12-13 s that take 0.2-2.4 s alone (the suite: 328 -> 285 s). Child processes (CLI
# tests) inherit it through OMP_NUM_THREADS.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    # The slow tests first (a stable sort): pytest-xdist hands tests, or a loadgroup's group,
    # to its workers in this order as they free up, so the longest start first and the
    # workers finish together instead of one running a 30 s test at the end alone. A group
    # (the Ray tests) moves whole, in its own order: its timing test runs before its cluster.
    def group(item):
        mark = item.get_closest_marker("xdist_group")
        return mark.args[0] if mark and mark.args else None
    slow_groups = {group(i) for i in items if "slow" in i.keywords} - {None}
    items.sort(key=lambda i: not ("slow" in i.keywords or group(i) in slow_groups))
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


def in_a_fork(child) -> tuple[int, str]:
    """``child()`` in a forked process (a pre-forking server's worker); its exit status and the
    text it returned. An alarm ends a child that hangs, as the old clients did."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12: fork of a threaded process
        pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os.close(r)
        signal.alarm(20)
        try:
            out = str(child())
        except BaseException as err:  # noqa: BLE001: reported to the parent
            out = f"{type(err).__name__}: {err}"
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        text = f.read().decode()
    return os.waitpid(pid, 0)[1], text
