"""The rank path of the engine: request validation and batch execution on the model.

``prepare_rank`` turns a ``RankRequest`` into validated arrays (or raises a typed error before
the request is admitted). ``RankRunner.run`` executes one batch of distinct users: it builds the
jagged token batch, runs the HSTU forward and splits the scores per request. Runs on the
engine's executor thread, never on the event loop.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..api import RankRequest
from ..cache.history import HistoryStore
from ..errors import (EmptyCandidates, HistoryTooLong, InvalidRequest, LengthMismatch,
                      TooManyCandidates)
from ..kernels.host_loops import pack_rows
from ..kernels.hstu_attention import JaggedKV, kernel_runs
from ..kernels.pinned import PinnedPool, to_device
from ..models.hstu import HSTU, HSTUConfig, JaggedBatch
from .fields import check_user_id, id_array, int_in


@dataclass
class PreparedRank:
    user: int | str
    items: np.ndarray  # int64 [events], full history once resolved
    actions: np.ndarray
    candidates: np.ndarray
    base_len: int | None = None

    @property
    def history_tokens(self) -> int:
        return 2 * len(self.items)


def prepare_rank(req: RankRequest, cfg: HSTUConfig) -> PreparedRank:
    """Validate a request against the model; raise a typed ``InvalidRequest`` subclass."""
    if not isinstance(req, RankRequest):
        raise InvalidRequest(f"expected a RankRequest, got {type(req).__name__}")
    user = check_user_id(req.user_id)
    too_long = lambda n: HistoryTooLong(  # noqa: E731
        f"history of {n} events, the model takes at most {cfg.max_history}")
    items = id_array("items", req.items, 0, cfg.num_items, (cfg.max_history, too_long))
    actions = id_array("actions", req.actions, 0, cfg.num_actions)
    candidates = id_array("candidates", req.candidates, 0, cfg.num_items, (
        cfg.max_candidates, lambda n: TooManyCandidates(
            f"{n} candidates, the model takes at most {cfg.max_candidates}")))
    if len(items) != len(actions):
        raise LengthMismatch(f"{len(items)} items but {len(actions)} actions")
    if len(candidates) == 0:
        raise EmptyCandidates("`candidates` is empty")
    base = req.base_len
    # any int >= 0: one past int64 is a count of events sent before, only far too many (the
    # history check below names it)
    if base is not None and not int_in(base, 0, base):
        raise InvalidRequest(f"`base_len` must be a non-negative int, got {base!r:.40}")
    base = None if base is None else int(base)
    total = len(items) + (base or 0)
    if total > cfg.max_history:
        raise too_long(total)
    return PreparedRank(user, items, actions, candidates, base)


@dataclass
class UserSlice:
    """What the model computes for one user: history tokens from ``start`` on, then candidates."""

    tokens: np.ndarray  # new history tokens (interleaved ids), absolute positions start..
    start: int
    candidates: np.ndarray


@dataclass
class PackedBatch:
    """A batch's token rows on the host (see ``build_jagged``); with ``staging``, views of one
    of its page-locked buffers (``pinned``), handed back by :meth:`release` or the upload."""

    packed: np.ndarray  # int64 [3, rows]: token ids, is_action, positions
    cand_rows: np.ndarray
    q_offsets: list[int]
    num_candidates: list[int]
    hist_lens: list[int]
    pinned: torch.Tensor | None = None
    staging: "UploadStaging | None" = None

    def release(self, event=None) -> None:
        """Hand the staging buffer back (``event``: it is reused only once that completed)."""
        if self.pinned is not None and self.staging is not None:
            self.staging.give_back(self.pinned, event)
        self.pinned = None


def build_jagged(users: list[UserSlice], device: torch.device) -> JaggedBatch:
    """One host-to-device copy of the whole batch's token ids, kinds and positions."""
    return upload_jagged(pack_jagged(users), device)


def upload_jagged(pb: PackedBatch, device: torch.device) -> JaggedBatch:
    rows, cands = pb.packed.shape[1], len(pb.cand_rows)
    if device.type == "cuda" and pb.pinned is not None:  # one copy out of the staging buffer
        dev = to_device(pb.pinned[:3 * rows + cands], device)
        ev = torch.cuda.Event()
        ev.record()
        pb.release(ev)
        t, cand = dev[:3 * rows].view(3, rows), dev[3 * rows:]
    else:
        t, cand = torch.from_numpy(pb.packed), torch.from_numpy(pb.cand_rows)
        if device.type == "cuda":
            t = t.pin_memory().to(device, non_blocking=True)
            cand = cand.pin_memory().to(device, non_blocking=True)
        pb.release()
    return JaggedBatch(token_ids=t[0], is_action=t[1].bool(), positions=t[2],
                       candidate_rows=cand, q_offsets=pb.q_offsets,
                       num_candidates=pb.num_candidates, hist_lens=pb.hist_lens)


