"""Rank benchmark: recompute vs gpu-only vs hierarchical on one synthetic KuaiRand-like trace.

Batches of distinct users in trace order (batch sizes 1, 4, 8), in one run. The first part of
the trace only warms the caches; the rest is measured. Recompute is stateless, so it is timed on
every k-th measured batch and the speed-ups compare the same batches. Before any timing counts,
the cached modes' scores are checked against recompute's on those batches. ``--interleave``
opens the three engines at once and runs each batch through all of them in turn (recompute on
every batch), so that a host whose speed drifts during the run weighs on every mode alike.

Output: MTServe's Table 1 (latency, speed-up, hit ratios) and Table 2 (per-stage breakdown),
latency by tier (GPU hit / host hit / miss), and a one-line summary last.

  python tools/bench_rank.py --spec rank-small                       # CPU, seconds
  python tools/bench_rank.py --spec rank-ref --profile kuairand-1k ...  # the H200 (issue 4)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamgr.config import parse_set_pairs  # noqa: E402
from streamgr.config import load_spec  # noqa: E402
from streamgr.engine.core import Engine  # noqa: E402
from streamgr.trace.replay import ReplayResult, batches_of_distinct_users, replay_batches  # noqa: E402
from streamgr.trace.synth import Timeline, synth_trace  # noqa: E402
from host_probe import probe_ms  # noqa: E402  (tools/, the script's own folder)

MODES = ("recompute", "gpu-only", "hierarchical")
SHORT = {"recompute": "RE", "gpu-only": "GPU", "hierarchical": "HIER"}
# plan / fill / launch: the host parts of "model" when a rank plan replays (within it)
STAGES = ("strip", "metadata", "onload_submit", "layout", "onload_wait", "model", "plan", "fill",
          "launch", "commit", "postprocess")


def drain_background(eng, rounds: int = 100_000) -> None:
    """Finish the prefill's background work before timing: commits, and the offload of every
    chunk it filled. A server running since the trace's start would have offloaded those chunks
    as they filled; left queued, the whole prefill's offload (GBs of gathers and copies) would
    run beside the timed batches and time them against a backlog no server has."""
    runner = eng.runner
    for _ in range(rounds):
        if not getattr(runner, "has_background_work", False):
            return
        eng.run_background()
        runner.flush()


def warm_batches(profile: str, seed: int, users: int, n: int, bs: int) -> list[list]:
    """``n`` batches of ``bs`` first visits of users no timed batch has (another synthesis,
    their ids moved past the trace's): replayed untimed in every mode before its timed batches,
    so that no mode's timed batches pay the process's or the engine's one-time costs (kernels
    loaded, plans captured, pools grown) while the others' do not."""
    if n <= 0:
        return []
    trace = synth_trace(profile, seed + 7919, users)
    tl = Timeline(trace)
    reqs = []
    for k in range(len(trace)):
        r, items, actions = tl.request(k)
        reqs.append((dataclasses.replace(r, user=r.user + 10 ** 9), items, actions))
    return list(batches_of_distinct_users(iter(reqs), bs))[:n]


def open_mode(spec, mode, prefill, delta=False, warm=()):
    """An engine in ``mode``, its warm-up batches and (cached modes) its prefill replayed."""
    eng = Engine(load_spec(spec, {"cache.mode": mode}))
    split = getattr(eng.runner, "onload_split", None)
    if split is not None and not isinstance(split, float):  # measured at start ("auto")
        print(f"{mode} onload split costs: onload {split.onload_s * 1e6:.3f} us a token; "
              f"recompute of a user's first {split.lengths.astype(int).tolist()} tokens "
              f"{np.round(split.recompute_s * 1e3, 3).tolist()} ms", file=sys.stderr)
    if warm:
        replay_batches(eng, list(warm), measure=[], label=f"{mode} warm-up", progress=False)
    if mode != "recompute" and prefill:
        # Each user's history as of the warm-up start, loaded once (untimed): the cache then
        # holds what a server running since the trace's beginning would hold.
        replay_batches(eng, prefill, measure=[], label=f"{mode} prefill", delta=delta)
        drain_background(eng)
    return eng


