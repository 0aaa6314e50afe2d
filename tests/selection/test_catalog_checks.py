"""What a catalog may hold (``selection.catalog``): each item id once, int64 ids and codes
inside their codebooks, at least one item; a file, a ``Catalog`` and a live update's delta are
held to the same rules, refused with a ``ContractError`` naming what is wrong."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from streamgr.config import PolicySpec
from streamgr.engine.updates import merged_policy
from streamgr.errors import ContractError
from streamgr.selection.vocabulary import SidTrie
from streamgr.selection.catalog import (Catalog, CatalogDelta, apply_delta, check_catalog,
                                       load_catalog, random_catalog)

SIZES = [4, 5]


def test_an_item_id_under_two_sids_is_refused_from_a_file_an_array_and_an_object(tmp_path):
    """Before, such a catalog served: a generate answer held that item twice (once per SID)
    and a history read it as either."""
    csv = tmp_path / "dup.csv"
    csv.write_text("item_id,s1,s2\n5,1,2\n6,1,3\n5,2,4\n")
    with pytest.raises(ContractError, match=r"catalog.item_id: item 5 appears 2 times"):
        load_catalog(csv, SIZES)
    npy = tmp_path / "dup.npy"
    np.save(npy, np.array([[9, 0, 0], [9, 1, 1], [9, 2, 2], [4, 3, 3]], dtype=np.int64))
    with pytest.raises(ContractError, match=r"item 9 appears 3 times"):
        load_catalog(npy, SIZES)
    cat = Catalog(np.array([1, 2, 2], dtype=np.int64), np.array([[0, 0], [0, 1], [1, 1]]))
    with pytest.raises(ContractError, match=r"item 2 appears 2 times"):
        check_catalog(cat, SIZES)
    assert not cat.ids_distinct


def test_distinct_ids_are_found_once_and_inherited_by_deltas():
    """A checked catalog is marked; a delta of it (removals, additions, a re-assigned id)
    keeps its ids distinct and inherits the mark, so a live update does not sort the
    catalog's ids again."""
    cat = random_catalog(300, SIZES, seed=1, distinct=False)
    check_catalog(cat, SIZES)
    assert cat.ids_distinct
    ids = cat.item_ids.tolist()
    child = apply_delta(cat, CatalogDelta(remove=ids[:7], add={ids[10]: [3, 4], 10**6: [0, 0]}),
                        SIZES)
    assert child.ids_distinct
    assert len(np.unique(child.item_ids)) == len(child.item_ids) == 300 - 7 + 1
    row = int(np.nonzero(child.item_ids == ids[10])[0][0])
    assert child.sids[row].tolist() == [3, 4]  # re-assigned, not added beside its old row
    # a delta of an unchecked catalog with a repeated id is still refused
    bad = Catalog(np.array([1, 1, 2], dtype=np.int64), np.zeros((3, 2), dtype=np.int64))
    with pytest.raises(ContractError, match="item 1 appears 2 times"):
        apply_delta(bad, CatalogDelta(remove=[2]), SIZES)
    assert apply_delta(bad, CatalogDelta(remove=[1]), SIZES).item_ids.tolist() == [2]


@pytest.mark.parametrize("arr, why", [
    (np.array([[1.7, 1, 2], [2.2, 3, 4]]), "got float64"),  # was truncated to ids 1, 2
    (np.array([[2**64 - 1, 1, 2]], dtype=np.uint64), "uint64 past int64"),  # was id -1
    (np.array([[1, 1, 2]], dtype=bool), "got bool"),
])
def test_an_array_catalog_of_other_than_int64_values_is_refused(tmp_path, arr, why):
    path = tmp_path / "cat.npy"
    np.save(path, arr)
    with pytest.raises(ContractError, match=why):
        load_catalog(path, SIZES)


def test_small_unsigned_and_int32_arrays_still_load(tmp_path):
    for dtype in (np.uint64, np.int32, np.uint8):
        path = tmp_path / f"cat_{np.dtype(dtype).name}.npy"
        np.save(path, np.array([[7, 1, 2], [8, 3, 4]], dtype=dtype))
        cat = load_catalog(path, SIZES)
        assert cat.item_ids.dtype == np.int64 and cat.item_ids.tolist() == [7, 8]


def test_a_catalog_file_without_items_says_so(tmp_path):
    """Before: numpy's "input contained no data" warning, then an error about codebook
    levels."""
    path = tmp_path / "empty.csv"
    path.write_text("item_id,s1,s2\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ContractError, match=r"catalog.path: .*empty.csv holds no items"):
            load_catalog(path, SIZES)
    npy = tmp_path / "empty.npy"
    np.save(npy, np.zeros((0, 3), dtype=np.int64))
    with pytest.raises(ContractError, match="holds no items"):
        load_catalog(npy, SIZES)


@pytest.mark.parametrize("delta, match", [
    (CatalogDelta(remove=[2**63]), "catalog.remove: item ids must be ints in the int64 range"),
    (CatalogDelta(remove=[-2**63 - 1]), "catalog.remove: item ids must be ints"),
    (CatalogDelta(remove=[1.5]), "catalog.remove: item ids must be ints"),
    (CatalogDelta(remove=[True]), "catalog.remove: item ids must be ints"),
    (CatalogDelta(add={2**63: [1, 1]}), "catalog.add: item ids must be ints in the int64 range"),
    (CatalogDelta(add={7.0: [1, 1]}), "catalog.add: item ids must be ints"),
    (CatalogDelta(add={900: [1.5, 1]}), "catalog.add: SID codes must be ints, got float64"),
    (CatalogDelta(add={900: [1, 2**70]}), "catalog.add: SID codes must be ints"),
    (CatalogDelta(add={900: [1, 2], 901: [1]}), "every SID must have the catalog's depth"),
])
def test_a_delta_built_in_python_with_ids_or_codes_no_int64_holds_is_refused(delta, match):
    """A ``CatalogDelta`` built in Python is not type-checked by msgspec as a dict is: before,
    ids past int64 raised ``OverflowError`` and floats were truncated to other items."""
    cat = random_catalog(50, SIZES, seed=0, distinct=False)
    check_catalog(cat, SIZES)
    with pytest.raises(ContractError, match=match):
        apply_delta(cat, delta, SIZES)


@pytest.mark.parametrize("changes", [[1], "beam_widths", 3, None])
def test_a_policy_change_of_another_type_is_a_contract_error(changes):
    """Before: ``TypeError: `struct` must be a `msgspec.Struct```."""
    with pytest.raises(ContractError, match="policy: a dict of policy fields or a PolicySpec"):
        merged_policy(PolicySpec(), changes, depth=3)
    assert merged_policy(PolicySpec(), {"top_k": 3}, depth=3).top_k == 3
    assert merged_policy(PolicySpec(), PolicySpec(top_k=4), depth=3).top_k == 4


def test_negative_item_ids_stay_valid():
    """Ids are int64 end to end (a history may name a negative id); a catalog may hold one."""
    cat = Catalog(np.array([-5, 0, 5], dtype=np.int64), np.array([[0, 0], [1, 1], [2, 2]]))
    check_catalog(cat, SIZES)
    assert SidTrie(cat, SIZES, 3).n_items() == 3
