"""``Engine``: the embedded async facade over the model, the batcher and the executor thread.

The event loop owns admission and batching; model work runs on one executor thread (torch
releases the GIL, so the loop keeps accepting while a batch computes). Bad input raises its
typed error at the call and never reaches a batch; a fault inside a batch fails that batch's
requests and the engine keeps serving, except a CUDA fault, which marks the engine dead.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping

import torch

from ..api import (GenerateRequest, GenerateResult, GenerateStats, RankRequest, RankResult,
                   RankStats)
from ..config import Spec, load_spec
from ..errors import (EngineClosed, EngineDead, Overloaded, StreamgrError,
                      UnsupportedRequest)
from ..cache import HistoryStore, KVCacheManager
from ..cache.store import KVStores
from ..errors import ContractError
from ..models import build_ranker
from .batcher import Batcher, Pending
from .cached_rank import CachedRankRunner
from .generate import GenerateRunner
from .metrics import EngineMetrics
from .preflight import check_cache_memory
from .rank import RankRunner, prepare_rank

log = logging.getLogger("streamgr.engine")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise StreamgrError("engine.device = \"cuda\" but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


GEN_IN_FLIGHT = 2  # generate batches submitted to the device but not yet answered


class Engine:
    """Embedded serving engine. ``async with Engine.from_spec("rank-small") as engine: ...``"""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.device = resolve_device(spec.engine.device)
        self.dtype = resolve_dtype(spec.model.dtype, self.device)
        self._loads = 0
        self.runner: RankRunner | None = None
        self.gen_runner: GenerateRunner | None = None
        if spec.model.family == "hstu":
            model, version = self._build_model(spec.model)
            self.runner = self._build_runner(model, version)
        if spec.generate_model is not None:
            from ..runtime.deployment import build_generator
            gmodel, source, trie, contract = build_generator(spec, self.device, self.dtype)
            self._loads += 1
            self.gen_runner = GenerateRunner(gmodel, f"{self._loads}:{source}", trie, contract, spec)
        self.metrics = EngineMetrics()
        self._batcher: Batcher | None = None
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._inflight = 0
        self._dead: BaseException | None = None
        self._closing = False

    def _build_model(self, model_spec):
        model, source = build_ranker(model_spec, self.device, self.dtype)
        self._loads += 1
        # The load counter makes a reloaded checkpoint a new version even at the same path.
        return model, f"{self._loads}:{source}"

    def _build_runner(self, model, version: str) -> RankRunner:
        history = HistoryStore(self.spec.engine.history_events)
        c = self.spec.cache
        if c.mode == "recompute":
            return self._with_plans(RankRunner(model, version, self.device, history), None, 1)
        hierarchical = c.mode == "hierarchical"
        cfg = model.cfg
        check_cache_memory(c, cfg.num_layers, cfg.num_heads, cfg.head_dim, self.dtype,
                           self.device, hierarchical)
        manager = KVCacheManager(c.page_tokens, c.chunk_tokens, c.device_pages,
                                 c.host_chunks if hierarchical else 0, c.offload_quota_tokens,
                                 hierarchical=hierarchical)
        stores = KVStores(cfg.num_layers, cfg.num_heads, cfg.head_dim, c.page_tokens,
                          c.chunk_tokens, c.device_pages, c.host_chunks if hierarchical else 0,
                          self.dtype, self.device, c.host_pinned)
        return self._with_plans(CachedRankRunner(model, version, self.device, history, manager,
                                                 stores), stores.pages, c.page_tokens)

    def _with_plans(self, runner: RankRunner, store, page_tokens: int) -> RankRunner:
        """Rank plans (CUDA graphs of the forward) where their kernels run."""
        from .rank_plans import RankPlans
        n = self.spec.engine.rank_plans
        if n and RankPlans.usable(runner.model, self.device):
            runner.plans = RankPlans(runner.model, self.spec.engine.max_batch, n, store,
                                     page_tokens, self.device)
        return runner

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

    async def update_weights(self, checkpoint: str | None = None, init_seed: int | None = None) -> str:
        """Load new weights of the same architecture off the request path, then cut over between
        batches: in-flight batches finish on the old weights; cached K/V of the old version are
        never served again (they are dropped as their users return). Returns the new version."""
        import msgspec
        if self.runner is None:
            raise UnsupportedRequest("update_weights reloads the rank model; this spec has none")
        if (checkpoint is None) == (init_seed is None):
            raise StreamgrError("give exactly one of checkpoint or init_seed")
        new_spec = msgspec.structs.replace(self.spec.model, checkpoint=checkpoint, init_seed=init_seed)
        loop = asyncio.get_running_loop()
        model, version = await loop.run_in_executor(None, self._build_model, new_spec)
        if model.cfg != self.runner.model.cfg:
            raise ContractError(f"new weights have architecture {model.cfg}, the engine serves "
                                f"{self.runner.model.cfg}")
        # On the executor thread, so the swap falls between two batches.
        await loop.run_in_executor(self._executor, self.runner.set_model, model, version)
        return version

    @classmethod
    def from_spec(cls, path_or_spec: str | Path | Spec | Mapping[str, Any],
                  overrides: Mapping[str, Any] | None = None) -> "Engine":
        return cls(load_spec(path_or_spec, overrides))

    @property
    def model_config(self):
        return self.model.cfg

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> "Engine":
        if self._task is not None:
            return self
        self._closing = False
        e = self.spec.engine
        self._batcher = Batcher(e.max_batch, e.max_wait_ms)
        self._gen_batcher = Batcher(e.max_batch, e.max_wait_ms)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamgr-exec")
        # Waits for generate batches on the device and answers them (see _gen_loop).
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamgr-finish")
        loop = asyncio.get_running_loop()
        if self.gen_runner is not None:  # decode plans of the common shapes, before serving
            await loop.run_in_executor(self._executor, self.gen_runner.warm_up)
        if e.gc_freeze:
            gc.collect()
            gc.freeze()
        self._task = loop.create_task(self._loop(), name="streamgr-batcher")
        self._gen_task = loop.create_task(self._gen_loop(), name="streamgr-gen-batcher")
        return self

    async def close(self, drain_timeout: float = 30.0) -> None:
        """Finish admitted requests (up to ``drain_timeout`` s), then stop."""
        if self._task is None:
            return
        self._closing = True
        t_end = time.monotonic() + drain_timeout
        loops = [t for t in (self._task, self._gen_task) if t is not None]
        # Both loops drain (a generate-only engine's rank loop ends at once: not a reason to
        # stop waiting), until the deadline or until every loop has died.
        while self._inflight and time.monotonic() < t_end and not all(t.done() for t in loops):
            await asyncio.sleep(0.005)
        for task in (self._task, self._gen_task):
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
        self._task = None

    async def __aenter__(self) -> "Engine":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- requests ----------------------------------------------------------------------------

    def _admit(self) -> None:
        if self._dead is not None:
            raise EngineDead(f"engine is dead: {self._dead!r}")
        if self._task is None or self._closing:
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

    async def _gen_loop(self) -> None:
        """Generate batches, pipelined: the executor thread queues batch i+1 on the device while
        the completion thread waits for batch i and answers it, so the device does not idle
        while the host builds inputs and answers (at most ``GEN_IN_FLIGHT`` batches between
        submit and answer)."""
        loop = asyncio.get_running_loop()
        slots = asyncio.Semaphore(GEN_IN_FLIGHT)
        pending: set[asyncio.Task] = set()
        try:
            while True:
                batch = await self._gen_batcher.next_batch()
                try:
                    await slots.acquire()
                    t_start = time.perf_counter()
                    handle = await loop.run_in_executor(
                        self._executor, self.gen_runner.submit, [p.payload for p in batch])
                except asyncio.CancelledError:  # closing: the batch in hand is refused
                    self._refuse(batch)
                    raise
                except Exception as err:
                    slots.release()
                    self._on_batch_error(batch, err)
                    continue
                task = loop.create_task(self._gen_finish(batch, handle, t_start, slots))
                pending.add(task)
                task.add_done_callback(pending.discard)
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _gen_finish(self, batch: list[Pending], handle, t_start: float,
                          slots: asyncio.Semaphore) -> None:
        loop = asyncio.get_running_loop()
        try:
            outcome = await loop.run_in_executor(self._finisher, self.gen_runner.finish, handle)
        except asyncio.CancelledError:
            self._refuse(batch)
            raise
        except Exception as err:
            self._on_batch_error(batch, err)
            return
        finally:
            slots.release()
        t_done = time.perf_counter()
        for p, ((items, scores, sids), per) in zip(batch, outcome.results):
            if p.future.done():
                continue
            stats = GenerateStats(batch_size=len(batch), queue_ms=(t_start - p.enqueued) * 1e3,
                                  compute_ms=(t_done - t_start) * 1e3,
                                  total_ms=(t_done - p.enqueued) * 1e3,
                                  steps=outcome.stages, **per)
            self.metrics.observe_generate(stats)
            p.future.set_result(GenerateResult(items=items, scores=scores, sids=sids,
                                               stats=stats))

    @staticmethod
    def _refuse(batch: list[Pending]) -> None:
        for p in batch:
            if not p.future.done():
                p.future.set_exception(EngineClosed("engine closed"))

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
        return out

    # -- the batch loop ------------------------------------------------------------------------

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self.runner is not None:
            batch = await self._batcher.next_batch()
            t_start = time.perf_counter()
            try:
                outcome = await loop.run_in_executor(
                    self._executor, self.runner.run, [p.payload for p in batch])
            except asyncio.CancelledError:  # closing: the batch in hand is refused
                self._refuse(batch)
                raise
            except Exception as err:  # the batch fails; the engine serves on
                self._on_batch_error(batch, err)
                continue
            t_done = time.perf_counter()
            compute_ms = (t_done - t_start) * 1e3
            for p, res in zip(batch, outcome.results):
                if p.future.done():
                    continue
                if isinstance(res, Exception):
                    self.metrics.count("rank_invalid")
                    p.future.set_exception(res)
                    continue
                scores, per = res
                stats = RankStats(batch_size=len(batch), queue_ms=(t_start - p.enqueued) * 1e3,
                                  compute_ms=compute_ms, total_ms=(t_done - p.enqueued) * 1e3,
                                  stages=outcome.stages, **per)
                self.metrics.observe_rank(stats)
                p.future.set_result(RankResult(scores=scores.tolist(), stats=stats))
            if not self.runner.has_background_work:
                continue
            try:  # after the replies: offload never delays them
                await loop.run_in_executor(self._executor, self.runner.background)
            except Exception:
                log.exception("background work failed")
                self.metrics.count("background_errors")

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
