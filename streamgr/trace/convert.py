"""Dataset converters: interaction logs -> streamgr traces.

Each user's events in time order are cut into requests at gaps of more than ``gap_s`` seconds
(60 s, as MTServe cuts KuaiRand-1K); a request arrives at its last event's time and carries the
events new since the user's previous request. Raw item ids are remapped to dense ids 0..n-1 in
order of first appearance (the map is saved beside the trace as ``TRACE.items.tsv``).
Candidates the logs do not have are sampled uniformly (``candidates`` per request, seeded).

Memory stays bounded by a chunk of events plus one int per request: events are sorted in
chunks spilled to temporary files and merged; requests are spilled in user order and written
in time order by an index of (time, offset).
"""

from __future__ import annotations

import csv
import heapq
import io
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Iterator

import msgspec
import numpy as np

from ..progress import Progress
from .format import Header, RankEvent, TraceWriter, WholeFile, check_output

KUAIRAND_COLUMNS = ("user_id", "video_id", "date", "hourmin", "time_ms", "is_click", "is_like",
                    "is_follow", "is_comment", "is_forward", "is_hate", "long_view",
                    "play_time_ms", "duration_ms", "profile_stay_time", "comment_stay_time",
                    "is_profile_enter", "is_rand", "tab")
# Feedback columns -> action bits (the action token is their bitmask: 0..255).
KUAIRAND_ACTION_BITS = ("is_click", "is_like", "is_follow", "is_comment", "is_forward", "is_hate",
                        "long_view", "is_profile_enter")


class ConvertError(ValueError):
    """A bad input row; the message names the file and line."""


Event = tuple[int, float, int, int]  # (user index, time s, dense item, action)


class _Progress(io.RawIOBase):
    """A binary file wrapper that advances a progress bar by the bytes read."""

    def __init__(self, f, bar: Progress) -> None:
        self.f, self.bar = f, bar

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
        self.bar.update(n or 0)
        return n


def _lines(paths: list[Path], label: str, progress: bool) -> Iterator[tuple[Path, int, str]]:
    total = sum(p.stat().st_size for p in paths)
    with Progress(total, label, enabled=progress) as bar:
        for p in paths:
            with open(p, "rb") as raw:
                text = io.TextIOWrapper(io.BufferedReader(_Progress(raw, bar)), encoding="utf-8",
                                        newline="")
                for n, line in enumerate(text, 1):
                    yield p, n, line


class _Ids:
    """Raw ids -> dense ints in order of first appearance."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def __call__(self, raw: str) -> int:
        i = self.ids.get(raw)
        if i is None:
            i = self.ids[raw] = len(self.ids)
        return i

    def raw(self) -> list[str]:
        return list(self.ids)


class _ExternalSort:
    """Sort (user, time, item, action) events in bounded memory: sorted chunks on disk, merged."""

    DTYPE = np.dtype([("u", "<i8"), ("t", "<f8"), ("i", "<i8"), ("a", "<i8")])

    def __init__(self, tmp: Path, chunk: int = 2_000_000) -> None:
        self.tmp, self.chunk = tmp, chunk
        self.buf: list[Event] = []
        self.files: list[Path] = []

    def add(self, ev: Event) -> None:
        self.buf.append(ev)
        if len(self.buf) >= self.chunk:
            self._spill()

    def _spill(self) -> None:
        if not self.buf:
            return
        arr = np.array(self.buf, dtype=self.DTYPE)
        arr.sort(order=["u", "t"], kind="stable")
        path = self.tmp / f"events{len(self.files)}.npy"
        np.save(path, arr)
        self.files.append(path)
        self.buf = []

    def merged(self) -> Iterator[Event]:
        self._spill()
        its = [map(tuple, np.load(p, mmap_mode="r").tolist()) for p in self.files]
        return heapq.merge(*its, key=lambda e: (e[0], e[1]))


def _requests(events: Iterable[Event], gap_s: float) -> Iterator[tuple[int, float, list, list]]:
    """Cut each user's (time-ordered) events into requests at gaps over ``gap_s``."""
    user, last_t, items, actions = None, 0.0, [], []
    for u, t, i, a in events:
        if u != user or t - last_t > gap_s:
            if items:
                yield user, last_t, items, actions
            user, items, actions = u, [], []
        items.append(int(i))
        actions.append(int(a))
        last_t = t
    if items:
        yield user, last_t, items, actions


