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

import numpy as np
import torch

from ..cache import HistoryStore, KVCacheManager
from ..cache.store import KVStores
from ..kernels import paged_kv
from ..models.hstu import HSTU
from .rank import BatchOutcome, PreparedRank, RankRunner, UserSlice, build_jagged, interleave

log = logging.getLogger("streamgr.cache")


def _tier(plan) -> str:
    if plan.length == 0:
        return "none"
    if plan.from_host:
        return "host"
    return "gpu" if plan.from_gpu else "miss"


class CachedRankRunner(RankRunner):
    def __init__(self, model: HSTU, version: str, device: torch.device, history: HistoryStore,
                 manager: KVCacheManager, stores: KVStores) -> None:
        super().__init__(model, version, device, history)
        self.manager, self.stores = manager, stores
        self.bytes_onloaded = 0
        self.bytes_offloaded = 0

    def _index(self, plans, jb) -> tuple:
        """Slots to append new K/V to, slots to read each user's history from, and the
        permutation that lays [gathered history; this batch's k] out as [history, candidates]
        per user."""
        app_p, app_o, app_rows, g_p, g_o, perm, kv_off = [], [], [], [], [], [], [0]
        g_total = sum(p.length for p in plans if not p.transient)
        g = 0
        for b, p in enumerate(plans):
            q0 = jb.q_offsets[b]
            new = p.length - p.start
            c = jb.num_candidates[b]
            if p.transient:
                perm.append(np.arange(q0, q0 + new) + g_total)
            else:
                pi, po = self.stores.slots(p.pages, p.start, p.length)
                app_p.append(pi), app_o.append(po), app_rows.append(np.arange(q0, q0 + new))
                pi, po = self.stores.slots(p.pages, 0, p.length)
                g_p.append(pi), g_o.append(po)
                perm.append(np.arange(g, g + p.length))
                g += p.length
            perm.append(np.arange(q0 + new, q0 + new + c) + g_total)
            kv_off.append(kv_off[-1] + p.length + c)
        cat = lambda xs: torch.from_numpy(np.concatenate(xs) if xs else np.zeros(0, np.int64)).to(self.device)
        return cat(app_p), cat(app_o), cat(app_rows), cat(g_p), cat(g_o), cat(perm), kv_off

    def run(self, batch: list[PreparedRank]) -> BatchOutcome:
        stages: dict[str, float] = {}
        t = time.perf_counter()
        resolved = self._resolve(batch)
        live = [i for i, h in enumerate(resolved) if not isinstance(h, Exception)]
        if not live:
            return BatchOutcome(list(resolved), stages)
        tokens = {batch[i].user: interleave(*resolved[i]) for i in live}
        t = self._mark(stages, "strip", t)
        plans = self.manager.plan_batch([(batch[i].user, tokens[batch[i].user]) for i in live],
                                        self.version)
        t = self._mark(stages, "metadata", t)
        try:
            onloads = []
            for p in plans:
                if p.onload:
                    buf, page_ids = self.stores.onload(p.onload, p.pages)
                    onloads.append((buf, page_ids))
                    self.bytes_onloaded += buf.numel() * buf.element_size()
            t = self._mark(stages, "onload_submit", t)
            users = [UserSlice(tokens[p.key][p.start:], p.start, batch[i].candidates)
                     for i, p in zip(live, plans)]
            jb = build_jagged(users, self.device)
            app_p, app_o, app_rows, g_p, g_o, perm, kv_off = self._index(plans, jb)
            t = self._mark(stages, "layout", t)
            store = self.stores.pages

            def kv_source(layer: int, k: torch.Tensor, v: torch.Tensor):
                for buf, page_ids in onloads:
                    self.stores.scatter_layer(layer, buf, page_ids)
                paged_kv.append_kv(store, layer, k[app_rows], v[app_rows], app_p, app_o)
                gk, gv = paged_kv.gather_kv(store, layer, g_p, g_o)
                return (torch.cat([gk, k]).index_select(0, perm),
                        torch.cat([gv, v]).index_select(0, perm), kv_off)

            scores = self.model(jb, kv_source).cpu().numpy()
            t = self._mark(stages, "model", t)
        except BaseException:
            self.manager.abort_batch(plans)
            raise
        self.manager.commit_batch(plans, tokens)
        self._remember(batch, resolved)
        t = self._mark(stages, "commit", t)
        results: list = list(resolved)
        o = 0
        for i, p in zip(live, plans):
            c = len(batch[i].candidates)
            results[i] = (scores[o:o + c], {
                "history_tokens": p.length, "tokens_from_gpu": p.from_gpu,
                "tokens_from_host": p.from_host, "tokens_recomputed": p.length - p.start,
                "tier": _tier(p)})
            o += c
        self._mark(stages, "postprocess", t)
        return BatchOutcome(results, stages)

    @property
    def has_background_work(self) -> bool:
        return bool(self.manager.wanted)

    def background(self) -> None:
        """Offload users' filled chunks to host memory, within the quota; failures are retried."""
        for job in self.manager.plan_offloads():
            try:
                self.bytes_offloaded += self.stores.offload(job)
            except Exception:
                log.exception("offload of user %r failed; will retry", job.key)
                self.manager.abort_offload(job)
                continue
            self.manager.finish_offload(job)

    def snapshot(self) -> dict:
        out = self.manager.snapshot()
        out.update(bytes_onloaded=self.bytes_onloaded, bytes_offloaded=self.bytes_offloaded)
        return out
