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


def test_one_engine_serves_rank_and_generate():
    from streamgr import RankRequest
    from streamgr.config import load_spec
    gen = load_spec("gen-small")
    spec = load_spec("rank-small", {"engine.device": "cpu"})
    import msgspec
    both = msgspec.structs.replace(spec, generator=gen.model, catalog=gen.catalog,
                                   policy=gen.policy)

    async def go():
        async with Engine.from_spec(both) as eng:
            assert eng.serves_rank and eng.serves_generate
            r, g = await asyncio.gather(
                eng.rank(RankRequest(user_id=1, items=[1, 2], actions=[0, 1], candidates=[3, 4])),
                eng.generate(GenerateRequest(user_id=1, history=[1, 2], top_k=4)))
            return r, g, eng.stats()["serves"]
    r, g, serves = asyncio.run(go())
    assert len(r.scores) == 2 and len(g.items) == 4 and serves == ["rank", "generate"]


def test_rank_only_engine_refuses_generate():
    from streamgr.errors import UnsupportedRequest

    async def go():
        async with Engine.from_spec("rank-small", {"engine.device": "cpu"}) as eng:
            try:
                await eng.generate(GenerateRequest(user_id=1, history=[1], top_k=2))
            except UnsupportedRequest as err:
                return err
    assert "does not serve generate" in str(asyncio.run(go()))
