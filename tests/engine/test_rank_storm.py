"""A storm over the rank cache through the engine: hierarchical with a device tier too small for
its users (evictions, host hits, half of each host hit recomputed by ``onload_split``), two
batches in flight, delta and full requests, histories rewritten in the middle, requests
cancelled while queued, and weight updates and rollbacks under the traffic. Every answer equals
a recompute engine's answer on the weights version stamped in its stats. CPU, fp32."""

from __future__ import annotations

import asyncio
import random
import re

import numpy as np
import pytest

from streamgr import Engine, RankRequest
from streamgr.errors import HistoryRequired

BASE = {"engine.device": "cpu", "model.dtype": "float32", "model.max_history": 400,
        "model.max_candidates": 16, "model.num_items": 300, "engine.max_wait_ms": 0.5,
        "cache.page_tokens": 16, "cache.chunk_tokens": 64}
CACHED = {**BASE, "cache.mode": "hierarchical", "cache.device_pages": 48,
          "cache.host_chunks": 64, "cache.offload_quota_tokens": 512,
          "cache.onload_split": 0.5, "engine.rank_in_flight": 2}


class Visitor:
    """One user's side: its history, what it last sent, a rewrite now and then."""

    def __init__(self, user: int, rng: random.Random) -> None:
        self.user, self.rng = user, rng
        self.items: list[int] = []
        self.actions: list[int] = []
        self.sent: int | None = None  # events the engine was last given (None: send it all)

    def next_request(self) -> tuple[RankRequest, RankRequest]:
        """(what is sent, the full request it stands for)."""
        rng = self.rng
        if len(self.items) > 10 and rng.random() < 0.05:  # an earlier event rewritten
            self.items[rng.randrange(len(self.items) - 5)] = rng.randrange(300)
            self.sent = None  # a delta would extend the prefix the engine holds
        n = rng.randint(1, 12)
        if len(self.items) + n > 380:  # start over (a history the cache no longer matches)
            self.items, self.actions, self.sent = [], [], None
        self.items += [rng.randrange(300) for _ in range(n)]
        self.actions += [rng.randrange(16) for _ in range(n)]
        cands = rng.sample(range(300), rng.randint(1, 16))
        full = RankRequest(user_id=self.user, items=list(self.items), actions=list(self.actions),
                           candidates=cands)
        b = self.sent
        if b is not None and rng.random() < 0.5:
            return RankRequest(user_id=self.user, items=self.items[b:], actions=self.actions[b:],
                               candidates=cands, base_len=b), full
        return full, full


@pytest.mark.slow
async def test_rank_storm_every_answer_equals_recompute_on_its_version():
    rng = random.Random(7)
    visitors = [Visitor(u, rng) for u in range(24)]
    locks = [asyncio.Lock() for _ in visitors]  # one request of a user at a time: its bookkeeping
    answered: list = []  # (full request, scores, version, tier)
    cancelled = 0

    async with Engine.from_spec("rank-small", CACHED) as eng:
        async def visit(c: Visitor) -> None:
            nonlocal cancelled
            sent, full = c.next_request()
            try:
                if rng.random() < 0.05:  # the caller gives up before its batch runs
                    t = asyncio.ensure_future(eng.rank(sent))
                    await asyncio.sleep(0)
                    t.cancel()
                    try:
                        r = await t
                    except asyncio.CancelledError:
                        cancelled += 1
                        c.sent = None  # whether the engine took the history is unknown
                        return
                else:
                    r = await eng.rank(sent)
            except HistoryRequired:  # the engine no longer holds that prefix: resend it all
                r = await eng.rank(full)
            c.sent = len(c.items)
            answered.append((full, np.asarray(r.scores), r.stats.version, r.stats.tier))

        async def traffic() -> None:
            for _ in range(100):
                u = rng.randrange(len(visitors))
                async with locks[u]:
                    await visit(visitors[u])

        async def updates() -> None:
            for step in range(5):
                await asyncio.sleep(0.1)
                if step % 3 == 2:
                    await eng.rollback()
                else:
                    await eng.update(weights=100 + step)

        await asyncio.gather(*(traffic() for _ in range(6)), updates())
        counters = eng.stats()["counters"]

    tiers = {t for *_, t in answered}
    versions = {v for _, _, v, _ in answered}
    assert {"host", "gpu", "miss"} <= tiers, tiers
    assert len(versions) >= 4, versions
    assert cancelled > 0 and counters["tokens_host_recomputed"] > 0
    by_version: dict[str, list] = {}
    for full, scores, v, _ in answered:
        by_version.setdefault(v, []).append((full, scores))
    for v, rows in by_version.items():
        seed = int(re.search(r"seed:(\d+)", v).group(1))
        async with Engine.from_spec("rank-small", {**BASE, "cache.mode": "recompute",
                                                  "model.init_seed": seed}) as ref:
            want = await asyncio.gather(*(ref.rank(full) for full, _ in rows))
        for (full, got), w in zip(rows, want):
            np.testing.assert_allclose(got, w.scores, rtol=1e-4, atol=1e-5,
                                       err_msg=f"user {full.user_id} on {v}")
