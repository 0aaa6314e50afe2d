"""``streamgr trace ...``: convert, synth, stats, replay, report."""

from __future__ import annotations

import sys
from pathlib import Path


def add_trace_commands(sub, overrides_fn) -> None:
    p = sub.add_parser("trace", help="trace tool: convert, synth, stats, replay, report")
    tsub = p.add_subparsers(dest="trace_command", required=True)
    if hasattr(sub, "common"):  # the same common options and --help defaults as every command
        tsub = type(sub)(tsub, sub.common)

    c = tsub.add_parser("convert", help="a dataset log -> a trace")
    csub = c.add_subparsers(dest="dataset", required=True)
    for name, help_ in (("kuairand", "KuaiRand-1K log_standard_*.csv files"),
                        ("movielens", "MovieLens u.data or ratings.csv"),
                        ("sequences", "one user per line: user item item ...")):
        q = csub.add_parser(name, help=help_)
        q.add_argument("inputs", nargs="+" if name == "kuairand" else 1, type=Path)
        q.add_argument("-o", "--out", required=True, type=Path)
        q.add_argument("--candidates", type=int, default=0,
                       help="candidates sampled per request (0: the replay samples them)")
        q.add_argument("--seed", type=int, default=0)
        q.set_defaults(func=_convert)

    s = tsub.add_parser("synth", help="a synthetic trace")
    s.add_argument("--profile", default="kuairand-1k",
                   help="kuairand-1k, small, tiny (rank) or gen (generate)")
    s.add_argument("--users", type=int, default=None)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("-o", "--out", required=True, type=Path)
    s.set_defaults(func=_synth)

    st = tsub.add_parser("stats", help="users, requests, distributions, working set")
    st.add_argument("trace", type=Path)
    st.add_argument("--spec", default=None)
    st.add_argument("--set", action="append", dest="overrides", metavar="KEY=VALUE")
    st.set_defaults(func=_stats)

    r = tsub.add_parser("replay", help="replay a trace against the engine or a server")
    r.add_argument("trace", type=Path)
    who = r.add_mutually_exclusive_group(required=True)
    who.add_argument("--spec", help="replay against an embedded engine of this spec")
    who.add_argument("--server", help="replay against a server at HOST:PORT or unix:PATH")
    r.add_argument("--set", action="append", dest="overrides", metavar="KEY=VALUE")
    r.add_argument("--batch", type=int, default=None,
                   help="offline replay in batches of B distinct users (MTServe's method)")
    load = r.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals/s")
    load.add_argument("--concurrency", type=int, default=8, help="closed loop: requests in flight")
    r.add_argument("--compare-modes", action="store_true",
                   help="recompute, gpu-only and hierarchical on the same requests")
    r.add_argument("--limit", type=int, default=None, help="the first N requests")
    r.add_argument("--fold-ids", action="store_true",
                   help="fold ids into the model's tables (a small model on a large log; against "
                        "a server, the tables its stats report)")
    r.add_argument("--candidates", type=int, default=32,
                   help="candidates per request where the trace has none")
    r.add_argument("--token-file", default=None, help="with --server: file holding the token")
    r.add_argument("-o", "--out", required=True, type=Path, help="results file (JSON lines)")
    r.set_defaults(func=_replay)

    rp = tsub.add_parser("report", help="PNG plots and a markdown summary of results")
    rp.add_argument("results", nargs="+", type=Path)
    rp.add_argument("-o", "--out", required=True, type=Path, help="output directory")
    rp.set_defaults(func=_report)
    p.set_defaults(_overrides=overrides_fn)


def _convert(args) -> int:
    from . import convert
    fn = {"kuairand": convert.convert_kuairand, "movielens": convert.convert_movielens,
          "sequences": convert.convert_sequences}[args.dataset]
    src = args.inputs if args.dataset == "kuairand" else args.inputs[0]
    h = fn(src, args.out, candidates=args.candidates, seed=args.seed)
    print(f"wrote {args.out}: {h.records:,} requests of {h.users:,} users, {h.num_items:,} items "
          f"(id map: {args.out.parent / h.item_map})")
    return 0


def _synth(args) -> int:
    from .synth import PROFILES, write_synth
    if args.profile not in PROFILES:
        raise SystemExit(f"streamgr: error: unknown profile {args.profile!r} "
                         f"({', '.join(PROFILES)})")
    h = write_synth(args.profile, args.out, args.users, args.seed, progress=True)
    print(f"wrote {args.out}: {h.records:,} {h.kind} requests of {h.users:,} users")
    return 0


def _stats(args) -> int:
    from ..config import load_spec
    from .stats import format_stats, trace_stats
    spec = load_spec(args.spec, args._overrides(args.overrides)) if args.spec else None
    print(format_stats(trace_stats(args.trace, spec)))
    return 0


def _replay(args) -> int:
    from ..tokens import read_token
    from .run import Interrupted, format_runs, replay_trace
    try:
        runs = replay_trace(args.trace, args.out, spec=args.spec,
                            overrides=args._overrides(args.overrides), server=args.server,
                            batch=args.batch, rate=args.rate, concurrency=args.concurrency,
                            compare_modes=args.compare_modes, limit=args.limit,
                            fold_ids=args.fold_ids, candidates=args.candidates,
                            token=read_token(args.token_file))
    except Interrupted as stop:
        print(f"streamgr: {stop}", file=sys.stderr)
        return 130
    print(format_runs(runs))
    print(f"results: {args.out}")
    failed = sum(r.get("errors", 0) for r in runs)
    if failed:
        print(f"streamgr: error: {failed} requests failed (see above and {args.out})",
              file=sys.stderr)
        if args.server and not args.fold_ids and any(
                "ID_OUT_OF_RANGE" in r.get("error_codes", {}) for r in runs):
            print("streamgr: the trace's ids do not fit the served model's tables: pass "
                  "--fold-ids to fold them in", file=sys.stderr)
        return 1
    return 0


def _report(args) -> int:
    from .report import write_report
    files = write_report(args.results, args.out)
    print("wrote " + ", ".join(str(f) for f in files))
    return 0