def close_mode(eng, mode, bs) -> None:
    plans = eng.stats().get("rank_plans")
    if plans is not None:
        print(f"{mode} bs={bs} rank plans: {plans}", file=sys.stderr)
    eng.close_offline()
    del eng
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_mode(spec, mode, batches, measured, timed_re, prefill, delta=False, stage_every=1,
             warm=()):
    eng = open_mode(spec, mode, prefill, delta, warm)
    measure = timed_re if mode == "recompute" else measured
    # Recompute keeps no state: only its timed batches need to run, after one untimed (its
    # first batch pays one-time costs: library handles, kernels loaded, pools grown).
    todo = [batches[i] for i in timed_re] if mode == "recompute" else batches
    if mode == "recompute" and todo:
        replay_batches(eng, todo[:1], measure=[], label=f"{mode} warm-up", progress=False)
    idx = list(range(len(timed_re))) if mode == "recompute" else measure
    res = replay_batches(eng, todo, measure=idx, keep_scores=True,
                         label=f"{mode} bs={len(batches[0])}", stage_every=stage_every,
                         delta=delta and mode != "recompute")
    if mode == "recompute":  # batch numbers back to the shared numbering
        for r in res.records:
            r.batch = timed_re[r.batch]
    close_mode(eng, mode, len(batches[0]))
    return res


def run_interleaved(spec, modes, batches, measured, prefill, stage_every=1, warm=()):
    """Every mode's engine open at once, each batch through all of them in turn (the order
    rotated batch by batch), every measured batch timed in every mode: a host that speeds up
    or slows down during the run (0.1-0.3 ms on a first-visit batch of 8 on the H200 hosts,
    session 22) then weighs on every mode alike, where one mode after another it lands on
    whichever mode ran then. Each engine's background work (hierarchical's offloads) is
    drained after its batch, so that it runs beside no other mode's batch; served one mode at a
    time it would run beside that mode's next batch, so the time it took is printed apart
    (stderr), not charged. Memory: the cached modes' stores are held together."""
    engines = {m: open_mode(spec, m, prefill, False, warm) for m in modes}
    runs = {m: ReplayResult() for m in modes}
    drained = dict.fromkeys(modes, 0.0)
    meas = set(measured)
    for j, batch in enumerate(batches):
        synced = stage_every > 0 and j % stage_every == 0
        k = j % len(modes)
        for m in modes[k:] + modes[:k]:
            r = replay_batches(engines[m], [batch], measure=[0] if j in meas else [],
                               keep_scores=True, progress=False, sync_stages=synced)
            t = time.perf_counter()
            drain_background(engines[m])
            drained[m] += time.perf_counter() - t
            acc = runs[m]
            for rec in r.records:
                rec.batch = j
            acc.records += r.records
            acc.scores += r.scores
            acc.batches += r.batches
            if r.batches and (stage_every <= 1 or synced):
                acc.stage_batches += 1
                for key, v in r.stages.items():
                    acc.stages[key] = acc.stages.get(key, 0.0) + v
    print("interleaved: background work drained after each batch, ms a batch: " + ", ".join(
        f"{m} {drained[m] / max(len(batches), 1) * 1e3:.3f}" for m in modes), file=sys.stderr)
    for m, eng in engines.items():
        close_mode(eng, m, len(batches[0]))
    return runs


def summarize(res, timed_re_set, n_batches, stage_every=1):
    """Latency over the batches timed as served (with ``--stage-every N > 1``, those without
    stage syncs; else every batch), the stage breakdown over the synced ones."""
    per_batch = {}
    for r in res.records:
        if stage_every <= 1 or not r.synced:
            per_batch[r.batch] = r.latency_ms
    gpu, total = res.hit_ratios()
    b = max(res.stage_batches, 1)
    return {"mean_ms": float(np.mean(list(per_batch.values()))),
            "median_ms": float(np.median(list(per_batch.values()))),
            "p99_ms": float(np.percentile(list(per_batch.values()), 99)),
            "mean_ms_on_re_batches": float(np.mean([per_batch[i] for i in per_batch if i in timed_re_set]
                                                   or list(per_batch.values()))),
            "gpu_hit": gpu, "total_hit": total, "held": res.held_ratio(), "batches": res.batches,
            "stages": {k: v / b for k, v in res.stages.items()},
            "tiers": {t: (float(lat.mean()), int(lat.size)) for t in ("gpu", "host", "miss")
                      for lat in [res.latencies(t)] if lat.size}}


def check_equal(ref, got, dtype_is_fp32):
    a, b = np.concatenate(ref.scores), np.concatenate(got.scores)
    err = float(np.abs(a - b).max())
    tol = 2e-3 if dtype_is_fp32 else 0.08 * max(1.0, float(np.abs(a).mean()))
    if err > tol:
        raise SystemExit(f"cached scores differ from recompute: max abs error {err:.3g} > {tol:.3g}")
    return err


