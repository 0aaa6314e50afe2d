"""Clients of the socket protocol: ``AsyncClient`` (pipelined) and the blocking ``Client``.

Both are made from an address (``"127.0.0.1:7700"``, ``"[::1]:7700"`` or ``"unix:/path"``) and
take the same request types as the embedded engine. Error replies raise the typed exception of
their code (``streamgr.errors``); a broken connection fails the calls in flight with
``ConnectionLost`` and the next call reconnects. An ``AsyncClient``'s connection belongs to the
event loop that made it (see ``AsyncClient._on_this_loop``).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from typing import Any

import msgspec

from . import api
from .errors import (ConnectionLost, ProtocolError, ServerUnavailable, StreamgrError,
                     WrongEventLoop, error_for_code)
from .protocol import framing, messages as m
from .aio import gather_all
from .protocol.ids import as_list, wire_ids


def parse_address(address: str) -> tuple[str, str | int | None]:
    """``("unix", path)`` or ``(host, port)``."""
    if address.startswith("unix:") and address[5:]:
        return "unix", address[5:]
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address {address!r}: expected HOST:PORT (a port in 0..65535) or "
                         f"unix:PATH")
    return host.strip("[]") or "127.0.0.1", int(port)


def _expire(fut: asyncio.Future, timeout: float) -> None:
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError(f"no reply within {timeout} s"))


class _ClientProtocol(asyncio.Protocol):
    """Parses reply frames in ``data_received`` and resolves the waiting calls directly."""

    def __init__(self, codec: framing.Codec) -> None:
        self.codec = codec
        self.buf = bytearray()
        self.pending: dict[int, asyncio.Future] = {}
        self.first: asyncio.Future = asyncio.get_running_loop().create_future()  # HelloAck
        self.transport: asyncio.Transport | None = None
        self.lost: Exception | None = None
        self._can_write = asyncio.Event()
        self._can_write.set()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while len(buf) >= 4:
            (n,) = framing.HEADER.unpack_from(buf)
            if len(buf) < 4 + n:
                return
            try:
                msg = self.codec.decode(bytes(buf[4:4 + n]))
            except msgspec.DecodeError as err:
                self._fail(ProtocolError(f"undecodable reply: {err}"))
                self.transport.abort()
                return
            del buf[:4 + n]
            if not self.first.done():
                self.first.set_result(msg)
                continue
            fut = self.pending.pop(getattr(msg, "id", 0), None)
            if fut is not None:
                if not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, m.Error) and msg.id == 0:
                self.lost = ConnectionLost(f"server closed the connection: {msg.code}: {msg.message}")

    def _fail(self, err: Exception) -> None:
        self.lost = self.lost or err
        if not self.first.done():
            self.first.set_exception(self.lost)
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(self.lost)
        self.pending.clear()

    def connection_lost(self, exc) -> None:
        self._fail(ConnectionLost(f"connection lost: {exc!r}" if exc else
                                  "connection closed by the server"))
        self._can_write.set()

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    async def writable(self) -> None:
        await self._can_write.wait()


class AsyncClient:
    def __init__(self, address: str, token: str | None = None, timeout: float | None = 60.0,
                 name: str = "streamgr.client") -> None:
        self.address = address
        self.token, self.timeout, self.name = token, timeout, name
        self.server_info: m.HelloAck | None = None
        self._ids = itertools.count(1)
        self._codec = framing.Codec()
        self._proto: _ClientProtocol | None = None
        self._connect_lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the connection's loop

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
        self._drop()

    def _drop(self) -> None:
        """Forget the connection, closing it from the thread of its loop if that one runs."""
        proto, owner = self._proto, self._loop
        self._proto, self._loop, self._connect_lock = None, None, None
        if proto is None:
            return
        try:
            if owner is not None and owner.is_running():
                owner.call_soon_threadsafe(proto.transport.abort)
            else:
                proto.transport.abort()
        except RuntimeError:  # its loop is closed: the socket closes when collected
            pass

    @property
    def connected(self) -> bool:
        p = self._proto
        return p is not None and p.lost is None and not p.transport.is_closing()

    async def connect(self) -> "AsyncClient":
        self._on_this_loop()
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        async with self._connect_lock:
            if self.connected:
                return self
            loop = asyncio.get_running_loop()
            host, port = parse_address(self.address)
            factory = lambda: _ClientProtocol(self._codec)  # noqa: E731
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
                raise ProtocolError(f"the server closed the connection during Hello: {err}") from None
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
        return self

    async def _call(self, make, timeout: float | None):
        self._on_this_loop()
        if not self.connected:
            await self.connect()
        proto = self._proto
        rid = next(self._ids)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        proto.pending[rid] = fut
        timeout = timeout if timeout is not None else self.timeout
        # A plain timer on the future: cheaper than wait_for's wrapper task on a hot path.
        timer = None if timeout is None else loop.call_later(timeout, _expire, fut, timeout)
        try:
            proto.transport.write(self._codec.frame(make(rid)))
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
            ids(request.candidates), request.base_len, deadline_ms), timeout)
        return api.RankResult(scores=reply.scores, stats=msgspec.convert(reply.stats, api.RankStats))

    async def rank_many(self, requests: list[api.RankRequest], deadline_ms: float | None = None,
                        timeout: float | None = None,
                        return_exceptions: bool = False) -> list[api.RankResult | Exception]:
        """All in flight at once on this connection (they can batch on the server); results
        in order; the first error raises, or with ``return_exceptions`` each failed
        request's error stands in its place."""
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
            getattr(request, "max_per_prefix", None)), timeout)
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
        if self._proto is not None and self._loop is asyncio.get_running_loop():
            self._proto.transport.close()
            self._proto = None
        else:  # a connection of another loop (or none)
            self._drop()

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()


