"""``streamgr serve``: the engine behind the socket server, with signals and a metrics endpoint.

The event loop is chosen here, at the entry point: uvloop where installed, else the stdlib loop.
SIGTERM/SIGINT: stop accepting, finish in-flight requests within ``--drain-timeout``, close,
exit 0; a second signal forces the close (exit 1).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import time

from ..engine import Engine
from ..errors import StreamgrError
from ..tokens import read_token
from .listeners import Listeners, address
from .server import Server, ServerLimits

log = logging.getLogger("streamgr.server")


METRICS_MAX_CONNECTIONS = 64  # HTTP connections at once on the metrics port
METRICS_REQUEST_TIMEOUT = 5.0  # s for a whole request head, however it trickles in
_metrics_open = {"n": 0}


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    line = await reader.readline()
    n = 0
    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
        n += 1
        if n > 100:
            break
    return line


def health_answer(server: Server, path: str) -> tuple[str, bytes]:
    """``/health``: the process serves (200); ``/ready``: the model is loaded and the server is
    not draining (200), else 503."""
    if path == "/health":
        return "200 OK", b"ok\n"
    ready, why = server.readiness()
    return ("200 OK", b"ready\n") if ready else ("503 Service Unavailable", why.encode() + b"\n")


async def _metrics_http(server: Server, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> None:
    if _metrics_open["n"] >= METRICS_MAX_CONNECTIONS:
        writer.close()
        return
    _metrics_open["n"] += 1
    try:
        line = await asyncio.wait_for(_read_head(reader), METRICS_REQUEST_TIMEOUT)
        parts = line.decode("latin-1").split()
        path = parts[1].split("?")[0] if len(parts) >= 2 and parts[0] == "GET" else ""
        if path in ("/metrics", "/"):
            body, status = server.prometheus().encode(), "200 OK"
        elif path in ("/health", "/ready"):
            status, body = health_answer(server, path)
        else:
            body, status = b"not found\n", "404 Not Found"
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
    except Exception:
        pass
    finally:
        _metrics_open["n"] -= 1
        writer.close()


async def serve(spec, overrides=None, host: str = "127.0.0.1", port: int | None = 7700,
                unix: str | None = None, token: str | None = None, metrics_port: int | None = None,
                limits: ServerLimits | None = None, drain_timeout: float = 30.0,
                access_log: bool = False, admin_token: str | None = None,
                engine=None, bound: Listeners | None = None) -> int:
    # The sockets first (``bound``: by the caller, before Ray started): a port in use is
    # found before the engine's start, not after.
    bound = bound or Listeners(host, port, unix, metrics_port)
    try:
        return await _serve(spec, overrides, engine, bound, token, limits, drain_timeout,
                            access_log, admin_token)
    finally:
        bound.close()  # what no server took (an engine that failed to start)


async def _serve(spec, overrides, engine, bound: Listeners, token, limits, drain_timeout,
                 access_log, admin_token) -> int:
    if engine is None:
        engine = Engine.from_spec(spec, overrides)
        log_startup(engine)
    # Or an engine-shaped one built by the caller (a Ray Serve application: `serve --ray`).
    # On a GPU the start captures the decode plans and compiles the selection kernels (gen-ref:
    # 30 s on the H200 where they are not in STREAMGR_KERNEL_CACHE), so the log says so before
    # and after.
    t0 = time.monotonic()
    log.info("starting the engine (plans and kernels are built now)")
    started = engine.start()
    if inspect.isawaitable(started):
        await started
    log.info("engine started in %.1f s", time.monotonic() - t0)
    server = Server(engine, limits, token, access_log=access_log, admin_token=admin_token)
    addrs = await server.start(bound=bound)
    metrics = []
    for sock in bound.take_metrics():
        metrics.append(await asyncio.start_server(lambda r, w: _metrics_http(server, r, w),
                                                  sock=sock))
        addrs.append(f"metrics http://{address(sock)}/metrics")
    print(f"streamgr serving {engine.spec.name} on {', '.join(addrs)}", flush=True)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = {"n": 0}
    drain: asyncio.Task | None = None

    def on_signal(signum: int) -> None:
        signals["n"] += 1
        if signals["n"] == 1:
            log.warning("signal %d: draining (send again to force)", signum)
            stop.set()
        elif drain is not None:
            drain.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    await stop.wait()
    for srv in metrics:
        srv.close()
    drain = loop.create_task(server.shutdown(drain_timeout))
    try:
        drained = await drain
    except asyncio.CancelledError:
        drained = False
        await server.shutdown(0.0)
    await engine.close(drain_timeout=0.0 if not drained else drain_timeout)
    print(f"streamgr stopped ({'drained' if drained else 'forced'})", flush=True)
    return 0 if drained else 1


def log_startup(engine) -> None:
    """One line with the spec as it runs (overrides applied) and the devices."""
    import json

    import msgspec
    import torch
    dev = engine.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    log.info("spec %s on %s (%s, %s): %s", engine.spec.name, dev, name,
             str(engine.dtype).replace("torch.", ""),
             json.dumps(msgspec.to_builtins(engine.spec), separators=(",", ":")))


def run(coro, loop: str = "auto") -> int:
    """Run on uvloop where installed (``loop="auto"``), or the named loop."""
    if loop in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                raise
        else:
            return uvloop.run(coro)
    return asyncio.run(coro)


def serve_limits(args) -> ServerLimits:
    """``streamgr serve``'s options checked (before an engine or Ray starts) and its limits."""
    if not (args.host or "").strip():
        raise StreamgrError("--host must be an address (127.0.0.1, 0.0.0.0, ::); an empty one "
                            "would open no protocol listener")
    for flag, port in (("--port", args.port), ("--metrics-port", args.metrics_port)):
        if port is not None and not 0 <= port <= 65535:
            raise StreamgrError(f"{flag} must be in 0..65535 (0: a free one), got {port}")
    if getattr(args, "ray", False) and args.replicas < 1:
        raise StreamgrError(f"--replicas must be at least 1, got {args.replicas}")
    if not 0 <= args.drain_timeout < float("inf"):
        raise StreamgrError(f"--drain-timeout must be a number of seconds >= 0, got "
                            f"{args.drain_timeout}")
    try:
        return ServerLimits(max_connections=args.max_connections, max_frame=args.max_frame,
                            max_inflight=args.max_inflight,
                            max_conn_inflight=args.max_conn_inflight,
                            idle_timeout=args.idle_timeout, read_timeout=args.read_timeout)
    except ValueError as err:
        raise StreamgrError(str(err)) from None


def bind(args) -> Listeners:
    """``streamgr serve``'s sockets, bound (not listening) before its engine or Ray starts."""
    return Listeners(args.host, args.port, args.unix, args.metrics_port)


def main_serve(args, overrides, engine=None, limits: ServerLimits | None = None,
               bound: Listeners | None = None) -> int:
    """``streamgr serve``: ``limits`` as ``serve_limits`` made them (checked here if not),
    ``bound`` as ``bind`` made them (``serve`` binds them if not)."""
    limits = limits or serve_limits(args)
    return run(serve(args.spec, overrides, args.host, args.port, args.unix,
                     read_token(args.token_file), args.metrics_port, limits, args.drain_timeout,
                     args.access_log, read_token(getattr(args, "admin_token_file", None)),
                     engine, bound), args.loop)
