"""Host-hit batches under a timeline: does a batch's onload overlap its compute, and which
``cache.onload_split`` / onload window serves host hits fastest (issue 12).

One hierarchical engine (and a recompute engine for the same batches), the trace's users
prefilled as ``bench_rank``'s host-hit run does; then the window's batches of distinct users,
each under one of ``--configs`` in turn (interleaved: the configurations see the same stretch
of the trace and the same host). Per batch CUDA timing events, from a reference recorded on an
idle device just before the batch: the onload's start, each layer's copies landed and scattered
into pages, the compute reaching each layer (``append``) and its attention starting, the
forward done. A batch whose compute waited for the whole onload before starting shows
``append_0`` near the last ``landed``; an overlapped one shows the layers' attention following
their own layer's scatter. ``--trace CONFIG ...``: two more batches of each under
torch.profiler, their slow host calls and their kernels' device time beside recompute's.

    python3 tools/probe_hosthit.py --spec rank-ref --set cache.device_pages=8192   # the H200
    python3 tools/probe_hosthit.py --spec rank-small --device cpu --profile small \
        --users 40 --window 40                                                      # smoke
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from streamgr import Engine  # noqa: E402
from streamgr.api import RankRequest  # noqa: E402
from streamgr.cache.onload_split import SplitFeedback  # noqa: E402
from streamgr.kernels import pinned  # noqa: E402
from streamgr.config import load_spec, parse_set_pairs  # noqa: E402
from streamgr.streams.onload import onload_inline  # noqa: E402
from streamgr.trace.replay import batches_of_distinct_users, replay_batches  # noqa: E402
from streamgr.trace.synth import Timeline, synth_trace  # noqa: E402
from bench_rank import drain_background  # noqa: E402
from profile_rank import DEV_CATS, chrome_trace, range_events  # noqa: E402


FLAGS = {"torch", "thread", "nopad", "fixed", "early", "smup"}


def parse_config(text: str) -> tuple[str, int | None, frozenset]:
    """SPLIT[:WINDOW_MB[:FLAGS]]; the window left out or empty: the engine's own; FLAGS,
    joined by ``+``: ``torch``, the direct onload's copies as torch ``copy_`` calls, not raw
    ``cudaMemcpyAsync``; ``thread``, issued from the onload thread under the window, not from
    the batch's thread (``STREAMGR_ONLOAD_INLINE=0``); ``nopad``, eager batches over their own
    row count, not bucketed (``RankRunner.pad_eager_rows``); ``fixed``, the split's recompute
    costs as measured at start, not corrected from device timings (the engine's
    ``CachedRankRunner.split_feedback``; each setting otherwise has its own, kept across its
    batches); ``early``, an inline onload submitted right after the split, before the batch's
    uploads (``CachedRankRunner.early_onload``); ``smup``, the batch's uploads read from
    page-locked memory by a kernel, not copied by the copy engine (``pinned.UPLOAD_BY_SM``)."""
    split, _, rest = text.partition(":")
    window, _, flags = rest.partition(":")
    if split != "auto":
        float(split)  # a fraction: checked here, not mid-run
    flags = set(flags.split("+")) - {""}
    if flags - FLAGS:
        raise SystemExit(f"--configs {text!r}: the third field is one of {sorted(FLAGS)} "
                         f"(several joined by '+'), or nothing")
    return split, int(window) << 20 if window else None, frozenset(flags)


def requests(batch) -> list[RankRequest]:
    return [RankRequest(user_id=r.user, items=items, actions=actions, candidates=r.candidates)
            for r, items, actions in batch]


def timeline(runner, ref, t0: float) -> dict[str, float]:
    """ms from ``ref`` to each timing event the batch recorded (compute and onload sides), and
    from ``t0`` (the host's clock when ``ref`` was recorded) to each host stamp (``host_*``)."""
    out = {}
    for events in (runner.trace_events or {}, runner.onload.trace_events or {}):
        for name, ev in events.items():
            out[name] = (ev - t0) * 1e3 if isinstance(ev, float) else ref.elapsed_time(ev)
    return out


def summary(rows: list[dict], layers: int) -> dict:
    host = [r for r in rows if r["host_hit"]]
    if not host:
        return {"batches": len(rows), "host_hit_batches": 0}
    mean = lambda k: float(np.mean([r[k] for r in host]))  # noqa: E731
    stages = {}
    for r in host:
        for k, v in r["stages"].items():
            stages[k] = stages.get(k, 0.0) + v / len(host)
    moved = sum(r["bytes"] for r in host)
    last = [r["events"].get(f"landed_{layers - 1}", 0) - r["events"].get("onload_start", 0)
            for r in host if f"landed_{layers - 1}" in r["events"]]
    return {
        "batches": len(rows), "host_hit_batches": len(host),
        "latency_ms": mean("latency_ms"), "latency_median_ms": float(np.median(
            [r["latency_ms"] for r in host])), "recompute_ms": mean("recompute_ms"),
        "vs_recompute": mean("recompute_ms") / mean("latency_ms"),
        "onloaded_mb_per_batch": moved / len(host) / 1e6,
        "onload_gb_s": (moved / 1e9) / (sum(last) / 1e3) if last and sum(last) > 0 else None,
        "host_recomputed_tokens": mean("host_recomputed"),
        "stages_ms": {k: round(v, 3) for k, v in stages.items()},
        "events_ms": {k: round(float(np.mean([r["events"][k] for r in host
                                               if k in r["events"]])), 3)
                      for k in sorted({k for r in host for k in r["events"]})},
    }


def apply(runner, costs, config, default_window: int, raw_copy=None, feedback=None) -> None:
    """Put one ``--configs`` setting in force: the split, the window (the engine's own when
    the setting names none), the onload's copies (``raw_copy``: the engine's own) and the
    flags (``feedback``: the setting's own SplitFeedback, kept across its batches)."""
    split, window, flags = config
    runner.onload_split = costs if split == "auto" else float(split)
    runner.onload.window_bytes = default_window if window is None else window
    runner.onload.raw_copy = None if "torch" in flags else raw_copy
    runner.onload.inline = "thread" not in flags
    runner.pad_eager_rows = "nopad" not in flags
    runner.split_feedback = None if "fixed" in flags else feedback
    runner.early_onload = "early" in flags
    pinned.UPLOAD_BY_SM = "smup" in flags


def trace_batches(eng, batches, name: str, least_us: float = 300.0, re_eng=None):
    """Two more host-hit batches of one configuration under torch.profiler: every runtime call
    and op of any thread taking ``least_us`` or more, in time order (what holds the compute
    thread before its first layer: a blocking copy, an allocation, a sync); then the kernels'
    device time per batch by kernel, beside the same batches through ``re_eng`` (recompute):
    where the cached path's compute differs from recompute's on the same tokens."""
    cuda = eng.device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    picked = batches[:2]
    runs = [(name, eng)] + ([("recompute", re_eng)] if re_eng is not None else [])
    with torch.profiler.profile(activities=acts) as prof:
        for tag, e in runs:
            for i, b in enumerate(picked):
                if cuda:
                    torch.cuda.synchronize()
                with torch.profiler.record_function(f"traced_{tag}_{i}"):
                    e.run_batch(requests(b), False, background=False)
                    if cuda:
                        torch.cuda.synchronize()
                e.run_background()
    trace = chrome_trace(prof)
    for i in range(len(picked)):
        found = range_events(trace, f"traced_{name}_{i}", ("cuda_runtime", "cuda_driver", "cpu_op"))
        if found is None:
            continue
        t0, t1, inside = found
        host = [e for e in inside if e.get("dur", 0) >= least_us]
        print(f"\ntrace {name} batch {i}: {t1 - t0:.0f} us on the host; calls >= "
              f"{least_us:.0f} us:")
        for e in host:
            print(f"  {e['ts'] - t0:9.1f} {e['dur']:9.1f} tid {e.get('tid')} {e['cat']:12s} "
                  f"{e['name'][:70]}")
    found = range_events(trace, f"traced_{name}_0", DEV_CATS)
    if found is not None:
        print(f"\ndevice timeline of {name} batch 0 (us from its start; runs of one op on one "
              "stream collapsed):")
        for row in device_runs(found[0], found[2])[:80]:
            print("  " + row)
    for tag, _ in runs:
        print(f"\nkernels of {tag}, us per batch (mean of {len(picked)}):")
        for row in kernel_table(trace, [f"traced_{tag}_{i}" for i in range(len(picked))]):
            print(f"  {row[1]:9.1f} {row[2]:6.1f} {row[0][:90]}")


def device_runs(t0: float, events: list[dict]) -> list[str]:
    """The device events as ``start end stream count name`` rows by start, a stream's
    consecutive events of one name as one row (whatever other streams ran between): which
    stream's copies run when (does an upload wait behind onload copies issued before it?)."""
    runs: list[list] = []
    last: dict = {}  # stream -> its current run
    for e in events:
        stream = e.get("args", {}).get("stream")
        r = last.get(stream)
        if r is not None and r[0] == (e["name"], stream):
            r[2], r[3] = e["ts"] + e["dur"], r[3] + 1
        else:
            last[stream] = r = [(e["name"], stream), e["ts"], e["ts"] + e["dur"], 1]
            runs.append(r)
    runs.sort(key=lambda r: r[1])
    return [f"{a - t0:9.1f} {b - t0:9.1f} s{k[1]!s:>3} x{n:<4d} {k[0][:70]}"
            for k, a, b, n in runs]


def kernel_table(trace: list[dict], markers: list[str], rows: int = 14) -> list[tuple]:
    """``(name, us per batch, launches per batch)`` of the device events (kernels, copies,
    memsets) inside the ``markers`` ranges, largest first; then a ``total`` row. (Events whose
    launch falls in a range would be exact; starting inside it, the batch's sync at its end
    included, is close.)"""
    found = [f for f in (range_events(trace, m, DEV_CATS) for m in markers) if f is not None]
    sums: dict[str, list[float]] = {}
    for _, _, inside in found:
        for e in inside:
            acc = sums.setdefault(e["name"], [0.0, 0])
            acc[0] += e["dur"]
            acc[1] += 1
    n = max(len(found), 1)
    out = sorted(((k, v[0] / n, v[1] / n) for k, v in sums.items()), key=lambda r: -r[1])
    total = (f"total ({len(out)} kinds)", sum(r[1] for r in out), sum(r[2] for r in out))
    return out[:rows] + [total]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="rank-ref")
    ap.add_argument("--set", action="append", dest="overrides", metavar="KEY=VALUE")
    ap.add_argument("--device", default=None)
    ap.add_argument("--profile", default="kuairand-1k")
    ap.add_argument("--users", type=int, default=400)
    ap.add_argument("--start-frac", type=float, default=0.5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=200, help="requests replayed untimed first")
    ap.add_argument("--window", type=int, default=480, help="requests probed")
    ap.add_argument("--configs", nargs="+", default=["auto", "0.0", "1.0", "auto:0"],
                    help="SPLIT[:WINDOW_MB[:FLAGS]] per batch in turn (SPLIT a fraction or "
                         "auto; WINDOW_MB the onload thread's megabytes in flight, 0 no limit; "
                         f"FLAGS of {sorted(FLAGS)} joined by '+': parse_config says each)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="profile every probed batch's host work (run_batch, cProfile) and "
                         "print its N costliest calls by cumulative and by own time")
    ap.add_argument("--trace", nargs="*", default=[], metavar="CONFIG",
                    help="then two batches of each CONFIG under torch.profiler: the host calls of "
                         ">= 300 us in time order, and the kernels' device time beside "
                         "recompute's on the same batches")
    ap.add_argument("--least-us", type=float, default=300.0,
                    help="--trace: host calls at least this long are listed")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    configs = [parse_config(c) for c in args.configs]
    ov = parse_set_pairs(args.overrides)
    ov.setdefault("cache.host_chunks", "3600")
    ov["cache.mode"], ov["cache.onload_split"] = "hierarchical", "auto"
    if args.device:
        ov["engine.device"] = args.device
    spec = load_spec(args.spec, ov)
    tl = Timeline(synth_trace(args.profile, 0, args.users))
    s0 = int(args.start_frac * len(tl.trace))
    order = list(range(s0, min(len(tl.trace), s0 + args.warmup + args.window)))
    batches = list(batches_of_distinct_users((tl.request(n) for n in order), args.batch))
    n_warm, seen = 0, 0
    while n_warm < len(batches) and seen < args.warmup:
        seen, n_warm = seen + len(batches[n_warm]), n_warm + 1
    eng = Engine(spec)
    runner = eng.runner
    costs = runner.onload_split
    print(f"split costs at start: {runner._split_state()}",
          file=sys.stderr)
    re_eng = Engine(load_spec(args.spec, {**ov, "cache.mode": "recompute"}))
    replay_batches(eng, tl.prefill(s0, order, max(args.batch, 8)), measure=[], progress=False)
    drain_background(eng)
    replay_batches(eng, batches[:n_warm], measure=[], progress=False)
    replay_batches(re_eng, batches[:2], measure=[], progress=False)  # its one-time costs
    cuda = eng.device.type == "cuda"
    layers = spec.model.num_layers
    rows: dict[str, list[dict]] = {c: [] for c in args.configs}
    default_window, raw_copy = runner.onload.window_bytes, runner.onload.raw_copy
    own_feedback = runner.split_feedback
    feedback = {c: SplitFeedback() for c in args.configs}
    prof = cProfile.Profile() if args.cprofile else None
    try:
        held = 2 * len(args.trace)  # the traced batches: users the window left on host
        probed = batches[n_warm:len(batches) - held]
        for j, batch in enumerate(probed):
            name = args.configs[j % len(configs)]
            apply(runner, costs, configs[j % len(configs)], default_window, raw_copy,
                  feedback[name])
            runner.trace_events, runner.onload.trace_events = {}, {}
            if cuda:
                torch.cuda.synchronize()
            ref = runner.streams.event(timing=True)
            ref.record(runner.streams.compute)
            moved = runner.bytes_onloaded
            t = t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            out = eng.run_batch(requests(batch), False, background=False)
            lat = (time.perf_counter() - t) * 1e3
            if prof is not None:
                prof.disable()
            if cuda:
                torch.cuda.synchronize()
            events = timeline(runner, ref, t0) if cuda else {}
            eng.run_background()
            meta = [m for _, m in out.results]
            t = time.perf_counter()
            re_eng.run_batch(requests(batch), False, background=False)
            rows[name].append({
                "latency_ms": lat, "recompute_ms": (time.perf_counter() - t) * 1e3,
                "host_hit": any(m["tier"] == "host" for m in meta),
                "host_recomputed": sum(m.get("tokens_host_recomputed", 0) for m in meta),
                "bytes": runner.bytes_onloaded - moved, "stages": dict(out.stages),
                "events": events})
    finally:
        runner.onload.window_bytes, runner.onload.raw_copy = default_window, raw_copy
        runner.onload.inline, runner.pad_eager_rows = onload_inline(), True
        runner.split_feedback, runner.early_onload = own_feedback, False
        runner.trace_events = runner.onload.trace_events = None
    result = {c: summary(rows[c], layers) for c in args.configs}
    for c, s in result.items():
        if not s.get("host_hit_batches"):
            print(f"{c}: no host-hit batches in {s['batches']}")
            continue
        gbs = f"{s['onload_gb_s']:.1f}" if s["onload_gb_s"] else "-"
        print(f"{c}: {s['host_hit_batches']} host-hit batches, mean {s['latency_ms']:.2f} ms "
              f"(median {s['latency_median_ms']:.2f}), recompute {s['recompute_ms']:.2f} ms "
              f"({s['vs_recompute']:.2f}x); onloaded {s['onloaded_mb_per_batch']:.1f} MB a batch "
              f"at {gbs} GB/s; host tokens recomputed {s['host_recomputed_tokens']:.0f}")
        print(f"  stages ms: {s['stages_ms']}")
        if "fixed" not in parse_config(c)[2] and parse_config(c)[0] == "auto":
            fb = feedback[c]
            print(f"  split feedback: scale {fb.scale:.3f} after {fb.updates} updates")
        e = s["events_ms"]
        if e:
            print("  layer  landed  scattered  append  attention  host append (ms from the "
                  "batch's start)")
            for l in range(layers):
                cells = [e.get(f"{n}_{l}") for n in ("landed", "scattered", "append", "attention",
                                                     "host_append")]
                print(f"  {l:5d}  " + "  ".join("-".rjust(8) if v is None else f"{v:8.2f}"
                                                for v in cells))
            host = [(n, e[f"host_{n}"]) for n in ("submit", "metadata", "layout", "uploaded",
                                                  "plans", "onload_start", "append_0")
                    if f"host_{n}" in e]
            print("  host reached: " + ", ".join(f"{n} {v:.2f}" for n, v in host))
            print(f"  onload start {e.get('onload_start', float('nan')):.2f} (issued by the "
                  f"host from {e.get('host_onload_start', float('nan')):.2f}), forward done "
                  f"{e.get('done', float('nan')):.2f} ms")
    if prof is not None:  # (the batch's host work up to its scores' wait, all settings)
        for key in ("cumulative", "tottime"):
            pstats.Stats(prof).sort_stats(key).print_stats(args.cprofile)
    for k, config in enumerate(args.trace):  # two batches each, not yet seen (host hits)
        apply(runner, costs, parse_config(config), default_window, raw_copy,
              feedback.get(config, own_feedback))
        trace_batches(eng, batches[len(batches) - 2 * (k + 1):len(batches) - 2 * k], config,
                      args.least_us, re_eng=re_eng)
    if args.json:
        args.json.write_text(json.dumps({"summary": result, "rows": rows}, indent=1))
    eng.close_offline()
    re_eng.close_offline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
