"""Admin requests on the socket: live updates, rollbacks and the version listing.

Only a connection whose Hello carried the server's admin token (``serve --admin-token-file``,
distinct from the client token) may send them; elsewhere they get ``UNAUTHORIZED`` and the
connection keeps serving. Each runs as a server task (not a connection's: a client that goes
away does not cancel an update half-way), and its reply is the engine's ``versions()`` after the
change, or the typed error (a contract violation names the field, and the active version keeps
serving).
"""

from __future__ import annotations

import asyncio
import inspect
import logging

import msgspec

from ..errors import StreamgrError
from ..protocol import messages as m

log = logging.getLogger("streamgr.server")


async def _run(engine, msg) -> dict:
    if isinstance(msg, m.VersionsRequest):
        versions = engine.versions()  # (a Ray application's asks its update log)
        return await versions if inspect.isawaitable(versions) else versions
    if isinstance(msg, m.RollbackRequest):
        return await engine.rollback(target=msg.target)
    if msg.weights is not None and msg.seed is not None:
        raise StreamgrError("update: weights (a checkpoint) or seed, not both")
    weights = msg.weights if msg.weights is not None else msg.seed
    catalog = None
    if msg.catalog is not None:
        if msg.catalog_add or msg.catalog_remove:
            raise StreamgrError("update: a catalog file, or additions/removals, not both")
        catalog = msg.catalog
    elif msg.catalog_add or msg.catalog_remove:
        catalog = {"add": msg.catalog_add, "remove": msg.catalog_remove}
    return await engine.update(weights=weights, catalog=catalog, policy=msg.policy or None,
                               target=msg.target, keep_previous=msg.keep_previous)


def handle(server, conn, msg) -> None:
    """Dispatch one admin request from ``conn``."""
    kind = "admin"
    if not conn.admin:
        server.metrics.observe(kind, "unauthorized", 0.0)
        log.warning("admin request from %s without the admin token", conn.peer())
        conn.send(m.Error(msg.id, m.UNAUTHORIZED, "admin requests need the admin token"))
        return
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    task = loop.create_task(_run(server.engine, msg))
    server.admin_tasks.add(task)
    conn.ids[msg.id] = None  # in flight on this connection, as a rank request's id is

    def done(t: asyncio.Task) -> None:
        server.admin_tasks.discard(t)
        conn.ids.pop(msg.id, None)
        if t.cancelled():
            return
        err = t.exception()
        if err is None:
            server.metrics.observe(kind, "ok", loop.time() - t0)
            conn.send(m.VersionsReply(msg.id, msgspec.to_builtins(t.result())))
            if not isinstance(msg, m.VersionsRequest):
                log.info("%s from %s: %s", type(msg).__name__, conn.peer(), t.result())
            return
        code = err.code if isinstance(err, StreamgrError) else "INTERNAL"
        if not isinstance(err, StreamgrError):
            log.error("admin request failed", exc_info=err)
        server.metrics.observe(kind, code.lower(), loop.time() - t0)
        conn.send(m.Error(msg.id, code, str(err)))
    task.add_done_callback(done)