def _write(events: Iterable[Event], users: _Ids, items: _Ids, out: Path, source: str,
           num_actions: int, candidates: int, seed: int, gap_s: float, tmp: Path) -> Header:
    """Requests spilled in user order, then written in time order."""
    spill_path = tmp / "requests.bin"
    enc = msgspec.msgpack.Encoder()
    times, offsets = [], []
    with open(spill_path, "wb") as spill:
        for u, t, its, acts in _requests(events, gap_s):
            offsets.append(spill.tell())
            times.append(t)
            body = enc.encode((u, t, its, acts))
            spill.write(len(body).to_bytes(4, "big") + body)
    n_items = len(items.ids)
    rng = np.random.default_rng(seed)
    raw_users = users.raw()
    t0 = min(times) if times else 0.0
    order = np.argsort(np.asarray(times), kind="stable")
    header = Header(kind="rank", source=source, num_items=n_items, num_actions=num_actions,
                    users=len(raw_users), records=len(order), item_map=out.name + ".items.tsv")
    # The trace and its item map replace what the path held only once both are written (an
    # interrupted conversion leaves neither half written nor a map of another trace).
    with open(spill_path, "rb") as spill, TraceWriter(out, header) as w, \
            WholeFile(out.parent / header.item_map, "w") as f:
        for k in order:
            spill.seek(offsets[k])
            n = int.from_bytes(spill.read(4), "big")
            u, t, its, acts = msgspec.msgpack.decode(spill.read(n))
            cands = rng.choice(n_items, size=min(candidates, n_items), replace=False).tolist() \
                if candidates else []
            raw = raw_users[u]
            w.write(RankEvent(t - t0, int(raw) if raw.isdigit() else raw, its, acts, cands))
        f.write("dense_id\traw_id\n")
        for dense, raw in enumerate(items.raw()):
            f.write(f"{dense}\t{raw}\n")
    return header


def _convert(out: str | Path, source: str, num_actions: int, candidates: int, seed: int,
             gap_s: float, rows: Callable[[_ExternalSort, _Ids, _Ids], None]) -> Header:
    if candidates < 0:  # before reading the log
        raise ConvertError(f"--candidates must be >= 0 (0: the replay samples them), got "
                           f"{candidates}")
    out = Path(out)
    check_output(out)  # before the log is read, not after
    with tempfile.TemporaryDirectory(prefix="streamgr-convert-") as tmpdir:
        tmp = Path(tmpdir)
        sorter, users, items = _ExternalSort(tmp), _Ids(), _Ids()
        rows(sorter, users, items)
        return _write(sorter.merged(), users, items, out, source, num_actions, candidates, seed,
                      gap_s, tmp)


