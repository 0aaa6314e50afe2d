"""Request fields checked at admission, for rank and generate alike: user ids, ints in a range
and id lists, with numpy's integer scalars and arrays (and tuples) taken as the Python ints
and lists they equal; anything else is a typed ``InvalidRequest`` naming the field."""

from __future__ import annotations

import numbers
from typing import Callable

import numpy as np

from ..errors import IdOutOfRange, InvalidRequest

MAX_EXCLUDE = 4096  # items in one request's deny list
MAX_USER_ID = 1024  # characters of a str user id


def check_user_id(user_id) -> int | str:
    """A user id is an int of the wire's range (int64 or uint64) or a str of at most
    ``MAX_USER_ID`` characters: the caches key their entries by it and count a user's entry as
    a few dozen events, so a megabyte id per user would slip past their memory bounds.
    Returns it as served: a numpy integer as the Python int it equals."""
    if isinstance(user_id, bool) or not isinstance(user_id, (numbers.Integral, str)):
        raise InvalidRequest("`user_id` must be an int or a str")
    if not isinstance(user_id, str):
        user_id = int(user_id)
    if isinstance(user_id, str) and len(user_id) > MAX_USER_ID:
        raise InvalidRequest(f"`user_id` is a str of {len(user_id)} characters, at most "
                             f"{MAX_USER_ID}")
    if isinstance(user_id, int) and not -2**63 <= user_id < 2**64:
        raise InvalidRequest("`user_id` is an int outside int64/uint64")
    return user_id


def int_in(x, lo: int, hi: int) -> bool:
    """An int (numpy's integer scalars too; not a bool) in ``lo..hi``."""
    return not isinstance(x, bool) and isinstance(x, numbers.Integral) and lo <= x <= hi


def as_list(xs) -> list | None:
    """A list, tuple or 1-d numpy array as a list (None for anything else)."""
    if isinstance(xs, np.ndarray):
        return xs.tolist() if xs.ndim == 1 else None
    return list(xs) if isinstance(xs, (list, tuple)) else None


def sized(x) -> int | None:
    """``len(x)``, or None for what has none (an iterator, a scalar: the conversion decides)."""
    try:
        return len(x)
    except TypeError:
        return None


def id_set(xs, name: str) -> np.ndarray | None:
    """A request's list of item ids (``id_array``'s forms) as a sorted unique array of at most
    ``MAX_EXCLUDE`` (None: not given)."""
    if xs is None:
        return None
    return np.unique(id_array(name, xs, -2**63, 2**63, (MAX_EXCLUDE, lambda n: InvalidRequest(
        f"`{name}` holds {n} item ids, at most {MAX_EXCLUDE}"))))


def id_array(name: str, value, low: int, high: int,
             most: tuple[int, Callable[[int], Exception]] | None = None) -> np.ndarray:
    """A request's ids (a list, or a numpy integer array read in place) as int64, each in
    ``low..high-1``: else ``IdOutOfRange`` naming the id as sent (never wrapped or rounded),
    or ``InvalidRequest`` for what is not a flat list of integers. ``most``: the most ids taken
    and the error for a count past it, raised from the length before any id is read where the
    value has one (3M ids in a list: ~85 ms of conversion otherwise)."""
    if most is not None and (n := sized(value)) is not None and n > most[0]:
        raise most[1](n)
    try:
        arr = np.asarray(value)
    except Exception:
        raise InvalidRequest(f"`{name}` is not a list of integers") from None
    if arr.ndim != 1:
        raise InvalidRequest(f"`{name}` must be a flat list of integers, got shape {arr.shape}")
    if most is not None and arr.size > most[0]:  # (an iterator's count)
        raise most[1](arr.size)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind in "fO" and all(type(v) is int for v in value):
            # ints past int64/uint64 (numpy fell back to float or object): out of range, said
            # as the id sent, never as a wrapped or rounded number
            bad = max(value, key=lambda v: v if v >= high else (-v if v < low else -1))
            raise IdOutOfRange(f"`{name}` holds id {bad}, outside [{low}, {high})")
        raise InvalidRequest(f"`{name}` must hold integers, got {arr.dtype}")
    if low == 0 and (arr.dtype.kind == "u" or high <= 1 << (8 * arr.itemsize - 1)) \
            and int(arr.view(f"u{arr.itemsize}").max()) < high:
        # one pass instead of min and max: read as unsigned, a negative id is at least
        # 2**(bits-1), so at least ``high``
        return arr.astype(np.int64, copy=False)
    lo, hi = int(arr.min()), int(arr.max())  # before any cast: 2**63 (uint64) stays itself
    if lo < low or hi >= high:
        bad = lo if lo < low else hi
        raise IdOutOfRange(f"`{name}` holds id {bad}, outside [{low}, {high})")
    return arr.astype(np.int64, copy=False)
