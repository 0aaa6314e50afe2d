"""``SidRows``: a generate answer's SIDs (``GenerateResult.sids``) as one int array, read as the
``list[list[int]]`` it stands for.

A gen-ref answer holds 256 items of 3 codes; building those lists (a list and three ints an
item) was ~80% of a batch's answer assembly, the largest piece of the host's time per request
(~600 us per 4,096 items on the CPU machine; docs/benchmarks.md, session 19), paid under the
GIL whether or not anyone reads them. A ``SidRows`` keeps the codes as the answer computed them
and makes the lists only when they are read (once, then cached); it compares equal to the
lists, iterates, indexes, pickles, and goes over the socket as msgpack built from the array in
one pass (``msgpack``, which the server splices into its reply as ``msgspec.Raw``): to a
decoder, the same as the lists' encoding.
It is a ``Sequence``, not a ``list``: encoders that take only lists (``json.dumps``,
``msgspec.json.encode`` of a result) need ``.tolist()`` or ``enc_hook`` here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class SidRows(Sequence):
    """Rows of SID codes over ``codes`` [items, depth] (non-negative ints)."""

    __slots__ = ("_a", "_list")

    def __init__(self, codes: np.ndarray) -> None:
        if codes.ndim != 2:
            raise ValueError(f"SidRows: codes must be [items, depth], got {codes.shape}")
        self._a = codes
        self._list: list[list[int]] | None = None

    def tolist(self) -> list[list[int]]:
        if self._list is None:
            self._list = self._a.tolist()
        return self._list

    def __array__(self, dtype=None, copy=None):
        return np.array(self._a, dtype=dtype, copy=True if copy else None)

    def __len__(self) -> int:
        return len(self._a)

    def __getitem__(self, i):
        return self.tolist()[i]

    def __iter__(self):
        return iter(self.tolist())

    def __eq__(self, other) -> bool:
        if isinstance(other, SidRows):
            return self._a.shape == other._a.shape and bool(np.array_equal(self._a, other._a))
        if isinstance(other, (list, tuple)):
            return self.tolist() == [list(x) for x in other]
        return NotImplemented

    __hash__ = None  # a sequence that compares equal to lists is not hashable

    def __repr__(self) -> str:
        return repr(self.tolist())

    def __reduce__(self):
        return SidRows, (np.ascontiguousarray(self._a),)

    def msgpack(self) -> bytes:
        """The rows as a msgpack array of arrays of unsigned ints (uint16 or uint32 fields, as
        wide as the largest code needs), built with numpy: what ``msgspec.Raw`` splices into
        a reply."""
        a = self._a
        n, d = a.shape
        if n and a.min() < 0:
            raise ValueError("SidRows.msgpack: negative codes")
        if d >= 16:
            raise ValueError("SidRows.msgpack: SIDs of 16 or more codes")
        top = int(a.max()) if n else 0
        if top >= 1 << 32:
            raise ValueError("SidRows.msgpack: codes of 32 bits or more")
        wide = top >= 1 << 16
        w = 4 if wide else 2
        rows = np.empty((n, 1 + d * (1 + w)), dtype=np.uint8)
        rows[:, 0] = 0x90 | d  # fixarray of d
        be = a.astype(">u4" if wide else ">u2").view(np.uint8).reshape(n, d, w)
        body = rows[:, 1:].reshape(n, d, 1 + w)
        body[:, :, 0] = 0xce if wide else 0xcd  # uint32 / uint16
        body[:, :, 1:] = be
        if n < 16:
            head = bytes([0x90 | n])
        elif n < 1 << 16:
            head = b"\xdc" + n.to_bytes(2, "big")
        else:
            head = b"\xdd" + n.to_bytes(4, "big")
        return head + rows.tobytes()


def enc_hook(obj):
    """For ``msgspec`` (or ``json``'s ``default``) encoding results: a ``SidRows`` as its lists;
    any other type is refused with the ``TypeError`` both encoders expect."""
    if isinstance(obj, SidRows):
        return obj.tolist()
    raise TypeError(f"cannot encode {type(obj).__name__}")
