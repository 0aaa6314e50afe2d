"""Replay a trace through an engine's runner in batches of distinct users, in trace order.

This is MTServe's offline replay (batch size 1, 4, 8): each batch is run and timed as a unit, the
offload work after it is done before the next batch but outside the batch's latency (it runs
after the replies). Used by ``tools/bench_rank.py`` and the trace tool.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np

from ..api import RankRequest
from ..progress import Progress


@dataclass
class RequestRecord:
    index: int
    user: int | str
    batch: int
    latency_ms: float  # the request's batch, end to end on the runner
    tier: str
    history_tokens: int
    from_gpu: int
    from_host: int
    recomputed: int
    synced: bool = False  # its batch ran with a device sync after every stage (timing stages)
    host_recomputed: int = 0  # held on host, recomputed by choice (cache.onload_split)


@dataclass
class ReplayResult:
    records: list[RequestRecord] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)  # ms summed over stage batches
    batches: int = 0
    stage_batches: int = 0  # measured batches ``stages`` sums (with stage_every: the synced)
    scores: list[np.ndarray] = field(default_factory=list)
    wall_s: float = 0.0

    def hit_ratios(self) -> tuple[float, float]:
        hist = sum(r.history_tokens for r in self.records)
        gpu = sum(r.from_gpu for r in self.records)
        host = sum(r.from_host for r in self.records)
        return (gpu / hist, (gpu + host) / hist) if hist else (0.0, 0.0)

    def held_ratio(self) -> float:
        """What the cache held: served, or on host and recomputed by choice."""
        hist = sum(r.history_tokens for r in self.records)
        held = sum(r.from_gpu + r.from_host + r.host_recomputed for r in self.records)
        return held / hist if hist else 0.0

    def latencies(self, tier: str | None = None) -> np.ndarray:
        return np.array([r.latency_ms for r in self.records if tier is None or r.tier == tier])


def batches_of_distinct_users(requests: Iterable, batch_size: int) -> Iterator[list]:
    """Group (request, items, actions) in trace order; a user repeats only in a later batch."""
    batch: list = []
    users: set = set()
    for item in requests:
        user = item[0].user
        if len(batch) == batch_size or user in users:
            yield batch
            batch, users = [], set()
        batch.append(item)
        users.add(user)
    if batch:
        yield batch


def replay_batches(engine, batches: list[list], measure: Iterable[int] | None = None,
                   keep_scores: bool = False, label: str = "replay",
                   progress: bool = True, sync_stages: bool = False,
                   delta: bool = False, stage_every: int = 0) -> ReplayResult:
    """Run ``batches`` through ``engine.run_batch`` (offline, in order); only batches in
    ``measure`` (default all) are recorded, the others just advance the cache state (warm-up).
    ``sync_stages`` times each stage on the device (a device sync after every stage, which
    also lengthens the batch); ``stage_every=N`` does so only for every N-th batch, so the
    others time batches as served. ``delta``: a user's request after its first
    sends only the events since its previous one (``base_len``), as a client that keeps the
    engine's history does; the engine's history store must hold them (else HistoryRequired)."""
    measured = set(range(len(batches))) if measure is None else set(measure)
    out = ReplayResult()
    sent: dict = {}  # user -> events its last request carried in all (delta)
    t0 = time.perf_counter()
    with Progress(len(batches), label, enabled=progress) as bar:
        for bi, batch in enumerate(batches):
            reqs = []
            for r, items, actions in batch:
                base = sent.get(r.user) if delta else None
                if base is not None and base <= len(items):
                    reqs.append(RankRequest(user_id=r.user, items=items[base:],
                                            actions=actions[base:], candidates=r.candidates,
                                            base_len=base))
                else:
                    reqs.append(RankRequest(user_id=r.user, items=items, actions=actions,
                                            candidates=r.candidates))
                sent[r.user] = len(items)
            synced = bi % stage_every == 0 if stage_every > 0 else sync_stages
            t = time.perf_counter()
            outcome = engine.run_batch(reqs, synced, background=False)
            lat = (time.perf_counter() - t) * 1e3  # answered: what follows runs after replies
            engine.run_background()
            bar.update()
            if bi not in measured:
                continue
            out.batches += 1
            if synced or stage_every <= 0:  # (without stage_every: every batch, as timed)
                out.stage_batches += 1
                for k, v in outcome.stages.items():
                    out.stages[k] = out.stages.get(k, 0.0) + v
            for (r, _, _), res in zip(batch, outcome.results):
                if isinstance(res, Exception):
                    raise res
                scores, s = res
                if keep_scores:
                    out.scores.append(scores)
                out.records.append(RequestRecord(
                    len(out.records), r.user, bi, lat, s["tier"], s["history_tokens"],
                    s.get("tokens_from_gpu", 0), s.get("tokens_from_host", 0),
                    s["tokens_recomputed"], synced, s.get("tokens_host_recomputed", 0)))
    out.wall_s = time.perf_counter() - t0
    return out
