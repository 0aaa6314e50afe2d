"""Live updates under traffic: open-loop generate requests while weights refits and catalog
changes arrive at RecoGEM's peak cadence (a refit every ~0.6 s), against the same traffic with no
updates. Reports p50/p99 with and without updates, each update's time from ``update()`` to
cutover, and the three counts that must be zero: requests answered on a version that was never
active, removed items answered by a version that had removed them, failed requests.

  python tools/bench_update.py --spec gen-small --rate 200 --seconds 10          # CPU
  python tools/bench_update.py --spec gen-ref --device cuda --rate 1000          # the H200

A refit's weights are an init seed by default (the engine draws them on its host, beside
serving); ``--checkpoints N`` writes N checkpoint directories before the timed phases and refits
from them in turn, as a deployment whose trainer publishes files does (the engine then reads
and moves them, and draws nothing). Per update phase (the engine's ``update_phases``: catalog
build, a checkpoint's read ("read"), its move to the device or a seed's build ("weights"),
captures, waiting for the executor, the cutover, the 50 ms after it), the
requests whose lifetime overlapped it: how many, their p99, how many were slower than the p99
without updates.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamgr import Engine  # noqa: E402
from streamgr.api import GenerateRequest  # noqa: E402
from streamgr.config import parse_set_pairs  # noqa: E402
from streamgr.selection.catalog import CatalogDelta  # noqa: E402
from stall_watch import StallWatch  # noqa: E402  (tools/, the script's own folder)


async def open_loop(eng, reqs, rate: float, seconds: float, rng) -> list[dict]:
    """Poisson arrivals for ``seconds``; one record per request."""
    out: list[dict] = []
    tasks = []

    async def one(r, t0):
        rec = {"t": t0}
        try:
            res = await eng.generate(r)
            # The items as an array, not the answer's list: a list of ints per record kept
            # the young generation full of tracked containers, and the collections that
            # walked them stalled the loop 44-59 ms (docs/benchmarks.md, session 13).
            rec.update(ms=(time.perf_counter() - t0) * 1e3, version=res.stats.version,
                       items=np.asarray(res.items, dtype=np.int64))
        except Exception as err:  # counted: must be zero
            rec.update(ms=(time.perf_counter() - t0) * 1e3, error=repr(err))
        out.append(rec)
    t_end = time.perf_counter() + seconds
    nxt = time.perf_counter()
    k = 0
    while nxt < t_end:
        await asyncio.sleep(max(0.0, nxt - time.perf_counter()))
        tasks.append(asyncio.create_task(one(reqs[k % len(reqs)], time.perf_counter())))
        k += 1
        nxt += rng.exponential(1.0 / rate)
    await asyncio.gather(*tasks)
    return out


async def updates(eng, every: float, seconds: float, rng, log: list, removed: dict,
                  catalog_every: int = 3, checkpoints: list[str] | None = None,
                  state: dict | None = None):
    """A weights refit every ``every`` s (from ``checkpoints`` in turn, else an init seed);
    every ``catalog_every``-th one (0: none) also takes items down. ``state`` (the count and
    the items taken down) carries over between rounds."""
    t_end = time.perf_counter() + seconds
    state = {"n": 0, "gone": set()} if state is None else state
    if "pool" not in state:  # the catalog's second half (as it was before any removal): the
        ids = eng.gen_runner.catalog_items  # requests' histories use the first half
        state["pool"] = ids[len(ids) // 2:]
    pool = state["pool"]
    gone: set[int] = state["gone"]
    n = state["n"]
    while time.perf_counter() + every < t_end:
        await asyncio.sleep(every)
        kw = {"weights": checkpoints[n % len(checkpoints)] if checkpoints
              else int(rng.integers(1, 1 << 30))}
        if catalog_every and n % catalog_every == catalog_every - 1:
            take = [int(x) for x in rng.choice(pool, 20, replace=False) if int(x) not in gone]
            kw["catalog"] = CatalogDelta(remove=take)
            gone |= set(take)
        t0 = time.perf_counter()
        vs = await eng.update(**kw, keep_previous=False)
        name = vs["generate"]["active"]["version"]
        removed[name] = set(gone)
        log.append({"at": t0, "cutover_ms": (time.perf_counter() - t0) * 1e3, "version": name,
                    "catalog": "catalog" in kw})
        n += 1
        state["n"] = n


async def loop_stalls(stop: asyncio.Event, out: list, watch=None, every: float = 0.001,
                      over: float = 0.004) -> None:
    """(start s, length s) of every time the event loop woke more than ``over`` late: the
    loop (or the GIL) held by something, which every request waits behind. ``watch``: a
    ``StallWatch`` to beat."""
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(every)
        if watch is not None:
            watch.beat()
        lag = time.perf_counter() - t - every
        if lag > over:
            out.append((t + every, lag))


def gc_timer(out: list):
    """A ``gc.callbacks`` hook appending (start s, length s, generation) of every collection."""
    began = {}

    def hook(phase, info):
        if phase == "start":
            began["t"] = time.perf_counter()
        elif "t" in began:
            out.append((began["t"], time.perf_counter() - began.pop("t"), info["generation"]))
    return hook


def phase_ms(phases) -> dict[str, list[float]]:
    """How long each update phase took (ms), by phase name, over ``update_phases``."""
    out: dict[str, list[float]] = {}
    for marks in phases:
        items = sorted(marks.items(), key=lambda kv: kv[1])
        for (_, a), (name, b) in zip(items, items[1:]):
            out.setdefault(name, []).append((b - a) * 1e3)
    return out


def write_checkpoints(eng, n: int, root: Path) -> list[str]:
    """``n`` checkpoint directories of the engine's generate model with random weights (seeds
    1..n), written now, before any timing."""
    from streamgr.models.checkpoint import save_checkpoint
    from streamgr.models.t5 import T5
    from streamgr.runtime.deployment import t5_config_from_spec
    cfg = t5_config_from_spec(eng.spec)
    out = []
    for i in range(n):
        out.append(str(save_checkpoint(T5(cfg).init_random(1 + i), cfg, root / f"refit{i}")))
    return out


def pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def by_phase(busy: list[dict], phases, slow_ms: float, after_s: float = 0.05) -> dict:
    """Requests of the updates phase by the update phase their lifetime overlapped (the engine's
    ``update_phases``: when each phase of an update ended; "after": the ``after_s`` following a
    cutover; "none": no update running): per phase, how many, their p99, and how many were
    slower than ``slow_ms`` (the p99 without updates). A request overlapping two phases counts
    in both."""
    spans = []  # (start, end, phase name)
    for marks in phases:
        items = sorted(marks.items(), key=lambda kv: kv[1])
        for (_, a), (name, b) in zip(items, items[1:]):
            spans.append((a, b, name))
        if "cutover" in marks:
            spans.append((marks["cutover"], marks["cutover"] + after_s, "after"))
    out: dict[str, list[float]] = {}
    for r in busy:
        if "error" in r:
            continue
        t0, t1 = r["t"], r["t"] + r["ms"] / 1e3
        hit = {name for a, b, name in spans if a < t1 and t0 < b} or {"none"}
        for name in hit:
            out.setdefault(name, []).append(r["ms"])
    return {k: (len(v), pct(v, 99), sum(x > slow_ms for x in v)) for k, v in sorted(out.items())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="gen-small")
    ap.add_argument("--set", action="append", dest="overrides", metavar="KEY=VALUE")
    ap.add_argument("--device", default=None)
    ap.add_argument("--rate", type=float, default=200.0, help="requests/s, open loop")
    ap.add_argument("--seconds", type=float, default=10.0, help="per phase")
    ap.add_argument("--every", type=float, default=0.6, help="seconds between refits")
    ap.add_argument("--catalog-every", type=int, default=3,
                    help="every N-th update also removes items (0: weights refits only)")
    ap.add_argument("--checkpoints", type=int, default=0,
                    help="refit from this many checkpoint directories written before the timed "
                         "phases (0: init seeds, drawn by the engine)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="alternate the two phases this many times (calm, updates, calm, ...): "
                         "the p99s pool every round's requests, so a host's drift over the run "
                         "falls on both phases alike")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ov = parse_set_pairs(args.overrides)
    if args.device:
        ov["engine.device"] = args.device
    eng = Engine.from_spec(args.spec, ov)
    rng = np.random.default_rng(0)
    ids = eng.gen_runner.catalog_items
    hist_ids = ids[:len(ids) // 2]
    n_hist = eng.spec.policy.max_context_items  # full contexts: the engine's warm-up shapes
    reqs = [GenerateRequest(user_id=u, history=rng.choice(hist_ids, n_hist).tolist(),
                            top_k=eng.spec.policy.top_k) for u in range(512)]
    log: list[dict] = []
    removed: dict[str, set] = {}
    tmp = tempfile.TemporaryDirectory(prefix="streamgr-refits-")
    ckpts = write_checkpoints(eng, args.checkpoints, Path(tmp.name))

    async def run():
        async with eng:
            first = eng.gen_runner.version
            removed[first] = set()
            await open_loop(eng, reqs[:64], args.rate, 1.0, rng)  # warm-up
            calm, busy, state = [], [], {"n": 0, "gone": set()}
            stop = asyncio.Event()
            probe = asyncio.create_task(loop_stalls(stop, stalls, watch))
            gc.callbacks.append(gc_timer(collections))  # the timed phases' collections
            for _ in range(args.rounds):
                c = await open_loop(eng, reqs, args.rate, args.seconds, rng)
                b, _ = await asyncio.gather(
                    open_loop(eng, reqs, args.rate, args.seconds, rng),
                    updates(eng, args.every, args.seconds, rng, log, removed,
                            args.catalog_every, ckpts, state))
                rounds.append((c, b))
                calm += c
                busy += b
            stop.set()
            await probe
            gc.callbacks.pop()
            return first, calm, busy
    rounds: list = []
    stalls: list = []
    collections: list = []
    with StallWatch() as watch:
        first, calm, busy = asyncio.run(run())
    known = set(removed)
    errors = sum("error" in r for r in calm + busy)
    unknown = sum(r.get("version") not in known for r in calm + busy if "error" not in r)
    leaked = sum(bool(set(r["items"].tolist()) & removed.get(r["version"], set()))
                 for r in busy if "error" not in r)
    lat_calm = [r["ms"] for r in calm if "error" not in r]
    lat_busy = [r["ms"] for r in busy if "error" not in r]
    cut = [u["cutover_ms"] for u in log]
    tmp.cleanup()
    source = f"{len(ckpts)} checkpoints" if ckpts else "init seeds"
    print(f"spec {eng.spec.name} on {eng.device}: {args.rate:g} req/s offered, {args.seconds:g} s "
          f"per phase x {args.rounds} round(s), a refit every {args.every:g} s from {source} "
          f"({len(log)} updates, "
          f"{sum(u['catalog'] for u in log)} with catalog removals)")
    print(f"{'phase':<16}{'requests':>10}{'p50 ms':>10}{'p99 ms':>10}")
    print(f"{'no updates':<16}{len(calm):>10}{pct(lat_calm, 50):>10.2f}{pct(lat_calm, 99):>10.2f}")
    print(f"{'updates':<16}{len(busy):>10}{pct(lat_busy, 50):>10.2f}{pct(lat_busy, 99):>10.2f}")
    print(f"update() to cutover: p50 {pct(cut, 50):.1f} ms, max {max(cut, default=float('nan')):.1f} ms")
    if len(rounds) > 1:
        each = [pct([r["ms"] for r in b if "error" not in r], 99)
                / pct([r["ms"] for r in c if "error" not in r], 99) for c, b in rounds]
        print("p99 ratio per round: " + ", ".join(f"{x:.2f}x" for x in each))
    slow = pct(lat_calm, 99)
    for name, (n, p99, n_slow) in by_phase(busy, list(eng.update_phases), slow).items():
        print(f"  during {name:<10}{n:>7} requests, p99 {p99:7.2f} ms, {n_slow:>4} over the "
              f"no-update p99")
    phases = list(eng.update_phases)
    print("phase durations ms (p50 / max): " + ", ".join(
        f"{k} {pct(v, 50):.1f} / {max(v):.1f}" for k, v in phase_ms(phases).items()))
    st = by_phase([{"t": t, "ms": lag * 1e3} for t, lag in stalls], phases, 0.0)
    print("event-loop stalls > 4 ms by phase (count, p99 ms): " + ", ".join(
        f"{k} {n} {p:.1f}" for k, (n, p, _) in st.items()))
    for gen in sorted({g for _, _, g in collections}):
        ms = [d * 1e3 for _, d, g in collections if g == gen]
        print(f"gc generation {gen}: {len(ms)} collections, max {max(ms):.1f} ms, total "
              f"{sum(ms):.0f} ms")
    in_gc = sum(any(a - 0.001 < t + lag and t < a + d + 0.001 for a, d, _ in collections)
                for t, lag in stalls)
    print(f"event-loop stalls overlapping a collection: {in_gc} of {len(stalls)}")
    print(watch.report(stalls))
    c = eng.stats()["counters"]
    print(f"in place (no version built, no plan captured): {c.get('generate_refits_in_place', 0)} "
          f"of {c.get('generate_updates', 0)} updates")
    ratio = pct(lat_busy, 99) / pct(lat_calm, 99)
    print(f"bench_update {eng.spec.name}: p99 with updates {ratio:.2f}x without (target <= 1.2); "
          f"unknown-version answers {unknown}, removed items answered {leaked}, failed {errors} "
          f"(targets 0)")
    if args.json:
        plain = lambda o: o.tolist() if hasattr(o, "tolist") else list(o)  # noqa: E731
        Path(args.json).write_text(json.dumps({"calm": calm, "busy": busy, "updates": log},
                                              default=plain))
    return 0 if unknown == leaked == errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
