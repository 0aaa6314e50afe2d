"""Where a cached rank batch's device time goes: torch.profiler's kernel table over rank
batches replayed from a synthetic trace (rank plans as the engine runs them).

The trace's first batches are replayed untimed (the cache fills), then the last ``--profile``
of them again under the profiler: every history is cached by then, so each profiled batch is
a cached batch of that trace's users (candidates and no new history tokens). Prints the top
kernels by device time and the kernel count per batch.

    python tools/profile_rank.py --spec rank-ref --batch 8                 # the H200
    python tools/profile_rank.py --spec rank-small --device cpu --batches 6  # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from streamgr import Engine  # noqa: E402
from streamgr.config import load_spec, parse_set_pairs  # noqa: E402
from streamgr.trace.replay import batches_of_distinct_users, replay_batches  # noqa: E402
from streamgr.trace.synth import Timeline, synth_trace  # noqa: E402
from bench_rank import drain_background  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="rank-small")
    ap.add_argument("--set", action="append", dest="overrides", metavar="KEY=VALUE")
    ap.add_argument("--device", default=None)
    ap.add_argument("--profile-name", default="kuairand-1k", help="synthetic trace profile")
    ap.add_argument("--users", type=int, default=64)
    ap.add_argument("--start-frac", type=float, default=0.0,
                    help="start there in the trace, each user's earlier history loaded first "
                         "(untimed), as bench_rank's --start-frac --prefill")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=40, help="batches replayed to fill the cache")
    ap.add_argument("--profile", type=int, default=5, help="batches replayed under the profiler")
    ap.add_argument("--rows", type=int, default=25, help="kernel table rows")
    ap.add_argument("--timeline", type=int, default=0, metavar="N",
                    help="also print the last profiled batch's timeline: its host runtime calls "
                         "and device events in time order, and the N longest device idle gaps")
    ap.add_argument("--unsynced", action="store_true",
                    help="profile batches as served (no device sync after each stage; the "
                         "stage times are then host times)")
    args = ap.parse_args()
    ov = parse_set_pairs(args.overrides)
    if args.device:
        ov["engine.device"] = args.device
    spec = load_spec(args.spec, ov)
    tl = Timeline(synth_trace(args.profile_name, 0, args.users))
    s0 = int(args.start_frac * len(tl.trace))
    order = range(s0, len(tl.trace))
    batches = list(batches_of_distinct_users((tl.request(n) for n in order),
                                             args.batch))[:args.batches]
    if len(batches) < args.profile:
        raise SystemExit(f"only {len(batches)} batches of {args.batch} in the trace")
    eng = Engine(spec)
    if s0:
        replay_batches(eng, tl.prefill(s0, list(order), max(8, args.batch)), measure=[],
                       progress=False)
        drain_background(eng)
    replay_batches(eng, batches, measure=[], progress=False)
    again = batches[-args.profile:]
    replay_batches(eng, again, measure=[], progress=False)  # shapes' plans outside the profile
    cuda = eng.device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        sums: dict[str, float] = {}
        for i, b in enumerate(again):  # one range per batch: the timeline finds the last one
            with torch.profiler.record_function(f"profiled_batch_{i}"):
                r = replay_batches(eng, [b], progress=False, sync_stages=not args.unsynced)
                if cuda:
                    torch.cuda.synchronize()
            for k, v in r.stages.items():
                sums[k] = sums.get(k, 0.0) + v
    events = prof.key_averages()
    key = "cuda_time_total" if cuda else "cpu_time_total"
    print(events.table(sort_by=key, row_limit=args.rows, max_name_column_width=70))
    stages = {k: round(v / len(again), 3) for k, v in sums.items()}
    print(f"stages per batch (ms, {'host' if args.unsynced else 'synchronized'}): {stages}")
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.key.startswith("profiled_batch_")]  # the ranges' device spans
        n = sum(e.count for e in kernels)
        total = sum(e.self_device_time_total for e in kernels) / 1e3
        print(f"profile_rank {spec.name}: {n / args.profile:.0f} kernels and {total / args.profile:.3f} "
              f"ms of kernel time per batch of {args.batch} ({args.profile} batches)")
        if args.timeline:
            print_timeline(prof, f"profiled_batch_{len(again) - 1}", args.timeline)
    else:
        print(f"profile_rank {spec.name}: {args.profile} batches of {args.batch} on the CPU "
              f"(no device kernels)")
    return 0


DEV_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # the Chrome trace's device-side events


def chrome_trace(prof) -> list[dict]:
    """The profiler's events as its Chrome trace has them (host and device, with categories)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return json.load(open(f.name))["traceEvents"]


def range_events(trace: list[dict], marker: str, cats: tuple[str, ...]):
    """``(start, end, events)`` of the ``record_function`` range ``marker``: the events of
    ``cats`` that start inside it, in time order; None when the trace has no such range."""
    spans = [e for e in trace if e.get("ph") == "X" and e.get("name") == marker]
    if not spans:
        return None
    t0, t1 = spans[0]["ts"], spans[0]["ts"] + spans[0]["dur"]
    inside = sorted((e for e in trace if e.get("ph") == "X" and t0 <= e["ts"] <= t1
                     and e.get("cat") in cats), key=lambda e: e["ts"])
    return t0, t1, inside


def print_timeline(prof, marker: str, gaps: int) -> None:
    """One batch in time order (from the profiler's Chrome trace): host runtime calls (launches,
    copies, syncs) and device events, each with its start offset; then the device's longest idle
    gaps inside the batch with the events on either side. Where a batch's time beyond its kernel
    time goes (launch gaps, blocking copies, host work the device waits for)."""
    found = range_events(chrome_trace(prof), marker, DEV_CATS + ("cuda_runtime", "cuda_driver"))
    if found is None:
        print(f"timeline: no {marker} range in the trace")
        return
    t0, t1, inside = found
    dev = [e for e in inside if e["cat"] in DEV_CATS]
    print(f"\ntimeline of {marker}: {t1 - t0:.1f} us on the host, {len(dev)} device events")
    for e in inside:
        side = "dev " if e["cat"] in DEV_CATS else "host"
        print(f"  {e['ts'] - t0:9.1f} {e['dur']:8.1f} {side} {e['name'][:90]}")
    if not dev:
        return
    busy = sum(e["dur"] for e in dev)
    span = dev[-1]["ts"] + dev[-1]["dur"] - dev[0]["ts"]
    print(f"device: first event at {dev[0]['ts'] - t0:.1f} us, span {span:.1f} us, busy "
          f"{busy:.1f} us ({busy / max(span, 1e-9):.0%})")
    holes = sorted(((b["ts"] - (a["ts"] + a["dur"]), a, b) for a, b in zip(dev, dev[1:])),
                   key=lambda h: -h[0])[:gaps]
    for g, a, b in holes:
        print(f"  idle {g:8.1f} us at {a['ts'] + a['dur'] - t0:9.1f}: after {a['name'][:50]} "
              f"before {b['name'][:50]}")


if __name__ == "__main__":
    sys.exit(main())
