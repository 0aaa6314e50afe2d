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
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from streamgr import Engine  # noqa: E402
from streamgr.config import load_spec, parse_set_pairs  # noqa: E402
from streamgr.trace.replay import batches_of_distinct_users, replay_batches  # noqa: E402
from streamgr.trace.synth import Timeline, synth_trace  # noqa: E402


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
    replay_batches(eng, batches, measure=[], progress=False)
    again = batches[-args.profile:]
    replay_batches(eng, again, measure=[], progress=False)  # shapes' plans outside the profile
    cuda = eng.device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        res = replay_batches(eng, again, progress=False, sync_stages=True)
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    key = "cuda_time_total" if cuda else "cpu_time_total"
    print(events.table(sort_by=key, row_limit=args.rows, max_name_column_width=70))
    stages = {k: round(v / max(res.batches, 1), 3) for k, v in res.stages.items()}
    print(f"stages per batch (ms, synchronized): {stages}")
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        n = sum(e.count for e in kernels)
        total = sum(e.self_device_time_total for e in kernels) / 1e3
        print(f"profile_rank {spec.name}: {n / args.profile:.0f} kernels and {total / args.profile:.3f} "
              f"ms of kernel time per batch of {args.batch} ({args.profile} batches)")
    else:
        print(f"profile_rank {spec.name}: {args.profile} batches of {args.batch} on the CPU "
              f"(no device kernels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
