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
        self._gen_lat: deque[float] = deque(maxlen=self.WINDOW)
        self._gen_summary: tuple[int, dict] = (-1, {})

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def observe_rank(self, stats) -> None:
        c = self.counters
        c["rank_requests"] += 1
        c["history_tokens"] += stats.history_tokens
        c["tokens_from_gpu"] += stats.tokens_from_gpu
        c["tokens_from_host"] += stats.tokens_from_host
        c["tokens_host_recomputed"] += stats.tokens_host_recomputed
        c["tokens_recomputed"] += stats.tokens_recomputed
        self._lat.append(stats.total_ms)

    def observe_generate(self, stats) -> None:
        self.counters["generate_requests"] += 1
        self._gen_lat.append(stats.total_ms)

    @staticmethod
    def _summary(cache: tuple[int, dict], n: int, lat: deque) -> tuple[int, dict]:
        if cache[0] == n:  # percentiles cost O(window): only when something changed
            return cache
        a = np.array(lat) if lat else None
        return (n, {} if a is None else {
            "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p99": float(np.percentile(a, 99)), "window": int(a.size)})

    def snapshot(self) -> dict:
        c = self.counters
        hist = c["history_tokens"]
        self._lat_summary = self._summary(self._lat_summary, c["rank_requests"], self._lat)
        self._gen_summary = self._summary(self._gen_summary, c["generate_requests"], self._gen_lat)
        return {
            "counters": dict(c),
            "gpu_hit_ratio": c["tokens_from_gpu"] / hist if hist else 0.0,
            "total_hit_ratio": (c["tokens_from_gpu"] + c["tokens_from_host"]) / hist if hist else 0.0,
            # what the cache held, served or recomputed by choice (cache.onload_split)
            "held_ratio": (c["tokens_from_gpu"] + c["tokens_from_host"]
                           + c["tokens_host_recomputed"]) / hist if hist else 0.0,
            "latency_ms": dict(self._lat_summary[1]),  # rank requests
            "generate_latency_ms": dict(self._gen_summary[1]),
        }
