"""Host-side planning of the jagged HSTU attention (the CUDA side runs what this plans).

A batch's query rows are cut into row tiles of BM = 128 (with tails: a user's last <= 16 rows
past a full tile join it), each tile's visible keys into chunks of KC absolute positions; the
work items are (tile, key range) with fp32 slots that the merge adds in chunk order. The tile
and chunk constants (and their A/B knobs from the environment) live here because the plan and
the kernels must agree on them: ``hstu_attention_cuda`` compiles them into the kernels.
``Capacity`` and ``pad_plan`` lay a plan into the fixed-size buffers a CUDA graph replays.
The planning runs compiled (``hstu_plan_jit``, Numba's CPU JIT: numpy's per-call overhead was
most of a cached batch's host planning); the numpy functions here (``*_reference``) are what
the tests hold it to, and what runs where Numba cannot be imported.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
from dataclasses import dataclass

import numpy as np

from ..errors import StreamgrError

log = logging.getLogger("streamgr.kernels")

BM, TAIL = 128, 16  # rows per tile, most rows a tile's tail may add (the .cu's BM, TAIL)
SR = BM + TAIL  # rows per workspace slot (tiles with tails need them; allocated either way)


def _env_ints(name: str, default: str, form: str) -> list[int]:
    """An A/B knob of integers joined by ``x`` (``64x2x32``), as many as ``form`` names."""
    raw = os.environ.get(name, default)
    try:
        vals = [int(x) for x in raw.lower().split("x")]
    except ValueError:
        vals = []
    if len(vals) != form.count("x") + 1:
        raise StreamgrError(f"{name}={raw!r}: expected {form}, e.g. {default}")
    return vals


def _tile_config() -> tuple[int, int, int]:
    """Keys per K/V tile, cp.async stages and keys per compute step, compiled into the kernel
    as HSTU_BN/HSTU_STAGES/HSTU_SUB. ``STREAMGR_HSTU_TILE=32x3x32`` picks another for A/B
    benchmarks (the default: 64-key tiles, two stages, computed 32 keys at a time, which keeps
    the D = 128 kernels within their registers)."""
    bn, stages, sub = _env_ints("STREAMGR_HSTU_TILE", "64x2x32", "KEYSxSTAGESxSTEP")
    if bn not in (32, 64) or stages not in (2, 3, 4) or sub not in (32, 64) or sub > bn:
        raise StreamgrError("STREAMGR_HSTU_TILE: keys 32 or 64, stages 2-4, step <= keys")
    return bn, stages, sub


def _chunk_keys() -> int:
    """Keys per chunk, the unit of the split and of the fold (HSTU_KC). A cached batch writes
    one fp32 partial per (row tile, chunk) and the merge reads them back, so longer chunks mean
    fewer partials but fewer, longer blocks; ``STREAMGR_HSTU_KC=1024`` picks another for A/B
    benchmarks (docs/benchmarks.md). Cached and recompute agree bit for bit under any one value."""
    (kc,) = _env_ints("STREAMGR_HSTU_KC", "512", "KEYS")
    if kc not in (256, 512, 1024, 2048, 4096):
        raise StreamgrError("STREAMGR_HSTU_KC: 256, 512, 1024, 2048 or 4096")
    return kc


def _tails() -> bool:
    """Tiles with tails (the default; ``STREAMGR_HSTU_TAIL=0`` for A/B): a user's last <= 16
    rows past a full tile join that tile (computed on its K/V tiles by all four warps) instead
    of a block of their own: cached batch 8 0.178 -> 0.160 ms on the H200 (docs/benchmarks.md)."""
    (on,) = _env_ints("STREAMGR_HSTU_TAIL", "1", "FLAG")
    if on not in (0, 1):
        raise StreamgrError("STREAMGR_HSTU_TAIL: 0 or 1")
    return bool(on)


BN, STAGES, SUB = _tile_config()
KC = _chunk_keys()
TAILS = _tails()


def _cdiv(a, b):
    return -(-a // b)


@dataclass
class HostPlan:
    """A batch's work items as host int arrays, before they go to the device."""

    split: bool
    items: np.ndarray  # [5, n]: user, row0, kt0, kt1, slot: one column per CUDA block row
    users: np.ndarray  # [6, users]: q_start, hist, new, cand, paged, kv_row
    page_ptr: np.ndarray  # users + 1
    pages: np.ndarray
    fin: np.ndarray  # [4, tiles]: user, row0, slot0, nslots per row tile (the merge)
    n_slots: int
    max_rows: int = BM  # SR when tiles carry tails


