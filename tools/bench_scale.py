"""Scale-out on Ray Serve: one engine against 1 and 2 replicas, user-affinity routing against
Ray's default router, on the same rank trace (a synthetic KuaiRand-like one), closed loop.

Prints per run: requests/s, p50/p99 latency and the total hit ratio (history tokens served from
a cache tier over all history tokens, from the results' stats), then the throughput of 2
replicas over 1 and the latency Ray adds (one request at a time: the embedded engine against
the same engine behind Ray, p50/p99).

  python tools/bench_scale.py --spec rank-small --users 200 --limit 3000          # CPU
  python tools/bench_scale.py --spec rank-ref --profile kuairand-1k --users 400   # 2 GPUs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamgr import Engine  # noqa: E402
from streamgr.api import RankRequest  # noqa: E402
from streamgr.config import parse_set_pairs  # noqa: E402
from streamgr.config import load_spec  # noqa: E402
from streamgr.trace.requests import load_requests  # noqa: E402
from streamgr.trace.run import drive  # noqa: E402
from streamgr.trace.synth import write_synth  # noqa: E402


def summary(name: str, records: list, wall: float, errors: list) -> dict:
    lat = [r["latency_ms"] for r in records]
    hist = sum(r["history_tokens"] for r in records)
    cached = sum(r["from_gpu"] + r["from_host"] for r in records)
    return {"run": name, "requests": len(records), "errors": len(errors),
            "req_s": len(records) / wall, "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "hit_ratio": cached / max(hist, 1)}


async def closed(call, reqs, concurrency, name):
    records, wall, errors = await drive(call, reqs, concurrency, None, name, False, name)
    return summary(name, records, wall, errors)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="rank-small")
    ap.add_argument("--set", action="append", dest="overrides", metavar="KEY=VALUE")
    ap.add_argument("--profile", default="small", help="synthetic trace profile")
    ap.add_argument("--users", type=int, default=200)
    ap.add_argument("--limit", type=int, default=3000, help="requests replayed per run")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--solo", type=int, default=200, help="requests for the latency Ray adds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import ray

    from streamgr.deploy.ray_serve import RayEngine
    ov = parse_set_pairs(args.overrides)
    spec = load_spec(args.spec, ov)
    m = spec.model
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "scale.trace"
        write_synth(args.profile, trace, users=args.users)
        reqs, _ = load_requests(trace, m.num_items, m.num_actions, m.max_history, True,
                                min(32, m.max_candidates), args.limit)
    reqs = [RankRequest(user_id=r.user, items=r.items, actions=r.actions,
                        candidates=r.candidates) for r in reqs]
    solo = reqs[:args.solo]
    runs = []

    async def single():
        async with Engine.from_spec(args.spec, ov) as eng:
            runs.append(await closed(eng.rank, reqs, args.concurrency, "one engine"))
            t = []
            for r in solo:
                t0 = time.perf_counter()
                await eng.rank(r)
                t.append((time.perf_counter() - t0) * 1e3)
            return t
    direct = asyncio.run(single())
    ray.init(include_dashboard=False, log_to_driver=False)
    through_ray = []
    for n, router in ((1, "affinity"), (2, "affinity"), (2, "default")):
        eng = RayEngine(args.spec, ov, replicas=n, router=router,
                        app=f"scale{n}{router}").start()

        async def go():
            out = await closed(eng.rank, reqs, args.concurrency, f"ray {n} x {router}")
            if n == 1:
                for r in solo:
                    t0 = time.perf_counter()
                    await eng.rank(r)
                    through_ray.append((time.perf_counter() - t0) * 1e3)
            await eng.close()
            return out
        runs.append(asyncio.run(go()))
    ray.shutdown()
    print(f"spec {spec.name}: {len(reqs)} requests of {args.users} users ({args.profile}), "
          f"closed loop, {args.concurrency} in flight")
    print(f"{'run':<22}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'hit ratio':>11}{'errors':>8}")
    for r in runs:
        print(f"{r['run']:<22}{r['req_s']:>9.1f}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}"
              f"{r['hit_ratio']:>11.2%}{r['errors']:>8}")
    by = {r["run"]: r for r in runs}
    two, one = by["ray 2 x affinity"], by["ray 1 x affinity"]
    add50 = np.percentile(through_ray, 50) - np.percentile(direct, 50)
    add99 = np.percentile(through_ray, 99) - np.percentile(direct, 99)
    print(f"latency Ray adds, one request at a time: p50 {add50:+.2f} ms, p99 {add99:+.2f} ms "
          f"(embedded p50 {np.percentile(direct, 50):.2f} ms)")
    print(f"bench_scale {spec.name}: 2 replicas {two['req_s'] / one['req_s']:.2f}x one "
          f"(target >= 1.8); hit ratio affinity {two['hit_ratio']:.2%}, default router "
          f"{by['ray 2 x default']['hit_ratio']:.2%}, one engine {by['one engine']['hit_ratio']:.2%}"
          f" (target: affinity within 1 point of one engine)")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "direct_ms": direct,
                                               "ray_ms": through_ray}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
