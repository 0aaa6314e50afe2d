"""What a started engine owns: its batchers, the executor and completion threads, and one
``BatchLoop`` task per runner. ``Engine.start`` creates an ``EngineResources``; its ``aclose``
drains, stops and joins everything, is idempotent, and never blocks the event loop (threads are
joined on a worker thread). ``serving_gc``/``restore_gc``: the collector's and the thread
switch interval's settings while an engine serves (``engine.gc_freeze``, ``engine.gc_gen0``,
``engine.switch_interval_ms``)."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from ..errors import EngineClosed, EngineDead, WrongEventLoop
from .answers import answer_generate, answer_rank
from .batcher import Batcher
from .loop import BatchLoop

_GC_LOCK = threading.Lock()
# engines serving with gc_freeze or a switch interval; the interpreter's settings to restore
_GC_STATE = {"engines": 0, "threshold": None, "switch": None}


def serving_gc(spec) -> bool:
    """With ``spec.gc_freeze``: freeze what is alive now (a full collection would otherwise
    walk torch's and the models' objects, 100+ ms stalls) and raise the young generation's
    threshold to ``spec.gc_gen0``; with ``spec.switch_interval_ms``, that switch interval (the
    shortest any serving engine asks for). Process-wide settings, so counted: the first engine
    to start saves the interpreter's, the last to close (``restore_gc``) puts them back and
    unfreezes. Returns whether this engine took part."""
    if not spec.gc_freeze and not spec.switch_interval_ms:
        return False
    with _GC_LOCK:
        if _GC_STATE["engines"] == 0:
            _GC_STATE["threshold"] = gc.get_threshold()
            _GC_STATE["switch"] = sys.getswitchinterval()
        _GC_STATE["engines"] += 1
        if spec.switch_interval_ms:
            sys.setswitchinterval(min(spec.switch_interval_ms / 1e3, sys.getswitchinterval()))
        if spec.gc_freeze:
            gc.collect()
            gc.freeze()
            before = _GC_STATE["threshold"]
            if spec.gc_gen0:
                gc.set_threshold(max(spec.gc_gen0, gc.get_threshold()[0]), *before[1:])
    return True


def restore_gc(took_part: bool) -> None:
    """Undo ``serving_gc`` once no engine serves with it: what it froze may be garbage now,
    so collectable again, and the interpreter's threshold returns."""
    if not took_part:
        return
    with _GC_LOCK:
        _GC_STATE["engines"] -= 1
        if _GC_STATE["engines"] == 0:
            gc.unfreeze()
            gc.set_threshold(*_GC_STATE["threshold"])
            sys.setswitchinterval(_GC_STATE["switch"])


def forked(pid: int) -> str:
    return (f"the engine was started in process {pid}; this process was forked from it and "
            "cannot use it (its threads and device state stay in that process): start an "
            "engine in each process")


def check_loop(res: "EngineResources | None", closing: bool = False) -> None:
    """Raise ``WrongEventLoop`` unless called on the loop the engine was started on: from
    another loop (or thread) a request would sit in queues that loop never wakes for, and its
    future could not be settled (the caller would wait for ever). ``closing``: a close is
    taken on any loop once the engine's own has closed (``aclose`` releases the threads)."""
    if res is None:
        return
    if res.pid != os.getpid():
        raise EngineClosed(forked(res.pid))
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if here is not res.loop and res.loop.is_closed():
        if closing and here is not None:
            return
        raise WrongEventLoop("the event loop the engine was started on has closed without "
                             "engine.close() (use `async with engine:`): close it from this "
                             "loop to release its threads, then start it again")
    if here is not res.loop:
        raise WrongEventLoop("the engine was started on another event loop; call it from that "
                             "loop (from another thread: BlockingEngine, or "
                             "asyncio.run_coroutine_threadsafe onto the engine's loop)")


