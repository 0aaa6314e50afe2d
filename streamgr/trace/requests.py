"""A trace's records as the requests a replay sends (``streamgr trace replay``): each carries the
user's full history so far (a trace holds only the new events), its ids checked against the
model's tables or folded into them (``--fold-ids``); and the replay's typed error."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..api import GenerateRequest
from ..errors import StreamgrError
from .format import read_header, read_trace


class ReplayError(StreamgrError):
    code = "BAD_TRACE"


@dataclass
class Req:
    user: object
    items: np.ndarray
    actions: np.ndarray
    candidates: np.ndarray


def load_requests(path, num_items: int | None, num_actions: int | None, max_history: int | None,
                  fold_ids: bool, candidates: int, limit: int | None, seed: int = 0):
    """Full-history requests of a rank trace; raises naming ``--fold-ids`` if ids do not fit."""
    header = read_header(path)
    if header.kind != "rank":
        raise ReplayError(f"{path}: a {header.kind} trace; replay runs rank traces")
    rng = np.random.default_rng(seed)
    hist: dict = {}
    out: list[Req] = []
    skipped = 0
    for n, r in enumerate(read_trace(path)):
        if limit is not None and len(out) + skipped >= limit:
            break
        items = np.asarray(r.items, dtype=np.int64)
        actions = np.asarray(r.actions, dtype=np.int64)
        cands = np.asarray(r.candidates, dtype=np.int64)
        if num_items is not None:
            if fold_ids:
                items, cands = items % num_items, cands % num_items
                actions = actions % num_actions
            elif (items.size and items.max() >= num_items) or (cands.size and cands.max() >= num_items) \
                    or (actions.size and actions.max() >= num_actions):
                raise ReplayError(
                    f"{path}: record {n}: ids do not fit the model's tables (items < {num_items}, "
                    f"actions < {num_actions}); pass --fold-ids to fold them in, or use a spec "
                    f"with larger tables")
        h = hist.setdefault(r.user, ([], []))
        h[0].append(items)
        h[1].append(actions)
        full_i, full_a = np.concatenate(h[0]), np.concatenate(h[1])
        h[0][:], h[1][:] = [full_i], [full_a]
        if max_history is not None and len(full_i) > max_history:
            skipped += 1  # the model cannot take it; counted, not truncated (that would rewrite)
            continue
        if cands.size == 0:
            cands = rng.choice(num_items or header.num_items, size=candidates, replace=False)
        out.append(Req(r.user, full_i, full_a, cands))
    return out, skipped


def load_generate_requests(path, catalog_ids: np.ndarray | None, fold_ids: bool,
                           limit: int | None) -> list[GenerateRequest]:
    """Full-history generate requests of a generate trace (items must be catalog items)."""
    ids = np.sort(catalog_ids) if catalog_ids is not None else None
    hist: dict = {}
    out: list[GenerateRequest] = []
    for n, r in enumerate(read_trace(path)):
        if limit is not None and len(out) >= limit:
            break
        items = np.asarray(r.items, dtype=np.int64)
        if ids is not None and items.size:
            if fold_ids:
                items = ids[items % len(ids)]
            elif not np.isin(items, ids).all():
                raise ReplayError(f"{path}: record {n}: items outside the spec's catalog; pass "
                                  f"--fold-ids to fold them in")
        h = hist.setdefault(r.user, [])
        h.extend(items.tolist())
        out.append(GenerateRequest(user_id=r.user, history=list(h), top_k=r.top_k,
                                   beam_width=r.beam_width))
    return out
