"""The costs behind ``cache.onload_split = "auto"``, measured on the engine's own device at start.

- Onload: seconds a token, timing the onload pipeline itself (``OnloadPipeline.submit``: the
  host store's chunks through the same copies and scatters a batch uses) into free pages
  (nothing is cached yet, so the bytes written are never read), as a slope between two sizes.
- Recompute: the model's recompute forward over synthetic users (one item and action id
  repeated; the ids do not change the work) at history lengths ``0, C, 2C, 4C, ...`` up to
  ``16 C`` or the model's longest history: ``t(n)``, a user's cumulative recompute time, from
  batches of ``USERS`` users less the batch of empty histories (its launches and candidates),
  as device time (a host-hit batch with a split is bound by the device's work, while these
  small eager batches would be bound by their launches).

Each point is the least of ``REPEATS`` timed runs after one untimed run. A few hundred ms at
the start of a GPU engine (rank-ref), far less on the CPU's small specs.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ..cache.onload_split import SplitCosts
from .rank import UserSlice, build_jagged

log = logging.getLogger("streamgr.cache")

USERS = 4
REPEATS = 2
MAX_CHUNKS = 16  # onloaded per timing (256 MiB at rank-ref's chunks)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Cycles of a spin kernel queued ahead of a timed forward on CUDA (~25 ms at the H200's ~2
# GHz): the forward's launches queue up behind it, so the events around the forward time the
# device's work alone, not the eager forward's host launches (which bound a small batch: a
# host-timed table read 0 ms for users of up to 4,096 tokens on the H200, session 20).
SPIN_CYCLES = 50_000_000


def _best(fn, device: torch.device, device_time: bool = False) -> float:
    """Least of ``REPEATS`` timings of ``fn`` after one untimed run: wall time, or with
    ``device_time`` on CUDA the device's time for the work ``fn`` queues."""
    fn()
    _sync(device)
    # (torch.cuda._sleep is private: without it, wall time, launches included)
    gpu = device_time and device.type == "cuda" and hasattr(torch.cuda, "_sleep")
    best = float("inf")
    for _ in range(REPEATS):
        if gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(SPIN_CYCLES)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            _sync(device)
            best = min(best, time.perf_counter() - t)
    return best


def onload_seconds_per_token(runner) -> float:
    """The slope between onloads of ``MAX_CHUNKS // 4`` and ``MAX_CHUNKS`` chunks: a batch's
    fixed costs (the thread hand-off, events, the scatter launch) are not per token. Where the
    two times do not rise (chunks too small to time apart), the larger one's mean a token."""
    stores, pipe = runner.stores, runner.onload
    per = stores.chunk_pages
    k = min(MAX_CHUNKS, stores.host.shape[0], stores.pages.shape[1] // per)
    if k < 2:
        return 0.0
    bytes_before = pipe.bytes

    def onload(n: int):
        job = [("onload-calibration", list(range(n)), list(range(n * per)))]

        def run() -> None:
            h = pipe.submit(job)
            h.done()
            h.ready[-1].synchronize()
        return run

    try:
        k0 = max(1, k // 4)
        t0, t1 = _best(onload(k0), runner.device), _best(onload(k), runner.device)
        if t1 > t0:
            return (t1 - t0) / ((k - k0) * stores.C)
        # Chunks so small that the fixed costs' jitter hides the bytes (tests' tiny specs; the
        # H200, session 23): the mean over the larger onload, fixed costs included. An upper
        # bound, never 0: an onload that looks free would never be split.
        log.info("onload split costs: %d and %d chunks took %.3f and %.3f ms; taking the "
                 "mean per token", k0, k, t0 * 1e3, t1 * 1e3)
        return t1 / (k * stores.C)
    finally:
        pipe.bytes = bytes_before  # not traffic of a batch


def recompute_table(runner) -> tuple[np.ndarray, np.ndarray]:
    cfg, C = runner.model.cfg, runner.stores.C
    top = min(16 * C, 2 * cfg.max_history)
    lengths = [0]
    n = C
    while n < top:
        lengths.append(n)
        n *= 2
    lengths.append(top)

    def batch(n: int):
        users = [UserSlice(np.ones(n, dtype=np.int64), 0, np.ones(1, dtype=np.int64))] * USERS
        jb = build_jagged(users, runner.device)
        return lambda: runner.model(jb)

    with torch.inference_mode():
        total = np.array([_best(batch(n), runner.device, device_time=True) for n in lengths])
    return np.array(lengths, dtype=float), (total - total[0]) / USERS


def measure_split_costs(runner) -> SplitCosts | float:
    """``SplitCosts`` of a hierarchical ``CachedRankRunner`` (before it serves); 1.0 (onload
    all, the behaviour without a split) with a warning if they cannot be measured (e.g. the
    device has no room for the synthetic batches): the engine still starts and serves."""
    t0 = time.perf_counter()
    try:
        a = onload_seconds_per_token(runner)
        lengths, t = recompute_table(runner)
        costs = SplitCosts(a, lengths, t)
    except Exception as err:  # noqa: BLE001 - a tuning measurement, not a reason to refuse
        log.warning("cache.onload_split = \"auto\": costs not measured (%r); host hits onload "
                    "all they hold", err)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        return 1.0
    log.info("onload split costs (%.0f ms to measure): onload %.3f us a token; recompute of a "
             "user's first %s tokens %s ms", (time.perf_counter() - t0) * 1e3, a * 1e6,
             lengths.astype(int).tolist(), np.round(costs.recompute_s * 1e3, 3).tolist())
    return costs
