"""Generate requests over the socket protocol (a real server on loopback)."""

from __future__ import annotations

import asyncio

from streamgr import Engine
from streamgr.api import GenerateRequest
from streamgr.client import Client
from streamgr.server import Server


def test_generate_over_the_socket_equals_embedded():
    req = GenerateRequest(user_id=5, history=[1, 2, 3], top_k=7)

    async def go():
        async with Engine.from_spec("gen-small", {"engine.device": "cpu"}) as eng:
            ref = await eng.generate(req)
            srv = Server(eng)
            addr = (await srv.start("127.0.0.1", 0))[0]
            loop = asyncio.get_running_loop()

            def blocking():
                with Client(addr) as c:
                    return c.generate(req)
            got = await loop.run_in_executor(None, blocking)
            await srv.shutdown(1.0)
            return ref, got
    ref, got = asyncio.run(go())
    assert got.items == ref.items and got.sids == ref.sids and len(got.items) == 7
    assert got.scores == ref.scores
