"""Real sockets, real event loops (asyncio and uvloop): every message, pipelining, clients."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import threading
import time

import numpy as np
import pytest

from streamgr import Engine, RankRequest, errors as E
from streamgr.client import AsyncClient, Client, parse_address
from streamgr.protocol import messages as m
from tests.conftest import in_a_fork, small_overrides
from tests.protocol.helpers import (LOOPS, ServerThread, connect, frame, new_loop, rank_msg,
                                    recv_msg, run)


def test_every_message_roundtrips_through_the_codec():
    from streamgr.protocol import Codec
    c = Codec()
    msgs = [m.Hello(1, "tok", "me"), m.HelloAck(1, "s", "rank-small", 10, 5, ["rank"]),
            m.RankRequest(1, "u", [1], [0], [2, 3], 4, 5.0), m.RankReply(2, [0.5], {"a": 1}),
            m.GenerateRequest(3, 7, [1, 2], 10, 64, None), m.GenerateReply(4, [1], [0.1], [[1, 2, 3]]),
            m.StatsRequest(5), m.StatsReply(6, {"x": {"y": [1, 2]}}), m.Error(7, "OVERLOADED", "busy"),
            m.Cancel(8)]
    for msg in msgs:
        assert c.decode(c.frame(msg)[4:]) == msg


def test_address_parsing():
    assert parse_address("127.0.0.1:7700") == ("127.0.0.1", 7700)
    assert parse_address("[::1]:80") == ("::1", 80)
    assert parse_address("unix:/tmp/s") == ("unix", "/tmp/s")
    for bad in ("localhost", "127.0.0.1:99999", "unix:", ":", ""):
        with pytest.raises(ValueError, match="expected HOST:PORT"):
            parse_address(bad)


@pytest.mark.parametrize("loop", LOOPS)
def test_rank_over_socket_equals_embedded(loop):
    rng = np.random.default_rng(0)
    reqs = [RankRequest(user_id=u, items=rng.integers(200, size=20).tolist(),
                        actions=rng.integers(16, size=20).tolist(),
                        candidates=rng.choice(200, 4, replace=False).tolist()) for u in range(8)]

    async def embedded():
        async with Engine.from_spec("rank-small", small_overrides()) as e:
            return [(await e.rank(r)).scores for r in reqs]
    ref = run(loop, embedded)
    with ServerThread(loop) as srv:
        async def remote():
            async with AsyncClient(srv.addr) as c:
                assert c.server_info.model == "rank-small" and "rank" in c.server_info.capabilities
                res = await asyncio.gather(*(c.rank(r) for r in reqs))  # pipelined on one connection
                stats = await c.stats()
                return res, stats
        res, stats = run(loop, remote)
    for r, s in zip(res, ref):
        np.testing.assert_allclose(r.scores, s, rtol=1e-5, atol=1e-6)
        assert r.stats.history_tokens == 40
    assert stats["server"]["requests"]["rank:ok"] == 8


@pytest.mark.parametrize("loop", LOOPS)
def test_replies_out_of_order(loop):
    with ServerThread(loop, overrides={"engine.max_wait_ms": 150.0}) as srv, connect(srv) as sock:
        sock.sendall(frame(rank_msg(1)) + frame(m.StatsRequest(2)) + frame(rank_msg(3, user=2)))
        ids = [recv_msg(sock).id for _ in range(3)]
    assert ids[0] == 2 and sorted(ids) == [1, 2, 3]  # stats overtook the batched ranks


@pytest.mark.parametrize("loop", LOOPS)
def test_typed_errors_and_generate_unsupported(loop):
    with ServerThread(loop) as srv:
        async def go():
            async with AsyncClient(srv.addr) as c:
                with pytest.raises(E.EmptyCandidates):
                    await c.rank(RankRequest(user_id=1, items=[], actions=[], candidates=[]))
                with pytest.raises(E.HistoryRequired):
                    await c.rank(RankRequest(user_id=9, items=[1], actions=[1], candidates=[1],
                                             base_len=3))
                with pytest.raises(E.IdOutOfRange):
                    await c.rank(RankRequest(user_id=1, items=[10**6], actions=[0], candidates=[1]))
                with pytest.raises(E.UnsupportedRequest):
                    await c._call(lambda rid: m.GenerateRequest(rid, 1, [1, 2], 5), None)
                ok = await c.rank(RankRequest(user_id=1, items=[1], actions=[1], candidates=[2]))
                return ok
        assert len(run(loop, go).scores) == 1


def test_blocking_client_and_unix_socket():
    path = os.path.join(tempfile.mkdtemp(), "sg.sock")
    with ServerThread("uvloop", unix=path):
        with Client(f"unix:{path}") as c:
            r = c.rank(RankRequest(user_id=1, items=[1, 2], actions=[0, 1], candidates=[3, 4]))
            assert len(r.scores) == 2 and c.stats()["server"]["connections"] == 1
            bad = RankRequest(user_id=2, items=[10**6], actions=[0], candidates=[1])
            got = c.rank_many([bad, RankRequest(user_id=1, items=[1, 2], actions=[0, 1],
                                                candidates=[3, 4])], return_exceptions=True)
            assert isinstance(got[0], E.IdOutOfRange)  # (a cache hit now: fp32 rounding apart)
            np.testing.assert_allclose(got[1].scores, r.scores, rtol=1e-5, atol=1e-6)
            with pytest.raises(E.IdOutOfRange):
                c.rank_many([bad])


@pytest.mark.parametrize("loop", LOOPS)
def test_client_reconnects_after_connection_loss(loop):
    with ServerThread(loop) as srv:
        async def go():
            c = AsyncClient(srv.addr)
            await c.rank(RankRequest(user_id=1, items=[1], actions=[0], candidates=[3]))
            c._proto.transport.abort()  # the connection breaks under the client
            await asyncio.sleep(0.05)
            r = await c.rank(RankRequest(user_id=1, items=[1], actions=[0], candidates=[3]))
            await c.close()
            return r
        assert len(run(loop, go).scores) == 1


@pytest.mark.parametrize("loop", LOOPS)
def test_an_async_client_follows_its_caller_across_event_loops(loop):
    """One AsyncClient used by two ``asyncio.run`` calls in turn: before, the second call wrote
    on the first loop's dead connection and waited out the whole timeout; now it connects
    again. From a loop running in another thread it raises WrongEventLoop (a reply would be
    read on that thread and never wake the caller), and close from there closes it."""
    req = RankRequest(user_id=1, items=[4, 5], actions=[0, 1], candidates=[3, 7])
    with ServerThread(loop) as srv:
        c = AsyncClient(srv.addr, timeout=20)
        first = run(loop, lambda: c.rank(req)).scores
        t0 = time.perf_counter()
        assert run(loop, lambda: c.rank(req)).scores == pytest.approx(first, abs=1e-5)
        assert time.perf_counter() - t0 < 5
        home = new_loop(loop)
        thread = threading.Thread(target=home.run_forever, daemon=True)
        thread.start()
        try:
            on_home = lambda coro: asyncio.run_coroutine_threadsafe(coro, home).result(20)  # noqa: E731
            assert on_home(c.rank(req)).scores == pytest.approx(first, abs=1e-5)
            with pytest.raises(E.WrongEventLoop, match="another thread"):
                run(loop, lambda: c.rank(req))
            assert on_home(c.health()).ready
            proto = c._proto
            run(loop, c.close)  # from the other loop: closed on its own loop's thread
            deadline = time.monotonic() + 5
            while proto.lost is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert proto.lost is not None and not c.connected
            with pytest.raises(E.ConnectionLost, match="client closed"):  # closed: no reconnect
                run(loop, lambda: c.rank(req))
            run(loop, c.connect)  # opened again on purpose
            assert run(loop, lambda: c.rank(req)).scores == pytest.approx(first, abs=1e-5)
            run(loop, c.close)
        finally:
            home.call_soon_threadsafe(home.stop)
            thread.join(10)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_closed_async_client_refuses_calls_instead_of_opening_a_connection(loop):
    """A call after ``async with`` ended (or after close()) used to open a new connection that
    nothing would close; now it raises ConnectionLost, as the blocking Client does, and
    ``async with`` / connect() opens the client again. A call waiting at the client's gate
    when it closes gets the same error."""
    req = RankRequest(user_id=1, items=[4, 5], actions=[0, 1], candidates=[3, 7])
    with ServerThread(loop, max_conn_inflight=1,
                      overrides={"engine.max_wait_ms": 200.0}) as srv:
        async def go():
            async with AsyncClient(srv.addr, timeout=20) as c:
                await c.rank(req)
                first = asyncio.ensure_future(c.rank(req))  # holds the one slot
                waiting = asyncio.ensure_future(c.rank(req))  # waits at the gate
                await asyncio.sleep(0.02)
            results = await asyncio.gather(first, waiting, return_exceptions=True)
            assert all(isinstance(r, E.ConnectionLost) and "client closed" in str(r)
                       for r in results), results  # (before: "closed by the server")
            with pytest.raises(E.ConnectionLost, match="client closed"):
                await c.rank(req)
            with pytest.raises(E.ConnectionLost, match="client closed"):
                await c.stats()
            async def open_connections():
                return len(srv.server.connections)
            deadline = time.monotonic() + 5  # (the server sees the close a moment later)
            while srv.call(open_connections()) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert srv.call(open_connections()) == 0  # the calls opened none
            async with c:
                return len((await c.rank(req)).scores)
        assert run(loop, go) == 2


@pytest.mark.parametrize("loop", LOOPS)
def test_token_auth(loop):
    with ServerThread(loop, token="s3cret") as srv:
        async def go():
            with pytest.raises(E.ProtocolError, match="wrong token"):
                await AsyncClient(srv.addr, token="guess").connect()
            # no token at all: said as such (before: "wrong token" too)
            with pytest.raises(E.ProtocolError, match=r"needs a token \(none was sent\)"):
                await AsyncClient(srv.addr).connect()
            async with AsyncClient(srv.addr, token="s3cret") as c:
                return await c.rank(RankRequest(user_id=1, items=[1], actions=[0], candidates=[3]))
        before = srv.counters().get("rank_requests", 0)
        assert before == 0
        run(loop, go)
        assert srv.counters()["rank_requests"] == 1  # only the authorised request ran
        assert srv.server.metrics.counters["auth_failures"] == 2


def test_a_port_that_is_not_a_streamgr_server_is_named():
    """A peer that closes on our Hello (an HTTP port, say): the error names the address and
    asks whether it is a streamgr protocol port (before: "the server closed the connection
    during Hello")."""
    import socket as so
    import threading as th
    lsock = so.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()
    port = lsock.getsockname()[1]

    def serve_one():
        conn, _ = lsock.accept()
        conn.recv(64)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        conn.close()
    t = th.Thread(target=serve_one, daemon=True)
    t.start()
    with pytest.raises(E.ProtocolError, match=rf"127.0.0.1:{port} .*is it a streamgr server"):
        asyncio.run(AsyncClient(f"127.0.0.1:{port}", timeout=10).connect())
    t.join(5)
    lsock.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_numpy_ids_travel_packed_and_answer_as_lists(loop, monkeypatch):
    """A client's numpy id arrays go to a server that lists ``packed-ids`` as little-endian
    int64 bytes: the same scores as lists. A packed id out of range is the same typed error as
    a listed one; packed bytes that make no whole int64s are INVALID_REQUEST; ids an int64
    cannot hold, and every id to a server without the capability, go as lists."""
    from streamgr.server import server as server_mod
    rng = np.random.default_rng(4)
    arrays = [RankRequest(user_id=u, items=rng.integers(200, size=60),
                          actions=rng.integers(16, size=60),
                          candidates=rng.choice(200, 4, replace=False)) for u in range(6)]
    lists = [RankRequest(user_id=r.user_id, items=r.items.tolist(), actions=r.actions.tolist(),
                         candidates=r.candidates.tolist()) for r in arrays]
    seen = []
    unpacked = server_mod.unpacked
    monkeypatch.setattr(server_mod, "unpacked",
                        lambda ids, name: (seen.append(type(ids)), unpacked(ids, name))[1])
    with ServerThread(loop) as srv:
        async def go():
            async with AsyncClient(srv.addr) as c:
                assert m.CAP_PACKED_IDS in c.server_info.capabilities
                packed = await asyncio.gather(*(c.rank(r) for r in arrays))
                assert set(seen) == {bytes}
                seen.clear()
                listed = await asyncio.gather(*(c.rank(r) for r in lists))
                assert set(seen) == {list}
                one = dict(user_id=1, actions=np.array([0]), candidates=np.array([1]))
                for bad in (np.array([10**6]), np.array([-3], dtype=np.int32)):
                    with pytest.raises(E.IdOutOfRange, match=str(int(bad[0]))):
                        await c.rank(RankRequest(items=bad, **one))
                with pytest.raises(E.IdOutOfRange, match=str(2**63)):  # sent as a list
                    await c.rank(RankRequest(items=np.array([2**63], dtype=np.uint64), **one))
                with pytest.raises(E.InvalidRequest, match="packed ids"):
                    await c._call(lambda rid: m.RankRequest(rid, 1, b"\x01" * 7, [0], [1]), None)
                seen.clear()
                c.server_info.capabilities.remove(m.CAP_PACKED_IDS)  # an older server
                again = await c.rank(arrays[0])
                assert set(seen) == {list}
                return packed, listed, again
        packed, listed, again = run(loop, go)
    for a, b in zip(packed, listed):
        np.testing.assert_array_equal(a.scores, b.scores)
    np.testing.assert_array_equal(again.scores, listed[0].scores)


def test_bench_protocol_ids_costs_run():
    """tools/bench_protocol.py --ids's measurement: both forms at every length, sizes that say
    8 bytes an id when packed."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from bench_protocol import ids_costs
    rows = ids_costs(lengths=(16, 200), reps=3)
    assert [(n, f) for n, f, *_ in rows] == [(16, "list"), (16, "packed"), (200, "list"),
                                             (200, "packed")]
    assert all(enc > 0 and srv > 0 for _, _, enc, srv, _ in rows)
    sizes = {(n, f): b for n, f, _, _, b in rows}
    grown = sizes[200, "packed"] - sizes[16, "packed"]  # 2 x 184 more ids (bin headers grow)
    assert 2 * 184 * 8 <= grown <= 2 * 184 * 8 + 4


def test_a_blocking_client_works_in_a_forked_child():
    """Before, a forked child's first call waited for ever on the parent's loop thread, which
    does not survive a fork. Now the child starts a loop and a connection of its own; the
    parent's connection serves on."""
    req = RankRequest(user_id=1, items=[4, 5], actions=[0, 1], candidates=[3, 7])
    with ServerThread() as srv:
        with Client(srv.addr, timeout=20) as c:
            first = c.rank(req).scores

            def child():
                scores = c.rank(req).scores
                c.close()
                return scores
            status, text = in_a_fork(child)
            assert status == 0 and text.startswith("["), (status, text)
            assert json.loads(text) == pytest.approx(first, abs=1e-5)
            assert c.rank(req).scores == pytest.approx(first, abs=1e-5)
            assert c.health().ready
        with pytest.raises(E.ConnectionLost, match="client closed"):
            c.rank(req)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_peer_that_never_says_helloack_is_unavailable_and_let_go(loop):
    """Something listening that never answers Hello (another service on the port, a stuck
    server): before, a bare TimeoutError and the socket left open; now ServerUnavailable
    naming the address, and the socket is closed (the peer reads EOF)."""
    import socket
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        addr = f"127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(E.ServerUnavailable, match=f"no HelloAck from {addr} within 0.2 s"):
            run(loop, lambda: AsyncClient(addr, timeout=0.2).connect())
        peer, _ = listener.accept()
        with peer:
            peer.settimeout(5)
            data = b""
            while chunk := peer.recv(4096):  # the Hello, then EOF
                data += chunk
            from streamgr.protocol import Codec
            assert isinstance(Codec().decode(data[4:]), m.Hello)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_list_longer_than_the_connection_cap_is_served(loop):
    """The HelloAck announces the per-connection cap and the client keeps to it: before, a
    list of 1,000 over a cap of 256 had 744 answered OVERLOADED."""
    reqs = [RankRequest(user_id=u, items=[1, 2, 3], actions=[0, 1, 0], candidates=[4, 5])
            for u in range(300)]
    with ServerThread(loop, max_conn_inflight=40) as srv:
        async def go():
            async with AsyncClient(srv.addr) as c:
                assert c.server_info.max_conn_inflight == 40
                return await c.rank_many(reqs, return_exceptions=True)
        out = run(loop, go)
    failed = [r for r in out if isinstance(r, Exception)]
    assert not failed and all(len(r.scores) == 2 for r in out), failed[:2]


@pytest.mark.parametrize("loop", LOOPS)
def test_a_request_the_client_cannot_encode_is_a_typed_error(loop):
    """Ids past uint64, floats or objects among ids, a user id with an unpaired surrogate:
    before, the client raised OverflowError, TypeError or UnicodeEncodeError; now the typed
    InvalidRequest (the embedded engine's error for such ids), and the connection serves on.
    (A str with an unpaired surrogate cannot travel as UTF-8; the embedded engine takes it.)"""
    bad = [dict(user_id="\ud800", items=[1]), dict(user_id=1, items=[np.float64(1.0)]),
           dict(user_id=1, items=[object()]), dict(user_id=2**70, items=[1]),
           dict(user_id=1, items=[2**70])]
    with ServerThread(loop) as srv:
        async def go():
            async with AsyncClient(srv.addr) as c:
                for kw in bad:
                    with pytest.raises(E.InvalidRequest):
                        await c.rank(RankRequest(actions=[0], candidates=[3], **kw))
                return await c.rank(RankRequest(user_id="é🙂", items=[1], actions=[0],
                                                candidates=[3]))
        assert len(run(loop, go).scores) == 1
