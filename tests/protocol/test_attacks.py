"""The attacker's findings of issue 11, each against a real server on loopback (asyncio and
uvloop): NaN deadlines, deep nesting, pre-Hello floods, a live Unix socket taken over, replies
lost at drain, the metrics endpoint's slow headers, health answers."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from streamgr import RankRequest
from streamgr.client import AsyncClient, Client
from streamgr.errors import StreamgrError
from streamgr.protocol import messages as m
from streamgr.server import main as server_main
from streamgr.tokens import read_token
from streamgr.server import Server
from tests.protocol.helpers import (LOOPS, ServerThread, connect, frame, good_request_works,
                                    rank_msg, raw_frame, recv_msg, run)


@pytest.fixture(scope="module", params=LOOPS)
def srv(request):
    with ServerThread(request.param, read_timeout=0.5) as s:
        yield s


def inflight(srv) -> int:
    async def get():
        return srv.server.inflight
    return srv.call(get())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_bad_deadline_is_refused_and_leaks_no_slot(srv, bad):
    with connect(srv) as sock:
        for i in range(50):
            sock.sendall(frame(rank_msg(100 + i, deadline_ms=bad)))
            reply = recv_msg(sock)
            assert isinstance(reply, m.Error) and reply.code == "INVALID_REQUEST", reply
            assert reply.id == 100 + i and "deadline_ms" in reply.message
    assert inflight(srv) == 0
    good_request_works(srv)


def test_deeply_nested_frame_gets_bad_frame(srv):
    body = b"\x91" * 100_000 + b"\x00"  # a one-element array inside another, 100,000 deep
    with connect(srv) as sock:
        sock.sendall(raw_frame(body))
        reply = recv_msg(sock)
        assert isinstance(reply, m.Error) and reply.code == m.BAD_FRAME, reply
        assert recv_msg(sock) is None  # then closed
    good_request_works(srv)


def test_pre_hello_flood_does_not_starve_clients(srv):
    flood = [socket.create_connection((srv.host, srv.port)) for _ in range(300)]
    try:
        time.sleep(0.2)
        for _ in range(3):  # legitimate clients still get in, one after another
            good_request_works(srv)
    finally:
        for s in flood:
            s.close()


def test_health_over_the_protocol(srv):
    with connect(srv) as sock:
        sock.sendall(frame(m.HealthRequest(7)))
        reply = recv_msg(sock)
    assert isinstance(reply, m.HealthReply) and reply.id == 7
    assert reply.live and reply.ready and reply.status == "ready"
    with Client(f"{srv.host}:{srv.port}") as c:
        assert c.health().ready


@pytest.mark.parametrize("loop", LOOPS)
def test_second_server_refuses_a_live_unix_socket(loop):
    path = os.path.join(tempfile.mkdtemp(), "sg.sock")
    with ServerThread(loop, unix=path) as first:
        async def second():
            s = Server(first.engine)
            with pytest.raises(StreamgrError, match="already listening"):
                await s.start(None, None, path)
        run(loop, second)
        with Client(f"unix:{path}") as c:  # the first server still owns its socket
            r = c.rank(RankRequest(user_id=1, items=[1, 2], actions=[0, 1], candidates=[3]))
            assert len(r.scores) == 1


@pytest.mark.parametrize("loop", LOOPS)
def test_drain_loses_no_reply_already_sent(loop):
    """The client keeps writing while the server drains: every request the server answered
    reaches the caller; the rest fail with a typed error, none hangs."""
    with ServerThread(loop, overrides={"engine.max_wait_ms": 50.0, "engine.max_batch": 64}) as srv:
        async def go():
            async with AsyncClient(f"{srv.host}:{srv.port}", timeout=20) as c:
                first = [asyncio.ensure_future(c.rank(RankRequest(
                    user_id=i, items=[1, 2, 3], actions=[0, 1, 2], candidates=[4, 5])))
                    for i in range(20)]
                await asyncio.sleep(0.01)
                asyncio.run_coroutine_threadsafe(srv.server.shutdown(10.0), srv.loop)
                late = []
                for i in range(40):  # writes that race the drain
                    late.append(asyncio.ensure_future(c.rank(RankRequest(
                        user_id=100 + i, items=[1], actions=[0], candidates=[4]))))
                    await asyncio.sleep(0.005)
                done = await asyncio.gather(*first, return_exceptions=True)
                rest = await asyncio.gather(*late, return_exceptions=True)
                return done, rest
        done, rest = run(loop, go)
        assert all(not isinstance(r, BaseException) and len(r.scores) == 2 for r in done), done
        bad = [r for r in rest if isinstance(r, BaseException) and not isinstance(r, StreamgrError)]
        assert not bad, bad


def test_whitespace_token_file_is_an_error(tmp_path):
    f = tmp_path / "token"
    f.write_text("  \n\t\n")
    with pytest.raises(StreamgrError, match="no token"):
        read_token(str(f))
    f.write_text(" s3cret \n")
    assert read_token(str(f)) == "s3cret"


class _StubServer:
    def __init__(self):
        self.state = (True, "ready")

    def prometheus(self):
        return "streamgr_up 1\n"

    def readiness(self):
        return self.state


async def _http(port, request: bytes, trickle: float | None = None):
    r, w = await asyncio.open_connection("127.0.0.1", port)
    if trickle is None:
        w.write(request)
    else:
        w.write(b"GET /metrics HTTP/1.1\r\n")
        for _ in range(100):  # one header line at a time, never the blank line
            await asyncio.sleep(trickle)
            if r.at_eof():
                break
            try:
                w.write(b"X-Slow: 1\r\n")
                await w.drain()
            except (ConnectionError, OSError):
                break
    data = await asyncio.wait_for(r.read(), 10)
    w.close()
    return data


def test_metrics_port_health_ready_and_slow_headers(monkeypatch):
    monkeypatch.setattr(server_main, "METRICS_REQUEST_TIMEOUT", 0.5)
    stub = _StubServer()

    async def go():
        srv = await asyncio.start_server(lambda r, w: server_main._metrics_http(stub, r, w),
                                         "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        health = await _http(port, b"GET /health HTTP/1.1\r\n\r\n")
        ready = await _http(port, b"GET /ready HTTP/1.1\r\n\r\n")
        stub.state = (False, "draining")
        not_ready = await _http(port, b"GET /ready HTTP/1.1\r\n\r\n")
        t = time.monotonic()
        slow = await _http(port, b"", trickle=0.1)
        slow_s = time.monotonic() - t
        srv.close()
        return health, ready, not_ready, slow, slow_s
    health, ready, not_ready, slow, slow_s = asyncio.run(go())
    assert health.startswith(b"HTTP/1.1 200") and health.endswith(b"ok\n")
    assert ready.startswith(b"HTTP/1.1 200")
    assert not_ready.startswith(b"HTTP/1.1 503") and b"draining" in not_ready
    assert slow == b"" and slow_s < 5.0  # cut off at the whole-request timeout


def test_metrics_port_caps_connections(monkeypatch):
    monkeypatch.setattr(server_main, "METRICS_MAX_CONNECTIONS", 4)
    stub = _StubServer()

    async def go():
        srv = await asyncio.start_server(lambda r, w: server_main._metrics_http(stub, r, w),
                                         "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
        await asyncio.sleep(0.05)
        try:
            extra = await asyncio.wait_for(_http(port, b"GET /metrics HTTP/1.1\r\n\r\n"), 5)
        except ConnectionResetError:  # closed before it read our request
            extra = b""
        for _, w in idle:
            w.close()
        await asyncio.sleep(0.05)
        after = await _http(port, b"GET /metrics HTTP/1.1\r\n\r\n")
        srv.close()
        return extra, after
    extra, after = asyncio.run(go())
    assert extra == b""  # closed at once: over the cap
    assert after.startswith(b"HTTP/1.1 200") and b"streamgr_up 1" in after


def test_empty_host_is_refused():
    from streamgr.cli import main
    assert main(["serve", "rank-small", "--host", "", "--set", "engine.device=cpu"]) == 2


@pytest.mark.parametrize("flags,says", [
    (["--port", "-1"], "--port must be in 0..65535"), (["--port", "70000"], "--port must be"),
    (["--metrics-port", "-5"], "--metrics-port must be"),
    (["--max-connections", "0"], "--max-connections) must be at least 1"),
    (["--max-inflight", "0"], "--max-inflight) must be"),
    (["--max-conn-inflight", "0"], "--max-conn-inflight) must be"),
    (["--max-frame", "0"], "--max-frame) must be"),
    (["--idle-timeout", "0"], "--idle-timeout) must be"),
    (["--read-timeout", "-1"], "--read-timeout) must be"),
    (["--read-timeout", "inf"], "--read-timeout) must be"),
    (["--drain-timeout", "-1"], "--drain-timeout must be"),
    (["--ray", "--replicas", "0"], "--replicas must be at least 1")])
def test_serve_options_that_would_serve_nothing_are_refused(flags, says):
    """Each of these started a server that refused every client (limits of 0), closed every
    connection at once, or failed later with a resolver's or Ray's message."""
    from streamgr.cli import build_parser
    from streamgr.server.main import serve_limits
    args = build_parser().parse_args(["serve", "rank-small", *flags])
    with pytest.raises(StreamgrError, match=re.escape(says)):
        serve_limits(args)


def test_serve_checks_its_options_before_starting():
    p = subprocess.run([sys.executable, "-m", "streamgr", "serve", "rank-small", "--set",
                        "engine.device=cpu", "--max-frame", "0"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "--max-frame) must be at least 1" in p.stderr, p.stderr


def test_hello_flood_then_abandoned_sockets_are_counted(srv):
    flood = [socket.create_connection((srv.host, srv.port)) for _ in range(80)]
    time.sleep(0.2)
    with Client(f"{srv.host}:{srv.port}") as c:
        server_stats = c.stats()["server"]
    for s in flood:
        s.close()
    assert server_stats.get("hello_evictions", 0) >= 80 - 64


def _raw_msg(*fields) -> bytes:
    import msgspec
    return raw_frame(msgspec.msgpack.encode(list(fields)))


@pytest.mark.parametrize("attack", [
    "unknown tag", "huge array", "overflowing id", "overflowing request id", "nan deadline",
    "truncated", "string where a list is due"])
def test_attack_categories_leave_the_server_serving(srv, attack):
    frames = {
        "unknown tag": _raw_msg(99, 1, 2, 3),
        "huge array": _raw_msg(3, 7, 1, list(range(200_000)), [0] * 200_000, [1, 2]),
        "overflowing id": _raw_msg(3, 8, 1, [2**64 - 1], [0], [1]),
        "overflowing request id": _raw_msg(3, 2**64 - 1, 1, [1], [0], [1]),
        "nan deadline": _raw_msg(3, 9, 1, [1], [0], [1], None, float("nan")),
        "truncated": _raw_msg(3, 10, 1, [1], [0], [1])[:-3],
        "string where a list is due": _raw_msg(3, 11, 1, "items", [0], [1]),
    }
    with connect(srv) as sock:
        sock.sendall(frames[attack])
        if attack == "truncated":  # half a frame: the read timeout closes the connection
            assert recv_msg(sock) is None
        else:
            reply = recv_msg(sock)
            assert isinstance(reply, m.Error), reply
            assert reply.code in ("INVALID_REQUEST", "ID_OUT_OF_RANGE", "HISTORY_TOO_LONG",
                                  m.PROTOCOL_ERROR, m.BAD_FRAME), reply
    good_request_works(srv)


def test_idle_flood_and_a_never_reading_client(srv):
    idle = [connect(srv) for _ in range(50)]  # greeted, then silent
    hog = connect(srv)
    hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        hog.settimeout(2)
        sent = 0
        try:  # requests whose replies it never reads, until its own socket backs up
            for i in range(20_000):
                hog.sendall(frame(rank_msg(1000 + i, user=i % 50)))
                sent += 1
        except (socket.timeout, BlockingIOError, OSError):
            pass
        assert sent > 0
        good_request_works(srv)  # everyone else is still served
    finally:
        hog.close()
        for s in idle:
            s.close()
    time.sleep(0.5)
    assert inflight(srv) <= 1024
    good_request_works(srv)