def pack_jagged(users: list[UserSlice], staging: UploadStaging | None = None) -> PackedBatch:
    """The batch's rows on the host (``kernels.host_loops.pack_rows``: one compiled call per
    batch), in a page-locked buffer of ``staging`` when given."""
    pinned = out = None
    if staging is not None:
        rows = sum(len(u.tokens) + len(u.candidates) for u in users)
        pinned = staging.take(3 * rows + sum(len(u.candidates) for u in users))
        out = pinned.numpy()
    packed, cand_rows, q_offsets, hist = pack_rows(users, out)
    return PackedBatch(packed, cand_rows, q_offsets, [len(u.candidates) for u in users], hist,
                       pinned, staging)


@dataclass
class InFlight:
    """A rank batch between ``submit`` and ``finish``: its scores are on their way to ``host``
    (valid once ``event`` completed; ``None``: already there)."""

    batch: list
    resolved: list
    live: list
    stages: dict
    plans: list = field(default_factory=list)  # cached modes: the users' cache plans
    tokens: dict = field(default_factory=dict)  # cached modes: user -> history tokens
    lengths: dict = field(default_factory=dict)  # recompute: request index -> tokens computed
    host: torch.Tensor | None = None
    event: object = None
    version: str = ""  # the weights the batch runs on (set at submit)
    pinned: torch.Tensor | None = None  # the pooled buffer ``host`` views (given back at finish)
    marks: dict | None = None  # cached modes: timing events for the onload split's feedback

    def wait(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
        return self.host.numpy()


class ScoreBuffers(PinnedPool):
    """Buffers for batches' scores: a batch takes one when its scores' copy is queued and gives
    it back once its answers hold copies of them."""

    def __init__(self) -> None:
        super().__init__(torch.float32, 4096)

    def read_back(self, scores: torch.Tensor):
        """(host view, event, buffer): the scores' copy queued behind the batch's work (no
        wait); on the CPU the scores themselves, no event, no buffer."""
        if not scores.is_cuda:
            return scores.detach(), None, None
        n = scores.numel()
        buf = self.take(n)
        host = buf[:n].view(scores.shape)
        host.copy_(scores, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event, buf


class UploadStaging(PinnedPool):
    """int64 buffers a batch's rows are packed into (``pack_rows(out=)``) and uploaded from:
    one host-to-device copy per batch and no ``pin_memory()``, which allocated and copied the
    rows again on the host (1.2 MB per recompute batch of 8; ~0.35 ms before its copy started
    on the lent H200's host, docs/benchmarks.md session 10). Given back with the copy's event."""

    def __init__(self) -> None:
        super().__init__(torch.int64, 1 << 16)


@dataclass
class BatchOutcome:
    """Per request: ``(scores, stats fields)`` or the exception that request gets."""

    results: list[tuple[np.ndarray, dict] | Exception]
    stages: dict[str, float] = field(default_factory=dict)
    version: str = ""  # rank: the weights version the batch ran on


class RankRunner:
    """Executes rank batches in ``recompute`` mode: every history token is computed each time.

    Subclassed by the cached runner; both resolve delta requests against the history store.
    """

    def __init__(self, model: HSTU, version: str, device: torch.device,
                 history: HistoryStore) -> None:
        self.model, self.version = model, version
        self.device = device
        self.history = history
        self.sync_stages = False  # benchmarks set it: stage times then include device work
        # Metadata read when a batch is submitted (executor thread) and written when one
        # finishes (completion thread): the history store, and the cache manager in subclasses.
        self._meta = threading.RLock()
        self.plans = None  # RankPlans: CUDA graphs of the forward (engine.rank_plans > 0)
        self.score_buffers = ScoreBuffers()
        self.staging = UploadStaging() if device.type == "cuda" else None
        self.pad_eager_rows = True  # (``_eager_rows``; off: the probes' A/B)

    def set_model(self, model: HSTU, version: str) -> None:
        self.model, self.version = model, version
        if self.plans is not None:
            self.plans.clear(model)

    def _forward_planned(self, pb: PackedBatch, desc, app=None, stages: dict | None = None):
        """Scores from a rank plan (a replayed CUDA graph), or None: run eagerly. ``stages``
        gets the host time of the plan's steps (``plan``, ``fill``, ``launch``, ms)."""
        if self.plans is None:
            return None
        from .rank_plans import HostBatch
        e = np.zeros(0, np.int64)
        app = app or (e, e, e)
        return self.plans.run(HostBatch(pb.packed, pb.cand_rows, *app), desc, stages)

    def _eager_rows(self, n: int, store: torch.Tensor | None = None) -> int:
        """Rows an eager batch of ``n`` runs its layers over: on the attention kernel's path,
        ``n`` bucketed as rank plans bucket it, so that the GEMMs meet row counts cuBLAS has
        planned before (its first call at a new one took 0.3-0.5 ms of host time, a few such a
        host-hit batch: H200, session 23); else ``n``."""
        from .rank_plans import row_bucket
        dtype = self.model.item_embedding.weight.dtype
        if self.pad_eager_rows and kernel_runs(self.device, dtype, self.model.cfg.head_dim, store):
            return row_bucket(n)
        return n

    def _mark(self, stages: dict, name: str, t: float) -> float:
        if self.sync_stages and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        stages[name] = stages.get(name, 0.0) + (now - t) * 1e3
        return now

    def _resolve(self, batch: list[PreparedRank]) -> tuple[list, list[int]]:
        """Each request's full history (or its error), and the indices of the valid ones."""
        with self._meta:
            return self._resolve_locked(batch)

    def _resolve_locked(self, batch: list[PreparedRank]) -> tuple[list, list[int]]:
        out: list = []
        max_hist = self.model.cfg.max_history
        for r in batch:
            try:
                res = self.history.resolve(r.user, r.base_len, r.items, r.actions,
                                           match_full=self.matches_history)
                if res.events > max_hist:
                    raise HistoryTooLong(f"history of {res.events} events, the model takes at "
                                         f"most {max_hist}")
                out.append(res)
            except InvalidRequest as err:
                out.append(err)
        return out, [i for i, h in enumerate(out) if not isinstance(h, Exception)]

    def _remember(self, batch: list[PreparedRank], resolved: list) -> None:
        with self._meta:
            for r, h in zip(batch, resolved):
                if not isinstance(h, Exception):
                    self.history.keep(r.user, h)

    def run(self, batch: list[PreparedRank]) -> BatchOutcome:
        """One batch start to finish (offline replays, tests)."""
        return self.finish(self.submit(batch))

    # The BatchLoop's runner protocol: ``submit`` (executor thread) queues the batch on the
    # device; ``finish`` (completion thread) waits for its scores and answers it.
    def submit(self, batch: list[PreparedRank]) -> InFlight:
        stages: dict[str, float] = {}
        t = time.perf_counter()
        resolved, live = self._resolve(batch)
        if not live:
            return InFlight(batch, resolved, live, stages, version=self.version)
        users = [UserSlice(resolved[i].tokens, 0, batch[i].candidates) for i in live]
        pb = pack_jagged(users, self.staging)
        t = self._mark(stages, "layout", t)
        scores = self._forward_planned(pb, JaggedKV.recompute(pb.q_offsets, pb.num_candidates),
                                       stages=stages)
        if scores is None:
            scores = self.model(upload_jagged(pb, self.device),
                                rows=self._eager_rows(pb.packed.shape[1]))
        pb.release()  # (a plan copied the rows into its own buffer on the host)
        host, event, pinned = self.score_buffers.read_back(scores)
        self._mark(stages, "model", t)
        return InFlight(batch, resolved, live, stages, host=host, event=event, version=self.version,
                        lengths={i: len(u.tokens) for i, u in zip(live, users)}, pinned=pinned)

    def finish(self, f: InFlight) -> BatchOutcome:
        if not f.live:
            return BatchOutcome(list(f.resolved), f.stages, f.version)
        t = time.perf_counter()
        scores = f.wait()
        t = self._mark(f.stages, "readback", t)
        self._remember(f.batch, f.resolved)
        results: list = list(f.resolved)
        o = 0
        for i in f.live:
            c = len(f.batch[i].candidates)
            n = f.lengths[i]
            results[i] = (scores[o:o + c].copy(), {"history_tokens": n,
                                                   "tokens_recomputed": n,
                                                   "tier": "none" if n == 0 else "miss"})
            o += c
        self.score_buffers.give_back(f.pinned)  # the answers hold copies now
        self._mark(f.stages, "postprocess", t)
        return BatchOutcome(results, f.stages, f.version)

    has_background_work = False  # recompute has nothing to do after a batch
    # Full requests compared with the held history (``HistoryStore.resolve``): only a cache
    # has a use for knowing that a history extends the last one.
    matches_history = False

    def close(self) -> None:
        """Release threads and buffers (the cached runner waits for its offloads)."""

    def background(self) -> None:
        """Work after the replies are out (the cached runner offloads here)."""