def _int(path: Path, line: int, name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConvertError(f"{path}:{line}: `{name}` is not an integer: {value!r}") from None


def _num(path: Path, line: int, name: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConvertError(f"{path}:{line}: `{name}` is not a number: {value!r}") from None


def convert_kuairand(logs: list[str | Path], out: str | Path, candidates: int = 0, seed: int = 0,
                     gap_s: float = 60.0, progress: bool = True) -> Header:
    """KuaiRand-1K ``log_standard_*.csv`` files -> a rank trace (action = feedback bitmask)."""
    paths = [Path(p) for p in logs]

    def rows(sorter, users, items):
        header: list[str] | None = None
        for path, n, line in _lines(paths, "convert kuairand", progress):
            fields = next(csv.reader([line]))
            if n == 1:
                missing = [c for c in ("user_id", "video_id", "time_ms", *KUAIRAND_ACTION_BITS)
                           if c not in fields]
                if missing:
                    raise ConvertError(f"{path}:1: not a KuaiRand log: missing columns {missing}")
                header = fields
                col = {c: fields.index(c) for c in fields}
                continue
            if not fields:
                continue
            if len(fields) != len(header):
                raise ConvertError(f"{path}:{n}: {len(fields)} fields, the header has {len(header)}")
            action = 0
            for bit, c in enumerate(KUAIRAND_ACTION_BITS):
                if _int(path, n, c, fields[col[c]]):
                    action |= 1 << bit
            t = _int(path, n, "time_ms", fields[col["time_ms"]]) / 1e3
            sorter.add((users(fields[col["user_id"]]), t, items(fields[col["video_id"]]), action))

    return _convert(out, f"kuairand:{','.join(p.name for p in paths)}", 256, candidates, seed,
                    gap_s, rows)


def convert_movielens(path: str | Path, out: str | Path, candidates: int = 0, seed: int = 0,
                      gap_s: float = 60.0, progress: bool = True) -> Header:
    """MovieLens ``u.data`` (tab-separated) or ``ratings.csv`` (header ``userId,movieId,...`` or
    ``user_id,item_id,...``) -> a rank trace. The action token is the rating in half stars."""
    path = Path(path)

    def rows(sorter, users, items):
        cols = None
        for p, n, line in _lines([path], "convert movielens", progress):
            line = line.strip()
            if not line:
                continue
            if cols is None and n == 1 and not line.split(",")[0].split("\t")[0].isdigit():
                names = [c.strip() for c in line.split(",")]
                spell = [("userId", "movieId"), ("user_id", "item_id")]
                found = next((s for s in spell if all(c in names for c in s)), None)
                if found is None or "rating" not in names or "timestamp" not in names:
                    raise ConvertError(f"{p}:1: unknown header {names}: expected "
                                       f"userId,movieId,rating,timestamp or user_id,item_id,...")
                cols = [names.index(found[0]), names.index(found[1]), names.index("rating"),
                        names.index("timestamp")]
                continue
            fields = line.split("\t") if "\t" in line else line.split(",")
            idx = cols or [0, 1, 2, 3]
            if len(fields) < 4:
                raise ConvertError(f"{p}:{n}: expected user, item, rating, timestamp; got {line!r}")
            rating = _num(p, n, "rating", fields[idx[2]])
            if not 0 <= rating <= 10:
                raise ConvertError(f"{p}:{n}: rating {rating} out of range")
            t = _num(p, n, "timestamp", fields[idx[3]])
            _int(p, n, "user", fields[idx[0]])
            sorter.add((users(fields[idx[0]]), t, items(fields[idx[1]]), int(round(rating * 2))))

    return _convert(out, f"movielens:{path.name}", 21, candidates, seed, gap_s, rows)


def convert_sequences(path: str | Path, out: str | Path, candidates: int = 0, seed: int = 0,
                      event_gap_s: float = 120.0, progress: bool = True) -> Header:
    """One user per line, ``user item item ...`` in time order, no times (Amazon Beauty as used
    by S3-Rec/TIGER). Synthetic times: a user's events ``event_gap_s`` apart (each its own
    request with the 60 s cut), users staggered by one second. Action token 0."""
    path = Path(path)

    def rows(sorter, users, items):
        for p, n, line in _lines([path], "convert sequences", progress):
            fields = line.split()
            if not fields:
                continue
            if len(fields) < 2:
                raise ConvertError(f"{p}:{n}: a user with no items: {line.strip()!r}")
            u = users(fields[0])
            for j, raw in enumerate(fields[1:]):
                sorter.add((u, float(u) + j * event_gap_s, items(raw), 0))

    return _convert(out, f"sequences:{path.name}", 1, candidates, seed, 60.0, rows)
