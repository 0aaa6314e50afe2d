"""One client connection of the socket server: frames parsed straight from ``data_received``
(no stream reader, no future per read), the Hello handshake, requests handed to the server,
replies written as they finish, and the limits every connection is held to."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from ..protocol import framing, messages as m

if TYPE_CHECKING:
    from .server import Server

log = logging.getLogger("streamgr.server")


@dataclass
class ServerLimits:
    max_connections: int = 1024
    max_frame: int = framing.DEFAULT_MAX_FRAME
    max_inflight: int = 1024  # requests in flight across the server
    # ... and on one connection: a client that floods (or never reads its replies) cannot
    # take every slot from the others
    max_conn_inflight: int = 256
    idle_timeout: float = 300.0  # s without a frame before the connection closes
    read_timeout: float = 10.0  # s to finish a frame once its first byte arrived
    hello_timeout: float = 10.0
    # Connections that have not said Hello yet; past it the oldest of them is closed, so a flood
    # of idle sockets cannot starve clients that greet at once.
    max_ungreeted: int = 64

    def __post_init__(self) -> None:  # (limits of 0 would serve nothing, or close everything)
        for name in ("max_connections", "max_frame", "max_inflight", "max_conn_inflight",
                     "max_ungreeted"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be at least 1, "
                                 f"got {getattr(self, name)}")
        for name in ("idle_timeout", "read_timeout", "hello_timeout"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be a number of "
                                 f"seconds > 0, got {getattr(self, name)}")


class Connection(asyncio.Protocol):
    """One client connection: frames parsed straight from ``data_received`` (no stream reader,
    no future per read), requests dispatched to the server, replies written as they finish."""

    def __init__(self, server: "Server") -> None:
        self.server = server
        self.codec = framing.Codec()
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.tasks: set[asyncio.Future] = set()  # requests in flight (engine futures / tasks)
        # their request ids (a second request may not reuse one): id -> its future (None for
        # an admin request, which a Cancel does not withdraw)
        self.ids: dict[int, asyncio.Future | None] = {}
        self.expired: set[asyncio.Future] = set()  # answered DEADLINE_EXCEEDED already
        self.greeted = False
        self.admin = False  # greeted with the admin token (server/admin.py)
        self.closed = False
        self.eof_sent = False  # half-closed at shutdown
        self.opened = self.last = time.monotonic()
        self.partial_since: float | None = None  # a frame started arriving and is not complete

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        srv = self.server
        if srv.closing or len(srv.connections) >= srv.limits.max_connections:
            srv.metrics.counters["connections_refused"] += 1
            self.send(m.Error(0, "OVERLOADED", "server is shutting down" if srv.closing
                              else "too many connections"))
            self.close()
            return
        srv.connections.add(self)
        waiting = [c for c in srv.connections if not c.greeted]
        if len(waiting) > srv.limits.max_ungreeted:  # evict the longest-waiting of them
            oldest = min(waiting, key=lambda c: c.opened)
            srv.metrics.counters["hello_evictions"] += 1
            oldest.send(m.Error(0, m.PROTOCOL_ERROR, "expected Hello"))
            oldest.close()
            srv.connections.discard(oldest)

    def connection_lost(self, exc) -> None:
        self.closed = True
        for t in list(self.tasks):  # the caller is gone: abort its requests downstream
            t.cancel()
        self.server.connections.discard(self)

    def pause_writing(self) -> None:  # the peer does not read: stop reading its requests too
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.last = time.monotonic()
        buf = self.buf
        buf += data
        max_frame = self.server.limits.max_frame
        while len(buf) >= 4 and not self.closed:
            (length,) = framing.HEADER.unpack_from(buf)
            if length > max_frame:  # refused unread
                self.server.metrics.counters["oversize_frames"] += 1
                self.send(m.Error(0, m.FRAME_TOO_LARGE,
                                  str(framing.FrameTooLarge(length, max_frame))))
                self.close()
                return
            if len(buf) < 4 + length:
                break
            body = bytes(buf[4:4 + length])
            del buf[:4 + length]
            self.partial_since = None
            self._frame(body)
        if buf and self.partial_since is None:
            self.partial_since = self.last

    # -- helpers ---------------------------------------------------------------------------------

    def send(self, msg) -> None:
        if not self.closed and not self.eof_sent and self.transport is not None and not self.transport.is_closing():
            self.transport.write(self.codec.frame(msg))

    def peer(self) -> str:
        info = self.transport.get_extra_info("peername") if self.transport else None
        return str(info) if info else "a local socket"

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def finish(self) -> None:
        """Shutdown: no more writes (EOF after the replies sent), reads go on until the peer
        closes, so a late write of the client meets no reset."""
        t = self.transport
        if t is None or self.closed or t.is_closing():
            return
        if not t.can_write_eof():
            self.close()
            return
        self.eof_sent = True
        t.write_eof()

    def _frame(self, body: bytes) -> None:
        srv = self.server
        if not self.greeted:
            self._hello(body)
            return
        try:
            msg = self.codec.decode(body)
        except RecursionError:  # nesting deeper than the decoder's stack: not a message
            srv.metrics.counters["bad_frames"] += 1
            self.send(m.Error(0, m.BAD_FRAME, "undecodable frame: nested too deeply"))
            self.close()
            return
        except msgspec.ValidationError as err:  # decodes, breaks the schema: per request
            rid = _guess_id(self.codec, body)
            if rid is None:  # not even plain MessagePack can hold it (nested too deeply)
                srv.metrics.counters["bad_frames"] += 1
                self.send(m.Error(0, m.BAD_FRAME, "undecodable frame: nested too deeply"))
                self.close()
                return
            srv.metrics.counters["invalid_frames"] += 1
            self.send(m.Error(rid, "INVALID_REQUEST", _named(self.codec, body, str(err))))
            return
        except msgspec.DecodeError as err:  # not a message at all: close
            srv.metrics.counters["bad_frames"] += 1
            self.send(m.Error(0, m.BAD_FRAME, f"undecodable frame: {err}"))
            self.close()
            return
        if not isinstance(msg, m.REQUESTS):
            self.send(m.Error(getattr(msg, "id", 0), m.PROTOCOL_ERROR,
                              f"{type(msg).__name__} is not a request"))
            return
        srv._dispatch(self, msg)

    def _token_ok(self, given: str) -> bool:
        """The client token (when the server has one) or the admin token opens a connection."""
        srv = self.server
        return srv.token is None or _same(given, srv.token) or _same(given, srv.admin_token)

    def _hello(self, body: bytes) -> None:
        srv = self.server
        try:
            hello = self.codec.decode(body)
        except (msgspec.DecodeError, RecursionError):
            hello = None
        if not isinstance(hello, m.Hello):
            srv.metrics.counters["bad_hello"] += 1
            self.send(m.Error(0, m.PROTOCOL_ERROR, "the first frame must be Hello"))
        elif hello.version != m.PROTOCOL_VERSION:
            self.send(m.Error(0, m.UNAUTHORIZED, f"protocol version {hello.version} not "
                                                 f"supported (server speaks {m.PROTOCOL_VERSION})"))
        elif not self._token_ok(hello.token):
            srv.metrics.counters["auth_failures"] += 1
            why = "wrong token" if hello.token else "this server needs a token (none was sent)"
            log.warning("auth failure from %s: %s", self.peer(), why)
            self.send(m.Error(0, m.UNAUTHORIZED, why))
        else:
            self.greeted = True
            self.admin = _same(hello.token, srv.admin_token)
            lim = srv.limits
            caps = ["rank", "stats", "health", m.CAP_PACKED_IDS, m.CAP_CANCEL] + (
                ["generate"] if getattr(srv.engine, "serves_generate", False) else [])
            caps += ["admin"] if self.admin else []
            self.send(m.HelloAck(m.PROTOCOL_VERSION, srv.name, srv.engine.spec.name,
                                 lim.max_frame, lim.max_inflight, caps, lim.max_conn_inflight))
            return
        self.close()


def _same(given: str, token: str | None) -> bool:
    return token is not None and hmac.compare_digest(given.encode(), token.encode())


_BY_TAG = {cls.__struct_config__.tag: cls for cls in m.REQUESTS}
_AT = re.compile(r"`\$\[(\d+)\]((?:\[\d+\]|\.\w+)*)`")


def _named(codec: framing.Codec, body: bytes, text: str) -> str:
    """A schema error's position in the wire's array (``$[4]``, after the tag) as the
    request's field name (``top_k``); the text as it is where that cannot be told."""
    at = _AT.search(text)
    try:
        cls = _BY_TAG.get(codec.decode_any(body)[0]) if at else None
    except Exception:  # (_guess_id read it already; anything odd: leave the text)
        cls = None
    fields = cls.__struct_fields__ if cls is not None else ()
    i = int(at[1]) - 1 if at else -1  # position 0 holds the tag
    if not 0 <= i < len(fields):
        return text
    return f"{text[:at.start()]}`{fields[i]}{at[2]}`{text[at.end():]}"


def _guess_id(codec: framing.Codec, body: bytes) -> int | None:
    """The request id of a frame that did not validate, when it can be read (else 0); None
    when the frame nests deeper than any decoder's stack."""
    try:
        raw = codec.decode_any(body)
    except RecursionError:
        return None
    except Exception:
        return 0
    if isinstance(raw, list) and len(raw) > 1 and type(raw[1]) is int and 0 <= raw[1] < 2**63:
        return raw[1]
    return 0
