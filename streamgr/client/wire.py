"""The client's side of a connection: addresses, and the protocol object that parses reply
frames and settles the waiting calls."""

from __future__ import annotations

import asyncio

import msgspec

from ..errors import ConnectionLost, ProtocolError
from ..protocol import framing, messages as m


def parse_address(address: str) -> tuple[str, str | int | None]:
    """``("unix", path)`` or ``(host, port)``."""
    if address.startswith("unix:") and address[5:]:
        return "unix", address[5:]
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address {address!r}: expected HOST:PORT (a port in 0..65535) or "
                         f"unix:PATH")
    return host.strip("[]") or "127.0.0.1", int(port)


def expire(fut: asyncio.Future, timeout: float) -> None:
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError(f"no reply within {timeout} s"))


class ReplyProtocol(asyncio.Protocol):
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

    def close(self, why: str, abort: bool = False) -> None:
        """Close from this side: the calls in flight fail with ``why``, not with "closed by
        the server"."""
        self._fail(ConnectionLost(why))
        if abort:
            self.transport.abort()
        else:
            self.transport.close()

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