def table(title, rows, cols):
    w0 = max(len(r[0]) for r in rows)
    widths = [max(len(c), *(len(r[i + 1]) for r in rows)) for i, c in enumerate(cols)]
    lines = [title, " " * w0 + "  " + "  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    for r in rows:
        lines.append(r[0].ljust(w0) + "  " + "  ".join(x.rjust(w) for x, w in zip(r[1:], widths)))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="rank-small")
    ap.add_argument("--set", action="append", dest="overrides", metavar="KEY=VALUE")
    ap.add_argument("--device", default=None, help="engine.device override (auto/cpu/cuda)")
    ap.add_argument("--profile", default="small", help="synthetic trace profile")
    ap.add_argument("--users", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--limit", type=int, default=None, help="use the first N requests")
    ap.add_argument("--warmup-frac", type=float, default=0.5,
                    help="without --window: the first part of the replay only warms the caches")
    ap.add_argument("--start-frac", type=float, default=None,
                    help="with --window: where in the trace the warm-up starts")
    ap.add_argument("--warmup", type=int, default=0, help="with --window: requests replayed untimed")
    ap.add_argument("--window", type=int, default=None, help="measured requests")
    ap.add_argument("--prefill", action="store_true",
                    help="load each user's history as of the warm-up start before replaying")
    ap.add_argument("--recompute-every", type=int, default=1)
    ap.add_argument("--delta", action="store_true",
                    help="returning users send only their new events (base_len), as a client "
                         "that keeps the engine's history does")
    ap.add_argument("--stage-every", type=int, default=1,
                    help="time the stages (a device sync after each) on every N-th batch only "
                         "and report latency over the others, as served (1: every batch synced, "
                         "the method of earlier sessions' tables); pick N co-prime with "
                         "--recompute-every, so the speed-ups still compare unsynced batches")
    ap.add_argument("--warm-batches", type=int, default=0,
                    help="untimed batches of other users' first visits through each mode's "
                         "engine before anything else (0: none, the method of earlier tables)")
    ap.add_argument("--mode-order", nargs=3, choices=MODES, default=list(MODES),
                    help="the order the modes run in (each in its own engine, one after the "
                         "other in this process): to tell a mode's cost from its place")
    ap.add_argument("--interleave", action="store_true",
                    help="open the three modes' engines at once and run each batch through "
                         "all of them in turn (the order rotated), recompute on every batch: "
                         "the host's drift during the run weighs on every mode alike")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if sorted(args.mode_order) != sorted(MODES):
        ap.error(f"--mode-order names each of {', '.join(MODES)} once")
    if args.interleave and args.delta:
        ap.error("--interleave replays whole requests (--delta keeps per-engine state)")
    ov = parse_set_pairs(args.overrides)
    if args.device:
        ov["engine.device"] = args.device
    spec = load_spec(args.spec, ov)
    trace = synth_trace(args.profile, args.seed, args.users)
    if args.limit:
        trace = trace[:args.limit]
    tl = Timeline(trace)
    if args.window is not None:
        s0 = int((args.start_frac or 0.0) * len(trace))
        order = list(range(s0, min(len(trace), s0 + args.warmup + args.window)))
    else:
        s0, order = 0, list(range(len(trace)))
    fp32 = spec.model.dtype == "float32" or (spec.model.dtype == "auto" and not (
        spec.engine.device != "cpu" and torch.cuda.is_available()))
    results = {}
    for bs in args.batch:
        batches = list(batches_of_distinct_users((tl.request(n) for n in order), bs))
        if args.window is not None:
            n_warm, seen = 0, 0
            while n_warm < len(batches) and seen < args.warmup:
                seen += len(batches[n_warm])
                n_warm += 1
            warm = n_warm
        else:
            warm = int(len(batches) * args.warmup_frac)
        measured = list(range(warm, len(batches)))
        timed_re = measured if args.interleave else measured[::args.recompute_every]
        prefill = None
        if args.prefill:  # untimed, in batches of 8 at least
            prefill = tl.prefill(s0, order, max(bs, 8))
        warm = warm_batches(args.profile, args.seed, args.users or 200, args.warm_batches, bs)
        if args.interleave:
            runs = run_interleaved(spec, tuple(args.mode_order), batches, measured, prefill,
                                   args.stage_every, warm)
        else:
            runs = {m: run_mode(spec, m, batches, measured, timed_re, prefill, args.delta,
                                args.stage_every, warm) for m in args.mode_order}
        # The cached modes' scores on the recompute-timed batches, against recompute's.
        re_set = set(timed_re)
        errs = {}
        for m in ("gpu-only", "hierarchical"):
            sub = type(runs[m])()
            sub.scores = [s for s, r in zip(runs[m].scores, runs[m].records) if r.batch in re_set]
            errs[m] = check_equal(runs["recompute"], sub, fp32)
        results[bs] = {m: summarize(runs[m], re_set, len(batches), args.stage_every)
                       for m in MODES}
        results[bs]["max_abs_err"] = errs
        results[bs]["batches"] = {"total": len(batches), "measured": len(measured),
                                  "recompute_timed": len(timed_re)}
        r = results[bs]
        print(f"BS={bs}: " + ", ".join(  # each batch size as soon as it is done
            f"{m} {r[m]['mean_ms']:.2f} ms (p99 {r[m]['p99_ms']:.2f}), hit {100 * r[m]['total_hit']:.2f}%"
            for m in MODES), flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))

    cols = [f"BS={bs} {SHORT[m]}" for bs in args.batch for m in MODES]
    get = lambda bs, m: results[bs][m]
    re_ms = lambda bs: get(bs, "recompute")["mean_ms"]
    rows = [
        ["Latency mean (ms)"] + [f'{get(bs, m)["mean_ms"]:.2f}' for bs in args.batch for m in MODES],
        # The median too: a mean carries the batches that captured a rank plan (first visits
        # bring new shapes in every mode), which can outweigh the differences measured.
        ["Latency median (ms)"] + [f'{get(bs, m)["median_ms"]:.2f}' for bs in args.batch for m in MODES],
        ["Latency p99 (ms)"] + [f'{get(bs, m)["p99_ms"]:.2f}' for bs in args.batch for m in MODES],
        ["Speedup vs RE"] + [f'{re_ms(bs) / get(bs, m)["mean_ms_on_re_batches"]:.2f}x'
                             for bs in args.batch for m in MODES],
        ["GPU hit ratio"] + ["-" if m == "recompute" else f'{100 * get(bs, m)["gpu_hit"]:.2f}%'
                             for bs in args.batch for m in MODES],
        ["Total hit ratio"] + ["-" if m == "recompute" else f'{100 * get(bs, m)["total_hit"]:.2f}%'
                               for bs in args.batch for m in MODES],
        # cache.onload_split: host tokens recomputed by choice count as held, not as hits
        ["Held (hits + host recomputed)"] + ["-" if m == "recompute" else f'{100 * get(bs, m)["held"]:.2f}%'
                                             for bs in args.batch for m in MODES],
    ]
    print(f"\nspec {spec.name} ({spec.model.num_layers} layers, dim {spec.model.num_heads * spec.model.head_dim}), "
          f"profile {args.profile}, {len(order)} requests replayed, device {torch.cuda.get_device_name() if torch.cuda.is_available() and spec.engine.device != 'cpu' else 'cpu'}, "
          f"host probe {probe_ms():.0f} ms (tools/host_probe.py)")
    print(table("Table 1: end-to-end batch latency, speed-up, hit ratios", rows, cols))
    srows = [[s] + [f'{get(bs, m)["stages"].get(s, 0.0):.2f}' for bs in args.batch for m in MODES]
             for s in STAGES]
    print(table("\nTable 2: per-batch stage breakdown (ms)", srows, cols))
    trows = [[f"{t} ({'mean ms' })"] + [
        (lambda v: f"{v[0]:.2f} n={v[1]}" if v else "-")(get(bs, m)["tiers"].get(t))
        for bs in args.batch for m in MODES] for t in ("gpu", "host", "miss")]
    print(table("\nLatency by tier (batches containing a request of that tier)", trows, cols))
    errs = {bs: results[bs]["max_abs_err"] for bs in args.batch}
    print(f"\nscores vs recompute, max abs error: {errs}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    bs = max(args.batch)
    h = get(bs, "hierarchical")
    g = get(bs, "gpu-only")
    print(f"bench_rank {spec.name}: BS={bs} hierarchical {re_ms(bs) / h['mean_ms_on_re_batches']:.2f}x "
          f"gpu-only {re_ms(bs) / g['mean_ms_on_re_batches']:.2f}x vs recompute; total hit "
          f"{100 * h['total_hit']:.2f}% (gpu-only {100 * g['total_hit']:.2f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
