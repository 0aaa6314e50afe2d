"""A real server on loopback in its own thread and event loop, and raw-socket helpers."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading

import msgspec
import uvloop

from streamgr.engine import Engine
from streamgr.protocol import Codec, messages as m
from streamgr.server import Server, ServerLimits
from tests.conftest import small_overrides

LOOPS = ["asyncio", "uvloop"]


def new_loop(kind: str) -> asyncio.AbstractEventLoop:
    return uvloop.new_event_loop() if kind == "uvloop" else asyncio.new_event_loop()


def run(kind: str, coro_fn):
    with asyncio.Runner(loop_factory=lambda: new_loop(kind)) as runner:
        return runner.run(coro_fn())


class ServerThread:
    def __init__(self, loop: str = "asyncio", token: str | None = None, unix: str | None = None,
                 **limits) -> None:
        self.kind = loop
        self.overrides = small_overrides(**limits.pop("overrides", {}))
        self.limits = ServerLimits(**limits)
        self.token, self.unix = token, unix

    def __enter__(self) -> "ServerThread":
        self.loop = new_loop(self.kind)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = Engine.from_spec("rank-small", self.overrides)

        async def up():
            await self.engine.start()
            self.server = Server(self.engine, self.limits, self.token)
            return await self.server.start("127.0.0.1", 0, self.unix)
        addrs = self.call(up())
        self.addr = addrs[-1]
        self.host, self.port = self.addr.rsplit(":", 1)[0], int(self.addr.rsplit(":", 1)[1])
        return self

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def counters(self) -> dict:
        return self.call(_stats(self.engine))["counters"]

    def __exit__(self, *exc) -> None:
        async def down():
            await self.server.shutdown(5.0)
            await self.engine.close()
        self.call(down())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


async def _stats(engine):
    return engine.stats()


CODEC = Codec()


def frame(msg) -> bytes:
    return CODEC.frame(msg)


def raw_frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def recv_msg(sock: socket.socket):
    head = recv_exact(sock, 4)
    if head is None:
        return None
    body = recv_exact(sock, struct.unpack(">I", head)[0])
    return None if body is None else CODEC.decode(body)


def connect(srv: ServerThread, token: str = "", timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection((srv.host, srv.port), timeout=timeout)
    sock.sendall(frame(m.Hello(m.PROTOCOL_VERSION, token)))
    ack = recv_msg(sock)
    assert isinstance(ack, m.HelloAck), ack
    return sock


def rank_msg(rid: int, user=1, n=5, deadline_ms=None) -> m.RankRequest:
    return m.RankRequest(rid, user, list(range(n)), [i % 3 for i in range(n)], [7, 8, 9],
                         None, deadline_ms)


def good_request_works(srv: ServerThread) -> None:
    with connect(srv) as sock:
        sock.sendall(frame(rank_msg(42)))
        reply = recv_msg(sock)
        assert isinstance(reply, m.RankReply) and reply.id == 42 and len(reply.scores) == 3


__all__ = ["LOOPS", "ServerThread", "run", "frame", "raw_frame", "recv_msg", "connect",
           "rank_msg", "good_request_works", "msgspec"]
