"""``Engine``: the embedded async facade: admission, lifecycle, stats, one ``BatchLoop`` per runner.

The event loop owns admission and batching; model work runs on one executor thread (torch
releases the GIL, so the loop keeps accepting while a batch computes) and batches complete on a
completion thread (``engine/loop.py``); runners are built by ``engine/factory.py``. Bad input raises its
typed error at the call and never reaches a batch; a fault inside a batch fails that batch's
requests and the engine keeps serving, except a CUDA fault, which marks the engine dead.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Mapping

from ..api import GenerateRequest, GenerateResult, RankRequest, RankResult
from ..config import Spec, load_spec
from ..errors import EngineClosed, EngineDead, Overloaded, StreamgrError, UnsupportedRequest
from .batcher import Pending
from .factory import Builder, resolve_device, resolve_dtype
from .generate import GenerateRunner
from .metrics import EngineMetrics
from .rank import BatchOutcome, RankRunner, prepare_rank
from .resources import EngineResources, check_loop
from .status import engine_stats, fail_batch
from .updates import Updates

log = logging.getLogger("streamgr.engine")


class Engine(Updates):
    """Embedded serving engine. ``async with Engine.from_spec("rank-small") as engine: ...``"""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.device = resolve_device(spec.engine.device)
        self.dtype = resolve_dtype(spec.model.dtype, self.device)
        self._build = Builder(spec, self.device, self.dtype)
        self.runner: RankRunner | None = None
        self.gen_runner: GenerateRunner | None = None
        if spec.model.family == "hstu":
            self.runner = self._build.rank_runner(*self._build.ranker(spec.model))
        if spec.generate_model is not None:
            self.gen_runner = self._build.generate_runner()
        self.metrics = EngineMetrics()
        self._res: EngineResources | None = None  # batchers, threads, loops: while started
        self._abandoned: EngineResources | None = None  # a start's, cut off while warming up
        self._inflight = 0
        self._dead: BaseException | None = None
        self._closing = False
        self._init_updates()  # updates.py
        self._rank_previous = None  # (model, version) kept for a rank rollback

    @property
    def model(self):
        return self.runner.model if self.runner is not None else self.gen_runner.model

    @property
    def weights_version(self) -> str:
        return (self.runner or self.gen_runner).version

    @property
    def serves_rank(self) -> bool:
        return self.runner is not None

    @property
    def serves_generate(self) -> bool:
        return self.gen_runner is not None

    @classmethod
    def from_spec(cls, path_or_spec: str | Path | Spec | Mapping[str, Any],
                  overrides: Mapping[str, Any] | None = None) -> "Engine":
        return cls(load_spec(path_or_spec, overrides))

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> "Engine":
        if self._res is not None:  # started already: on this loop, else WrongEventLoop
            check_loop(self._res)
            return self
        self._closing = False
        self._res = await EngineResources.open(self)  # warmed up and serving (resources.py)
        return self

    async def close(self, drain_timeout: float = 30.0) -> None:
        """Finish admitted requests (up to ``drain_timeout`` s), then stop."""
        res = self._res
        if res is None:
            return
        check_loop(res, closing=True)
        self._closing = True
        try:
            await res.aclose(self, drain_timeout)
        finally:
            if res.closed:  # (not when only its caller was cancelled: the next close waits)
                self._res = None

    async def __aenter__(self) -> "Engine":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- requests ----------------------------------------------------------------------------

    def _admit(self) -> None:
        check_loop(self._res)
        if self._dead is not None:
            raise EngineDead(f"engine is dead: {self._dead!r}")
        if self._res is None or self._closing:
            raise EngineClosed("engine is not running (use `async with engine:` or start())")
        if self._inflight >= self.spec.engine.max_queue:
            self.metrics.count("overloaded")
            raise Overloaded(f"{self._inflight} requests in flight (engine.max_queue)")

    def submit_rank(self, request: RankRequest) -> asyncio.Future:
        """Admit a rank request and return the future of its ``RankResult``, without a task.

        Bad input raises its typed error here, before anything is queued. Cancelling the future
        withdraws the request: the batcher skips it if it has not run yet.
        """
        runner = self.runner
        return self._submit("rank", runner, lambda: prepare_rank(request, runner.model.cfg),
                            lambda p, fut: ("rank", p.user))  # one batch per user at a time

    def submit_generate(self, request: GenerateRequest) -> asyncio.Future:
        """Admit a generate request; the future of its ``GenerateResult``."""
        runner = self.gen_runner
        # Generation keeps no per-user state: the same user may share a batch.
        return self._submit("generate", runner, lambda: runner.prepare(request),
                            lambda p, fut: ("gen", id(fut)))

    def _submit(self, kind: str, runner, prepare, key) -> asyncio.Future:
        self._admit()
        if runner is None:
            raise UnsupportedRequest(f"spec {self.spec.name} does not serve {kind}")
        try:
            prepared = prepare()
        except StreamgrError:
            self.metrics.count(f"{kind}_invalid")
            raise
        fut = asyncio.get_running_loop().create_future()
        self._inflight += 1
        fut.add_done_callback(lambda f: self._settled(f, kind))
        batcher = self._res.rank_batcher if kind == "rank" else self._res.gen_batcher
        batcher.put(Pending(key(prepared, fut), prepared, fut))
        return fut

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """The top-k items (and SIDs, scores) for a user's history by beam search."""
        return await self.submit_generate(request)

    def _settled(self, fut: asyncio.Future, kind: str) -> None:
        self._inflight -= 1
        if fut.cancelled():  # the caller went away
            self.metrics.count(f"{kind}_cancelled")

    async def rank(self, request: RankRequest) -> RankResult:
        """Scores for ``request.candidates``, in order. Raises typed errors for bad input."""
        return await self.submit_rank(request)

    def stats(self) -> dict[str, Any]:
        return engine_stats(self)

    def _on_batch_error(self, batch: list[Pending], err: Exception) -> None:
        fail_batch(self, batch, err)

    # -- offline (not started): replays and benchmarks run batches synchronously -----------

    def run_batch(self, requests: list[RankRequest], sync_stages: bool = False,
                  background: bool = True) -> BatchOutcome:
        """One rank batch on this thread, not while started (replays); ``background=False``
        leaves the after-reply work (commit, offload) to :meth:`run_background`."""
        if self._res is not None:
            raise StreamgrError("run_batch is for an engine that is not started")
        if self.runner is None:
            raise UnsupportedRequest(f"spec {self.spec.name} does not serve rank")
        prepared = [prepare_rank(r, self.runner.model.cfg) for r in requests]
        self.runner.sync_stages = sync_stages
        out = self.runner.run(prepared)
        if background:
            self.runner.background()
        return out

    def run_background(self) -> None:
        if self.runner is not None:
            self.runner.background()

    def close_offline(self) -> None:
        """After ``run_batch``: pending offloads flushed, the runner's threads stopped."""
        if self.runner is not None:
            if hasattr(self.runner, "flush"):
                self.runner.flush()
            self.runner.close()