class Client:
    """Blocking client: ``with Client("127.0.0.1:7700") as c: c.rank(RankRequest(...))``. Its
    loop runs on a thread of its own, so any thread may call it; a forked child gets a loop thread
    and a connection of its own at its first call (the parent's thread is not forked)."""

    def __init__(self, address: str, token: str | None = None, timeout: float | None = 60.0) -> None:
        self._args = (address, token, timeout)
        self._closed, self._orphans = False, []
        self._start()

    def _start(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="streamgr-client")
        self._thread.start()
        self._client = AsyncClient(*self._args)
        try:
            self._run(self._client.connect())
        except BaseException:
            self._stop()
            raise
        self._pid = os.getpid()  # (a child whose connect failed starts again at its next call)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _call(self, call):
        """``call(async_client)`` run on the client's loop (started again in a forked child)."""
        if self._closed:
            raise ConnectionLost("client closed (Client.close)")
        if self._pid != os.getpid():  # a forked child (the parent's kept: collected, they
            self._orphans.append((self._loop, self._thread, self._client))  # close its loop)
            self._start()
        return self._run(call(self._client))

    def rank(self, request: api.RankRequest, deadline_ms: float | None = None,
             timeout: float | None = None) -> api.RankResult:
        return self._call(lambda c: c.rank(request, deadline_ms, timeout))

    def generate(self, request, deadline_ms: float | None = None, timeout: float | None = None):
        return self._call(lambda c: c.generate(request, deadline_ms, timeout))

    def rank_many(self, requests, deadline_ms: float | None = None, timeout: float | None = None,
                  return_exceptions: bool = False):
        return self._call(lambda c: c.rank_many(requests, deadline_ms, timeout,
                                                return_exceptions))

    def generate_many(self, requests, deadline_ms: float | None = None,
                      timeout: float | None = None, return_exceptions: bool = False):
        return self._call(lambda c: c.generate_many(requests, deadline_ms, timeout,
                                                    return_exceptions))

    def health(self) -> m.HealthReply:
        return self._call(lambda c: c.health())

    def update(self, **kw) -> dict[str, Any]:
        """``AsyncClient.update`` (admin token required)."""
        return self._call(lambda c: c.update(**kw))

    def rollback(self, target: str = "auto") -> dict[str, Any]:
        return self._call(lambda c: c.rollback(target))

    def versions(self) -> dict[str, Any]:
        return self._call(lambda c: c.versions())

    def stats(self) -> dict[str, Any]:
        return self._call(lambda c: c.stats())

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pid == os.getpid():  # a forked child that never called has nothing to close
            self._run(self._client.close())
            self._stop()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["AsyncClient", "Client", "parse_address", "StreamgrError"]
