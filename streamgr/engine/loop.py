"""One batch loop for every runner (vLLM v1's step loop with a batch queue).

A ``BatchLoop`` takes batches from its batcher, submits each on the executor thread
(``runner.submit``) and finishes it on the completion thread (``runner.finish``), with at most
``in_flight`` batches between the two: while batch ``n`` computes, batch ``n+1`` is prepared and
queued. A key (a rank user) in a batch in flight waits for a later batch. The engine's ``answer`` resolves the batch's futures; then the runner's background work
(rank offloads) runs on the executor, before the batch's slot frees, so it never delays a reply
and never overlaps the next batch's preparation. Rank and generate share this loop, its one
drain, one refusal path and one error path: they differ only in their runner and ``answer``.
A batch whose finish outlasts ``stall_timeout`` (a hung kernel never returns its stream) fails
with ``EngineDead``, which marks the engine dead (``status.fail_batch``); the loop is then
``stalled`` and the engine's close does not wait for the stuck completion thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from typing import Any, Callable, Protocol

from ..errors import EngineClosed, EngineDead
from .batcher import Batcher, Pending

log = logging.getLogger("streamgr.engine")


class Runner(Protocol):
    """What a loop drives: ``submit`` (executor thread) returns a handle, ``finish`` (completion
    thread) waits for it and returns the batch's outcome; ``background`` runs after answers."""

    has_background_work: bool

    def submit(self, payloads: list) -> Any: ...

    def finish(self, handle: Any) -> Any: ...

    def background(self) -> None: ...

    def close(self) -> None: ...


def refuse(batch: list[Pending]) -> None:
    for p in batch:
        if not p.future.done():
            p.future.set_exception(EngineClosed("engine closed"))


class BatchLoop:
    def __init__(self, name: str, batcher: Batcher, runner: Runner, executor: Executor,
                 finisher: Executor, in_flight: int,
                 answer: Callable[[list[Pending], Any, float, float], None],
                 on_error: Callable[[list[Pending], Exception], None],
                 on_background_error: Callable[[], None], stall_timeout: float = 0.0) -> None:
        self.name, self.batcher, self.runner = name, batcher, runner
        self.executor, self.finisher, self.in_flight = executor, finisher, in_flight
        self.answer, self.on_error, self.on_background_error = (answer, on_error,
                                                                on_background_error)
        self.stall_timeout = stall_timeout  # s; 0: none
        self.stalled = False  # a batch's finish outlasted stall_timeout (its thread is stuck)
        self.busy: set = set()  # keys of the batches between submit and finish

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        slots = asyncio.Semaphore(self.in_flight)
        pending: set[asyncio.Task] = set()
        try:
            while True:
                await slots.acquire()
                batch = await self.batcher.next_batch(self.busy)
                keys = [p.key for p in batch]
                self.busy.update(keys)
                try:
                    t_start = time.perf_counter()
                    handle = await loop.run_in_executor(
                        self.executor, self.runner.submit, [p.payload for p in batch])
                except asyncio.CancelledError:  # closing: the batch in hand is refused
                    refuse(batch)
                    raise
                except Exception as err:  # the batch fails; the engine serves on
                    self._release(keys, slots)
                    self.on_error(batch, err)
                    continue
                task = loop.create_task(self._finish(batch, keys, handle, t_start, slots))
                pending.add(task)
                task.add_done_callback(pending.discard)
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    def _release(self, keys: list, slots: asyncio.Semaphore) -> None:
        self.busy.difference_update(keys)
        slots.release()
        self.batcher.wake()

    async def _finish(self, batch: list[Pending], keys: list, handle, t_start: float,
                      slots: asyncio.Semaphore) -> None:
        loop = asyncio.get_running_loop()
        try:
            fut = loop.run_in_executor(self.finisher, self.runner.finish, handle)
            try:
                if self.stall_timeout:  # 0: awaited as is, no waiter or timer a batch
                    # wait, not wait_for: a TimeoutError the runner raises stays the runner's
                    done, _ = await asyncio.wait({fut}, timeout=self.stall_timeout)
                    if not done:
                        self.stalled = True
                        self.on_error(batch, EngineDead(
                            f"{self.name}: a batch of {len(batch)} did not finish within "
                            f"{self.stall_timeout:g} s (engine.stall_timeout_s): the device "
                            f"looks stalled, e.g. a hung kernel; restart the engine"))
                        return
                outcome = await fut
            except asyncio.CancelledError:
                refuse(batch)
                raise
            except Exception as err:
                self.on_error(batch, err)
                return
            self.answer(batch, outcome, t_start, time.perf_counter())
            if self.runner.has_background_work:
                try:  # after the replies: offload never delays them
                    await loop.run_in_executor(self.executor, self.runner.background)
                except Exception:
                    log.exception("%s: background work failed", self.name)
                    self.on_background_error()
        finally:
            self._release(keys, slots)
