"""``streamgr update | rollback | versions --server ADDR``: live updates of a running server;
``streamgr status --server ADDR``: its health and a summary of its stats.

The admin commands open an admin connection (the server's ``--admin-token-file`` token,
distinct from the client token) and print the server's versions after the change as JSON.
Paths given to ``update`` (a checkpoint directory, a catalog file) are read by the server, on
its host (a relative one that exists here is sent absolute); ``--catalog-add`` (a CSV
``item_id,s1,s2,...``) and ``--policy`` (JSON or TOML with fields of ``[policy]``) are read
here and sent. ``status`` needs only the client token.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from .errors import StreamgrError
from .tokens import read_token


def _catalog_add(path: str | None) -> dict[int, list[int]]:
    if path is None:
        return {}
    rows = Path(path).read_text().strip().splitlines()
    if not rows or not rows[0].startswith("item_id,"):
        raise StreamgrError(f"--catalog-add {path}: a CSV with header item_id,s1,s2,...")
    out, line_of = {}, {}
    for n, line in enumerate(rows[1:], 2):
        try:
            vals = [int(v) for v in line.split(",")]
        except ValueError:
            raise StreamgrError(f"--catalog-add {path}:{n}: not integers: {line!r}") from None
        if vals[0] in out:  # (a dict would keep the last silently: an item has one SID)
            raise StreamgrError(f"--catalog-add {path}:{n}: item {vals[0]} again (line "
                                f"{line_of[vals[0]]})")
        out[vals[0]], line_of[vals[0]] = vals[1:], n
    return out


def _ids(text: str | None) -> list[int]:
    """``1,2,3``, or ``@FILE`` holding ids separated by commas or newlines."""
    if text and text.startswith("@"):
        text = Path(text[1:]).read_text()
    if not text:
        return []
    try:
        return [int(v) for v in text.replace("\n", ",").split(",") if v.strip()]
    except ValueError:
        raise StreamgrError(f"--catalog-remove: comma-separated item ids, got {text!r}") from None


def _here(path: str | None) -> str | None:
    """A relative path that exists here, made absolute: the server reads it on its host, from
    its own working directory, where the relative form would name another path (the same
    host, the common case). Others go as given (absolute, or on the server's host only)."""
    if path is None or Path(path).is_absolute() or not Path(path).exists():
        return path
    return str(Path(path).resolve())


def _policy(path: str | None) -> dict:
    if path is None:
        return {}
    text = Path(path).read_text()
    try:
        data = tomllib.loads(text) if path.endswith(".toml") else json.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as err:
        raise StreamgrError(f"--policy {path}: {err}") from None
    data = data.get("policy", data)
    if not isinstance(data, dict):
        raise StreamgrError(f"--policy {path}: a table of policy fields")
    return data


def cmd_admin(args) -> int:
    from .client import Client
    token = read_token(args.admin_token_file)
    if token is None:
        raise StreamgrError("--admin-token-file is required (the server's admin token)")
    with Client(args.server, token, timeout=None) as c:
        if args.command == "versions":
            out = c.versions()
        elif args.command == "rollback":
            out = c.rollback(args.target)
        else:
            out = c.update(weights=_here(args.weights), seed=args.seed,
                           catalog=_here(args.catalog),
                           catalog_add=_catalog_add(args.catalog_add),
                           catalog_remove=_ids(args.catalog_remove),
                           policy=_policy(args.policy), target=args.target,
                           keep_previous=not args.drop_previous)
    print(json.dumps(out, indent=1))
    return 0


def _pct(x) -> str:
    return f"{100 * x:.1f}%"


def status_lines(addr: str, health, stats: dict) -> list[str]:
    """``streamgr status``'s summary of a server's HealthReply and StatsReply (a Ray
    application's: the same for each replica, from its last report)."""
    srv, serves = stats.get("server", {}), stats.get("serves", [])
    conns = srv.get("connections", 0)  # (this command's own among them)
    where = (f"Ray app {stats['ray_app']}, {stats['replicas']} replicas" if "ray_app" in stats
             else stats.get("device", "?"))
    out = [f"{addr}: {health.status} (serves {', '.join(serves) or 'nothing'}"
           f" on {where}, {conns} connection{'' if conns == 1 else 's'})"]
    out += _version_line(stats, serves)
    by: dict[str, list[str]] = {}
    for key, n in sorted(srv.get("requests", {}).items()):  # "kind:outcome"
        kind, outcome = key.split(":", 1)
        by.setdefault(kind, []).append(f"{outcome} {n:,}")
    if by:
        out.append("requests: " + "; ".join(f"{k} {', '.join(v)}" for k, v in by.items()))
    out += _engine_lines(stats)
    reports = stats.get("replica_stats", {})
    if reports is None:
        out.append("replicas: their stats are not available now (the update log actor)")
    for name, rs in (reports or {}).items():
        out.append(f"replica {name} on {rs.get('device', '?')}:")
        out += ["  " + line for line in _version_line(rs, rs.get("serves", serves))
                + _engine_lines(rs)]
    return out


def _version_line(stats: dict, serves: list) -> list[str]:
    versions = [f"{k} {stats[v]}" for k, v in (("rank", "weights_version"),
                                                ("generate", "generate_version"))
                if k in serves and v in stats]
    return ["versions: " + ", ".join(versions)] if versions else []


def _engine_lines(stats: dict) -> list[str]:
    out = []
    for kind, key in (("rank", "latency_ms"), ("generate", "generate_latency_ms")):
        lat = stats.get(key) or {}
        if lat:
            out.append(f"{kind} latency ms (last {lat['window']:,}): mean {lat['mean']:.2f}, "
                       f"p50 {lat['p50']:.2f}, p99 {lat['p99']:.2f}")
    if "queued" in stats:
        out.append(f"engine: {stats['queued']} queued, {stats.get('inflight', 0)} in flight")
    cache = stats.get("cache")
    if cache:
        gpu, total, held = (_pct(stats.get(f"{k}_ratio", 0)) for k in ("gpu_hit", "total_hit",
                                                                         "held"))
        out.append(f"cache ({stats.get('cache_mode', '?')}): hits GPU {gpu}, total {total}, "
                   f"held {held}; "
                   f"{cache.get('resident_users', 0):,} users resident, "
                   f"{cache.get('free_pages', 0):,} free pages, "
                   f"{cache.get('free_chunks', 0):,} free host chunks")
    return out


def cmd_status(args) -> int:
    """Exit 0 when the server is ready, 1 when it answers but is not (draining, its engine
    dead, full); an unreachable server is an error (2), as for every command."""
    from .client import Client
    from .errors import Overloaded
    try:
        with Client(args.server, read_token(args.token_file), timeout=args.timeout) as c:
            health, stats = c.health(), c.stats()
    except Overloaded as err:  # it answered, refusing the connection (draining, or full)
        print(f"{args.server}: not ready: {err}")
        return 1
    if args.json:
        print(json.dumps({"health": {"live": health.live, "ready": health.ready,
                                     "status": health.status}, "stats": stats}, indent=1,
                         default=str))
    else:
        print("\n".join(status_lines(args.server, health, stats)))
    return 0 if health.ready else 1


def add_admin_commands(sub) -> None:
    p = sub.add_parser("status", help="a running server's health and stats (exit 1: not ready)")
    p.add_argument("--server", required=True, help="HOST:PORT or unix:PATH")
    p.add_argument("--token-file", default=None, help="file holding the server's client token")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server")
    p.add_argument("--json", action="store_true", help="health and the whole stats as JSON")
    p.set_defaults(func=cmd_status)

    for name, text in (("update", "a live update of a running server's weights, catalog, "
                                  "policy"),
                       ("rollback", "a running server back to its previous version"),
                       ("versions", "a running server's active and kept versions")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--server", required=True, help="HOST:PORT or unix:PATH")
        p.add_argument("--admin-token-file", required=True,
                       help="file holding the server's admin token")
        if name != "versions":
            p.add_argument("--target", choices=["auto", "rank", "generate"], default="auto",
                           help="which model (auto: the one the server serves)")
        if name == "update":
            p.add_argument("--weights", default=None,
                           help="checkpoint directory on the server's host")
            p.add_argument("--seed", type=int, default=None,
                           help="random weights of this seed instead of a checkpoint")
            p.add_argument("--catalog", default=None,
                           help="catalog file on the server's host (full replacement)")
            p.add_argument("--catalog-add", default=None,
                           help="CSV item_id,s1,s2,... read here: items added or re-assigned")
            p.add_argument("--catalog-remove", default=None,
                           help="item ids to take down: 1,2,3 or @FILE")
            p.add_argument("--policy", default=None,
                           help="JSON or TOML file of [policy] fields to change, read here")
            p.add_argument("--drop-previous", action="store_true",
                           help="do not keep the replaced version for a rollback")
        p.set_defaults(func=cmd_admin)
