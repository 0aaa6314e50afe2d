"""Framing: a 4-byte big-endian body length, then the MessagePack body.

The reader checks the declared length against the limit *before* reading the body (the stream
reader's buffer limit does not bound ``readexactly(n)``).
"""

from __future__ import annotations

import asyncio
import numbers
import struct

import msgspec

from .messages import Message

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 16 * 1024 * 1024


class FrameTooLarge(Exception):
    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"frame of {length} bytes over the {limit}-byte limit")
        self.length, self.limit = length, limit


def _integral(obj):
    """What msgspec cannot encode: numpy's integer scalars (a request's ``np.int64(8)``) go as
    ints; anything else stays an error."""
    if isinstance(obj, numbers.Integral) and not isinstance(obj, bool):
        return int(obj)
    raise TypeError(f"Encoding objects of type {type(obj).__name__} is unsupported")


class Codec:
    """Encoder/decoder pair; one per connection (the encoder reuses its buffer)."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder(enc_hook=_integral)
        self._dec = msgspec.msgpack.Decoder(Message)
        self._any = msgspec.msgpack.Decoder()

    def frame(self, msg) -> bytes:
        buf = bytearray(4)
        self._enc.encode_into(msg, buf, 4)
        HEADER.pack_into(buf, 0, len(buf) - 4)
        return bytes(buf)

    def decode(self, body: bytes):
        """A message; raises msgspec.DecodeError (not MessagePack) or ValidationError (schema)."""
        return self._dec.decode(body)

    def decode_any(self, body: bytes):
        return self._any.decode(body)


async def read_frame(reader: asyncio.StreamReader, max_frame: int,
                     idle_timeout: float | None, read_timeout: float | None) -> bytes | None:
    """One frame's body; None on a clean EOF at a frame boundary. Raises ``FrameTooLarge``
    before reading an oversize body, ``asyncio.TimeoutError`` on idle or a half-sent frame,
    ``asyncio.IncompleteReadError`` on EOF inside a frame."""
    try:
        first = await asyncio.wait_for(reader.readexactly(1), idle_timeout)
    except asyncio.IncompleteReadError:
        return None
    rest = await asyncio.wait_for(reader.readexactly(3), read_timeout)
    (length,) = HEADER.unpack(first + rest)
    if length > max_frame:
        raise FrameTooLarge(length, max_frame)
    return await asyncio.wait_for(reader.readexactly(length), read_timeout)
