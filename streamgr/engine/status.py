"""The engine's stats snapshot and its handling of a failed batch (each request of the batch
gets the error; a CUDA fault marks the engine dead and fails everything queued)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..errors import EngineDead, StreamgrError
from .cached_rank import CachedRankRunner

log = logging.getLogger("streamgr.engine")


def engine_stats(engine) -> dict[str, Any]:
    out = engine.metrics.snapshot()
    if isinstance(engine.runner, CachedRankRunner):
        out["cache"] = engine.runner.snapshot()
    out["serves"] = [k for k, r in (("rank", engine.runner), ("generate", engine.gen_runner)) if r]
    if engine.runner is not None:
        out["limits"] = engine.spec.rank_limits
    if engine.gen_runner is not None and engine.gen_runner.search.plans is not None:
        out["decode_plans"] = engine.gen_runner.search.plans.stats()
    if engine.runner is not None and engine.runner.plans is not None:
        out["rank_plans"] = engine.runner.plans.stats()
    out.update(inflight=engine._inflight,
               queued=engine._res.queued() if engine._res is not None else 0,
               device=str(engine.device), dtype=str(engine.dtype).replace("torch.", ""),
               cache_mode=engine.spec.cache.mode, weights_version=engine.weights_version)
    if engine.gen_runner is not None:
        out["generate_version"] = engine.gen_runner.version
    return out


def fail_batch(engine, batch: list, err: Exception) -> None:
    log.exception("batch of %d failed", len(batch), exc_info=err)
    engine.metrics.count("batch_errors")
    # A CUDA error (not an out-of-memory) leaves the context unusable: the engine is dead.
    # So is a runner that says so (EngineDead: e.g. a transfer that never settled).
    fatal = isinstance(err, EngineDead) or (
        not isinstance(err, torch.cuda.OutOfMemoryError) and "CUDA error" in str(err))
    if fatal:
        engine._dead = err
        wrapped = err if isinstance(err, EngineDead) else EngineDead(f"engine is dead: {err!r}")
    elif isinstance(err, StreamgrError):
        wrapped = err
    else:
        wrapped = StreamgrError(f"batch failed: {err!r}")
    for p in batch:
        if not p.future.done():
            p.future.set_exception(wrapped)
    if fatal and engine._res is not None:
        engine._res.fail_queued(lambda: EngineDead(f"engine is dead: {err!r}"))