def page_csr(desc) -> tuple[np.ndarray, np.ndarray]:
    """The batch's page table as CSR: ``page_ptr`` [users + 1] and the flat page ids (one dummy
    entry when no user is paged, so the device array is never empty). Built once per batch
    (kept with ``desc``): the runner's page slots and the attention plans both read it."""
    csr = desc._cache.get("csr")
    if csr is None:
        csr = desc._cache["csr"] = _page_csr(desc)
    return csr


def _page_csr(desc) -> tuple[np.ndarray, np.ndarray]:
    return csr_of(desc.pages, desc.paged)


def csr_of(pages: list, flags: list[bool]) -> tuple[np.ndarray, np.ndarray]:
    """``page_csr`` of the users whose ``flags`` are set (the others get no pages)."""
    page_ptr = np.zeros(len(pages) + 1, dtype=np.int64)
    page_ptr[1:] = np.cumsum([len(p) if f else 0 for p, f in zip(pages, flags)])
    n = int(page_ptr[-1])
    if not n:
        return page_ptr, np.zeros(1, dtype=np.int64)
    paged = [p for p, f in zip(pages, flags) if f and len(p)]
    if all(isinstance(p, np.ndarray) for p in paged):  # the cached runner's page arrays
        return page_ptr, np.concatenate(paged).astype(np.int64, copy=False)
    return page_ptr, np.fromiter(  # ~2x faster than a list comprehension over the ids
        itertools.chain.from_iterable(paged), dtype=np.int64, count=n)


@functools.lru_cache(maxsize=1)
def _jit():
    """The compiled planner, or None where Numba cannot be imported (then numpy plans)."""
    try:
        from . import hstu_plan_jit
        return hstu_plan_jit
    except Exception as err:  # noqa: BLE001 - e.g. a numpy this numba does not support
        log.warning("batch planning runs in numpy: numba is not importable (%s)", err)
        return None


def plan_host(desc, heads: int, sms: int = 132, force: str | None = None,
              tails: bool = False, cand_only: bool = False) -> HostPlan:
    """Work items of one batch (``force``: ``"split"`` or ``"direct"`` for tests and benches;
    ``tails``: a user's last <= TAIL rows past a full tile join that tile; ``cand_only``: only
    the row tiles that hold a candidate, for a layer whose other rows nobody reads: the model's
    last, where a recompute's whole causal history is otherwise attended once more for
    nothing). Dropping tiles changes no row's bits: a row's sums run over its keys' chunks in
    key order whatever tile it is in."""
    if _jit() is None:
        return plan_host_reference(desc, heads, sms, force, tails, cand_only)
    return _JitTiles(desc, tails).plan(desc, heads, sms, force, cand_only)


def plan_host_pair(desc, heads: int, sms: int = 132,
                   tails: bool = False) -> tuple[HostPlan, HostPlan | None]:
    """The plans of every layer but the last and of the last (``cand_only``) from one tiling;
    None for the last when it would drop no tile (then it is the first)."""
    if _jit() is None:
        return plan_host_pair_reference(desc, heads, sms, tails)
    t = _JitTiles(desc, tails)
    last = None if t.all_hold_candidates() else t.plan(desc, heads, sms, None, True)
    return t.plan(desc, heads, sms, None, False), last


def plan_host_reference(desc, heads: int, sms: int = 132, force: str | None = None,
                        tails: bool = False, cand_only: bool = False) -> HostPlan:
    """:func:`plan_host` in numpy."""
    t = _Tiles(desc, tails)
    return t.plan(desc, heads, sms, force, t.with_candidates() if cand_only else None)


