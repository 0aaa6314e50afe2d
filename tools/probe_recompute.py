"""Host-side probes of eager recompute rank batches (where a batch's time goes beyond its
kernels), on batches of distinct users from the middle of a synthetic trace:

- ``variants``: each batch run four times, rotating: stage-synced, unsynced, unsynced with a
  device sync before the scores' event wait, unsynced with the garbage collector off (do the
  bench's synced stage batches time the same thing as its unsynced ones?);
- ``per-batch``: each batch once from a fresh engine, its latency beside its rows (do early
  batches pay for new allocations? set ``PYTORCH_CUDA_ALLOC_CONF`` to compare allocators);
- ``cprofile``: the host time from a batch's start to layer 0's attention launch, then
  cProfile over further batches (which Python the launches cost).

    python tools/probe_recompute.py --spec rank-ref variants      # the H200 (session 10)
    python tools/probe_recompute.py --spec rank-small --profile small --device cpu per-batch
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from streamgr import Engine, RankRequest  # noqa: E402
from streamgr.config import load_spec  # noqa: E402
from streamgr.engine import rank as rank_mod  # noqa: E402
from streamgr.kernels import hstu_attention_cuda  # noqa: E402
from streamgr.trace.replay import batches_of_distinct_users, replay_batches  # noqa: E402
from streamgr.trace.synth import Timeline, synth_trace  # noqa: E402


def _sync(eng) -> None:
    if eng.device.type == "cuda":
        torch.cuda.synchronize(eng.device)


def _requests(batch) -> list[RankRequest]:
    return [RankRequest(user_id=r.user, items=it, actions=ac, candidates=r.candidates)
            for r, it, ac in batch]


def _timed(eng, reqs, synced: bool) -> float:
    _sync(eng)
    t = time.perf_counter()
    eng.run_batch(reqs, synced, background=False)
    ms = (time.perf_counter() - t) * 1e3
    eng.run_background()
    return ms


def variants(eng, batches) -> None:
    orig = rank_mod.InFlight.wait

    def devsync_wait(self):
        _sync(eng)
        return orig(self)
    names = ("synced", "unsynced", "unsynced+devsync", "unsynced+gcoff")
    res: dict[str, list[float]] = {n: [] for n in names}
    try:
        for i, b in enumerate(batches):
            reqs = _requests(b)
            for j in range(len(names)):
                v = names[(i + j) % len(names)]
                rank_mod.InFlight.wait = devsync_wait if v == "unsynced+devsync" else orig
                if v == "unsynced+gcoff":
                    gc.disable()
                try:
                    res[v].append(_timed(eng, reqs, v == "synced"))
                finally:
                    gc.enable()
    finally:
        rank_mod.InFlight.wait = orig
    for k, xs in res.items():
        print(f"{k:18s} n={len(xs)} mean {statistics.mean(xs):.2f} median "
              f"{statistics.median(xs):.2f} ms")


def per_batch(eng, batches) -> None:
    lat = [_timed(eng, _requests(b), False) for b in batches]
    rows = [sum(2 * len(it) + len(r.candidates) for r, it, _ in b) for b in batches]
    half = len(lat) // 2
    print(f"{os.environ.get('PYTORCH_CUDA_ALLOC_CONF', 'default allocator')}: mean "
          f"{statistics.mean(lat):.2f} median {statistics.median(lat):.2f} ms; first half "
          f"{statistics.mean(lat[:half] or lat):.2f}, second half {statistics.mean(lat[half:]):.2f}")
    print("ms/rows: " + " ".join(f"{ms:.1f}/{n / 1000:.0f}k" for ms, n in zip(lat, rows)))


def cprofile(eng, batches) -> None:
    orig, marks = hstu_attention_cuda.run, []

    def run(*a, **k):
        marks.append(time.perf_counter())
        return orig(*a, **k)
    half = max(1, len(batches) // 2)
    hstu_attention_cuda.run = run
    try:
        starts = []
        for b in batches[:half]:
            reqs = _requests(b)
            _sync(eng)
            marks.clear()
            t = time.perf_counter()
            eng.run_batch(reqs, False, background=False)
            if marks:  # (the CPU runs the torch reference: no kernel launch to mark)
                starts.append(round((marks[0] - t) * 1e3, 3))
    finally:
        hstu_attention_cuda.run = orig
    print("host ms from batch start to layer 0's attention launch:", starts)
    prof = cProfile.Profile()
    prof.enable()
    for b in batches[half:]:
        eng.run_batch(_requests(b), False, background=False)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(35)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("probe", nargs="+", choices=("variants", "per-batch", "cprofile"),
                    help="one or more, run in turn on one engine")
    ap.add_argument("--spec", default="rank-small")
    ap.add_argument("--device", default=None)
    ap.add_argument("--profile", default="kuairand-1k", help="synthetic trace profile")
    ap.add_argument("--users", type=int, default=400)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--start-frac", type=float, default=0.5)
    args = ap.parse_args()
    ov = {"cache.mode": "recompute", "cache.host_chunks": 16}
    if args.device:
        ov["engine.device"] = args.device
    spec = load_spec(args.spec, ov)
    tl = Timeline(synth_trace(args.profile, 0, args.users))
    s0 = int(args.start_frac * len(tl.trace))
    batches = list(batches_of_distinct_users(
        (tl.request(n) for n in range(s0, len(tl.trace))), args.batch))[:args.batches + 1]
    if len(batches) < 2:
        raise SystemExit("too few batches in the trace")
    eng = Engine(spec)
    replay_batches(eng, batches[:1], measure=[], progress=False)  # compiles, first allocations
    for probe in args.probe:
        {"variants": variants, "per-batch": per_batch, "cprofile": cprofile}[probe](
            eng, batches[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
