"""``streamgr serve`` binds its sockets before its engine starts (server/listeners.py): a port
in use, a ``--unix`` path that cannot be bound or a host that does not resolve is an error
naming the flag, said before the start (gen-ref's takes ~30 s on the H200); a client that
connects during the start is refused at once; once the server listens it is served."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile

import pytest

from streamgr import Engine, RankRequest
from streamgr.client import AsyncClient
from streamgr.errors import StreamgrError
from streamgr.server import Server
from streamgr.server.listeners import Listeners

from .helpers import small_overrides

REQ = RankRequest(user_id=1, items=[1, 2], actions=[0, 1], candidates=[3])


def _busy_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_a_port_in_use_is_said_before_the_engine_starts(flag):
    """Before: the engine started (and on a GPU built its plans), then the bind failed with
    asyncio's message, which did not say which flag."""
    busy, port = _busy_port()
    with busy:
        args = ["--port", "0", flag, str(port)] if flag != "--port" else ["--port", str(port)]
        p = subprocess.run([sys.executable, "-m", "streamgr", "serve", "rank-small", "--set",
                            "engine.device=cpu", *args], capture_output=True, text=True,
                           timeout=120)
    assert p.returncode == 2
    assert f"{flag} {port}: cannot listen on 127.0.0.1:{port}: address already in use" \
        in p.stderr
    assert "starting the engine" not in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("unix, host, match", [
    ("/nonexistent-dir/sg.sock", "127.0.0.1",
     "--unix /nonexistent-dir/sg.sock: cannot listen there: no such file or directory"),
    (None, "no-such-host.invalid", "--host no-such-host.invalid: not an address"),
])
def test_an_address_that_cannot_be_bound_names_its_flag(unix, host, match):
    """Before: ``[Errno 2] No such file or directory`` without the path."""
    with pytest.raises(StreamgrError, match=match):
        Listeners(host, 0, unix, None)


def test_a_file_that_is_not_a_socket_is_left_alone(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("keep me")
    with pytest.raises(StreamgrError, match="exists and is not a socket"):
        Listeners(None, None, str(path), None)
    assert path.read_text() == "keep me"


def test_a_failed_bind_closes_what_was_bound_before_it():
    busy, port = _busy_port()
    path = os.path.join(tempfile.mkdtemp(), "sg.sock")
    with busy, pytest.raises(StreamgrError, match="--metrics-port"):
        Listeners("127.0.0.1", 0, path, port)
    assert not os.path.exists(path)  # the unix socket bound first was closed and removed


async def test_clients_are_refused_until_the_server_listens_then_served():
    """Bound, not listening: a connection is refused at once (a client retries), not held in
    a backlog while the engine starts. A stale socket file of a dead server is replaced."""
    path = os.path.join(tempfile.mkdtemp(), "sg.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # the file stays, nobody listens
    bound = Listeners("127.0.0.1", 0, path, None)
    port = bound.tcp[0].getsockname()[1]
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_unix_connection(path)
    async with Engine.from_spec("rank-small", small_overrides()) as eng:
        srv = Server(eng)
        addrs = await srv.start(bound=bound)
        assert addrs == [f"unix:{path}", f"127.0.0.1:{port}"]
        try:
            for addr in addrs:
                async with AsyncClient(addr, timeout=30) as c:
                    assert len((await c.rank(REQ)).scores) == 1
        finally:
            await srv.shutdown(1.0)
