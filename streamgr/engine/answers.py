"""Answering a finished batch: each request's future gets its result and stats (or its own
error), and the engine's metrics see it. Called by the BatchLoops on the event loop."""

from __future__ import annotations

from ..api import GenerateResult, GenerateStats, RankResult, RankStats
from .batcher import Pending
from .metrics import EngineMetrics


def answer_rank(metrics: EngineMetrics, batch: list[Pending], outcome, t_start: float,
                t_done: float) -> None:
    compute_ms = (t_done - t_start) * 1e3
    metrics.count("rank_batches")
    for p, res in zip(batch, outcome.results):
        if p.future.done():
            continue
        if isinstance(res, Exception):
            metrics.count("rank_invalid")
            p.future.set_exception(res)
            continue
        scores, per = res
        stats = RankStats(batch_size=len(batch), queue_ms=(t_start - p.enqueued) * 1e3,
                          compute_ms=compute_ms, total_ms=(t_done - p.enqueued) * 1e3,
                          stages=outcome.stages, version=outcome.version, **per)
        metrics.observe_rank(stats)
        p.future.set_result(RankResult(scores=scores.tolist(), stats=stats))


def answer_generate(metrics: EngineMetrics, batch: list[Pending], outcome, t_start: float,
                    t_done: float) -> None:
    # The device's busy time (CUDA: each batch's span on its stream), summed over batches:
    # against wall time it says whether the GPU or the host bounds a run.
    metrics.count("generate_gpu_us", int(outcome.stages.get("gpu", 0.0) * 1e3))
    metrics.count("generate_batches")
    for p, res in zip(batch, outcome.results):
        if p.future.done():
            continue
        if isinstance(res, Exception):  # refused by the version it ran on
            metrics.count("generate_invalid")
            p.future.set_exception(res)
            continue
        (items, scores, sids), per = res
        stats = GenerateStats(batch_size=len(batch), queue_ms=(t_start - p.enqueued) * 1e3,
                              compute_ms=(t_done - t_start) * 1e3,
                              total_ms=(t_done - p.enqueued) * 1e3,
                              steps=outcome.stages, **per)
        metrics.observe_generate(stats)
        p.future.set_result(GenerateResult(items=items, scores=scores, sids=sids,
                                           stats=stats))
