"""The generate path of the engine: versioned artifacts, request validation, batched search.

A ``GenerateVersion`` is one consistent view a request runs on (RecoGEM section 3.3): the T5
weights, the SID catalog (trie, item -> tokens map), the selection policy, the deployment
contract they were checked against, and the beam search with its own decode plans (a graph
holds its version's tensor addresses). ``GenerateRunner`` serves the *active* version and keeps
the previous one for a rollback; ``activate`` swaps them on the executor thread, between batches,
so a batch already submitted finishes on the version it started on. A request prepared on an
older version is prepared again on the active one when its batch is submitted (queued requests
run on the new version; one that the new version refuses, e.g. a history item taken out of the
catalog, fails alone with its typed error).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..api import GenerateRequest
from ..config import MAX_BEAMS
from ..errors import IdOutOfRange, InvalidRequest, StreamgrError
from ..runtime.beam import BeamRequest, BeamSearch
from ..runtime.plans import PlanCache, bucket_rows
from ..selection.vocabulary import ItemIndex
from .fields import as_list, check_user_id, id_array, id_set, int_in
from .rank import BatchOutcome


@dataclass
class PreparedGenerate:
    user: object
    context: np.ndarray
    top_k: int
    widths: list[int]
    request: GenerateRequest | None = None
    version: "GenerateVersion | None" = None
    exclude: np.ndarray | None = None  # sorted item ids never answered
    max_per_prefix: int = 0
    # What it was prepared against: the catalog (its trie's item array) and the policy. A
    # version's storage may take another catalog in place (``GenerateRunner.refit``), so the
    # version object alone does not say the preparation still holds.
    catalog: object = None
    policy: object = None


class GenerateVersion:
    """Weights + catalog + policy as one unit; ``name`` is what results and stats report."""

    def __init__(self, name: str, model, weights: str, catalog, catalog_name: str, trie,
                 policy, policy_name: str, contract: dict, spec) -> None:
        self.name, self.model, self.weights = name, model, weights
        self.catalog, self.catalog_name, self.trie = catalog, catalog_name, trie
        self.policy, self.policy_name, self.contract = policy, policy_name, contract
        # Device tables of its own (host arrays shared): a later catalog may be written into
        # them in place (GenerateRunner.refit) without touching another version's.
        trie = self.trie = trie.view()
        # The longest encoder context the policy allows (SID tokens of every item, then EOS).
        self.max_context = max(policy.max_context_items * trie.depth + int(policy.append_eos), 1)
        plans = None
        if spec.engine.decode_plans and model.shared.weight.is_cuda:
            plans = PlanCache(spec.engine.max_batch, spec.engine.decode_plans,
                              max_length=self.max_context)
        self.search = BeamSearch(model, trie, spec.catalog.sid_policy, plans)
        self.item_ids, self.index, self._tokens = catalog_views(trie)
        self._eos = np.array([model.cfg.eos_token_id])  # what ends each context

    def adopt_catalog(self, catalog, catalog_name: str, trie, views) -> None:
        """A catalog whose device tables were just written into this version's (``refit``)."""
        self.catalog, self.catalog_name, self.trie = catalog, catalog_name, trie
        self.search.trie = trie
        self.item_ids, self.index, self._tokens = views

    def describe(self) -> dict:
        return {"version": self.name, "weights": self.weights, "catalog": self.catalog_name,
                "catalog_items": int(len(self.item_ids)), "policy": self.policy_name,
                "beam_widths": list(self.policy.beam_widths), "top_k": self.policy.top_k}

    def prepare(self, req: GenerateRequest) -> PreparedGenerate:
        if not isinstance(req, GenerateRequest):
            raise InvalidRequest(f"expected a GenerateRequest, got {type(req).__name__}")
        user = check_user_id(req.user_id)
        pol = self.policy
        if not int_in(req.top_k, 1, pol.max_top_k):
            raise InvalidRequest(f"`top_k` must be an int in 1..{pol.max_top_k}")
        top_k = int(req.top_k)
        bw = req.beam_width
        if bw is not None and not int_in(bw, 1, MAX_BEAMS):
            raise InvalidRequest(f"`beam_width` must be an int in 1..{MAX_BEAMS}")
        bw = None if bw is None else int(bw)
        widths = self._widths(req, bw)
        exclude = id_set(req.exclude_items, "exclude_items")
        # the last step keeps the beams the answer needs (top_k, and a deny list's more): never
        # fewer than top_k items (Hugging Face refuses num_return_sequences > num_beams); as a
        # power of two, so batches share plan shapes (the answer's first beams are the same)
        need = top_k + (0 if exclude is None else len(exclude))
        if need > widths[-1]:
            widths[-1] = min(MAX_BEAMS, 1 << (need - 1).bit_length())
        mpp = req.max_per_prefix if req.max_per_prefix is not None else pol.max_per_prefix
        if not int_in(mpp, 0, 2**31 - 1):
            raise InvalidRequest("`max_per_prefix` must be an int in 0..2**31-1 (0: no cap)")
        mpp = int(mpp)
        hist = id_array("history", req.history, -2**63, 2**63)[-pol.max_context_items:]
        # each item's SID tokens, then the EOS where it ends the context (keeps the GIL)
        tokens, bad = self.index.context(hist, self._eos if pol.append_eos or not hist.size
                                         else None)
        if bad.size:
            raise IdOutOfRange(f"`history` holds item {hist[bad[0]]}, not in the catalog "
                               f"(version {self.name})")
        return PreparedGenerate(user, tokens, top_k, widths, req, self, exclude, mpp,
                                self.trie.leaf_items, pol)

    def _widths(self, req: GenerateRequest, bw: int | None) -> list[int]:
        depth = self.trie.depth
        if req.beam_widths is None:
            return [bw] * depth if bw is not None else list(self.policy.beam_widths)
        if bw is not None:
            raise InvalidRequest("give `beam_width` or `beam_widths`, not both")
        ws = as_list(req.beam_widths)
        if ws is None or len(ws) != depth or not all(int_in(w, 1, MAX_BEAMS) for w in ws):
            raise InvalidRequest(f"`beam_widths` must be {depth} ints in 1..{MAX_BEAMS} "
                                 f"(one per SID level)")
        return [int(w) for w in ws]

    def plan_keys(self) -> list[tuple]:
        """The batch shapes this version's plans hold (what the traffic has been using)."""
        return self.search.plans.keys() if self.search.plans is not None else []

    def warm_up(self, keys: list[tuple] | None = None) -> None:
        """Capture plans before serving: the given shapes (an update passes the active one's:
        ready at the cutover), else every row bucket at full context and the policy's widths."""
        plans = self.search.plans
        if plans is None:
            return
        if keys is not None:
            for key in keys:
                plans.capture(self.search, key)
            return
        ctx = np.full(self.max_context, self.model.cfg.eos_token_id, dtype=np.int64)
        for rows in sorted({bucket_rows(r, plans.max_rows) for r in range(1, plans.max_rows + 1)}):
            self.search.run([BeamRequest(ctx, 1, list(self.policy.beam_widths))] * rows)


