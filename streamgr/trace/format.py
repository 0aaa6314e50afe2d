"""The trace file format (docs/trace-format.md): a versioned header, then a stream of records.

Every frame is a 4-byte big-endian length and a MessagePack body (the socket protocol's
framing), so a trace of any size is written and read in constant memory. The first frame is a
``Header``; every other frame is a ``RankEvent`` or a ``GenerateEvent`` (array-like, tagged),
in arrival order.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
from pathlib import Path
from typing import Iterator, Union

import msgspec

FORMAT = "streamgr-trace"
VERSION = 1
_LEN = struct.Struct(">I")


class Header(msgspec.Struct, kw_only=True):
    format: str = FORMAT
    version: int = VERSION
    kind: str = "rank"  # "rank" | "generate"
    source: str = ""  # what it was made from (converter + input files, or synth profile)
    created: float = msgspec.field(default_factory=time.time)
    num_items: int = 0  # dense item ids are 0..num_items-1
    num_actions: int = 0  # action tokens are 0..num_actions-1
    users: int = 0
    records: int = 0  # 0 when unknown at writing time
    item_map: str = ""  # file beside the trace mapping dense ids back to raw ids


class RankEvent(msgspec.Struct, array_like=True, tag=1):
    time: float  # seconds since the trace start
    user: Union[int, str]
    items: list[int]  # events new since the user's previous request
    actions: list[int]
    candidates: list[int]  # empty: the replay samples them


class GenerateEvent(msgspec.Struct, array_like=True, tag=2):
    time: float
    user: Union[int, str]
    items: list[int]  # history items new since the user's previous request
    top_k: int
    beam_width: Union[int, None] = None


Record = Union[RankEvent, GenerateEvent]


class TraceError(ValueError):
    pass


def check_output(path: str | Path, flag: str = "-o") -> None:
    """Refuse, before any long work, an output path that could not be written at its end: a
    folder, or one in a folder that is missing or not writable (a replay's results would be
    lost after it ran)."""
    p = Path(path)
    folder = p.parent
    if p.is_dir():
        raise TraceError(f"{flag} {p}: is a folder; give a file path")
    if not folder.is_dir():
        raise TraceError(f"{flag} {p}: no folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise TraceError(f"{flag} {p}: the folder {folder} is not writable")


class WholeFile:
    """A file written beside ``path`` and renamed over it by ``commit`` (the clean end of a
    ``with`` block), or removed by ``discard`` (an exception): an interrupted write (Ctrl-C, a
    kill, a full disk) leaves no half file at ``path``, nor half of the one it replaced."""

    def __init__(self, path: str | Path, mode: str = "wb") -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        try:
            self.f = open(self.tmp, mode)
        except OSError as err:  # (named as the file asked for, not its temporary twin)
            raise OSError(err.errno, f"writing {self.path}: {err.strerror}") from None

    def commit(self) -> None:
        if not self.f.closed:
            self.f.close()
            os.replace(self.tmp, self.path)

    def discard(self) -> None:
        if not self.f.closed:
            self.f.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)

    def __enter__(self):
        return self.f

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


class TraceWriter:
    """A trace file, in place at ``path`` only once closed whole (``WholeFile``)."""

    def __init__(self, path: str | Path, header: Header) -> None:
        self.path = Path(path)
        self._out = WholeFile(self.path)
        self._f = self._out.f
        self._enc = msgspec.msgpack.Encoder()
        self.count = 0
        try:
            self._write(header)
        except BaseException:
            self._out.discard()
            raise

    def _write(self, obj) -> None:
        body = self._enc.encode(obj)
        self._f.write(_LEN.pack(len(body)))
        self._f.write(body)

    def write(self, record) -> None:
        self._write(record)
        self.count += 1

    def close(self) -> None:
        self._out.commit()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self._out.commit()
        else:
            self._out.discard()


MAX_FRAME = 1 << 28  # a record holds one request: megabytes at most


def _frames(f, path) -> Iterator[bytes]:
    """The length-prefixed frames of ``f``; a short one names the file and the frame (frame 0
    is the header: a file that is not a trace usually fails there)."""
    i = 0
    while True:
        head = f.read(4)
        if not head:
            return
        what = "the header (not a streamgr trace?)" if i == 0 else f"record {i - 1}"
        if len(head) < 4:
            raise TraceError(f"{path}: {what} is cut short (a truncated frame header)")
        (n,) = _LEN.unpack(head)
        if n > MAX_FRAME:  # (not read: a text file's first bytes read as a length are ~2 GB)
            raise TraceError(f"{path}: {what} claims {n} bytes, more than any trace frame "
                             f"({MAX_FRAME})")
        body = f.read(n)
        if len(body) < n:
            raise TraceError(f"{path}: {what} is cut short ({len(body)} of {n} bytes)")
        yield body
        i += 1


def read_header(path: str | Path) -> Header:
    with open(path, "rb") as f:
        first = next(_frames(f, path), None)
    if first is None:
        raise TraceError(f"{path}: empty file, not a trace")
    try:
        header = msgspec.msgpack.decode(first, type=Header)
    except msgspec.DecodeError as err:
        raise TraceError(f"{path}: not a streamgr trace ({err})") from None
    if header.format != FORMAT:
        raise TraceError(f"{path}: not a streamgr trace (format {header.format!r})")
    if header.version > VERSION:
        raise TraceError(f"{path}: trace version {header.version}, this streamgr reads "
                         f"up to {VERSION}")
    return header


def read_trace(path: str | Path) -> Iterator[Record]:
    """The records of a trace, streamed (the header is checked, not yielded)."""
    read_header(path)
    dec = msgspec.msgpack.Decoder(Record)
    with open(path, "rb") as f:
        frames = _frames(f, path)
        next(frames)
        for i, body in enumerate(frames):
            try:
                yield dec.decode(body)
            except msgspec.DecodeError as err:
                raise TraceError(f"{path}: record {i}: {err}") from None
