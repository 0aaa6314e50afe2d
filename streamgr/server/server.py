"""The socket server: connections, framing, admission, deadlines, cancellation, graceful drain.

Per connection: a Hello first (version, optional shared token), then any number of requests in
flight, replies in completion order, each echoing its request's id. What arrives is sorted by
what it breaks: a clean EOF at a frame boundary is a normal close; an oversize length is refused
unread and closes; bytes that are not a message close after an error reply; a message that
decodes but breaks the schema gets a per-request error and the connection stays. Past
``max_inflight`` a request gets an immediate ``OVERLOADED``; a closed connection cancels its
requests inside the engine. ``shutdown`` stops accepting, lets in-flight requests finish within
a timeout, cancels the rest and closes. uvloop's ``wait_closed`` returns at once even with live
connections, so connections and tasks are tracked here, not left to the loop.
"""

from __future__ import annotations

import asyncio
import math
import logging
import time

import msgspec
import numpy as np

from .. import api
from ..errors import InvalidRequest, StreamgrError
from ..protocol import messages as m
from . import admin
from .connection import Connection, ServerLimits
from .listeners import Listeners, address
from .metrics import ServerMetrics

log = logging.getLogger("streamgr.server")
access = logging.getLogger("streamgr.access")


def unpacked(ids, name: str):
    """A request's ids as sent: a list, or packed ids (``messages.CAP_PACKED_IDS``) read in place
    as an int64 array (the engine checks their range as it does a list's)."""
    if not isinstance(ids, bytes):
        return ids
    if len(ids) % 8:
        raise InvalidRequest(f"`{name}`: packed ids are little-endian int64, and {len(ids)} "
                             f"bytes is not a whole number of them")
    return np.frombuffer(ids, dtype="<i8")