def catalog_views(trie) -> tuple:
    """(sorted item ids, their index, each item's SID tokens): what requests are prepared with
    (item id -> a row of the sorted ids, through a table when dense)."""
    ids = trie.leaf_items
    order = np.argsort(ids, kind="stable")
    item_ids = ids[order]
    leaf_of_item = np.repeat(np.arange(len(trie.leaf_ptr) - 1), np.diff(trie.leaf_ptr))
    tokens = (trie.leaf_sids[leaf_of_item] + np.asarray(trie.level_offset))[order]
    return item_ids, ItemIndex(item_ids, tokens), tokens


def _still_prepared(p: PreparedGenerate, v: "GenerateVersion") -> bool:
    """``v`` would prepare ``p``'s request as it is: the same catalog (a trie over the same
    item array: the same request views) and policy (the end-of-sequence token is the
    architecture's, fixed for the engine's life). After a weights refit the requests queued at
    the cutover (tens at 1,000 requests/s) are then not prepared again on the serving thread;
    after a catalog change they are, even where the version object is the one they were
    prepared on (a refit in place wrote the catalog into it), so an item taken out fails its
    request."""
    return p.catalog is v.trie.leaf_items and p.policy == v.policy


def views_after_removal(views: tuple, removed) -> tuple:
    """:func:`catalog_views` of a catalog that lost the items ``removed`` (nothing added), from
    the views before: a removed id's rows go, the rest keep their order (by id, ties in SID
    order); nothing is sorted again (~0.3 s a million items, in an update's build)."""
    ids, _, tokens = views
    rm = np.asarray(removed, dtype=np.int64)  # ids sorted: each removed id's rows bisected
    lo, hi = np.searchsorted(ids, rm, "left"), np.searchsorted(ids, rm, "right")
    n = hi - lo
    keep = np.ones(len(ids), dtype=bool)
    keep[np.repeat(lo - np.cumsum(n) + n, n) + np.arange(n.sum())] = False
    ids = ids[keep]
    tokens = tokens[keep]
    return ids, ItemIndex(ids, tokens), tokens


