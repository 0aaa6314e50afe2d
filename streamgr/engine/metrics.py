"""Engine counters and latency summaries (what ``Engine.stats()`` and the server's metrics show)."""

from __future__ import annotations

from collections import Counter, deque

import numpy as np


class EngineMetrics:
    """Counters plus a bounded window of recent latencies (for p50/p99 without unbounded memory)."""

    WINDOW = 10000

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self._lat: deque[float] = deque(maxlen=self.WINDOW)
        self._lat_summary: tuple[int, dict] = (-1, {})  # (observations, summary): reused until one more

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def observe_rank(self, stats) -> None:
        c = self.counters
        c["rank_requests"] += 1
        c["history_tokens"] += stats.history_tokens
        c["tokens_from_gpu"] += stats.tokens_from_gpu
        c["tokens_from_host"] += stats.tokens_from_host
        c["tokens_recomputed"] += stats.tokens_recomputed
        self._lat.append(stats.total_ms)

    def snapshot(self) -> dict:
        c = self.counters
        hist = c["history_tokens"]
        n = c["rank_requests"]
        if self._lat_summary[0] != n:  # percentiles cost O(window): only when something changed
            lat = np.array(self._lat) if self._lat else None
            self._lat_summary = (n, {} if lat is None else {
                "mean": float(lat.mean()), "p50": float(np.percentile(lat, 50)),
                "p99": float(np.percentile(lat, 99)), "window": int(lat.size)})
        return {
            "counters": dict(c),
            "gpu_hit_ratio": c["tokens_from_gpu"] / hist if hist else 0.0,
            "total_hit_ratio": (c["tokens_from_gpu"] + c["tokens_from_host"]) / hist if hist else 0.0,
            "latency_ms": dict(self._lat_summary[1]),
        }
