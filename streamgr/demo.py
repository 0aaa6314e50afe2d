"""``streamgr demo``: the newcomer's main job. Builds a spec's model (rank-small by default, random
weights), drives a short synthetic workload of returning users through the embedded engine on
the default device, and prints a table of requests, latency and throughput."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Mapping

import numpy as np

from .api import RankRequest
from .engine import Engine
from .progress import Progress


def synthetic_requests(n_requests: int, n_users: int, max_history: int, num_items: int,
                       num_actions: int, n_candidates: int, seed: int = 0) -> list[RankRequest]:
    """Users return several times; each visit appends a few events to a growing history."""
    rng = np.random.default_rng(seed)
    target = rng.integers(1, max_history + 1, size=n_users)
    hist_items: list[list[int]] = [[] for _ in range(n_users)]
    hist_actions: list[list[int]] = [[] for _ in range(n_users)]
    out = []
    for _ in range(n_requests):
        u = int(rng.integers(n_users))
        room = max_history - len(hist_items[u])
        grow = min(room, int(rng.integers(1, max(2, target[u] // 4))))
        hist_items[u].extend(rng.integers(num_items, size=grow).tolist())
        hist_actions[u].extend(rng.integers(num_actions, size=grow).tolist())
        cands = rng.choice(num_items, size=n_candidates, replace=False).tolist()
        out.append(RankRequest(user_id=u, items=list(hist_items[u]),
                               actions=list(hist_actions[u]), candidates=cands))
    return out


async def run_demo(spec: str = "rank-small", overrides: Mapping[str, Any] | None = None,
                   n_requests: int = 300, n_users: int = 48, concurrency: int = 16,
                   seed: int = 0, progress: bool = True) -> dict:
    engine = Engine.from_spec(spec, overrides)
    cfg = engine.model_config
    reqs = synthetic_requests(n_requests, n_users, cfg.max_history, cfg.num_items,
                              cfg.num_actions, min(32, cfg.max_candidates), seed)
    latencies: list[float] = []
    sem = asyncio.Semaphore(concurrency)
    async with engine:
        with Progress(len(reqs), "demo", enabled=progress) as bar:
            async def one(r: RankRequest) -> None:
                async with sem:
                    t = time.perf_counter()
                    await engine.rank(r)
                    latencies.append((time.perf_counter() - t) * 1e3)
                    bar.update()
            t0 = time.perf_counter()
            # Per user in order (a user's next visit extends the last), across users concurrently.
            await asyncio.gather(*(one(r) for r in reqs))
            wall = time.perf_counter() - t0
        stats = engine.stats()
    lat = np.array(latencies)
    return {"spec": engine.spec.name, "device": stats["device"], "dtype": stats["dtype"],
            "mode": stats["cache_mode"], "requests": len(reqs), "mean_ms": float(lat.mean()),
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "throughput": len(reqs) / wall, "total_hit_ratio": stats["total_hit_ratio"]}


def format_table(rows: list[dict]) -> str:
    head = ("spec", "device", "mode", "requests", "mean ms", "p99 ms", "req/s", "hit ratio")
    body = [(r["spec"], f'{r["device"]}/{r["dtype"]}', r["mode"], str(r["requests"]),
             f'{r["mean_ms"]:.2f}', f'{r["p99_ms"]:.2f}', f'{r["throughput"]:.1f}',
             f'{100 * r["total_hit_ratio"]:.1f}%') for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])
