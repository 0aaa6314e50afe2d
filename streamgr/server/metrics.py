"""Server metrics: request counts by kind and outcome, a latency histogram, and the Prometheus
text exposition of those plus the engine's cache statistics."""

from __future__ import annotations

import bisect
from collections import Counter

BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


def label_value(value) -> str:
    """A Prometheus label value, escaped as the text format wants (backslash, quote and line
    feed): a version names its checkpoint's path, and one raw line feed there would make the
    whole scrape unparseable."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class ServerMetrics:
    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()  # (kind, outcome)
        self.counters: Counter[str] = Counter()
        self.hist: dict[str, list[int]] = {}
        self.sums: Counter[str] = Counter()

    def observe(self, kind: str, outcome: str, seconds: float) -> None:
        self.requests[(kind, outcome)] += 1
        h = self.hist.setdefault(kind, [0] * (len(BUCKETS_S) + 1))
        h[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        self.sums[kind] += seconds

    def snapshot(self) -> dict:
        return {"requests": {f"{k}:{o}": n for (k, o), n in self.requests.items()},
                **self.counters}

    def prometheus(self, engine_stats: dict, connections: int, inflight: int) -> str:
        out = ["# TYPE streamgr_requests_total counter"]
        for (kind, outcome), n in sorted(self.requests.items()):
            out.append(f'streamgr_requests_total{{kind="{kind}",outcome="{outcome}"}} {n}')
        out.append("# TYPE streamgr_request_latency_seconds histogram")
        for kind, h in sorted(self.hist.items()):
            acc = 0
            for le, n in zip(BUCKETS_S, h):
                acc += n
                out.append(f'streamgr_request_latency_seconds_bucket{{kind="{kind}",le="{le}"}} {acc}')
            acc += h[-1]
            out.append(f'streamgr_request_latency_seconds_bucket{{kind="{kind}",le="+Inf"}} {acc}')
            out.append(f'streamgr_request_latency_seconds_sum{{kind="{kind}"}} {self.sums[kind]:.6f}')
            out.append(f'streamgr_request_latency_seconds_count{{kind="{kind}"}} {acc}')
        out += ["# TYPE streamgr_connections gauge", f"streamgr_connections {connections}",
                "# TYPE streamgr_inflight gauge", f"streamgr_inflight {inflight}"]
        for name in ("gpu_hit_ratio", "total_hit_ratio", "held_ratio"):
            out += [f"# TYPE streamgr_{name} gauge", f"streamgr_{name} {engine_stats.get(name, 0.0)}"]
        for name, value in sorted(engine_stats.get("cache", {}).items()):
            if isinstance(value, (int, float)):
                out.append(f"streamgr_cache_{name} {value}")
        for name, value in sorted(engine_stats.get("decode_plans", {}).items()):
            if isinstance(value, (int, float)):  # plans, captures, replays, enabled (0/1)
                out.append(f"streamgr_decode_plans_{name} {int(value)}")
        counters = engine_stats.get("counters", {})
        for kind in ("rank", "generate"):  # live updates (engine/updates.py)
            for what in ("updates", "rollbacks"):
                out.append(f"streamgr_{kind}_{what}_total {counters.get(f'{kind}_{what}', 0)}")
        # Saturation: requests waiting for a batch, batches run and the requests they answered
        # (the two counters' rates give the mean batch size of any window); only for an engine
        # in this process (a Ray ingress's replicas keep their own counters).
        serves = engine_stats.get("serves", []) if "counters" in engine_stats else []
        if "queued" in engine_stats:
            out += ["# TYPE streamgr_engine_queued gauge",
                    f"streamgr_engine_queued {engine_stats['queued']}"]
        for name, what in (("batches", "batches"), ("batched_requests", "requests")):
            out += [f"# TYPE streamgr_{name}_total counter"] if serves else []
            for kind in serves:
                out.append(f'streamgr_{name}_total{{kind="{kind}"}} '
                           f'{counters.get(f"{kind}_{what}", 0)}')
        if "rank" in serves:
            # Where rank history tokens came from, as counters: their rates give the hit ratio
            # of a window (the *_ratio gauges above are since the start). Disjoint, summing to
            # the history tokens; "recomputed" includes what the host held and onload_split
            # chose to recompute (streamgr_cache_host_tokens_recomputed).
            out.append("# TYPE streamgr_rank_history_tokens_total counter")
            for source, key in (("gpu", "tokens_from_gpu"), ("host", "tokens_from_host"),
                                ("recomputed", "tokens_recomputed")):
                out.append(f'streamgr_rank_history_tokens_total{{source="{source}"}} '
                           f"{counters.get(key, 0)}")
        if "generate" in serves:
            out += ["# TYPE streamgr_generate_gpu_seconds_total counter",
                    f"streamgr_generate_gpu_seconds_total "
                    f"{counters.get('generate_gpu_us', 0) / 1e6:.6f}"]
        out.append("# TYPE streamgr_version_info gauge")
        for kind, key in (("rank", "weights_version"), ("generate", "generate_version")):
            if kind in engine_stats.get("serves", []) and key in engine_stats:
                out.append(f'streamgr_version_info{{kind="{kind}",'
                           f'version="{label_value(engine_stats[key])}"}} 1')
        for name, value in sorted(self.counters.items()):
            out.append(f"streamgr_server_{name}_total {value}")
        return "\n".join(out) + "\n"