def plan_host_pair_reference(desc, heads: int, sms: int = 132,
                             tails: bool = False) -> tuple[HostPlan, HostPlan | None]:
    """:func:`plan_host_pair` in numpy."""
    t = _Tiles(desc, tails)
    keep = t.with_candidates()
    last = None if keep.all() else t.plan(desc, heads, sms, None, keep)
    return t.plan(desc, heads, sms, None, None), last


def _users(desc, q_off, hist, new, cand) -> np.ndarray:
    return np.stack([q_off[:-1], hist, new, cand, np.asarray(desc.paged, dtype=np.int64),
                     np.asarray(desc.kv_rows, dtype=np.int64)])


class _JitTiles:
    """:class:`_Tiles` through the compiled planner."""

    def __init__(self, desc, tails: bool) -> None:
        jit = _jit()
        self.q_off = np.asarray(desc.q_offsets, dtype=np.int64)
        self.cand = np.asarray(desc.num_candidates, dtype=np.int64)
        self.hist = np.asarray(desc.hist_lens, dtype=np.int64)
        self.max_rows = SR if tails else BM
        self.user, self.row0, self.nrows, self.new = jit.tiles(
            self.q_off, self.cand, tails, BM, TAIL, self.max_rows)
        self.users = None  # the per-user arrays, once for both plans

    def all_hold_candidates(self) -> bool:
        return bool(_jit().all_hold(self.user, self.row0, self.nrows, self.new))

    def plan(self, desc, heads: int, sms: int, force: str | None, cand_only: bool) -> HostPlan:
        f = -1 if force is None else int(force == "split")
        split, items, fin, n_slots = _jit().plan(self.user, self.row0, self.nrows, self.new,
                                                 self.hist, cand_only, heads, sms, f, BN, KC)
        if self.users is None:
            self.users = _users(desc, self.q_off, self.hist, self.new, self.cand)
        page_ptr, pages = page_csr(desc)
        return HostPlan(bool(split), items, self.users, page_ptr, pages, fin, int(n_slots),
                        self.max_rows)


