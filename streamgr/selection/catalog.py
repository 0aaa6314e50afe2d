"""The catalog: items and their semantic IDs, as files, arrays and live-update deltas.

Catalog files: CSV with a header ``item_id,s1,s2,...`` or ``.npy`` of shape [items, 1 + depth]
(item id first), int64 ids and codes. Each item id once (one SID an item); one SID may name
several items. ``check_catalog`` holds a catalog to that and to its codebooks; ``apply_delta``
derives the catalog of a live update's removals and additions.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from ..errors import ContractError


@dataclass
class Catalog:
    item_ids: np.ndarray  # [n] int64, catalog order
    sids: np.ndarray  # [n, depth] int64 codes
    # The rows in stable lexicographic SID order, once computed (``sid_order``): a catalog
    # derived by removals takes it from its parent instead of sorting again.
    _sid_order: np.ndarray | None = None
    # Each id once, as ``check_catalog`` found (a delta of a checked catalog keeps it so).
    ids_distinct: bool = False

    @property
    def depth(self) -> int:
        return self.sids.shape[1]

    def sid_order(self) -> np.ndarray:
        """Row indices in stable lexicographic order of the SIDs (items with one SID stay in
        catalog order): ~0.3 s for a million items, kept."""
        if self._sid_order is None:
            self._sid_order = np.lexsort(self.sids.T[::-1])
        return self._sid_order


def load_catalog(path: str | Path, codebook_sizes: list[int]) -> Catalog:
    path = Path(path)
    if not path.is_file():
        raise ContractError(f"catalog.path: no such file {path}")
    if path.suffix == ".npy":
        arr = np.load(path)
        if arr.ndim != 2 or arr.shape[1] < 2:
            raise ContractError(f"catalog.path: {path} must be [items, 1 + depth]")
        # (an astype alone would truncate floats and wrap uint64 ids past int64 to negatives)
        if not np.issubdtype(arr.dtype, np.integer) or (
                arr.size and arr.dtype == np.uint64 and arr.max() > np.iinfo(np.int64).max):
            raise ContractError(f"catalog.path: {path} must hold int64 ids and codes, got "
                                f"{arr.dtype}" + (" past int64" if arr.dtype == np.uint64 else ""))
        cat = Catalog(arr[:, 0].astype(np.int64), arr[:, 1:].astype(np.int64))
    else:
        with open(path) as f:
            header = f.readline().strip().split(",")
        if header[0] != "item_id" or any(h != f"s{i + 1}" for i, h in enumerate(header[1:])):
            raise ContractError(f"catalog.path: {path}: header must be item_id,s1,s2,..., got "
                                f"{','.join(header)}")
        try:
            with warnings.catch_warnings():  # (no rows: said below, not as numpy's warning)
                warnings.simplefilter("ignore", UserWarning)
                arr = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.int64, ndmin=2)
        except ValueError as err:
            raise ContractError(f"catalog.path: {path}: {err}") from None
        cat = Catalog(arr[:, 0], arr[:, 1:])
    if not len(cat.item_ids):
        raise ContractError(f"catalog.path: {path} holds no items")
    check_catalog(cat, codebook_sizes)
    return cat


def check_catalog(cat: Catalog, codebook_sizes: list[int]) -> None:
    """Codes inside their codebooks, and each item id once: an id under two SIDs would be
    answered twice and read from a history as either (``ContractError`` naming it)."""
    if cat.depth != len(codebook_sizes):
        raise ContractError(f"catalog.codebook_sizes: {len(codebook_sizes)} levels, the catalog's "
                            f"SIDs have {cat.depth}")
    for level, size in enumerate(codebook_sizes):
        col = cat.sids[:, level]
        bad = np.nonzero((col < 0) | (col >= size))[0]
        if bad.size:
            raise ContractError(f"catalog.s{level + 1}: item {cat.item_ids[bad[0]]} has code "
                                f"{col[bad[0]]}, outside codebook {level} of size {size}")
    if not cat.ids_distinct:
        s = np.sort(cat.item_ids)  # (~8 ms a million ids; once a catalog: deltas inherit it)
        dup = np.nonzero(s[1:] == s[:-1])[0]
        if dup.size:
            item = s[dup[0]]
            raise ContractError(f"catalog.item_id: item {item} appears "
                                f"{int(np.count_nonzero(cat.item_ids == item))} times (an item "
                                f"has one SID; {dup.size} repeats in all)")
        cat.ids_distinct = True


class CatalogDelta(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A change to a catalog: ``remove`` these item ids; ``add`` items with their SIDs (an id
    already in the catalog gets the new SID: a re-assignment). Removal first, then additions."""

    add: dict[int, list[int]] = msgspec.field(default_factory=dict)
    remove: list[int] = msgspec.field(default_factory=list)


