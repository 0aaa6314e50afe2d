"""The paged append's torch reference (the CPU path): rows of strided k/v land in their slots,
padding entries (negative pages) write nothing, other slots keep their bytes."""

from __future__ import annotations

import pytest
import torch

from streamgr.errors import StreamgrError
from streamgr.kernels import paged_kv


@pytest.mark.parametrize("n", [1, 13, 128])
def test_append_rows_reference_places_rows(n):
    g = torch.Generator().manual_seed(n)
    L, pages, P, H, D = 2, 40, 4, 2, 8
    store = torch.randn(L, pages, 2, P, H, D, generator=g)
    before = store.clone()
    fused = torch.randn(n + 3, 4, H, D, generator=g)
    k, v = fused[:, 2], fused[:, 3]
    rows = torch.randperm(n + 3, generator=g)[:n]
    slots = torch.randperm(pages * P, generator=g)[:n]
    page, off = slots // P, slots % P
    page[::3] = -1
    paged_kv.append_rows(store, 1, k, v, rows, page, off)
    written = torch.zeros(pages, 2, P, dtype=torch.bool)
    for i in range(n):
        if page[i] < 0:
            continue
        assert torch.equal(store[1, page[i], 0, off[i]], k[rows[i]])
        assert torch.equal(store[1, page[i], 1, off[i]], v[rows[i]])
        written[page[i], :, off[i]] = True
    assert torch.equal(store[0], before[0])  # another layer untouched
    assert torch.equal(store[1][~written], before[1][~written])


def test_append_rows_checks_shapes():
    store = torch.zeros(1, 2, 2, 4, 2, 8)
    k = torch.zeros(3, 2, 4)
    with pytest.raises(StreamgrError, match="do not fit"):
        paged_kv.append_rows(store, 0, k, k, torch.zeros(3, dtype=torch.long),
                             torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
