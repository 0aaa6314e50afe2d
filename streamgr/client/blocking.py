"""``Client``: the blocking client, an ``AsyncClient`` on a loop thread of its own."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

from .. import api
from ..errors import ConnectionLost
from ..protocol import messages as m
from .async_client import AsyncClient


class Client:
    """Blocking client: ``with Client("127.0.0.1:7700") as c: c.rank(RankRequest(...))``. Its
    loop runs on a thread of its own, so any thread may call it; a forked child gets a loop thread
    and a connection of its own at its first call (the parent's thread is not forked)."""

    def __init__(self, address: str, token: str | None = None, timeout: float | None = 60.0) -> None:
        self._args = (address, token, timeout)
        self._closed, self._orphans = False, []
        self._start()

    def _start(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="streamgr-client")
        self._thread.start()
        self._client = AsyncClient(*self._args)
        try:
            self._run(self._client.connect())
        except BaseException:
            self._stop()
            raise
        self._pid = os.getpid()  # (a child whose connect failed starts again at its next call)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _call(self, call):
        """``call(async_client)`` run on the client's loop (started again in a forked child)."""
        if self._closed:
            raise ConnectionLost("client closed (Client.close)")
        if self._pid != os.getpid():  # a forked child (the parent's kept: collected, they
            self._orphans.append((self._loop, self._thread, self._client))  # close its loop)
            self._start()
        return self._run(call(self._client))

    def rank(self, request: api.RankRequest, deadline_ms: float | None = None,
             timeout: float | None = None) -> api.RankResult:
        return self._call(lambda c: c.rank(request, deadline_ms, timeout))

    def generate(self, request, deadline_ms: float | None = None, timeout: float | None = None):
        return self._call(lambda c: c.generate(request, deadline_ms, timeout))

    def rank_many(self, requests, deadline_ms: float | None = None, timeout: float | None = None,
                  return_exceptions: bool = False):
        return self._call(lambda c: c.rank_many(requests, deadline_ms, timeout,
                                                return_exceptions))

    def generate_many(self, requests, deadline_ms: float | None = None,
                      timeout: float | None = None, return_exceptions: bool = False):
        return self._call(lambda c: c.generate_many(requests, deadline_ms, timeout,
                                                    return_exceptions))

    def health(self) -> m.HealthReply:
        return self._call(lambda c: c.health())

    def update(self, **kw) -> dict[str, Any]:
        """``AsyncClient.update`` (admin token required)."""
        return self._call(lambda c: c.update(**kw))

    def rollback(self, target: str = "auto") -> dict[str, Any]:
        return self._call(lambda c: c.rollback(target))

    def versions(self) -> dict[str, Any]:
        return self._call(lambda c: c.versions())

    def stats(self) -> dict[str, Any]:
        return self._call(lambda c: c.stats())

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pid == os.getpid():  # a forked child that never called has nothing to close
            self._run(self._client.close())
            self._stop()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