def apply_delta(cat: Catalog, delta: CatalogDelta, codebook_sizes: list[int]) -> Catalog:
    """``cat`` with ``delta`` applied (a new Catalog; ``cat`` is left as it is). Removing an
    item the catalog lacks is a ContractError naming it (a typo must not pass silently)."""
    ids, sids, order = cat.item_ids, cat.sids, None
    if delta.remove:
        rm = _int64s("catalog.remove", delta.remove)
        # (not np.setdiff1d: it hashes the whole catalog, 0.65 s for a million items, holding
        # the GIL ~150 ms of it against the requests being served; one pass over the catalog,
        # the ids it lacks then found among the few it holds)
        keep = ~np.isin(ids, rm)
        missing = rm[~np.isin(rm, ids[~keep])]
        if missing.size:
            raise ContractError(f"catalog.remove: item {int(missing[0])} is not in the catalog")
        ids, sids = ids[keep], sids[keep]
        if not delta.add and cat._sid_order is not None:
            # Removal keeps the survivors' relative order, and a stable sort of a subsequence
            # is the subsequence of the stable sort: no new sort (the build of an update that
            # takes items down, beside serving).
            o = cat._sid_order
            order = (np.cumsum(keep) - 1)[o[keep[o]]]
    if delta.add:
        new_ids = _int64s("catalog.add", list(delta.add.keys()))
        try:
            new_sids = np.asarray(list(delta.add.values()))
        except ValueError:  # ragged
            new_sids = None
        if new_sids is None or new_sids.ndim != 2:
            raise ContractError("catalog.add: every SID must have the catalog's depth")
        if new_sids.dtype.kind not in "iu":  # (codes past int64 wrap: refused as outside)
            raise ContractError(f"catalog.add: SID codes must be ints, got {new_sids.dtype}")
        new_sids = new_sids.astype(np.int64, copy=False)
        if new_sids.shape[1] != cat.depth:
            raise ContractError(f"catalog.add: SIDs of {new_sids.shape[1]} codes, the catalog's "
                                f"have {cat.depth}")
        keep = ~np.isin(ids, new_ids)  # re-assigned items leave their old place
        ids = np.concatenate([ids[keep], new_ids])
        sids = np.concatenate([sids[keep], new_sids])
    # A removal keeps ids distinct, and so does an addition (an added id leaves its old row).
    out = Catalog(ids, sids, None if delta.add else order, ids_distinct=cat.ids_distinct)
    check_catalog(out, codebook_sizes)
    return out


def _int64s(field: str, ids) -> np.ndarray:
    """A delta's item ids as int64 (a ``CatalogDelta`` built in Python is not type-checked:
    floats would truncate, ids past int64 overflow)."""
    a = np.asarray(ids) if len(ids) else np.zeros(0, dtype=np.int64)
    if a.ndim != 1 or a.dtype.kind not in "iu" or (
            a.dtype.kind == "u" and a.size and a.max() > np.iinfo(np.int64).max):
        raise ContractError(f"{field}: item ids must be ints in the int64 range")
    return a.astype(np.int64, copy=False)


def random_catalog(n_items: int, codebook_sizes: list[int], seed: int,
                   distinct: bool = True) -> Catalog:
    """Items with random SIDs (distinct when asked, as WORKLOADS.md's gen-ref catalog)."""
    rng = np.random.default_rng(seed)
    total = int(np.prod(codebook_sizes))
    if distinct:
        if n_items > total:
            raise ValueError(f"{n_items} distinct SIDs do not fit codebooks {codebook_sizes}")
        flat = rng.choice(total, size=n_items, replace=False) if total < 2**62 else None
        sids = np.stack(np.unravel_index(flat, codebook_sizes), axis=1)
    else:
        sids = np.stack([rng.integers(c, size=n_items) for c in codebook_sizes], axis=1)
    return Catalog(np.arange(n_items, dtype=np.int64), sids.astype(np.int64))


def save_catalog(cat: Catalog, path: str | Path) -> None:
    path = Path(path)
    if path.suffix == ".npy":
        np.save(path, np.concatenate([cat.item_ids[:, None], cat.sids], axis=1))
        return
    header = "item_id," + ",".join(f"s{i + 1}" for i in range(cat.depth))
    np.savetxt(path, np.concatenate([cat.item_ids[:, None], cat.sids], axis=1), fmt="%d",
               delimiter=",", header=header, comments="")
