"""asyncio helpers shared by the engine's blocking wrapper and the socket clients."""

from __future__ import annotations

import asyncio


async def gather_all(calls: list, return_exceptions: bool) -> list:
    """``asyncio.gather`` of ``calls``, results in order; when the first error raises (without
    ``return_exceptions``), the calls still in flight are cancelled: nobody will read them,
    and a cancelled call is withdrawn where it waits (the engine's queue; the server's, by
    Cancel)."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks, return_exceptions=return_exceptions))
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