@dataclass
class CatalogRefit:
    """What a catalog update in place brings (``GenerateRunner.refit``): the catalog, its trie
    (tables not yet its own), the views requests are prepared with, its tables staged on the
    device (``SidTrie.staged``), and a version name and contract."""

    name: str
    catalog: object
    catalog_name: str
    trie: object
    views: tuple
    staged: list
    contract: dict


@dataclass
class WeightsOnly:
    """What a weights refit in place brings (``GenerateRunner.refit``): the version name, the
    new weights (a model, or a checkpoint's tensors by state-dict name: ``state()``), their
    source and contract. They are copied into a retired version's tensors."""

    name: str
    model: object | None
    weights: str
    contract: dict
    tensors: dict | None = None  # a checkpoint's, on the device, when no model was built
    # (slot, its tensors, the new ones in the same order), paired on the build's worker
    # thread (``pair_with``): the executor then only queues the copies
    pairs: tuple | None = None

    def state(self) -> dict:
        return self.tensors if self.model is None else self.model.state_dict()

    def pair_with(self, slot) -> None:
        """Pair the new tensors with ``slot``'s now, off the executor (two state dicts of ~200
        entries each, on the serving thread, for every refit)."""
        src, dst = self.state(), slot.model.state_dict()
        self.pairs = (slot, list(dst.values()), [src[key] for key in dst])


