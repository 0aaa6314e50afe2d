"""``Engine``: the embedded async facade: admission, lifecycle, stats, one ``BatchLoop`` per runner.

The event loop owns admission and batching; model work runs on one executor thread (torch
releases the GIL, so the loop keeps accepting while a batch computes) and batches complete on a
completion thread (``engine/loop.py``); runners are built by ``engine/factory.py``. Bad input raises its
typed error at the call and never reaches a batch; a fault inside a batch fails that batch's
requests and the engine keeps serving, except a CUDA fault, which marks the engine dead.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Mapping

import torch

from ..api import GenerateRequest, GenerateResult, RankRequest, RankResult
from ..config import Spec, load_spec
from ..errors import (EngineClosed, EngineDead, Overloaded, StreamgrError,
                      UnsupportedRequest)
from .answers import answer_generate, answer_rank
from .batcher import Batcher, Pending
from .cached_rank import CachedRankRunner
from .factory import Builder, resolve_device, resolve_dtype
from .generate import GenerateRunner
from .loop import BatchLoop
from .metrics import EngineMetrics
from .updates import Updates
from .rank import RankRunner, prepare_rank

log = logging.getLogger("streamgr.engine")


GEN_IN_FLIGHT = 2  # generate batches submitted to the device but not yet answered


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
        self._batcher: Batcher | None = None
        self._tasks: list[asyncio.Task] | None = None  # one per BatchLoop, while started
        self._executor: ThreadPoolExecutor | None = None
        self._inflight = 0
        self._dead: BaseException | None = None
        self._closing = False
        self._updating: asyncio.Lock | None = None  # live updates, one at a time (updates.py)
        self._rank_previous = None  # (model, version) kept for a rank rollback

    def _build_model(self, model_spec):  # tests: new weights of the served architecture
        return self._build.ranker(model_spec)

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

    @property
    def model_config(self):
        return self.model.cfg

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> "Engine":
        if self._tasks is not None:
            return self
        self._closing = False
        e = self.spec.engine
        self._batcher = Batcher(e.max_batch, e.max_wait_ms)
        self._gen_batcher = Batcher(e.max_batch, e.max_wait_ms)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamgr-exec")
        # Waits for submitted batches on the device and hands them to be answered.
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamgr-finish")
        loop = asyncio.get_running_loop()
        if self.gen_runner is not None:  # decode plans of the common shapes, before serving
            await loop.run_in_executor(self._executor, self.gen_runner.warm_up)
        if e.gc_freeze:
            gc.collect()
            gc.freeze()
        count_bg = lambda: self.metrics.count("background_errors")  # noqa: E731
        # Rank batches in flight: the cache manager leases each batch's users (a user in flight
        # waits for a later batch), so batch n+1 is planned while batch n computes.
        loops = [BatchLoop("rank", self._batcher, self.runner, self._executor, self._finisher,
                           e.rank_in_flight, partial(answer_rank, self.metrics), self._on_batch_error, count_bg)
                 if self.runner is not None else None,
                 BatchLoop("generate", self._gen_batcher, self.gen_runner, self._executor,
                           self._finisher, GEN_IN_FLIGHT, partial(answer_generate, self.metrics),
                           self._on_batch_error, count_bg)
                 if self.gen_runner is not None else None]
        self._tasks = [loop.create_task(b.run(), name=f"streamgr-{b.name}") for b in loops if b]
        return self

    async def close(self, drain_timeout: float = 30.0) -> None:
        """Finish admitted requests (up to ``drain_timeout`` s), then stop."""
        if self._tasks is None:
            return
        self._closing = True
        t_end = time.monotonic() + drain_timeout
        loops = self._tasks
        # Every loop drains, until the deadline or until every loop has died.
        while self._inflight and time.monotonic() < t_end and not all(t.done() for t in loops):
            await asyncio.sleep(0.005)
        for task in loops:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        for b in (self._batcher, self._gen_batcher):
            b.fail_all(lambda: EngineClosed("engine closed"))
        for runner in (self.runner, self.gen_runner):
            if runner is not None:
                await asyncio.get_running_loop().run_in_executor(self._executor, runner.close)
        loop = asyncio.get_running_loop()
        for ex in (self._executor, self._finisher):  # joined off the event loop
            await loop.run_in_executor(None, ex.shutdown, True)
        if self.spec.engine.gc_freeze:  # what start froze may be garbage now: collectable again
            gc.unfreeze()
        self._tasks = None

    async def __aenter__(self) -> "Engine":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- requests ----------------------------------------------------------------------------

    def _admit(self) -> None:
        if self._dead is not None:
            raise EngineDead(f"engine is dead: {self._dead!r}")
        if self._tasks is None or self._closing:
            raise EngineClosed("engine is not running (use `async with engine:` or start())")
        if self._inflight >= self.spec.engine.max_queue:
            self.metrics.count("overloaded")
            raise Overloaded(f"{self._inflight} requests in flight (engine.max_queue)")

    def submit_rank(self, request: RankRequest) -> asyncio.Future:
        """Admit a rank request and return the future of its ``RankResult``, without a task.

        Bad input raises its typed error here, before anything is queued. Cancelling the future
        withdraws the request: the batcher skips it if it has not run yet.
        """
        self._admit()
        if self.runner is None:
            raise UnsupportedRequest(f"spec {self.spec.name} does not serve rank")
        try:
            prepared = prepare_rank(request, self.runner.model.cfg)
        except StreamgrError:
            self.metrics.count("rank_invalid")
            raise
        fut = asyncio.get_running_loop().create_future()
        self._inflight += 1
        fut.add_done_callback(self._settled_rank)
        self._batcher.put(Pending(("rank", prepared.user), prepared, fut))
        return fut

    def submit_generate(self, request: GenerateRequest) -> asyncio.Future:
        """Admit a generate request; the future of its ``GenerateResult``."""
        self._admit()
        if self.gen_runner is None:
            raise UnsupportedRequest(f"spec {self.spec.name} does not serve generate")
        try:
            prepared = self.gen_runner.prepare(request)
        except StreamgrError:
            self.metrics.count("generate_invalid")
            raise
        fut = asyncio.get_running_loop().create_future()
        self._inflight += 1
        fut.add_done_callback(self._settled_generate)
        # Generation keeps no per-user state: the same user may share a batch.
        self._gen_batcher.put(Pending(("gen", id(fut)), prepared, fut))
        return fut

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """The top-k items (and SIDs, scores) for a user's history by beam search."""
        return await self.submit_generate(request)

    def _settled(self, fut: asyncio.Future, kind: str) -> None:
        self._inflight -= 1
        if fut.cancelled():  # the caller went away
            self.metrics.count(f"{kind}_cancelled")

    def _settled_rank(self, fut: asyncio.Future) -> None:
        self._settled(fut, "rank")

    def _settled_generate(self, fut: asyncio.Future) -> None:
        self._settled(fut, "generate")

    async def rank(self, request: RankRequest) -> RankResult:
        """Scores for ``request.candidates``, in order. Raises typed errors for bad input."""
        return await self.submit_rank(request)

    def stats(self) -> dict[str, Any]:
        out = self.metrics.snapshot()
        if isinstance(self.runner, CachedRankRunner):
            out["cache"] = self.runner.snapshot()
        out["serves"] = [k for k, r in (("rank", self.runner), ("generate", self.gen_runner)) if r]
        if self.gen_runner is not None and self.gen_runner.search.plans is not None:
            out["decode_plans"] = self.gen_runner.search.plans.stats()
        if self.runner is not None and self.runner.plans is not None:
            out["rank_plans"] = self.runner.plans.stats()
        queued = (len(self._batcher) + len(self._gen_batcher)) if self._batcher else 0
        out.update(inflight=self._inflight, queued=queued,
                   device=str(self.device), dtype=str(self.dtype).replace("torch.", ""),
                   cache_mode=self.spec.cache.mode, weights_version=self.weights_version)
        if self.gen_runner is not None:
            out["generate_version"] = self.gen_runner.version
        return out

    def _on_batch_error(self, batch: list[Pending], err: Exception) -> None:
        log.exception("batch of %d failed", len(batch), exc_info=err)
        self.metrics.count("batch_errors")
        # A CUDA error (not an out-of-memory) leaves the context unusable: the engine is dead.
        fatal = not isinstance(err, torch.cuda.OutOfMemoryError) and "CUDA error" in str(err)
        if fatal:
            self._dead = err
        if fatal:
            wrapped = EngineDead(f"engine is dead: {err!r}")
        elif isinstance(err, StreamgrError):
            wrapped = err
        else:
            wrapped = StreamgrError(f"batch failed: {err!r}")
        for p in batch:
            if not p.future.done():
                p.future.set_exception(wrapped)
        if fatal:
            for b in (self._batcher, self._gen_batcher):
                b.fail_all(lambda: EngineDead(f"engine is dead: {err!r}"))
