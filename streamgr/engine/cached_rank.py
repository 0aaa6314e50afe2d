"""The cached rank path (``gpu-only`` and ``hierarchical``): MTServe's seven-step batch.

lookup and validate (fingerprints, weights version) -> allocate pages (LRU eviction) -> onload
host chunks -> strip the cached tokens -> compute only new tokens and candidates, each layer
appending its new K/V to the pages and attending over the user's pages -> commit metadata ->
scores. Offload of filled chunks runs after the replies (``background``). Users that cannot get
pages (bigger than the device cache, or locked by an offload while their prefix changed) are
computed whole without caching: served correctly, never refused.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import numpy as np
import torch

from ..cache import HistoryStore, KVCacheManager
from ..cache.onload_split import SplitCosts, split_by_cost, split_fraction
from ..cache.store import KVStores
from ..errors import EngineDead
from ..kernels.host_loops import page_slots
from ..kernels.hstu_plan import csr_of, page_csr
from ..kernels import paged_kv
from ..kernels.hstu_attention import JaggedKV, hstu_attention_jagged, prepare_plans
from ..models.hstu import HSTU
from ..streams import (NullOffload, NullOnload, OffloadPipeline, OnloadFault, OnloadPipeline,
                       StreamSet)
from .rank import (BatchOutcome, InFlight, PreparedRank, RankRunner, UserSlice,
                   pack_jagged, upload_jagged)

log = logging.getLogger("streamgr.cache")


def _tier(plan) -> str:
    if plan.length == 0:
        return "none"
    if plan.from_host or plan.host_recomputed:
        return "host"
    return "gpu" if plan.from_gpu else "miss"


class CachedRankRunner(RankRunner):
    matches_history = True  # full requests that extend the held history skip the hashing

    def __init__(self, model: HSTU, version: str, device: torch.device, history: HistoryStore,
                 manager: KVCacheManager, stores: KVStores) -> None:
        super().__init__(model, version, device, history)
        self.manager, self.stores = manager, stores
        self.streams = StreamSet(device)
        if manager.hierarchical:
            self.onload = OnloadPipeline(stores, self.streams)
            self.offload = OffloadPipeline(stores, self.streams)
        else:  # no host tier: nothing to move, no pipeline threads
            self.onload, self.offload = NullOnload(stores.layers, self.streams), NullOffload()
        self._compute_done = None  # the last batch's compute event: pages it read may be reused
        self.bytes_offloaded = 0
        self.onload_faults = 0
        self.trace_events: dict | None = None  # tests: {name: timing event} of the last batch
        self._to_commit: deque = deque()  # finished batches whose commit runs in ``background``
        self.commit_failures = 0
        # cache.onload_split: 1.0 onloads all a host hit holds; a fraction, or SplitCosts
        # (measured at start, engine/onload_costs.py) to recompute part of it meanwhile.
        self.onload_split: float | SplitCosts = 1.0
        # A SplitFeedback: "auto"'s recompute costs corrected batch by batch from device
        # timings (cache/onload_split.py; the factory sets one with "auto").
        self.split_feedback = None
        # A/B for tools/probe_hosthit.py (``early``): an inline onload submitted right after the
        # split, before the batch's uploads (H200, session 24: 20.9 against 13.4 ms, the
        # uploads landing after all of the onload; why is open: tools/probe_zerocopy.py).
        self.early_onload = False

    @property
    def bytes_onloaded(self) -> int:
        return self.onload.bytes

    def _descriptor(self, plans, pb) -> tuple[JaggedKV, tuple[np.ndarray, ...]]:
        """Where each user's history keys live, and the page slots its new K/V go to
        (rows of the batch, pages, offsets). A user with nothing cached (a miss, or a host hit
        that recomputes all of it) attends over its rows of this batch's k/v, as recompute
        does, not over the pages they are appended to: the same bits, and the attention reads
        contiguous keys with no page lookups (rank-ref misses, session 20: 1.87 ms a layer over
        pages, 1.40 over rows)."""
        cached = [not p.transient for p in plans]
        paged = [c and p.start > 0 for c, p in zip(cached, plans)]
        desc = JaggedKV(pb.q_offsets, pb.num_candidates, [p.length for p in plans], paged,
                        list(pb.q_offsets[:-1]), [p.page_ids for p in plans], self.stores.P,
                        self.stores.pages)
        page_ptr, pages = page_csr(desc)  # kept with desc: the attention plans read it too
        if paged != cached:  # the misses append to pages the attention does not read
            page_ptr, pages = csr_of(desc.pages, cached)
        end = np.array([p.length for p in plans], dtype=np.int64)
        start = np.array([p.length if p.transient else p.start for p in plans], dtype=np.int64)
        app = page_slots(np.asarray(pb.q_offsets[:-1], dtype=np.int64), start, end, page_ptr,
                         pages, self.stores.P)  # a transient user appends nothing
        return desc, app

    def _split(self, plans) -> None:
        """Host hits: onload part of what the host holds, recompute the rest (onload_split)."""
        s = self.onload_split
        if not any(p.from_host for p in plans) or (not isinstance(s, SplitCosts) and s >= 1):
            return
        # (the tokens it recomputes are counted at commit: a batch retried after an onload
        # fault counts once)
        if isinstance(s, SplitCosts):
            fb = self.split_feedback
            split_by_cost(plans, self.manager.C, s, fb.scale if fb is not None else 1.0)
        else:
            split_fraction(plans, self.manager.C, s)

    def _split_state(self):
        s = self.onload_split
        if not isinstance(s, SplitCosts):
            return s
        fb = {} if self.split_feedback is None else {
            "feedback_scale": round(self.split_feedback.scale, 4)}
        return {**fb, "onload_us_per_token": round(s.onload_s * 1e6, 4),
                "recompute_ms": {str(int(n)): round(t * 1e3, 4)
                                 for n, t in zip(s.lengths, s.recompute_s)}}

    def submit(self, batch: list[PreparedRank]) -> "InFlight":
        """Plan the batch, queue its onloads and its forward on the device, and queue the
        scores' copy to the host; nothing here waits for the device (``finish`` does)."""
        with self._meta:
            self._commit()  # offline callers may not have run ``background`` since the last
            self._apply_completions()
        try:
            return self._submit(batch, frozenset())
        except OnloadFault as fault:  # the batch again, those users recomputed: still right
            self.onload_faults += 1
            log.warning("%s; recomputing them", fault)
            return self._submit(batch, frozenset(fault.users))

    def _submit(self, batch: list[PreparedRank], transient: frozenset) -> "InFlight":
        stages: dict[str, float] = {}
        t = time.perf_counter()
        if self.trace_events is not None:  # tests and probes: this batch's events and stamps
            self.trace_events = {}
        self._stamp("host_submit")
        resolved, live = self._resolve(batch)
        if not live:
            return InFlight(batch, resolved, live, stages, version=self.version)
        tokens = {batch[i].user: resolved[i].tokens for i in live}  # interleaved, kept so
        t = self._mark(stages, "strip", t)
        # A history that extends the one the cache last committed for that user: its cached
        # tokens are a prefix of these, known without hashing them (history.py's stamps).
        known = {batch[i].user: (resolved[i].base[0], 2 * resolved[i].base[1]) for i in live
                 if resolved[i].base is not None}
        with self._meta:
            plans = self.manager.plan_batch(
                [(batch[i].user, tokens[batch[i].user]) for i in live], self.version, transient,
                known)
            self._split(plans)
        t = self._mark(stages, "metadata", t)
        self._stamp("host_metadata")
        s = self.streams
        handles = None
        try:
            with s.use(s.compute):
                per = self.stores.chunk_pages
                jobs = [(p.key, [c for c, _ in p.onload],
                         [pg for _, i in p.onload for pg in p.pages[i * per:(i + 1) * per]])
                        for p in plans if p.onload]
                # The onload: on its own streams, the model waiting per layer. From the
                # onload thread it starts now (the batch's own uploads then follow it on the
                # copy engine behind at most its window of copies in flight); inline (the
                # CUDA default, ``deferred``) once those uploads are queued, below.
                deferred = bool(jobs) and self.onload.deferred and not self.early_onload
                # timing marks for split_feedback: a batch that both onloads and recomputes
                marks = {} if (self.split_feedback is not None and s.cuda and jobs and any(
                    p.host_recomputed for p in plans)) else None
                if not deferred:
                    handles = self.onload.submit(jobs, after=self._compute_done)
                t = self._mark(stages, "onload_submit", t)
                users = [UserSlice(tokens[p.key][p.start:], p.start, batch[i].candidates)
                         for i, p in zip(live, plans)]
                pb = pack_jagged(users, self.staging)
                desc, app = self._descriptor(plans, pb)
                t = self._mark(stages, "layout", t)
                self._stamp("host_layout")
                # Batches that onload host chunks stay eager (per-layer onload events).
                scores = None if jobs else self._forward_planned(pb, desc, app, stages)
                if scores is None:
                    up = self._upload(pb, app)
                    self._stamp("host_uploaded")
                    if deferred:  # behind the batch's uploads and attention plans, on its thread
                        cfg = self.model.cfg
                        prepare_plans(desc, self.device, self.model.item_embedding.weight.dtype,
                                      cfg.num_heads, cfg.head_dim)
                        self._stamp("host_plans")
                        handles = self.onload.submit(jobs, after=self._compute_done)
                    scores = self._forward_eager(up, desc, handles, stages, marks)
                pb.release()  # (the eager upload gave it back behind its copy already)
                handles.done()
                if marks is not None:  # the last layer's K/V in pages (all scatters issued)
                    marks["landed"] = s.scatter.record_event(s.event(timing=True))
                self._compute_done = s.compute.record_event(s.event())
                host, event, pinned = self.score_buffers.read_back(scores)
            self._mark(stages, "model", t)
        except BaseException:
            self._quiesce(handles)
            with self._meta:
                self.manager.abort_batch(plans)
            raise
        return InFlight(batch, resolved, live, stages, plans=plans, tokens=tokens, host=host,
                        event=event, version=self.version, pinned=pinned, marks=marks)

    def _stamp(self, name: str) -> None:
        """A traced batch's host stamp ``name`` (``host_*``): when this thread got there."""
        if self.trace_events is not None:
            self.trace_events[name] = time.perf_counter()

    def finish(self, f: "InFlight") -> BatchOutcome:
        """Wait for the batch's scores, then commit its users' K/V to the cache metadata."""
        if not f.live:
            return BatchOutcome(list(f.resolved), f.stages, f.version)
        stages, t = f.stages, time.perf_counter()
        try:
            scores = f.wait()
        except BaseException:
            self._quiesce(None)
            with self._meta:
                self.manager.abort_batch(f.plans)
            raise
        t = self._mark(stages, "readback", t)
        if f.marks:  # (the scores are here: the forward, and so its waits, are done)
            m = f.marks
            m["landed"].synchronize()
            self.split_feedback.update(m["ref"].elapsed_time(m["reached"]),
                                       m["ref"].elapsed_time(m["landed"]))
        # The commit runs after the replies (``background``): the scores do not depend on it,
        # and the batch loop keeps these users out of later batches until it is done.
        with self._meta:
            self._to_commit.append(f)
        results: list = list(f.resolved)
        o = 0
        for i, p in zip(f.live, f.plans):
            c = len(f.batch[i].candidates)
            results[i] = (scores[o:o + c].copy(), {
                "history_tokens": p.length, "tokens_from_gpu": p.from_gpu,
                "tokens_from_host": p.from_host, "tokens_recomputed": p.length - p.start,
                "tokens_host_recomputed": p.host_recomputed,
                "tier": _tier(p)})
            o += c
        self.score_buffers.give_back(f.pinned)  # the answers hold copies now
        self._mark(stages, "postprocess", t)
        return BatchOutcome(results, stages, f.version)

    def _quiesce(self, handles) -> None:
        """Before a failed batch's pages go back to the pool: its onload has stopped issuing
        copies (within ``streams.TRANSFER_TIMEOUT_S``), and later device work waits for those
        already issued. Otherwise a retry could reuse a page while a stale scatter still heads
        for it. A transfer that never settles leaves the pages unusable: the engine is dead."""
        if handles is not None and not handles.settle():
            raise EngineDead("an onload transfer did not settle in time: the pages it writes "
                             "cannot be reused safely")
        self.streams.fence_transfers()

    def _upload(self, pb, app):
        """The batch's host-to-device copies: its rows and the append slots."""
        jb = upload_jagged(pb, self.device)
        slots = np.stack(app)
        # From a pooled page-locked buffer: a pageable copy would block this thread behind a
        # host hit's onload copies, and a pin_memory() per batch took 5-6 ms beside them.
        app_dev = (torch.from_numpy(slots) if self.staging is None
                   else self.staging.upload(slots, self.device))  # one copy
        return jb, app_dev

    def _forward_eager(self, up, desc, handles, stages, marks=None) -> torch.Tensor:
        """The layer loop from Python over the batch's uploads ``up``: each layer appends its
        new K/V, waits for its own onloaded history (deeper layers' are still in flight), then
        attends. ``marks`` (a dict): timing events of where the compute reached its last
        layer's wait, from a reference at its start (``split_feedback``)."""
        s = self.streams
        last = self.model.cfg.num_layers - 1
        if marks is not None:
            marks["ref"] = s.compute.record_event(s.event(timing=True))
        jb, (app_rows, app_p, app_o) = up
        store, cfg = self.stores.pages, self.model.cfg
        wait = [0.0]
        ev = self.trace_events

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            if ev is not None:  # the layer's projections are queued: compute reached it
                ev[f"append_{layer}"] = s.compute.record_event(s.event(timing=True))
                ev[f"host_append_{layer}"] = time.perf_counter()  # and when the host did
            if app_rows.numel():
                paged_kv.append_rows(store, layer, k, v, app_rows, app_p, app_o)
            if marks is not None and layer == last:
                marks["reached"] = s.compute.record_event(s.event(timing=True))
            t0 = time.perf_counter()
            handles.wait(layer)  # this layer's history K/V only
            wait[0] += time.perf_counter() - t0
            if ev is not None:
                ev[f"attention_{layer}"] = s.compute.record_event(s.event(timing=True))
            return hstu_attention_jagged(q, k, v, desc, layer, cfg.alpha, cfg.attn_max_len,
                                         cand_only=cfg.is_last(layer))

        scores = self.model(jb, attention, rows=self._eager_rows(len(jb.token_ids), store))
        if ev is not None:
            ev["done"] = s.compute.record_event(s.event(timing=True))
        stages["onload_wait"] = wait[0] * 1e3
        return scores

    def _commit(self) -> None:
        """Finished batches' K/V into the cache metadata, in the order they finished. A commit
        that fails gives its batch's pages back and is logged and counted, never raised: its
        answers were already right, those users miss next time, and the batch being submitted
        (which may run this) is not failed for it."""
        with self._meta:  # (re-entrant: callers that hold it already may call this)
            self._commit_locked()

    def _commit_locked(self) -> None:
        while self._to_commit:
            f = self._to_commit.popleft()
            t = time.perf_counter()
            try:
                self.manager.commit_batch(f.plans, f.tokens,
                                          {f.batch[i].user: f.resolved[i].stamp for i in f.live})
            except Exception:  # noqa: BLE001
                log.exception("commit of a finished rank batch failed; its pages go back")
                self.commit_failures += 1
                self.manager.abort_batch(f.plans)
                continue
            self._remember(f.batch, f.resolved)
            f.stages["commit"] = (time.perf_counter() - t) * 1e3

    @property
    def has_background_work(self) -> bool:
        return (bool(self._to_commit) or bool(self.manager.res.wanted)
                or not self.offload.completions.empty())

    def background(self) -> None:
        """After the replies: commit finished batches, then start offloading users' filled
        chunks (within the quota); returns at once. Finished offloads are applied to the
        metadata here and at the next batch."""
        with self._meta:
            self._commit()
            self._apply_completions()
            jobs = self.manager.plan_offloads()
        if jobs:
            self.offload.submit(jobs, after=self._compute_done)
        with self._meta:
            self._apply_completions()

    def _apply_completions(self) -> None:
        q = self.offload.completions
        while not q.empty():
            done = q.get()  # streams.offload.OffloadDone
            if done.ok:
                self.manager.finish_offload(done.job)
                self.bytes_offloaded += done.nbytes
            else:
                self.manager.abort_offload(done.job)

    def flush(self, timeout: float | None = 60.0) -> None:
        """Wait for offloads in flight and apply them (tests, benchmarks, shutdown)."""
        self._commit()
        self.offload.wait_idle(timeout)
        with self._meta:
            self._apply_completions()

    def close(self, timeout: float | None = 60.0) -> None:
        """Offloads in flight get ``timeout`` s to finish (unfinished ones are left unpersisted,
        never marked done), then the pipelines and stores are released."""
        self._commit()
        self._apply_completions()
        self.offload.close(timeout)
        self._apply_completions()
        self.onload.close()
        if self.streams.cuda:
            torch.cuda.synchronize(self.device)
        self.stores.close()

    def snapshot(self) -> dict:
        out = self.manager.snapshot()
        out.update(bytes_onloaded=self.bytes_onloaded, bytes_offloaded=self.bytes_offloaded,
                   onload_faults=self.onload_faults, offloads_in_flight=self.offload.inflight,
                   commit_failures=self.commit_failures, onload_split=self._split_state())
        return out
