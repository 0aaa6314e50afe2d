"""``streamgr demo``: the newcomer's main job. Builds a spec's model (rank-small by default, random
weights), drives a short synthetic workload through the embedded engine on the default device
(returning users' rank requests, or generate requests over the spec's catalog), and prints a
table of requests, latency and throughput."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Mapping

import numpy as np

from .api import GenerateRequest, RankRequest
from .errors import StreamgrError
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


def synthetic_generate_requests(engine: Engine, n_requests: int, n_users: int,
                                seed: int = 0) -> list[GenerateRequest]:
    """Histories of catalog items (a few to the policy's context length), top 10."""
    rng = np.random.default_rng(seed)
    items = engine.gen_runner.catalog_items
    max_ctx = engine.spec.policy.max_context_items
    top_k = min(10, engine.spec.policy.max_top_k)
    return [GenerateRequest(user_id=int(rng.integers(n_users)),
                            history=rng.choice(items, size=int(rng.integers(1, max_ctx + 1))).tolist(),
                            top_k=top_k) for _ in range(n_requests)]


async def run_demo(spec: str = "rank-small", overrides: Mapping[str, Any] | None = None,
                   n_requests: int = 300, n_users: int = 48, concurrency: int = 16,
                   seed: int = 0, progress: bool = True) -> dict:
    for name, value in (("requests", n_requests), ("users", n_users), ("concurrency", concurrency)):
        if value < 1:
            raise StreamgrError(f"demo: --{name} must be at least 1, got {value}")
    engine = Engine.from_spec(spec, overrides)
    if engine.serves_rank:
        cfg = engine.model.cfg
        reqs = synthetic_requests(n_requests, n_users, cfg.max_history, cfg.num_items,
                                  cfg.num_actions, min(32, cfg.max_candidates), seed)
        call = engine.rank
    else:
        reqs = synthetic_generate_requests(engine, n_requests, n_users, seed)
        call = engine.generate
    latencies: list[float] = []
    sem = asyncio.Semaphore(concurrency)
    async with engine:
        with Progress(len(reqs), "demo", enabled=progress) as bar:
            async def one(r) -> None:
                async with sem:
                    t = time.perf_counter()
                    await call(r)
                    latencies.append((time.perf_counter() - t) * 1e3)
                    bar.update()
            t0 = time.perf_counter()
            # Per user in order (a user's next visit extends the last), across users concurrently.
            await asyncio.gather(*(one(r) for r in reqs))
            wall = time.perf_counter() - t0
        stats = engine.stats()
    lat = np.array(latencies)
    return {"spec": engine.spec.name, "device": stats["device"], "dtype": stats["dtype"],
            "mode": stats["cache_mode"] if engine.serves_rank else "generate", "requests": len(reqs), "mean_ms": float(lat.mean()),
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "throughput": len(reqs) / wall,
            "total_hit_ratio": stats.get("total_hit_ratio", 0.0) if engine.serves_rank else None}


def format_table(rows: list[dict]) -> str:
    head = ("spec", "device", "mode", "requests", "mean ms", "p99 ms", "req/s", "hit ratio")
    body = [(r["spec"], f'{r["device"]}/{r["dtype"]}', r["mode"], str(r["requests"]),
             f'{r["mean_ms"]:.2f}', f'{r["p99_ms"]:.2f}', f'{r["throughput"]:.1f}',
             "-" if r["total_hit_ratio"] is None else f'{100 * r["total_hit_ratio"]:.1f}%')
            for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])
