"""The ``streamgr`` command (also ``python -m streamgr``).

Every subcommand that takes a spec takes ``--set KEY=VALUE`` (repeatable) to override any key.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from .config import parse_set_pairs
from .errors import StreamgrError


def _add_spec(p: argparse.ArgumentParser, required: bool = True, default: str | None = None) -> None:
    if required:
        p.add_argument("spec", help="a spec file (pipeline/*.toml) or a built-in name (rank-small)")
    else:
        p.add_argument("--spec", default=default, help=f"spec file or built-in name (default {default})")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", dest="overrides",
                   help="override a spec key, e.g. --set cache.mode=recompute (repeatable)")


def cmd_init_model(args) -> int:
    from .config import load_spec
    from .spec_doc import spec_to_toml
    from .models import HSTU, hstu_config_from_spec
    from .models.checkpoint import save_checkpoint
    spec = load_spec(args.spec, parse_set_pairs(args.overrides))
    if spec.model.family == "t5":
        return _init_generator(spec, args)
    cfg = hstu_config_from_spec(spec.model)
    model = HSTU(cfg).init_random(args.seed)
    out = save_checkpoint(model, cfg, args.out)
    import msgspec
    spec = msgspec.structs.replace(
        spec, model=msgspec.structs.replace(spec.model, checkpoint=".", init_seed=None))
    (out / "spec.toml").write_text(spec_to_toml(spec))
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}/config.json, model.safetensors ({n:,} parameters) and spec.toml")
    return 0


def _init_generator(spec, args) -> int:
    """A random T5 checkpoint in Hugging Face's layout, a random catalog, and a spec for both."""
    import json

    import msgspec

    from .models.checkpoint import write_weights
    from .spec_doc import spec_to_toml
    from .runtime.deployment import build_catalog, t5_config_from_spec
    from .models.t5 import T5
    from .selection.catalog import save_catalog
    cfg = t5_config_from_spec(spec)
    model = T5(cfg).init_random(args.seed)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    hf = {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"],
          "is_encoder_decoder": True, **msgspec.to_builtins(cfg)}
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    write_weights(model.state_dict(), out)
    save_catalog(build_catalog(spec), out / "catalog.csv")
    cat = msgspec.structs.replace(spec.catalog, path="catalog.csv", random_items=0)
    m = msgspec.structs.replace(spec.model, checkpoint=".", init_seed=None)
    (out / "spec.toml").write_text(spec_to_toml(msgspec.structs.replace(spec, model=m, catalog=cat)))
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}/config.json, model.safetensors ({n:,} parameters), catalog.csv and spec.toml")
    return 0


def cmd_contract(args) -> int:
    import json

    from .config import load_spec
    from .engine.factory import resolve_device, resolve_dtype
    from .runtime.deployment import build_generator
    spec = load_spec(args.spec, parse_set_pairs(args.overrides))
    if spec.generate_model is None:
        raise StreamgrError(f"spec {spec.name} has no generate model: no deployment contract")
    device = torch_device("cpu")
    _, _, _, contract, _ = build_generator(spec, device, resolve_dtype(spec.generate_model.dtype,
                                                                    resolve_device("cpu")))
    if not args.weights:
        contract["weights"] = f"{len(contract['weights'])} tensors (--weights lists them)"
    print(json.dumps(contract, indent=1))
    return 0


def torch_device(name: str):
    import torch
    return torch.device(name)


def cmd_demo(args) -> int:
    from .demo import format_table, run_demo
    row = asyncio.run(run_demo(args.spec, parse_set_pairs(args.overrides), n_requests=args.requests,
                               n_users=args.users, concurrency=args.concurrency, seed=args.seed))
    print(format_table([row]))
    return 0


def cmd_spec_doc(args) -> int:
    from .spec_doc import render
    print(render())
    return 0


def cmd_ray_config(args) -> int:
    import yaml

    from .config import load_spec
    from .deploy.ray_serve import serve_config
    ov = parse_set_pairs(args.overrides)
    load_spec(args.spec, ov)  # a bad spec or key fails here, not on the cluster
    print(yaml.safe_dump(serve_config(args.spec, ov, args.replicas, args.router, args.gpus),
                         sort_keys=False), end="")
    return 0


