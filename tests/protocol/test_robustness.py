"""The server stays up whatever arrives: >10,000 malformed frames, half-sent frames, oversize
lengths, overload, deadlines, cancelled callers (real sockets, asyncio and uvloop)."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from streamgr import RankRequest, errors as E
from streamgr.client import AsyncClient
from streamgr.protocol import messages as m
from tests.protocol.helpers import (LOOPS, ServerThread, connect, frame, good_request_works,
                                    rank_msg, raw_frame, recv_msg, run)

@pytest.fixture(scope="module", params=LOOPS)
def srv(request):
    with ServerThread(request.param, read_timeout=0.3, max_frame=1 << 16) as s:
        yield s


def test_random_bytes_frames(srv):
    rng = np.random.default_rng(0)
    for i in range(4000):
        with connect(srv) as sock:
            body = rng.bytes(int(rng.integers(1, 64)))
            sock.sendall(raw_frame(body))
            reply = recv_msg(sock)
            assert isinstance(reply, m.Error) and reply.code in (m.BAD_FRAME, "INVALID_REQUEST", m.PROTOCOL_ERROR)
    good_request_works(srv)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12)


@pytest.fixture(scope="module")
def fuzz_conn(srv):
    sock = connect(srv)
    yield sock
    sock.close()


# 500 random frames a loop each CI run (fresh seeds every run; 1,000 cost ~5.5 s a loop, 1,500
# ~7.5 s: CI keeps under 5 minutes)
@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(value=msgpack_values, tag=st.sampled_from([None, 1, 3, 5, 7, 9, 99]))
def test_hypothesis_msgpack_frames(srv, fuzz_conn, value, tag):
    if tag is not None:  # a real tag with random fields: wrong types and arity
        value = [tag] + (value if isinstance(value, list) else [value])
    fuzz_conn.sendall(raw_frame(msgspec.msgpack.encode(value)))
    reply = recv_msg(fuzz_conn)
    assert reply is not None, "the server closed a connection for a decodable frame"


def test_wrong_types_keep_the_connection(srv):
    """Over ten thousand malformed (decodable, ill-typed) frames on one connection, each
    answered with an error, then the same connection serves."""
    bad = [[3, "id", 1, [1], [0], [2]], [3, 1, 1.5, [1], [0], [2]], [3, 2, 1, "items", [0], [2]],
           [3, 3, 1, [1], [0]], [7], [7, -1], [5, 4, 1, [1], "k"], [3, 5, 1, [1.5], [0], [2]],
           [3, 6, 1, [1], [0], [2], "x", "y"], {"t": 3}, [2, 1, "s", "m", 1, 1]]
    with connect(srv) as sock:
        for _ in range(910):  # 10,010 frames
            for v in bad:
                sock.sendall(raw_frame(msgspec.msgpack.encode(v)))
                reply = recv_msg(sock)
                assert isinstance(reply, m.Error), reply
        sock.sendall(frame(rank_msg(77)))
        assert recv_msg(sock).id == 77  # same connection still serves


def test_schema_errors_name_the_field(srv):
    """msgspec reports positions in the wire's arrays (``$[4]``); the reply names the message's
    field instead (``top_k``, ``candidates[0]``), and leaves other messages as they were."""
    cases = [([3, 8, 1, [1], [0], ["x"]], "`candidates[0]`"),
             ([5, 9, 1, [1, 2], "5"], "`top_k`"), ([3, 10, 1.5, [1], [0], [2]], "`user_id`")]
    with connect(srv) as sock:
        for body, field in cases:
            sock.sendall(raw_frame(msgspec.msgpack.encode(body)))
            reply = recv_msg(sock)
            assert isinstance(reply, m.Error) and reply.id == body[1], reply
            assert f"at {field}" in reply.message and "$[" not in reply.message, reply.message
        sock.sendall(raw_frame(msgspec.msgpack.encode([99, 11])))  # no such tag: unchanged
        assert isinstance(recv_msg(sock), m.Error)
        sock.sendall(frame(rank_msg(78)))
        assert recv_msg(sock).id == 78


def test_huge_lengths_refused_unread(srv):
    for length in [1 << 16 + 1, 1 << 20, 2**31, 2**32 - 1] * 25:
        with connect(srv) as sock:
            sock.sendall(struct.pack(">I", length))  # no body follows: must not be awaited
            reply = recv_msg(sock)
            assert isinstance(reply, m.Error) and reply.code == m.FRAME_TOO_LARGE
            assert recv_msg(sock) is None  # and closed
    good_request_works(srv)


def test_half_sent_frame_is_closed_after_read_timeout(srv):
    with connect(srv) as sock:
        sock.sendall(struct.pack(">I", 100) + b"\x93\x03")  # 2 of 100 bytes, then silence
        t = time.perf_counter()
        assert recv_msg(sock) is None
        waited = time.perf_counter() - t
    assert 0.2 <= waited < 3.0, waited
    with connect(srv) as sock:  # a header left half-sent too
        sock.sendall(b"\x00\x00")
        assert recv_msg(sock) is None
    good_request_works(srv)


def test_no_hello_first_is_refused(srv):
    with socket.create_connection((srv.host, srv.port), timeout=5) as sock:
        sock.sendall(frame(rank_msg(1)))
        reply = recv_msg(sock)
        assert isinstance(reply, m.Error) and reply.code == m.PROTOCOL_ERROR
        assert recv_msg(sock) is None


@pytest.mark.parametrize("loop", LOOPS)
def test_overload_answers_fast(loop):
    with ServerThread(loop, max_inflight=2, overrides={"engine.max_wait_ms": 300.0}) as srv, \
            connect(srv) as sock:
        t = time.perf_counter()
        sock.sendall(b"".join(frame(rank_msg(i, user=i)) for i in range(1, 11)))
        first8 = [recv_msg(sock) for _ in range(8)]
        fast = time.perf_counter() - t
        rest = [recv_msg(sock) for _ in range(2)]
    assert all(isinstance(r, m.Error) and r.code == "OVERLOADED" for r in first8)
    assert fast < 0.25, fast  # before the batch of the two admitted ones even ran
    assert sorted(r.id for r in rest) == [1, 2] and all(isinstance(r, m.RankReply) for r in rest)


@pytest.mark.parametrize("loop", LOOPS)
def test_deadline_exceeded(loop):
    with ServerThread(loop, overrides={"engine.max_wait_ms": 300.0}) as srv:
        async def go():
            async with AsyncClient(srv.addr) as c:
                with pytest.raises(E.DeadlineExceeded):
                    await c.rank(RankRequest(user_id=1, items=[1], actions=[0], candidates=[3]),
                                 deadline_ms=20)
                return await c.rank(RankRequest(user_id=1, items=[1], actions=[0], candidates=[3]),
                                    deadline_ms=5000)
        assert len(run(loop, go).scores) == 1


@pytest.mark.parametrize("loop", LOOPS)
def test_closing_the_client_cancels_its_requests_in_the_engine(loop):
    with ServerThread(loop, overrides={"engine.max_wait_ms": 400.0, "engine.max_batch": 64}) as srv:
        with connect(srv) as sock:
            sock.sendall(b"".join(frame(rank_msg(i, user=i)) for i in range(1, 6)))
            time.sleep(0.05)  # the server has read them: they wait in the batcher
        deadline = time.time() + 3
        while srv.counters().get("rank_cancelled", 0) < 5 and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # past the batch window: nothing of them may run
        c = srv.counters()
    assert c.get("rank_cancelled", 0) == 5 and c.get("rank_requests", 0) == 0, c


@pytest.mark.parametrize("loop", LOOPS)
def test_a_request_given_up_on_is_withdrawn_from_the_server(loop):
    """A caller that stops waiting (its timeout, or its task cancelled) sends Cancel: the
    request, still queued, never runs and is not answered (before, it ran for nobody). A
    Cancel of an id not in flight is ignored, and the connection keeps serving."""
    req = RankRequest(user_id=1, items=[1], actions=[0], candidates=[3])
    with ServerThread(loop, overrides={"engine.max_wait_ms": 400.0, "engine.max_batch": 64}) as srv:
        async def go():
            async with AsyncClient(srv.addr) as c:
                assert m.CAP_CANCEL in c.server_info.capabilities
                with pytest.raises(TimeoutError):
                    await c.rank(req, timeout=0.03)  # the client's timeout
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(c.rank(req), 0.03)  # the caller's task cancelled
                deadline = time.monotonic() + 3
                while srv.counters().get("rank_cancelled", 0) < 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.5)  # past the batch window: nothing of them may run
                return srv.counters(), await c.rank(req)
        counters, last = run(loop, go)
        assert counters.get("rank_cancelled") == 2 and "rank_requests" not in counters, counters
        assert len(last.scores) == 1 and srv.server.metrics.counters["cancels"] == 2
        with connect(srv) as sock:
            sock.sendall(frame(m.Cancel(99)) + frame(rank_msg(3, user=1)) + frame(m.Cancel(3))
                         + frame(m.HealthRequest(4)))
            health = recv_msg(sock)  # 99: unknown; 3 withdrawn: no reply to either
            assert isinstance(health, m.HealthReply) and health.id == 4, health
            sock.sendall(frame(rank_msg(3, user=1)))  # withdrawn: its id is free again
            assert isinstance(recv_msg(sock), m.RankReply)
        assert srv.server.metrics.counters["cancels"] == 3


@pytest.mark.parametrize("loop", LOOPS)
def test_a_list_call_that_raises_withdraws_the_rest_on_the_server(loop):
    """``AsyncClient.rank_many``: the first error raises, and the list's other requests are
    withdrawn from the server's queue by Cancel (before, they ran for nobody)."""
    reqs = [RankRequest(user_id=u, items=[1, 2], actions=[0, 1], candidates=[3]) for u in range(8)]
    bad = RankRequest(user_id=99, items=[10**6], actions=[1], candidates=[3])
    with ServerThread(loop, overrides={"engine.max_wait_ms": 400.0, "engine.max_batch": 64}) as srv:
        async def go():
            async with AsyncClient(srv.addr) as c:
                with pytest.raises(E.IdOutOfRange):
                    await c.rank_many(reqs + [bad])
                deadline = time.monotonic() + 3
                while srv.counters().get("rank_cancelled", 0) < 8 and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.5)  # past the batch window: nothing of them may run
                return srv.counters()
        counters = run(loop, go)
        assert counters.get("rank_cancelled") == 8 and "rank_requests" not in counters, counters


