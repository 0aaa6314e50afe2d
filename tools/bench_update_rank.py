"""Live rank weights refits under traffic: open-loop rank requests (a synthetic trace of users
returning with growing histories, so the K/V cache is hot) while new weights arrive every
``--every`` s, against the same traffic with no refits. Reports p50/p99 with and without, the
time from ``update()`` to cutover, and checks that cached K/V of older weights are never served:
a sample of results is recomputed from scratch on the weights version stamped in each result
and must match. ``--checkpoints N`` refits from N checkpoint directories (the engine's weights
with noise, written before any timing) as production does; else each refit is an init seed
(for rank-ref a seeded init is ~5-9 s of CPU random draws). An untimed warm-up phase first
(rank plans captured, the cache filled).

  python tools/bench_update_rank.py --spec rank-small --rate 150 --seconds 10       # CPU
  python tools/bench_update_rank.py --spec rank-ref --device cuda --rate 1000 --checkpoints 3
"""

from __future__ import annotations

import argparse
import asyncio
import re
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
from streamgr.trace.synth import write_synth  # noqa: E402
from tools.bench_update import pct  # noqa: E402


async def open_loop(eng, reqs, start: int, rate: float, seconds: float, rng) -> list[dict]:
    out: list[dict] = []

    async def one(i, t0):
        rec = {"i": i}
        try:
            res = await eng.rank(reqs[i])
            rec.update(ms=(time.perf_counter() - t0) * 1e3, version=res.stats.version,
                       scores=res.scores, gpu=res.stats.tokens_from_gpu,
                       host=res.stats.tokens_from_host, hist=res.stats.history_tokens)
        except Exception as err:  # counted: must be zero
            rec.update(ms=(time.perf_counter() - t0) * 1e3, error=repr(err))
        out.append(rec)
    tasks, t_end, nxt, k = [], time.perf_counter() + seconds, time.perf_counter(), start
    while nxt < t_end and k < len(reqs):
        await asyncio.sleep(max(0.0, nxt - time.perf_counter()))
        tasks.append(asyncio.create_task(one(k, time.perf_counter())))
        k += 1
        nxt += rng.exponential(1.0 / rate)
    await asyncio.gather(*tasks)
    return out


async def refits(eng, every: float, seconds: float, rng, log: list,
                 checkpoints: list[str]) -> None:
    """A refit every ``every`` s while the phase lasts (one that ends after it still counts)."""
    t_end = time.perf_counter() + seconds
    while time.perf_counter() + every < t_end:
        await asyncio.sleep(every)
        t0 = time.perf_counter()
        w = (checkpoints[len(log) % len(checkpoints)] if checkpoints
             else int(rng.integers(1, 1 << 30)))
        vs = await eng.update(weights=w, keep_previous=False)
        log.append({"cutover_ms": (time.perf_counter() - t0) * 1e3,
                    "version": vs["rank"]["active"], "in_phase": time.perf_counter() < t_end})


