"""The generate path of the engine: request validation and batched trie-constrained beam search.

``prepare_generate`` maps a request's history to encoder tokens (each item's SID tokens, the
newest ``max_context_items`` items, then EOS) or raises a typed error before admission.
``GenerateRunner.run`` runs one batch of requests through the beam search on the executor thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..api import GenerateRequest
from ..errors import IdOutOfRange, InvalidRequest
from ..runtime.beam import BeamRequest, BeamSearch
from ..runtime.plans import PlanCache, bucket_rows
from .rank import BatchOutcome

MAX_BEAM = 4096


@dataclass
class PreparedGenerate:
    user: object
    context: np.ndarray
    top_k: int
    widths: list[int]


class GenerateRunner:
    has_background_work = False

    def __init__(self, model, version: str, trie, contract: dict, spec) -> None:
        self.model, self.version, self.trie, self.contract = model, version, trie, contract
        self.policy, self.catalog = spec.policy, spec.catalog
        plans = None
        if spec.engine.decode_plans and model.shared.weight.is_cuda:
            plans = PlanCache(spec.engine.max_batch, spec.engine.decode_plans)
        self.search = BeamSearch(model, trie, spec.catalog.sid_policy, plans)
        # Item id -> its SID tokens, by binary search over the sorted catalog ids.
        ids = trie.leaf_items
        order = np.argsort(ids, kind="stable")
        self._ids = ids[order]
        leaf_of_item = np.repeat(np.arange(len(trie.leaf_ptr) - 1), np.diff(trie.leaf_ptr))
        offs = np.asarray(trie.level_offset)
        self._tokens = (trie.leaf_sids[leaf_of_item] + offs)[order]

    @property
    def catalog_items(self) -> np.ndarray:
        """Every catalog item id, sorted."""
        return self._ids

    def prepare(self, req: GenerateRequest) -> PreparedGenerate:
        if not isinstance(req, GenerateRequest):
            raise InvalidRequest(f"expected a GenerateRequest, got {type(req).__name__}")
        if isinstance(req.user_id, bool) or not isinstance(req.user_id, (int, str)):
            raise InvalidRequest("`user_id` must be an int or a str")
        if isinstance(req.top_k, bool) or not isinstance(req.top_k, int) or \
                not 1 <= req.top_k <= self.policy.max_top_k:
            raise InvalidRequest(f"`top_k` must be an int in 1..{self.policy.max_top_k}")
        bw = req.beam_width
        if bw is not None and (isinstance(bw, bool) or not isinstance(bw, int) or not 1 <= bw <= MAX_BEAM):
            raise InvalidRequest(f"`beam_width` must be an int in 1..{MAX_BEAM}")
        try:
            hist = np.asarray(req.history)
        except Exception:
            raise InvalidRequest("`history` is not a list of integers") from None
        if hist.ndim != 1 or (hist.size and hist.dtype.kind not in "iu"):
            raise InvalidRequest("`history` must be a flat list of integers")
        hist = hist.astype(np.int64)[-self.policy.max_context_items:]
        pos = np.searchsorted(self._ids, hist)
        pos = np.minimum(pos, len(self._ids) - 1)
        bad = np.nonzero(self._ids[pos] != hist)[0]
        if bad.size:
            raise IdOutOfRange(f"`history` holds item {hist[bad[0]]}, not in the catalog")
        tokens = self._tokens[pos].reshape(-1)
        if self.policy.append_eos:
            tokens = np.append(tokens, self.model.cfg.eos_token_id)
        if tokens.size == 0:  # an empty context still needs one encoder position
            tokens = np.array([self.model.cfg.eos_token_id])
        widths = [bw] * self.trie.depth if bw is not None else list(self.policy.beam_widths)
        return PreparedGenerate(req.user_id, tokens, req.top_k, widths)

    def set_model(self, model, version: str) -> None:
        self.model, self.version = model, version
        self.search.set_model(model)

    def submit(self, batch: list[PreparedGenerate]):
        """Queue a batch on the device (executor thread); ``finish`` completes it."""
        t = time.perf_counter()
        return batch, self.search.submit([BeamRequest(p.context, p.top_k, p.widths)
                                          for p in batch]), t

    def finish(self, handle) -> BatchOutcome:
        """Wait for a submitted batch and answer its requests (completion thread)."""
        batch, sub, t = handle
        res = self.search.finish(sub)
        stages = dict(res[0].steps) if res else {}
        stages["total"] = (time.perf_counter() - t) * 1e3
        return BatchOutcome([((r.items, r.scores, r.sids), {"context_tokens": len(p.context)})
                             for p, r in zip(batch, res)], stages)

    def run(self, batch: list[PreparedGenerate]) -> BatchOutcome:
        return self.finish(self.submit(batch))

    def warm_up(self) -> None:
        """Capture the plan of every row bucket for a full-length context and the policy's
        widths, so that no live request pays for a capture of the common shapes."""
        plans = self.search.plans
        if plans is None:
            return
        n = self.policy.max_context_items * self.trie.depth + int(self.policy.append_eos)
        ctx = np.full(n, self.model.cfg.eos_token_id, dtype=np.int64)
        for rows in sorted({bucket_rows(r, plans.max_rows) for r in range(1, plans.max_rows + 1)}):
            self.search.run([BeamRequest(ctx, 1, list(self.policy.beam_widths))] * rows)

    def background(self) -> None:
        pass

    def close(self) -> None:
        pass
