"""Selection variants beside plain beam search, applied to a batch's final beams.

Production GR runs many beam-search policy variants (RecoGEM section 3.3 counts about twenty);
the ones here are data (per deployment in ``[policy]``, per request in ``GenerateRequest``):

- per-step beam widths that narrow (``beam_widths``, e.g. [256, 128, 64]): the search itself;
- a per-request deny list (``exclude_items``): those items are never answered; the last step
  keeps ``top_k + len(exclude_items)`` beams so the answer still holds ``top_k`` items;
- prefix diversity (``max_per_prefix``): at most that many answered items share their first
  SID code (the coarsest semantic cluster), so one cluster cannot fill the list; fewer than
  ``top_k`` items come back when the final beams hold too few clusters.

``keep_mask`` runs on the flat item list of a whole batch (row-major, each row best first), as
``BeamSearch.answer_batch`` lays it out, before the cut to each request's ``top_k``.
"""

from __future__ import annotations

import numpy as np


def keep_mask(row: np.ndarray, items: np.ndarray, prefix: np.ndarray,
              exclude: list[np.ndarray | None], max_per_prefix: list[int]) -> np.ndarray:
    """Which flat entries survive: ``row``/``items``/``prefix`` per entry; per request its
    sorted excluded ids (or None) and its prefix cap (0: none)."""
    keep = np.ones(len(row), dtype=bool)
    for r, ex in enumerate(exclude):
        if ex is not None and len(ex):
            lo, hi = np.searchsorted(row, [r, r + 1])
            keep[lo:hi] = ~np.isin(items[lo:hi], ex)
    caps = np.asarray(max_per_prefix, dtype=np.int64)
    if not caps.any():
        return keep
    idx = np.nonzero(keep)[0]
    key = row[idx] * (int(prefix.max(initial=0)) + 1) + prefix[idx]
    order = np.argsort(key, kind="stable")  # groups of (row, prefix), each in rank order
    k = key[order]
    start = np.r_[True, k[1:] != k[:-1]]
    first = np.maximum.accumulate(np.where(start, np.arange(len(k)), 0))
    rank = np.empty(len(k), dtype=np.int64)
    rank[order] = np.arange(len(k)) - first  # place within its (row, prefix) group
    cap = caps[row[idx]]
    keep[idx[(cap > 0) & (rank >= cap)]] = False
    return keep