class Server:
    def __init__(self, engine, limits: ServerLimits | None = None, token: str | None = None,
                 name: str = "streamgr/0.1.0", access_log: bool = False,
                 admin_token: str | None = None) -> None:
        self.engine = engine
        # A Hello with this token opens an admin connection (live updates; server/admin.py).
        if admin_token is not None and admin_token == token:
            raise ValueError("the admin token must differ from the client token")
        self.admin_token = admin_token
        self.admin_tasks: set[asyncio.Task] = set()
        self.access_log = access_log  # one INFO line per request on "streamgr.access"
        self.limits = limits or ServerLimits()
        self.token = token
        self.name = name
        self.metrics = ServerMetrics()
        self.connections: set[Connection] = set()
        self.inflight = 0
        self.closing = False
        self._servers: list[asyncio.base_events.Server] = []
        self._idle = asyncio.Event()
        self._idle.set()
        self._watchdog: asyncio.Task | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self, host: str | None = "127.0.0.1", port: int | None = 7700,
                    unix: str | None = None, bound: Listeners | None = None) -> list[str]:
        """Listen on ``bound``'s sockets (bound before the engine started: ``serve``) or on
        sockets of ``host:port`` / ``unix`` bound now; returns the addresses (``host:port`` /
        ``unix:path``). A port in use or a path that cannot be bound is a ``StreamgrError``
        naming it."""
        bound = bound or Listeners(host, port, unix, None)
        usock, tcp = bound.take_protocol()
        addrs = []
        loop = asyncio.get_running_loop()
        if usock is not None:
            self._servers.append(await loop.create_unix_server(lambda: Connection(self),
                                                               sock=usock))
            addrs.append(f"unix:{bound.unix_path}")
        for sock in tcp:
            self._servers.append(await loop.create_server(lambda: Connection(self), sock=sock))
            addrs.append(address(sock))
        self._watchdog = loop.create_task(self._watch())
        return addrs

    async def _watch(self) -> None:
        """Close connections that never said Hello, leave a frame half-sent, or sit idle. One
        task for all connections instead of a timer per read keeps the per-frame cost down."""
        lim = self.limits
        tick = max(0.01, min(lim.read_timeout, lim.idle_timeout, lim.hello_timeout) / 4)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for conn in list(self.connections):
                if not conn.greeted and now - conn.opened > lim.hello_timeout:
                    conn.send(m.Error(0, m.PROTOCOL_ERROR, "expected Hello"))
                elif conn.partial_since is not None:
                    if now - conn.partial_since <= lim.read_timeout:
                        continue
                elif conn.tasks or now - conn.last <= lim.idle_timeout:
                    continue
                self.metrics.counters["timeouts"] += 1
                conn.transport.abort()
                conn.connection_lost(None)

    async def shutdown(self, drain_timeout: float = 30.0) -> bool:
        """Stop accepting, finish in-flight requests (up to ``drain_timeout`` s), then close.
        Returns True if everything in flight finished."""
        self.closing = True
        for srv in self._servers:
            srv.close()
        if self._watchdog is not None:
            self._watchdog.cancel()
        try:
            await asyncio.wait_for(self._idle.wait(), drain_timeout)
            drained = True
        except asyncio.TimeoutError:
            drained = False
        for conn in list(self.connections):
            for t in list(conn.tasks):
                t.cancel()
            conn.finish()
        # Half-closed connections: the clients read every reply, then EOF. Closing at once
        # instead would let a client's next write meet a reset, which discards the replies
        # still unread in its socket. Wait briefly for them to close.
        t_end = time.monotonic() + min(self.LINGER, max(drain_timeout, 0.0))
        while any(not c.closed for c in self.connections) and time.monotonic() < t_end:
            await asyncio.sleep(0.01)
        for conn in list(self.connections):
            conn.close()
        await asyncio.sleep(0)  # let the transports flush and report connection_lost
        return drained

    LINGER = 2.0  # s that half-closed connections get to read their replies at shutdown

    def readiness(self) -> tuple[bool, str]:
        """Ready to take requests: listening, the engine started and alive, not draining."""
        if self.closing:
            return False, "draining"
        if getattr(self.engine, "_dead", None) is not None:
            return False, "engine dead"
        if not self._servers:
            return False, "not listening"
        return True, "ready"

    def stats(self) -> dict:
        out = self.engine.stats()
        out["server"] = {**self.metrics.snapshot(), "connections": len(self.connections),
                         "inflight": self.inflight}
        return out

    def prometheus(self) -> str:
        return self.metrics.prometheus(self.engine.stats(), len(self.connections), self.inflight)

    # -- requests --------------------------------------------------------------------------------

    def _dispatch(self, conn: Connection, msg) -> None:
        conn.last = t0 = time.monotonic()
        if isinstance(msg, m.Cancel):
            fut = conn.ids.get(msg.id)
            if fut is not None and not fut.done():
                self.metrics.counters["cancels"] += 1
                fut.cancel()  # _done: outcome "cancelled", no reply
            return
        if msg.id in conn.ids:  # its reply could not be told from the first one's
            conn.send(m.Error(msg.id, "INVALID_REQUEST", f"request id {msg.id} is already in "
                                                         "flight on this connection"))
            self.metrics.counters["duplicate_ids"] += 1
            return
        if isinstance(msg, m.HealthRequest):
            ready, status = self.readiness()
            conn.send(m.HealthReply(msg.id, True, ready, status))
            return
        if isinstance(msg, m.ADMIN):
            admin.handle(self, conn, msg)
            return
        if isinstance(msg, m.StatsRequest):
            conn.send(m.StatsReply(msg.id, msgspec.to_builtins(self.stats())))
            self.metrics.observe("stats", "ok", 0.0)
            return
        kind = "rank" if isinstance(msg, m.RankRequest) else "generate"
        if (self.closing or self.inflight >= self.limits.max_inflight
                or len(conn.tasks) >= self.limits.max_conn_inflight):
            self.metrics.observe(kind, "overloaded", 0.0)
            why = ("server is shutting down" if self.closing else
                   f"{self.inflight} requests in flight" if self.inflight >= self.limits.max_inflight
                   else f"{len(conn.tasks)} requests in flight on this connection")
            conn.send(m.Error(msg.id, "OVERLOADED", why))
            return
        dl = msg.deadline_ms
        if dl is not None and (isinstance(dl, bool) or not math.isfinite(dl) or dl < 0):
            self.metrics.observe(kind, "invalid_request", 0.0)
            conn.send(m.Error(msg.id, "INVALID_REQUEST",
                              f"`deadline_ms` must be a finite number >= 0, got {dl!r}"))
            return
        loop = asyncio.get_running_loop()
        try:
            if kind == "rank":
                # The engine's own future, no task in between: a callback sends the reply.
                fut = self.engine.submit_rank(api.RankRequest(
                    user_id=msg.user_id, items=unpacked(msg.items, "items"),
                    actions=unpacked(msg.actions, "actions"),
                    candidates=unpacked(msg.candidates, "candidates"), base_len=msg.base_len))
            else:
                fut = loop.create_task(self._generate(msg))
        except StreamgrError as err:
            self.metrics.observe(kind, err.code.lower(), 0.0)
            conn.send(m.Error(msg.id, err.code, str(err)))
            return
        self.inflight += 1
        self._idle.clear()
        conn.tasks.add(fut)
        conn.ids[msg.id] = fut
        timer = None
        if msg.deadline_ms is not None:
            timer = loop.call_later(msg.deadline_ms / 1e3, self._expire, conn, msg, fut)
        fut.add_done_callback(lambda f: self._done(conn, msg, kind, f, t0, timer))

    def _expire(self, conn: Connection, msg, fut: asyncio.Future) -> None:
        if not fut.done():
            conn.expired.add(fut)
            conn.ids.pop(msg.id, None)  # answered: the client may use the id again
            conn.send(m.Error(msg.id, "DEADLINE_EXCEEDED", f"no reply within {msg.deadline_ms} ms"))
            fut.cancel()  # withdrawn from the engine if it has not run yet

    def _done(self, conn: Connection, msg, kind: str, fut: asyncio.Future, t0: float,
              timer) -> None:
        conn.tasks.discard(fut)
        if fut not in conn.expired:  # (an expired one's id may be in use again already)
            conn.ids.pop(msg.id, None)
        if timer is not None:
            timer.cancel()
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()
        if fut in conn.expired:
            conn.expired.discard(fut)
            outcome = "deadline"
        elif fut.cancelled():
            outcome = "cancelled"  # the connection went away; nobody to answer
        elif (err := fut.exception()) is not None:
            if isinstance(err, StreamgrError):
                outcome = err.code.lower()
                conn.send(m.Error(msg.id, err.code, str(err)))
            else:
                outcome = "internal"
                log.error("request %d failed: %r", msg.id, err)
                conn.send(m.Error(msg.id, "INTERNAL", repr(err)))
        else:
            outcome = "ok"
            result = fut.result()
            if kind == "rank":
                conn.send(m.RankReply(msg.id, result.scores, msgspec.to_builtins(result.stats)))
            else:
                conn.send(m.GenerateReply(msg.id, result.items, result.scores,
                                          wire_sids(result.sids),
                                          msgspec.to_builtins(result.stats)))
        dt = time.monotonic() - t0
        self.metrics.observe(kind, outcome, dt)
        if self.access_log:
            peer = conn.peer()  # (the fields again as extras: --log-format json keys)
            access.info("%s %s id=%d user=%r %s %.2f ms", peer, kind, msg.id, msg.user_id,
                        outcome, dt * 1e3, extra={"peer": peer, "kind": kind, "id": msg.id,
                                                  "user": msg.user_id, "outcome": outcome,
                                                  "ms": round(dt * 1e3, 3)})

    async def _generate(self, msg):
        gen = getattr(self.engine, "generate", None)
        if gen is None or not getattr(self.engine, "serves_generate", False):
            from ..errors import UnsupportedRequest
            raise UnsupportedRequest(f"spec {self.engine.spec.name} does not serve generate")
        from ..api import GenerateRequest
        return await gen(GenerateRequest(user_id=msg.user_id,
                                         history=unpacked(msg.history, "history"),
                                         top_k=msg.top_k, beam_width=msg.beam_width,
                                         beam_widths=msg.beam_widths,
                                         exclude_items=msg.exclude_items,
                                         max_per_prefix=msg.max_per_prefix))


def wire_sids(sids):
    """A reply's ``sids``: an engine's ``SidRows`` (``runtime/sid_rows.py``) as the msgpack it
    builds from its array in one pass (``msgspec.Raw``, spliced into the reply), so no list
    is made for the socket; lists (an engine on the CPU path, a Ray replica's) as they are."""
    pack = getattr(sids, "msgpack", None)
    return msgspec.Raw(pack()) if pack is not None else sids