class EngineResources:
    def __init__(self, engine) -> None:
        e = engine.spec.engine
        self.rank_batcher = Batcher(e.max_batch, e.max_wait_ms)
        self.gen_batcher = Batcher(e.max_batch, e.max_wait_ms)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamgr-exec")
        # Waits for submitted batches on the device and hands them to be answered.
        self.finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamgr-finish")
        # Live updates' builds (one at a time: the update lock), always on this one thread, so
        # that the memory a build frees is what the next one takes: glibc keeps a thread's
        # arena, and fresh memory costs a page fault a page (Updates._warm_updates).
        self.builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamgr-build")
        self.runners = [r for r in (engine.runner, engine.gen_runner) if r is not None]
        self.tasks: list[asyncio.Task] = []
        self.loops: list[BatchLoop] = []
        self._closing: asyncio.Task | None = None
        self.gc = False  # took part in serving_gc
        self.loop = asyncio.get_running_loop()  # the one loop the engine serves on
        self.pid = os.getpid()  # and the one process

    @classmethod
    async def open(cls, engine) -> "EngineResources":
        """New resources, warmed up (generate's decode plans and live updates' memory:
        updates.py) and serving. A start cancelled or failed while warming leaves its threads
        to finish what they run, and the next start waits for them: two warm-ups of one
        runner would capture its plans at once."""
        left, engine._abandoned = engine._abandoned, None
        if left is not None:
            await asyncio.get_running_loop().run_in_executor(None, left.shutdown_threads, True)
        res = cls(engine)
        try:
            if engine.gen_runner is not None:
                await engine._warm_generate(res)
        except BaseException:
            res.shutdown_threads(False)
            engine._abandoned = res
            raise
        res.gc = serving_gc(engine.spec.engine)  # after warm-up: what is alive now is frozen
        res.start_loops(engine)
        return res

    def shutdown_threads(self, wait: bool) -> None:
        for ex in (self.executor, self.finisher, self.builder):
            ex.shutdown(wait=wait, cancel_futures=True)

    def start_loops(self, engine) -> None:
        """One BatchLoop per runner. Rank batches in flight: the cache manager leases each
        batch's users (a user in flight waits for a later batch), so batch n+1 is planned while
        batch n computes."""
        count_bg = lambda: engine.metrics.count("background_errors")  # noqa: E731
        e = engine.spec.engine
        loops = []
        if engine.runner is not None:
            loops.append(BatchLoop("rank", self.rank_batcher, engine.runner, self.executor,
                                   self.finisher, e.rank_in_flight,
                                   partial(answer_rank, engine.metrics), engine._on_batch_error,
                                   count_bg, e.stall_timeout_s))
        if engine.gen_runner is not None:
            loops.append(BatchLoop("generate", self.gen_batcher, engine.gen_runner,
                                   self.executor, self.finisher, e.gen_in_flight,
                                   partial(answer_generate, engine.metrics),
                                   engine._on_batch_error, count_bg, e.stall_timeout_s))
        loop = asyncio.get_running_loop()
        self.loops = loops
        self.tasks = [loop.create_task(b.run(), name=f"streamgr-{b.name}") for b in loops]

    def queued(self) -> int:
        return len(self.rank_batcher) + len(self.gen_batcher)

    def fail_queued(self, make_error) -> None:
        for b in (self.rank_batcher, self.gen_batcher):
            b.fail_all(make_error)

    async def aclose(self, engine, drain_timeout: float) -> None:
        """Drain (until the engine has nothing in flight, the deadline, or every loop died),
        stop the loops, fail what is still queued, close the runners on the executor, join the
        threads, put the interpreter's gc settings back. After the engine's loop closed without
        this: the runners and threads only, and if a batch in flight there never finished (its
        users stay leased in the cache), the engine is dead. Runs to its end even if its caller
        is cancelled (a timeout): a second close waits for the same one."""
        task = self._closing
        if task is None or task.cancelled() or (not task.done() and task.get_loop().is_closed()):
            # (cut off: its loop closed under it, e.g. asyncio.run cancelling every task)
            task = self._closing = asyncio.ensure_future(self._aclose(engine, drain_timeout))
        await asyncio.shield(task)

    @property
    def closed(self) -> bool:
        """The close has ended (done, or failed: a later close does not try again)."""
        return self._closing is not None and self._closing.done() and \
            not self._closing.cancelled()

    async def _aclose(self, engine, drain_timeout: float) -> None:
        try:
            await self._stop(engine, drain_timeout)
        finally:
            restore_gc(self.gc)
            self.gc = False

    async def _stop(self, engine, drain_timeout: float) -> None:
        orphaned = self.loop.is_closed()
        if orphaned:
            self.tasks = []  # their loop's: died with it, as did the requests' futures
            self.rank_batcher, self.gen_batcher = Batcher(1, 0.0), Batcher(1, 0.0)
            engine._inflight = 0
        inflight = lambda: engine._inflight  # noqa: E731
        t_end = time.monotonic() + drain_timeout
        while inflight() and time.monotonic() < t_end and not all(t.done() for t in self.tasks):
            await asyncio.sleep(0.005)
        for task in self.tasks:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self.fail_queued(lambda: EngineClosed("engine closed"))
        loop = asyncio.get_running_loop()
        if any(b.stalled for b in self.loops):
            # a completion thread is stuck on the device: closing the runners would wait on the
            # device too, and joining that thread would never return
            self.shutdown_threads(False)
            return
        try:
            for runner in self.runners:
                try:  # (submitting raises: the runner's own errors come at the await)
                    done = loop.run_in_executor(self.executor, runner.close)
                except RuntimeError:  # a close cut off before shut the executor down
                    done = loop.run_in_executor(None, runner.close)
                await done
        finally:  # (a runner's close failing too)
            for ex in (self.executor, self.finisher, self.builder):  # joined off the loop
                await loop.run_in_executor(None, ex.shutdown, True)
        if orphaned and any(getattr(getattr(r, "manager", None), "in_batch", None)
                            for r in self.runners):
            engine._dead = EngineDead("the event loop the engine was started on closed with a "
                                      "batch in flight, whose users stay leased in the cache: "
                                      "make a new Engine")
