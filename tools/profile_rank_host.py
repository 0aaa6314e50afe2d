"""The host path of cached rank batches on the CPU, with the model stubbed out: rank-ref's cache
geometry and a KuaiRand-like trace (users' earlier history loaded first), a one-layer toy model,
and the forward replaced by zeros, so what is timed is the host work a GPU batch waits on
(history check, cache metadata, row layout, page slots). Prints the stages per batch and,
with ``--top N``, cProfile's N most expensive functions.

    python3 tools/profile_rank_host.py [--mode gpu-only|hierarchical] [--users 200] [--top 20]
    python3 tools/profile_rank_host.py --first --users 1000 --requests 2400   # first visits
    python3 tools/profile_rank_host.py --mode hierarchical --set cache.device_pages=8192 \
        --set cache.onload_split=0.5                                          # host hits
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_rank import drain_background  # noqa: E402  (tools/, the script's own folder)
from streamgr.config import load_spec, parse_set_pairs  # noqa: E402
from streamgr.engine.cached_rank import CachedRankRunner  # noqa: E402
from streamgr.engine.core import Engine  # noqa: E402
from streamgr.trace.replay import batches_of_distinct_users, replay_batches  # noqa: E402
from streamgr.trace.synth import Timeline, synth_trace  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="gpu-only", choices=["gpu-only", "hierarchical"])
    ap.add_argument("--users", type=int, default=200)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--top", type=int, default=0, help="print cProfile's top N functions")
    ap.add_argument("--sort", default="tottime", help="cProfile's order (tottime, cumtime)")
    ap.add_argument("--first", action="store_true",
                    help="users' first visits: the trace from its start, nothing loaded before")
    ap.add_argument("--set", action="append", dest="overrides", metavar="KEY=VALUE",
                    help="spec overrides, e.g. cache.device_pages=8192: host hits")
    args = ap.parse_args()
    spec = load_spec("rank-ref", {
        "engine.device": "cpu", "model.num_layers": 1, "model.model_dim": 32,
        "model.num_heads": 1, "model.head_dim": 32, "model.dtype": "float32",
        "cache.host_chunks": 3000, "cache.mode": args.mode, **parse_set_pairs(args.overrides)})
    trace = synth_trace("kuairand-1k", 0, args.users)
    tl = Timeline(trace)
    s0 = 0 if args.first else len(trace) // 2
    order = list(range(s0, min(len(trace), s0 + args.requests)))
    batches = list(batches_of_distinct_users((tl.request(n) for n in order), args.batch))
    eng = Engine(spec)
    if not args.first:
        replay_batches(eng, tl.prefill(s0, order, max(args.batch, 8)), measure=[], progress=False)
        drain_background(eng)
    # The model is not what is timed here: a stand-in returns zero scores at once.
    CachedRankRunner._forward_eager = lambda self, up, *_args, **_kw: torch.zeros(
        int(sum(up[0].num_candidates)))
    warm = min(20, len(batches) // 4)
    replay_batches(eng, batches[:warm], measure=[], progress=False)
    prof = cProfile.Profile() if args.top else None
    t = time.perf_counter()
    if prof:
        prof.enable()
    res = replay_batches(eng, batches[warm:], progress=False, stage_every=0)
    if prof:
        prof.disable()
    n = len(batches) - warm
    stages = {k: round(v / max(res.stage_batches, 1), 3) for k, v in res.stages.items()}
    print(f"{args.mode}, batch {args.batch}: {n} batches, "
          f"{(time.perf_counter() - t) / n * 1e3:.3f} ms per batch (run_batch + background)")
    print("stages (ms per batch):", stages)
    print("history tokens: " + ", ".join(  # what the timed batches' users had cached where
        f"{k.replace('_', ' ')} {sum(getattr(r, k) for r in res.records):,}"
        for k in ("from_gpu", "from_host", "host_recomputed", "recomputed")))
    if prof:
        pstats.Stats(prof).sort_stats(args.sort).print_stats(args.top)
    eng.close_offline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
