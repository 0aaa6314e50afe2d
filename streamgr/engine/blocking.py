"""A blocking wrapper of ``Engine`` for scripts and notebooks: the engine runs on its own event
loop in a background thread; calls block the caller until the reply arrives. At most
``engine.max_queue`` of the wrapper's requests are in flight: the others (of a list, or of
threads calling at once) wait for a slot, so they are served rather than refused with
``Overloaded``."""

from __future__ import annotations

import asyncio
import os
import threading
from functools import partial
from pathlib import Path
from typing import Any, Mapping

from ..api import GenerateRequest, GenerateResult, RankRequest, RankResult
from ..aio import gather_all
from ..config import Spec
from ..errors import EngineClosed
from .core import Engine
from .resources import forked


class BlockingEngine:
    """``with BlockingEngine("rank-small") as eng: eng.rank(RankRequest(...))`` (and
    ``generate`` / ``generate_many`` on a generate spec)."""

    def __init__(self, path_or_spec: str | Path | Spec | Mapping[str, Any] | Engine,
                 overrides: Mapping[str, Any] | None = None) -> None:
        self.engine = path_or_spec if isinstance(path_or_spec, Engine) else \
            Engine.from_spec(path_or_spec, overrides)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="streamgr-loop",
                                        daemon=True)
        self._thread.start()
        self._pid = os.getpid()
        self._gate: asyncio.Semaphore | None = None  # (made on the engine's loop)
        self._call(self.engine.start())

    def _call(self, coro, timeout: float | None = None):
        """``coro`` run on the engine's loop; once closed, or in a forked child (where the
        loop's thread did not come along: the call would wait for ever), dropped unstarted."""
        if self._loop.is_closed() or self._pid != os.getpid():
            coro.close()
            raise EngineClosed("engine closed (BlockingEngine.close)" if self._loop.is_closed()
                               else forked(self._pid))
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except BaseException:  # a timeout or Ctrl-C withdraws what is still queued
            fut.cancel()
            raise

    async def _gated(self, call):
        """``await call()`` once fewer than ``engine.max_queue`` of this wrapper's requests are
        in flight: every caller's (lists, and threads calling at once) wait for a slot instead
        of being refused with ``Overloaded``. Runs on the engine's loop, so one gate serves
        all."""
        if self._gate is None:
            self._gate = asyncio.Semaphore(self.engine.spec.engine.max_queue)
        async with self._gate:
            return await call()

    async def _many(self, fn, requests: list, return_exceptions: bool) -> list:
        # they still batch together; results in order
        return await gather_all([self._gated(partial(fn, r)) for r in requests],
                                return_exceptions)

    def rank(self, request: RankRequest, timeout: float | None = None) -> RankResult:
        return self._call(self._gated(partial(self.engine.rank, request)), timeout)

    def rank_many(self, requests: list[RankRequest],
                  return_exceptions: bool = False) -> list[RankResult | Exception]:
        """Submitted together so they batch; results in order. The first error raises, or
        with ``return_exceptions`` each failed request's error stands in its place."""
        return self._call(self._many(self.engine.rank, requests, return_exceptions))

    def generate(self, request: GenerateRequest, timeout: float | None = None) -> GenerateResult:
        return self._call(self._gated(partial(self.engine.generate, request)), timeout)

    def generate_many(self, requests: list[GenerateRequest],
                      return_exceptions: bool = False) -> list[GenerateResult | Exception]:
        """``rank_many`` for generate."""
        return self._call(self._many(self.engine.generate, requests, return_exceptions))

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        if self._loop.is_closed() or self._pid != os.getpid():
            return
        self._call(self.engine.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> "BlockingEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
