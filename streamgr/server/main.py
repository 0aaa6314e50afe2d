"""``streamgr serve``: the engine behind the socket server, with signals and a metrics endpoint.

The event loop is chosen here, at the entry point: uvloop where installed, else the stdlib loop.
SIGTERM/SIGINT: stop accepting, finish in-flight requests within ``--drain-timeout``, close,
exit 0; a second signal forces the close (exit 1).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

from ..engine import Engine
from .server import Server, ServerLimits

log = logging.getLogger("streamgr.server")


async def _metrics_http(server: Server, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> None:
    try:
        line = await asyncio.wait_for(reader.readline(), 5.0)
        while (await asyncio.wait_for(reader.readline(), 5.0)) not in (b"\r\n", b"\n", b""):
            pass
        parts = line.decode("latin-1").split()
        if len(parts) >= 2 and parts[0] == "GET" and parts[1].split("?")[0] in ("/metrics", "/"):
            body, status = server.prometheus().encode(), "200 OK"
        else:
            body, status = b"not found\n", "404 Not Found"
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
    except Exception:
        pass
    finally:
        writer.close()


async def serve(spec, overrides=None, host: str = "127.0.0.1", port: int | None = 7700,
                unix: str | None = None, token: str | None = None, metrics_port: int | None = None,
                limits: ServerLimits | None = None, drain_timeout: float = 30.0) -> int:
    engine = Engine.from_spec(spec, overrides)
    await engine.start()
    server = Server(engine, limits, token)
    addrs = await server.start(host, port, unix)
    metrics = None
    if metrics_port is not None:
        metrics = await asyncio.start_server(lambda r, w: _metrics_http(server, r, w), host,
                                             metrics_port)
        maddr = metrics.sockets[0].getsockname()
        addrs.append(f"metrics http://{maddr[0]}:{maddr[1]}/metrics")
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
    if metrics is not None:
        metrics.close()
    drain = loop.create_task(server.shutdown(drain_timeout))
    try:
        drained = await drain
    except asyncio.CancelledError:
        drained = False
        await server.shutdown(0.0)
    await engine.close(drain_timeout=0.0 if not drained else drain_timeout)
    print(f"streamgr stopped ({'drained' if drained else 'forced'})", flush=True)
    return 0 if drained else 1


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


def read_token(path: str | None) -> str | None:
    return Path(path).read_text().strip() if path else None


def main_serve(args, overrides) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    limits = ServerLimits(max_connections=args.max_connections, max_frame=args.max_frame,
                          max_inflight=args.max_inflight, idle_timeout=args.idle_timeout,
                          read_timeout=args.read_timeout)
    return run(serve(args.spec, overrides, args.host, args.port, args.unix,
                     read_token(args.token_file), args.metrics_port, limits, args.drain_timeout),
               args.loop)
