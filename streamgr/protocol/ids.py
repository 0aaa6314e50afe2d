"""Ids as the client puts them on the wire: lists of ints, or packed ids
(``messages.CAP_PACKED_IDS``). Imports no numpy (a client-only install has none): a numpy array
is read through its own methods. The server's side is ``server.server.unpacked``."""

from __future__ import annotations


def as_list(x) -> list[int]:
    """A list of Python ints from a list or a numpy array (msgspec encodes no numpy scalars)."""
    return x.tolist() if hasattr(x, "tolist") else list(x)


def wire_ids(x, packed: bool):
    """Request ids for the wire: a numpy integer array as packed ids (little-endian
    int64 bytes, where the server takes them: ``messages.CAP_PACKED_IDS``), anything else as a
    list. Without importing numpy (a client-only install has none): the array's own methods.
    Values an int64 cannot hold go as a list, so the server names them as they were sent."""
    kind = getattr(getattr(x, "dtype", None), "kind", "")
    if packed and kind in "iu" and kind and getattr(x, "ndim", 0) == 1 and (
            kind == "i" or x.size == 0 or int(x.max()) < 1 << 63):
        return x.astype("<i8", copy=False).tobytes()
    return as_list(x)
