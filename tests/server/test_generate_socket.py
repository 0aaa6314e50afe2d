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


def test_a_numpy_history_travels_packed_and_answers_as_a_list(monkeypatch):
    """A numpy history goes as packed ids (``packed-ids``) and gets the list's answer; a
    packed history of a length no int64s make is INVALID_REQUEST."""
    import numpy as np
    import pytest
    from streamgr import errors as E
    from streamgr.client import AsyncClient
    from streamgr.protocol import messages as m
    from streamgr.server import server as server_mod
    seen = []
    unpacked = server_mod.unpacked
    monkeypatch.setattr(server_mod, "unpacked",
                        lambda ids, name: (seen.append(type(ids)), unpacked(ids, name))[1])
    hist = np.array([4, 9, 1, 30, 2])

    async def go():
        async with Engine.from_spec("gen-small", {"engine.device": "cpu"}) as eng:
            srv = Server(eng)
            addr = (await srv.start("127.0.0.1", 0))[0]
            async with AsyncClient(addr) as c:
                packed = await c.generate(GenerateRequest(user_id=5, history=hist, top_k=7))
                listed = await c.generate(GenerateRequest(user_id=5, history=hist.tolist(),
                                                          top_k=7))
                with pytest.raises(E.InvalidRequest, match="packed ids"):
                    await c._call(lambda rid: m.GenerateRequest(rid, 1, b"\x00" * 12, 5), None)
            await srv.shutdown(1.0)
            return packed, listed
    packed, listed = asyncio.run(go())
    assert seen[:2] == [bytes, list]
    assert packed.items == listed.items and packed.scores == listed.scores


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


def test_rank_and_generate_alike_blocking_and_many():
    """The blocking engine and both clients take generate as they take rank, one by one or
    many at once (results in order)."""
    from streamgr import BlockingEngine, GenerateResult
    reqs = [GenerateRequest(user_id=u, history=[1 + u, 2, 3], top_k=5) for u in range(6)]
    with BlockingEngine("gen-small", {"engine.device": "cpu"}) as eng:
        one = eng.generate(reqs[0])
        many = eng.generate_many(reqs)
        assert isinstance(one, GenerateResult) and one.items == many[0].items
        assert [len(r.items) for r in many] == [5] * 6

        async def serve_and_call():
            srv = Server(eng.engine)
            addr = (await srv.start("127.0.0.1", 0))[0]
            return srv, addr
        srv, addr = eng._call(serve_and_call())
        with Client(addr) as c:
            remote = c.generate_many(reqs)
            assert c.health().ready
        eng._call(srv.shutdown(1.0))
    assert [r.items for r in remote] == [r.items for r in many]
    assert [r.scores for r in remote] == [r.scores for r in many]


def test_engine_stats_have_generate_latency_and_cancellations():
    async def go():
        async with Engine.from_spec("gen-small", {"engine.device": "cpu",
                                                  "engine.max_wait_ms": 50.0}) as eng:
            await asyncio.gather(*(eng.generate(GenerateRequest(user_id=u, history=[1, 2],
                                                                top_k=3)) for u in range(5)))
            t = asyncio.ensure_future(eng.generate(GenerateRequest(user_id=9, history=[1],
                                                                   top_k=3)))
            await asyncio.sleep(0)
            t.cancel()
            await asyncio.sleep(0.1)
            return eng.stats()
    st = asyncio.run(go())
    c = st["counters"]
    assert c["generate_requests"] == 5 and c.get("generate_cancelled") == 1
    assert "rank_cancelled" not in c
    lat = st["generate_latency_ms"]
    assert lat["window"] == 5 and 0 < lat["p50"] <= lat["p99"]


def test_closing_a_generate_only_engine_drains_its_requests():
    async def go():
        eng = Engine.from_spec("gen-small", {"engine.device": "cpu", "engine.max_wait_ms": 30.0})
        await eng.start()
        tasks = [asyncio.ensure_future(eng.generate(GenerateRequest(user_id=u, history=[1, 2],
                                                                    top_k=3))) for u in range(6)]
        await asyncio.sleep(0)  # admitted, waiting in the batcher
        await eng.close(drain_timeout=30.0)
        return await asyncio.gather(*tasks, return_exceptions=True)
    res = asyncio.run(go())
    assert all(not isinstance(r, BaseException) and len(r.items) == 3 for r in res), res