class GenerateRunner:
    has_background_work = False

    def __init__(self, version: GenerateVersion) -> None:
        self.active = version
        self.previous: GenerateVersion | None = None
        # A retired version kept only as storage for the next weights refit (never served):
        # what ``activate(keep_previous=False)`` drops, so a refit can reuse its tensors and
        # decode plans instead of capturing new ones (see ``refit_slot``).
        self.spare: GenerateVersion | None = None
        self.refits_in_place = 0
        self._refit_source = None  # the last refit's source weights (see ``refit``)

    # The active version's parts, for callers that predate versions.
    model = property(lambda self: self.active.model)
    trie = property(lambda self: self.active.trie)
    search = property(lambda self: self.active.search)
    policy = property(lambda self: self.active.policy)
    contract = property(lambda self: self.active.contract)
    version = property(lambda self: self.active.name)
    catalog_items = property(lambda self: self.active.item_ids)  # every catalog item, sorted

    def prepare(self, req: GenerateRequest) -> PreparedGenerate:
        return self.active.prepare(req)

    def activate(self, version: GenerateVersion, keep_previous: bool = True) -> None:
        """Cut over (executor thread: between batches). The old active version becomes
        ``previous``; with ``keep_previous`` off it is not offered for rollback but kept as the
        spare (its memory goes with the next spare, once no batch in flight holds it)."""
        old, self.active = self.active, version
        # The version this cutover retires (the old previous, or the old active itself) is
        # the new spare; anything older goes.
        retired, self.previous = (self.previous, old) if keep_previous else (old, None)
        if retired is not None and retired is not version:
            self.spare = retired
        if self.spare is version or self.spare is self.previous:
            self.spare = None

    def refit_slot(self, trie=None) -> GenerateVersion | None:
        """A retired version whose storage can take the next version in place: the one a
        ``keep_previous=False`` update drops anyway (the spare, or the previous it replaces),
        with the active policy, and either the catalog the update brings (``trie``; None: the
        active one) or tables it fits into. Its decode plans read its own tensors, so writing
        the new weights and tables into them keeps the plans valid: the update then builds no
        version and captures nothing (captures and version builds beside live traffic cost
        p99)."""
        a = self.active
        target = trie if trie is not None else a.trie
        for v in (self.spare, self.previous):
            if v is not None and v is not a and v.policy == a.policy \
                    and v.policy_name == a.policy_name \
                    and (v.trie.same_catalog(target) or target.fits(v.trie)):
                return v
        return None

    def refit(self, slot: GenerateVersion, new: WeightsOnly | None, keep_previous: bool,
              cat: CatalogRefit | None = None) -> None:
        """Executor thread, between batches: into ``slot``'s tensors, the new weights (``new``;
        None: the active ones, where the slot's differ) and catalog tables (``cat``; None: the
        active catalog, where the slot's differs), then ``slot`` becomes active under the new
        name. The copies are queued on the stream every batch is, after all of them, so a batch
        still running on ``slot`` reads its old state to the end; its answers keep the name it
        was submitted under."""
        # Out of reach first: a copy that failed half-way must not leave a rollback target
        # with mixed weights.
        if self.spare is slot:
            self.spare = None
        if self.previous is slot:
            self.previous = None
        a = self.active
        if new is not None or slot.weights != a.weights:
            if new is not None and new.pairs is not None and new.pairs[0] is slot:
                _, dsts, srcs = new.pairs
            else:
                src = new.state() if new is not None else a.model.state_dict()
                dst = slot.model.state_dict()
                dsts, srcs = list(dst.values()), [src[key] for key in dst]
            with torch.no_grad():  # one multi-tensor launch, not one per parameter (~200)
                torch._foreach_copy_(dsts, srcs, non_blocking=True)
            if new is not None:
                # Made on a build stream (streams.off_stream): their memory must not go back
                # to that stream's pool before the copies queued here have read it.
                cur = {}
                for t in srcs:
                    if t.is_cuda:
                        s = cur.get(t.device)
                        if s is None:  # (one lookup per device, not one per tensor)
                            s = cur[t.device] = torch.cuda.current_stream(t.device)
                        t.record_stream(s)
                self._refit_source = new  # kept until the next refit, a second guard
        if cat is not None or not slot.trie.same_catalog(a.trie):
            if cat is None:  # the active catalog's tables, device to device
                cat = CatalogRefit(slot.name, a.catalog, a.catalog_name, a.trie.view(),
                                   (a.item_ids, a.index, a._tokens),
                                   a.trie.staged(slot.model.shared.weight.device), a.contract)
            cat.trie.write_into(slot.trie, slot.model.shared.weight.device, cat.staged)
            slot.adopt_catalog(cat.catalog, cat.catalog_name, cat.trie, cat.views)
        # The name, weights and contract of what now lies in the slot.
        src = new if new is not None else cat
        slot.name, slot.contract = src.name, src.contract
        slot.weights = new.weights if new is not None else a.weights
        self.refits_in_place += 1
        self.activate(slot, keep_previous)

    def rollback(self) -> GenerateVersion:
        if self.previous is None:
            raise StreamgrError("no previous generate version to roll back to")
        self.active, self.previous = self.previous, self.active
        return self.active

    def submit(self, batch: list[PreparedGenerate]):
        """Queue a batch on the device (executor thread); ``finish`` completes it. The batch
        runs on the version active now; requests prepared on another are prepared again."""
        t = time.perf_counter()
        v = self.active
        fresh: list[PreparedGenerate | Exception] = []
        for p in batch:
            if p.request is None or _still_prepared(p, v):
                fresh.append(p)
                continue
            try:
                fresh.append(v.prepare(p.request))
            except StreamgrError as err:
                fresh.append(err)
        run = [p for p in fresh if not isinstance(p, Exception)]
        sub = v.search.submit([BeamRequest(p.context, p.top_k, p.widths, p.exclude,
                                           p.max_per_prefix) for p in run]) if run else None
        return fresh, sub, t, v, v.name  # the name now: a refit may rename v before finish

    def finish(self, handle) -> BatchOutcome:
        """Wait for a submitted batch and answer its requests (completion thread)."""
        fresh, sub, t, v, name = handle
        res = iter(v.search.finish(sub) if sub is not None else [])
        out, stages = [], {}
        for p in fresh:
            if isinstance(p, Exception):
                out.append(p)
                continue
            r = next(res)
            stages = dict(r.steps)
            out.append(((r.items, r.scores, r.sids),
                        {"context_tokens": len(p.context), "version": name}))
        stages["total"] = (time.perf_counter() - t) * 1e3
        return BatchOutcome(out, stages)

    def run(self, batch: list[PreparedGenerate]) -> BatchOutcome:
        return self.finish(self.submit(batch))

    def warm_up(self) -> None:
        self.active.warm_up()
        if self.spare is not None:  # refit_spare: its plans too, before serving
            self.spare.warm_up(self.active.plan_keys() or None)

    def background(self) -> None:
        pass

    def close(self) -> None:
        pass
