"""``AsyncClient``: one pipelined connection, on the event loop that made it."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import msgspec

from .. import api
from ..aio import gather_all
from ..errors import (ConnectionLost, InvalidRequest, ProtocolError, ServerUnavailable,
                      StreamgrError, WrongEventLoop, error_for_code)
from ..protocol import framing, messages as m
from ..protocol.ids import as_list, wire_ids
from .wire import ReplyProtocol, expire, parse_address


_CLOSED = "client closed (AsyncClient.close) with this call in flight"


class AsyncClient:
    def __init__(self, address: str, token: str | None = None, timeout: float | None = 60.0,
                 name: str = "streamgr.client") -> None:
        self.address = address
        self.token, self.timeout, self.name = token, timeout, name
        self.server_info: m.HelloAck | None = None
        self._ids = itertools.count(1)
        self._codec = framing.Codec()
        self._proto: ReplyProtocol | None = None
        self._connect_lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the connection's loop
        # close() was called: calls raise instead of opening a connection nobody would close
        # (a call after ``async with`` ended); connect() opens it again.
        self._closed = False
        self._gate: asyncio.Semaphore | None = None  # the server's per-connection cap

    def _on_this_loop(self) -> None:
        """A connection belongs to the loop that made it. Called from another loop: if that
        one no longer runs (a script's earlier ``asyncio.run``), the connection died with it and
        is dropped, so the call connects again here; if it runs (another thread), a reply would
        be read on that thread and never wake this loop: ``WrongEventLoop``."""
        owner = self._loop
        if owner is None or owner is asyncio.get_running_loop():
            return
        if owner.is_running():
            raise WrongEventLoop("this AsyncClient is connected on an event loop running in "
                                 "another thread: call it there, or make a client per loop "
                                 "(the blocking Client serves any thread)")
        self._drop("the connection's event loop no longer runs; connecting again on this one")

    def _drop(self, why: str) -> None:
        """Forget the connection, closing it from the thread of its loop if that one runs
        (calls in flight on it fail with ``why``)."""
        proto, owner = self._proto, self._loop
        self._proto, self._loop, self._connect_lock = None, None, None
        if proto is None:
            return
        try:
            if owner is not None and owner.is_running():
                owner.call_soon_threadsafe(proto.close, why, True)
            else:
                proto.close(why, True)
        except RuntimeError:  # its loop is closed: the socket closes when collected
            pass

    @property
    def connected(self) -> bool:
        p = self._proto
        return p is not None and p.lost is None and not p.transport.is_closing()

    async def connect(self) -> "AsyncClient":
        self._on_this_loop()
        self._closed = False
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        async with self._connect_lock:
            if self.connected:
                return self
            loop = asyncio.get_running_loop()
            host, port = parse_address(self.address)
            factory = lambda: ReplyProtocol(self._codec)  # noqa: E731
            try:
                if host == "unix":
                    _, proto = await loop.create_unix_connection(factory, port)
                else:
                    _, proto = await loop.create_connection(factory, host, port)
            except OSError as err:  # refused, no such socket, unreachable
                raise ServerUnavailable(f"no streamgr server answers at {self.address} "
                                        f"({err.strerror or err})") from None
            proto.transport.write(self._codec.frame(
                m.Hello(m.PROTOCOL_VERSION, self.token or "", self.name)))
            try:
                reply = await asyncio.wait_for(proto.first, self.timeout)
            except ConnectionLost as err:
                raise ProtocolError(f"{self.address} closed the connection during Hello ({err}): "
                                    f"is it a streamgr server's protocol port?") from None
            except BaseException as err:  # no HelloAck in time, or cancelled: not left open
                proto.transport.close()
                raise (ServerUnavailable(f"no HelloAck from {self.address} within {self.timeout}"
                                         " s") if isinstance(err, asyncio.TimeoutError) else err)
            if isinstance(reply, m.Error):
                proto.transport.close()
                if reply.code in (m.UNAUTHORIZED, m.PROTOCOL_ERROR):
                    raise ProtocolError(f"{reply.code}: {reply.message}")
                raise error_for_code(reply.code, reply.message)
            if not isinstance(reply, m.HelloAck):
                proto.transport.close()
                raise ProtocolError(f"expected HelloAck, got {type(reply).__name__}")
            self.server_info = reply
            self._proto, self._loop = proto, loop
            cap = min(reply.max_conn_inflight, reply.max_inflight)  # (0: an older server's)
            self._gate = asyncio.Semaphore(cap) if cap > 0 else None
        return self

    async def _call(self, make, timeout: float | None, gated: bool = False):
        """``make(id)`` sent, its reply awaited. ``gated`` (rank, generate): at most the
        server's per-connection cap of them in flight, the rest waiting here for a slot (as
        HTTP/2 clients keep to a peer's concurrent streams) instead of being refused with
        OVERLOADED; the wait counts in ``timeout``."""
        self._on_this_loop()
        if not self.connected:
            await self._reconnect()
        timeout = timeout if timeout is not None else self.timeout
        gate = self._gate if gated else None
        if gate is None:
            return await self._send(make, timeout)
        if gate.locked():
            t0 = asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(gate.acquire(), timeout)
            except asyncio.TimeoutError:
                raise asyncio.TimeoutError(f"no reply within {timeout} s") from None
            if timeout is not None:  # what is left of it for the reply
                timeout = max(timeout - (asyncio.get_running_loop().time() - t0), 1e-3)
        else:
            await gate.acquire()
        try:
            if not self.connected:  # lost (or closed) while this call waited
                await self._reconnect()
            return await self._send(make, timeout)
        finally:
            gate.release()

    async def _reconnect(self) -> None:
        """Connect again for a call, unless ``close()`` was called."""
        if self._closed:
            raise ConnectionLost("client closed (AsyncClient.close); connect() or `async "
                                 "with` opens it again")
        await self.connect()

    async def _send(self, make, timeout: float | None):
        proto = self._proto
        rid = next(self._ids)
        try:
            data = self._codec.frame(make(rid))
        except StreamgrError:
            raise
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as err:
            # (ids past uint64, floats or objects among ids, unpaired surrogates in a str)
            raise InvalidRequest(f"the request cannot be encoded: {err}") from None
        if len(data) - 4 > self.server_info.max_frame:
            # Refused here: the server would close the connection, and every other request in
            # flight on it would fail with ConnectionLost.
            raise InvalidRequest(f"a request of {len(data) - 4:,} bytes, over the server's "
                                 f"max_frame of {self.server_info.max_frame:,} (numpy arrays "
                                 "travel packed; base_len sends only new events)")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        proto.pending[rid] = fut
        # A plain timer on the future: cheaper than wait_for's wrapper task on a hot path.
        timer = None if timeout is None else loop.call_later(timeout, expire, fut, timeout)
        try:
            proto.transport.write(data)
            await proto.writable()
            reply = await fut
        except (asyncio.TimeoutError, asyncio.CancelledError):
            # Given up on (its timeout, or the caller's task cancelled): withdrawn on the
            # server too, so that queued work nobody waits for does not run.
            if proto.lost is None and not proto.transport.is_closing() and self._cancels:
                proto.transport.write(self._codec.frame(m.Cancel(rid)))
            raise
        finally:
            if timer is not None:
                timer.cancel()
            proto.pending.pop(rid, None)
        if isinstance(reply, m.Error):
            raise error_for_code(reply.code, reply.message)
        return reply

    @property
    def _cancels(self) -> bool:
        info = self.server_info
        return info is not None and m.CAP_CANCEL in info.capabilities

    @property
    def _packs_ids(self) -> bool:
        """The server takes packed ids (``messages.CAP_PACKED_IDS``)."""
        info = self.server_info
        return info is not None and m.CAP_PACKED_IDS in info.capabilities

    async def rank(self, request: api.RankRequest, deadline_ms: float | None = None,
                   timeout: float | None = None) -> api.RankResult:
        ids = lambda x, packed=self._packs_ids: wire_ids(x, packed)  # noqa: E731
        reply = await self._call(lambda rid: m.RankRequest(
            rid, request.user_id, ids(request.items), ids(request.actions),
            ids(request.candidates), request.base_len, deadline_ms), timeout, gated=True)
        return api.RankResult(scores=reply.scores, stats=msgspec.convert(reply.stats, api.RankStats))

    async def rank_many(self, requests: list[api.RankRequest], deadline_ms: float | None = None,
                        timeout: float | None = None,
                        return_exceptions: bool = False) -> list[api.RankResult | Exception]:
        """All in flight at once on this connection, up to the server's per-connection cap
        (they can batch on the server); results in order; the first error raises and withdraws
        the rest, or with ``return_exceptions`` each failed request's error stands in its
        place."""
        return await gather_all([self.rank(r, deadline_ms, timeout) for r in requests],
                                return_exceptions)

    async def generate_many(self, requests: list, deadline_ms: float | None = None,
                            timeout: float | None = None, return_exceptions: bool = False) -> list:
        """``rank_many`` for generate."""
        return await gather_all([self.generate(r, deadline_ms, timeout) for r in requests],
                                return_exceptions)

    async def generate(self, request, deadline_ms: float | None = None,
                       timeout: float | None = None):
        opt = lambda x: None if x is None else as_list(x)  # noqa: E731
        packed = self._packs_ids
        reply = await self._call(lambda rid: m.GenerateRequest(
            rid, request.user_id, wire_ids(request.history, packed), request.top_k,
            request.beam_width,
            deadline_ms, opt(getattr(request, "beam_widths", None)),
            opt(getattr(request, "exclude_items", None)),
            getattr(request, "max_per_prefix", None)), timeout, gated=True)
        return api.GenerateResult(items=reply.items, scores=reply.scores, sids=reply.sids,
                                  stats=msgspec.convert(reply.stats, api.GenerateStats))

    async def stats(self, timeout: float | None = None) -> dict[str, Any]:
        return (await self._call(lambda rid: m.StatsRequest(rid), timeout)).stats

    async def health(self, timeout: float | None = None) -> m.HealthReply:
        """The server's liveness and readiness (``ready`` False while draining)."""
        return await self._call(lambda rid: m.HealthRequest(rid), timeout)

    # Admin calls: the connection must have been opened with the server's admin token.
    async def update(self, weights: str | None = None, seed: int | None = None,
                     catalog: str | None = None, catalog_add: dict | None = None,
                     catalog_remove: list | None = None, policy: dict | None = None,
                     target: str = "auto", keep_previous: bool = True,
                     timeout: float | None = 600.0) -> dict[str, Any]:
        """A live update on the server (``Engine.update``); the versions after it. Paths are
        on the server's host."""
        add = {int(k): as_list(v) for k, v in (catalog_add or {}).items()}
        reply = await self._call(lambda rid: m.UpdateRequest(
            rid, target, weights, seed, catalog, add, as_list(catalog_remove or []),
            dict(policy or {}), keep_previous), timeout)
        return reply.versions

    async def rollback(self, target: str = "auto", timeout: float | None = 600.0) -> dict:
        return (await self._call(lambda rid: m.RollbackRequest(rid, target), timeout)).versions

    async def versions(self, timeout: float | None = None) -> dict[str, Any]:
        return (await self._call(lambda rid: m.VersionsRequest(rid), timeout)).versions

    async def close(self) -> None:
        self._closed = True
        if self._proto is not None and self._loop is asyncio.get_running_loop():
            self._proto.close(_CLOSED)
            self._proto = None
        else:  # a connection of another loop (or none)
            self._drop(_CLOSED)

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()
