"""``streamgr update | rollback | versions --server ADDR``: live updates of a running server.

They open an admin connection (the server's ``--admin-token-file`` token, distinct from the
client token) and print the server's versions after the change as JSON. Paths given to
``update`` (a checkpoint directory, a catalog file) are read by the server, on its host;
``--catalog-add`` (a CSV ``item_id,s1,s2,...``) and ``--policy`` (JSON or TOML with fields of
``[policy]``) are read here and sent.
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
    out = {}
    for n, line in enumerate(rows[1:], 2):
        try:
            vals = [int(v) for v in line.split(",")]
        except ValueError:
            raise StreamgrError(f"--catalog-add {path}:{n}: not integers: {line!r}") from None
        out[vals[0]] = vals[1:]
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
            out = c.update(weights=args.weights, seed=args.seed, catalog=args.catalog,
                           catalog_add=_catalog_add(args.catalog_add),
                           catalog_remove=_ids(args.catalog_remove),
                           policy=_policy(args.policy), target=args.target,
                           keep_previous=not args.drop_previous)
    print(json.dumps(out, indent=1))
    return 0


def add_admin_commands(sub) -> None:
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