class _Tiles:
    """A batch's row tiles: each one's user, first row and row count."""

    def __init__(self, desc, tails: bool) -> None:
        self.q_off = np.asarray(desc.q_offsets, dtype=np.int64)
        self.cand = np.asarray(desc.num_candidates, dtype=np.int64)
        self.hist = np.asarray(desc.hist_lens, dtype=np.int64)
        rows = self.q_off[1:] - self.q_off[:-1]
        self.new = rows - self.cand
        tiles = _cdiv(rows, BM)
        if tails:
            tiles = tiles - ((tiles > 1) & (rows - (tiles - 1) * BM <= TAIL))
        self.max_rows = SR if tails else BM
        self.user = np.repeat(np.arange(len(rows)), tiles)
        self.row0 = (np.arange(tiles.sum()) - np.repeat(np.cumsum(tiles) - tiles, tiles)) * BM
        left = rows[self.user] - self.row0
        # the kernels' rule (tile_rows, hstu_slots.cuh)
        self.nrows = np.where(left <= self.max_rows, left, BM)

    def with_candidates(self) -> np.ndarray:
        return self.row0 + self.nrows > self.new[self.user]

    def plan(self, desc, heads: int, sms: int, force: str | None,
             keep: np.ndarray | None) -> HostPlan:
        user, row0, nrows = self.user, self.row0, self.nrows
        if keep is not None:
            user, row0, nrows = user[keep], row0[keep], nrows[keep]
        hist, new = self.hist, self.new
        start = hist[user] - new[user]
        key_lim = np.where(row0 + nrows > new[user], hist[user], start + row0 + nrows)
        n_kt = _cdiv(key_lim, BN)
        n_chunks = _cdiv(key_lim, KC)
        if force is not None:
            split = force == "split"
        else:  # split when one tile's keys are well over a balanced share of two blocks per SM
            share = n_kt.sum() * heads / (2 * sms)
            split = bool(len(n_kt)) and n_chunks.max() > 1 and n_kt.max() > 1.5 * share
        if split:
            item_tile = np.repeat(np.arange(len(n_kt)), n_chunks)
            slot0 = np.cumsum(n_chunks) - n_chunks
            chunk = np.arange(n_chunks.sum()) - np.repeat(slot0, n_chunks)
            kt0 = chunk * (KC // BN)
            kt1 = np.minimum(kt0 + KC // BN, n_kt[item_tile])
            slot = np.arange(n_chunks.sum())
            # longest first; a chunk's row tiles of one user side by side (they share its K/V in L2)
            order = np.lexsort((item_tile, chunk, user[item_tile], -(kt1 - kt0)))
            item_tile, kt0, kt1, slot = item_tile[order], kt0[order], kt1[order], slot[order]
            fin = [user, row0, slot0, n_chunks]
            n_slots = int(n_chunks.sum())
        else:  # one slot per tile; tiles without keys only merge (their own keys)
            item_tile = np.argsort(-n_kt, kind="stable")
            kt0, kt1 = np.zeros_like(item_tile), n_kt[item_tile]
            slot = item_tile.copy()
            fin = [user, row0, np.arange(len(n_kt)), (n_kt > 0).astype(np.int64)]
            n_slots = len(n_kt)
        page_ptr, flat = page_csr(desc)
        return HostPlan(split, np.stack([user[item_tile], row0[item_tile], kt0, kt1, slot]),
                        _users(desc, self.q_off, hist, new, self.cand), page_ptr, flat,
                        np.stack(fin), n_slots, self.max_rows)


@dataclass
class Capacity:
    """Fixed sizes of a captured plan (a CUDA graph replays one grid): items, users (the
    batch's maximum), pages, merge rows, workspace slots."""

    items: int
    users: int
    pages: int
    fin: int
    slots: int

    @property
    def sizes(self) -> list[int]:
        u = self.users + 1  # + a user with no rows: padding items point at it
        return [self.items] * 5 + [u] * 6 + [u + 1, self.pages] + [self.fin] * 4


def pad_plan(hp: HostPlan, cap: Capacity, out: np.ndarray) -> None:
    """Write ``hp`` into ``out`` (int32, ``sum(cap.sizes)``) at the capacity's layout. Padding
    items and merge rows belong to the empty user, so their blocks write nothing."""
    jit = _jit()
    if jit is None:
        return pad_plan_reference(hp, cap, out)
    jit.pad(hp.items, hp.users, hp.page_ptr, hp.pages, hp.fin, cap.items, cap.users, cap.pages,
            cap.fin, out)


def pad_plan_reference(hp: HostPlan, cap: Capacity, out: np.ndarray) -> None:
    """:func:`pad_plan` in numpy."""
    empty = cap.users
    fills = [empty, 0, 0, 0, 0] + [0] * 6 + [int(hp.page_ptr[-1]), 0] + [empty, 0, 0, 0]
    arrays = list(hp.items) + list(hp.users) + [hp.page_ptr, hp.pages] + list(hp.fin)
    o = 0
    for a, fill, size in zip(arrays, fills, cap.sizes):
        n = len(a)
        if n > size:
            raise ValueError("plan larger than its capacity")
        out[o:o + n] = a
        out[o + n:o + size] = fill
        o += size


def warm() -> None:
    """Compile the planner now (a few seconds the first time; Numba caches it on disk), not
    in the first batch."""
    from .hstu_attention import JaggedKV
    desc = JaggedKV([0, 3, 300], [2, 150], [40, 300], [True, False], [0, 3], [[0, 1], []], 32)
    for tails in (False, True):
        for hp in plan_host_pair(desc, 2, 4, tails=tails) + (
                plan_host(desc, 2, 4, "split", tails), plan_host(desc, 2, 4, "direct", tails)):
            if hp is not None:
                cap = Capacity(items=max(1, hp.items.shape[1]), users=2, pages=4,
                               fin=max(1, hp.fin.shape[1]), slots=max(1, hp.n_slots))
                pad_plan(hp, cap, np.empty(sum(cap.sizes), dtype=np.int32))
