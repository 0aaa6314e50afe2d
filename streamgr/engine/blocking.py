"""A blocking wrapper of ``Engine`` for scripts and notebooks: the engine runs on its own event
loop in a background thread; calls block the caller until the reply arrives."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any, Mapping

from ..api import GenerateRequest, GenerateResult, RankRequest, RankResult
from ..config import Spec
from .core import Engine


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
        self._call(self.engine.start())

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def rank(self, request: RankRequest, timeout: float | None = None) -> RankResult:
        return self._call(self.engine.rank(request), timeout)

    def rank_many(self, requests: list[RankRequest]) -> list[RankResult]:
        """Submit all at once so they batch together; results in order."""
        async def go():
            return await asyncio.gather(*(self.engine.rank(r) for r in requests))
        return self._call(go())

    def generate(self, request: GenerateRequest, timeout: float | None = None) -> GenerateResult:
        return self._call(self.engine.generate(request), timeout)

    def generate_many(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Submit all at once so they batch together; results in order."""
        async def go():
            return await asyncio.gather(*(self.engine.generate(r) for r in requests))
        return self._call(go())

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._call(self.engine.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> "BlockingEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