@pytest.mark.parametrize("loop", LOOPS)
def test_one_request_over_max_frame_fails_alone(loop):
    """A request whose frame is over the server's max_frame: before, the client sent it, the
    server refused it unread and closed the connection, and the 20 other requests in flight
    on it failed with ConnectionLost. Now the client refuses that one (InvalidRequest) and
    the others are answered."""
    with ServerThread(loop, max_frame=4096, overrides={"engine.max_wait_ms": 50.0}) as srv:
        async def go():
            async with AsyncClient(srv.addr) as c:
                small = [c.rank(RankRequest(user_id=u, items=[1, 2], actions=[0, 1],
                                            candidates=[3])) for u in range(20)]
                big = c.rank(RankRequest(user_id=99, items=list(range(1, 1500)),
                                         actions=[0] * 1499, candidates=[3]))
                return await asyncio.gather(*small, big, return_exceptions=True)
        out = run(loop, go)
    assert all(len(r.scores) == 1 for r in out[:20]), out[:3]
    assert isinstance(out[20], E.InvalidRequest) and "over the server's max_frame of 4,096" \
        in str(out[20])


@pytest.mark.parametrize("loop", LOOPS)
def test_an_id_in_flight_is_not_taken_twice_on_a_connection(loop):
    """Replies come in completion order and carry only the id: a second request under an id
    still in flight is refused (the first is answered as usual); once answered, even by a
    DEADLINE_EXCEEDED, the id may be used again. Other connections have ids of their own."""
    with ServerThread(loop, overrides={"engine.max_wait_ms": 200.0}) as srv:
        with connect(srv) as sock, connect(srv) as other:
            sock.sendall(frame(rank_msg(5, user=1)) + frame(rank_msg(5, user=2))
                         + frame(m.StatsRequest(5)))
            other.sendall(frame(rank_msg(5, user=3)))
            first, second, third = recv_msg(sock), recv_msg(sock), recv_msg(sock)
            for refused in (first, second):
                assert isinstance(refused, m.Error) and refused.id == 5, refused
                assert refused.code == "INVALID_REQUEST" and "already in flight" in refused.message
            assert isinstance(third, m.RankReply) and third.id == 5 and len(third.scores) == 3
            assert isinstance(recv_msg(other), m.RankReply)
            sock.sendall(frame(rank_msg(5, user=1)))  # answered: free again
            assert isinstance(recv_msg(sock), m.RankReply)
            sock.sendall(frame(rank_msg(6, user=1, deadline_ms=1.0)))
            expired = recv_msg(sock)
            assert isinstance(expired, m.Error) and expired.code == "DEADLINE_EXCEEDED"
            sock.sendall(frame(rank_msg(6, user=1)))  # its first request may still be queued
            again = recv_msg(sock)
            assert isinstance(again, m.RankReply) and again.id == 6
        assert srv.server.metrics.counters["duplicate_ids"] == 2  # (the server's, not the engine's)