def cmd_serve(args) -> int:
    from .server.main import bind, main_serve, serve_limits
    ov = parse_set_pairs(args.overrides)
    limits = serve_limits(args)  # before Ray starts
    bound = bind(args)  # the ports too: one in use is said now, not after the engine's start
    engine = None
    try:
        if args.ray:  # a Ray Serve application of engine replicas behind the socket
            from .deploy.ray_serve import RayEngine, connect
            connect(args.ray_address)
            engine = RayEngine(args.spec, ov, args.replicas, args.router)
    except BaseException:
        bound.close()
        raise
    return main_serve(args, ov, engine, limits, bound)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _common() -> argparse.ArgumentParser:
    """Options every command takes (``--log-level``), as an argparse parent."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--log-level", choices=LOG_LEVELS, default=None, type=str.upper,
                   help="log verbosity on stderr (default: INFO for serve, WARNING otherwise)")
    p.add_argument("--log-format", choices=["text", "json"], default="text",
                   help="log lines as text, or one JSON object a line (fields as keys)")
    return p


class _Sub:
    """``add_parser`` with the common options and defaults shown in every --help."""

    def __init__(self, sub, common):
        self.sub, self.common = sub, common

    def add_parser(self, name, **kw):
        kw.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        return self.sub.add_parser(name, parents=[self.common], **kw)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    parser = argparse.ArgumentParser(prog="streamgr", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"streamgr {__version__}")
    sub = _Sub(parser.add_subparsers(dest="command", required=True), _common())

    p = sub.add_parser("init-model", help="write a random-weight checkpoint for a spec")
    p.add_argument("--spec", required=True, help="spec file or built-in name")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", dest="overrides")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="weights seed")
    p.set_defaults(func=cmd_init_model)

    p = sub.add_parser("demo", help="run a short synthetic workload and print a latency table")
    _add_spec(p, required=False, default="rank-small")
    p.add_argument("--requests", type=int, default=300, help="requests to send")
    p.add_argument("--users", type=int, default=48, help="distinct users among them")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("contract", help="print the deployment contract of a generate spec")
    _add_spec(p)
    p.add_argument("--weights", action="store_true", help="list every weight binding")
    p.set_defaults(func=cmd_contract)

    p = sub.add_parser("spec-doc", help="print the spec reference (docs/specs.md)")
    p.set_defaults(func=cmd_spec_doc)

    p = sub.add_parser("serve", help="serve a spec over the msgspec socket protocol")
    _add_spec(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=7700, help="TCP port (0: pick a free one)")
    p.add_argument("--unix", default=None, help="also listen on this Unix socket path")
    p.add_argument("--token-file", default=None, help="file holding a shared token for Hello")
    p.add_argument("--ray", action="store_true",
                   help="serve a Ray Serve application of engine replicas (streamgr[ray])")
    p.add_argument("--replicas", type=int, default=2, help="with --ray: engine replicas")
    p.add_argument("--router", choices=["affinity", "default"], default="affinity",
                   help="with --ray: user-affinity (rendezvous hashing) or Ray's default")
    p.add_argument("--ray-address", default=None,
                   help="with --ray: the cluster (default RAY_ADDRESS, else a local one)")
    p.add_argument("--admin-token-file", default=None,
                   help="file holding the admin token (update/rollback/versions); none: no admin")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus text endpoint")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="open connections; past it a new one gets OVERLOADED")
    p.add_argument("--max-inflight", type=int, default=1024,
                   help="requests in flight across the server; past it OVERLOADED")
    p.add_argument("--max-conn-inflight", type=int, default=256,
                   help="requests in flight on one connection; past it OVERLOADED")
    p.add_argument("--max-frame", type=int, default=16 * 1024 * 1024,
                   help="largest frame body in bytes")
    p.add_argument("--idle-timeout", type=float, default=300.0,
                   help="seconds a connection may sit without a frame")
    p.add_argument("--read-timeout", type=float, default=10.0,
                   help="seconds to finish a frame once it started")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for requests in flight")
    p.add_argument("--loop", choices=["auto", "uvloop", "asyncio"], default="auto",
                   help="event loop (auto: uvloop where installed)")
    p.add_argument("--access-log", action="store_true",
                   help="log one line per request (logger streamgr.access, INFO)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("ray-config", help="print a Ray Serve config (YAML) for a spec")
    p.add_argument("spec", help="a spec file or a built-in name, as the replicas will load it")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", dest="overrides")
    p.add_argument("--replicas", type=int, default=2, help="engine replicas")
    p.add_argument("--router", choices=["affinity", "default"], default="affinity")
    p.add_argument("--gpus", type=float, default=None,
                   help="GPUs per replica (default: 1 where the driver sees CUDA, else 0)")
    p.set_defaults(func=cmd_ray_config)

    from .admin_cli import add_admin_commands
    add_admin_commands(sub)

    from .trace.cli import add_trace_commands
    add_trace_commands(sub, parse_set_pairs)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .logs import configure
    args = build_parser().parse_args(argv)
    level = args.log_level or ("INFO" if args.command == "serve" else "WARNING")
    configure(level, args.log_format)
    try:
        return args.func(args)
    except (StreamgrError, ValueError, OSError) as err:
        # Bad input (a spec, a trace, a file) is a clean error, never a traceback.
        print(f"streamgr: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