def write_checkpoints(model, n: int, root: Path) -> list[str]:
    """``n`` checkpoints of ``model``'s weights plus 5% noise (drawn on its device), written
    before any timing."""
    import torch
    from streamgr.models.checkpoint import save_checkpoint
    out = []
    for i in range(n):
        gen = torch.Generator(device=model.item_embedding.weight.device).manual_seed(1 + i)
        state = {}
        for k, v in model.state_dict().items():
            f = v.float()
            noise = torch.randn(f.shape, generator=gen, device=f.device, dtype=f.dtype)
            state[k] = (f + 0.05 * (f.std() if f.numel() > 1 else 1.0) * noise).to(v.dtype)
        out.append(str(save_checkpoint(state, model.cfg, root / f"refit{i}")))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="rank-small")
    ap.add_argument("--set", action="append", dest="overrides", metavar="KEY=VALUE")
    ap.add_argument("--device", default=None)
    ap.add_argument("--profile", default="small", help="synthetic trace profile")
    ap.add_argument("--users", type=int, default=200)
    ap.add_argument("--rate", type=float, default=150.0)
    ap.add_argument("--seconds", type=float, default=10.0, help="per phase")
    ap.add_argument("--every", type=float, default=0.6)
    ap.add_argument("--check", type=int, default=200, help="results recomputed and compared")
    ap.add_argument("--checkpoints", type=int, default=0,
                    help="refit from this many checkpoint directories (0: init seeds)")
    args = ap.parse_args()
    ov = parse_set_pairs(args.overrides)
    if args.device:
        ov["engine.device"] = args.device
    m = load_spec(args.spec, ov).model
    with tempfile.TemporaryDirectory() as tmp:
        write_synth(args.profile, Path(tmp) / "t.trace", users=args.users)
        loaded, _ = load_requests(Path(tmp) / "t.trace", m.num_items, m.num_actions,
                                  m.max_history, True, min(16, m.max_candidates), None)
    reqs = [RankRequest(user_id=r.user, items=r.items, actions=r.actions,
                        candidates=r.candidates) for r in loaded]
    rng = np.random.default_rng(0)
    eng = Engine.from_spec(args.spec, ov)
    log: list[dict] = []

    tmp = tempfile.TemporaryDirectory()
    ckpts = write_checkpoints(eng.runner.model, args.checkpoints, Path(tmp.name))

    async def run():
        async with eng:
            first = eng.versions()["rank"]["active"]
            warm = min(2.0, args.seconds)
            n = int(args.rate * warm * 1.2)
            await open_loop(eng, reqs, 0, args.rate, warm, rng)
            calm = await open_loop(eng, reqs, n, args.rate, args.seconds, rng)
            n += int(args.rate * args.seconds * 1.2)
            busy, _ = await asyncio.gather(open_loop(eng, reqs, n, args.rate, args.seconds, rng),
                                           refits(eng, args.every, args.seconds, rng, log, ckpts))
            return first, calm, busy
    first, calm, busy = asyncio.run(run())
    known = {first} | {u["version"] for u in log}
    ok = [r for r in busy if "error" not in r]
    errors = sum("error" in r for r in calm + busy)
    unknown = sum(r["version"] not in known for r in ok)
    # Recompute a sample on the stamped version: stale K/V would show as a mismatch.
    sample = [ok[i] for i in np.linspace(0, len(ok) - 1, min(args.check, len(ok))).astype(int)]
    by_version: dict[str, list] = {}
    for r in sample:
        by_version.setdefault(r["version"], []).append(r)
    mismatched, worst = 0, []

    async def recompute():
        nonlocal mismatched
        for version, rs in by_version.items():
            m = re.search(r"seed:(\d+)|ckpt:(.+)$", version)
            weights = ({"model.init_seed": int(m.group(1))} if m.group(1) else
                       {"model.checkpoint": m.group(2), "model.init_seed": None})
            async with Engine.from_spec(args.spec, {**ov, **weights,
                                                    "cache.mode": "recompute"}) as ref:
                for r in rs:
                    want = (await ref.rank(reqs[r["i"]])).scores
                    bad = not np.allclose(r["scores"], want, rtol=2e-3, atol=2e-4)
                    mismatched += bad
                    if bad and len(worst) < 5:  # what a mismatch looks like, to tell causes
                        worst.append(f"{version} hit {r['gpu'] + r['host']}/{r['hist']}: "
                                     f"max |diff| {np.abs(np.asarray(r['scores']) - want).max():.3g}")
    asyncio.run(recompute())
    tmp.cleanup()
    def hit_ratio(rs):
        return sum(r["gpu"] + r["host"] for r in rs) / max(sum(r["hist"] for r in rs), 1)
    hit = hit_ratio(ok)
    hit_calm = hit_ratio([r for r in calm if "error" not in r])
    lat_c = [r["ms"] for r in calm if "error" not in r]
    lat_b = [r["ms"] for r in ok]
    cut = [u["cutover_ms"] for u in log]
    print(f"spec {args.spec} on {eng.device}: {args.rate:g} req/s offered, {args.seconds:g} s per "
          f"phase, a refit every {args.every:g} s from "
          f"{f'{len(ckpts)} checkpoints' if ckpts else 'init seeds'} ({len(log)} refits, "
          f"{sum(u['in_phase'] for u in log)} cut over inside the phase)")
    print(f"{'phase':<12}{'requests':>10}{'p50 ms':>10}{'p99 ms':>10}")
    print(f"{'no refits':<12}{len(calm):>10}{pct(lat_c, 50):>10.2f}{pct(lat_c, 99):>10.2f}")
    print(f"{'refits':<12}{len(busy):>10}{pct(lat_b, 50):>10.2f}{pct(lat_b, 99):>10.2f}")
    print(f"update() to cutover: p50 {pct(cut, 50):.1f} ms, max {max(cut, default=0):.1f} ms; "
          f"hit ratio {hit_calm:.1%} without refits, {hit:.1%} during (each refit drops the "
          f"older weights' K/V)")
    print(f"bench_update_rank {args.spec}: p99 with refits {pct(lat_b, 99) / pct(lat_c, 99):.2f}x"
          f" without (target <= 1.2); {len(sample)} results recomputed on their stamped version: "
          f"{mismatched} mismatched; unknown-version answers {unknown}; failed {errors} "
          f"(targets 0)")
    for w in worst:
        print(f"  mismatched: {w}")
    return 0 if mismatched == unknown == errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
