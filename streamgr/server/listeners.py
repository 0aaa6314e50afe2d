"""The sockets ``streamgr serve`` listens on, bound before the engine starts.

An engine's start takes seconds to minutes (gen-ref on the H200: ~30 s of decode plans and
kernels; a Ray application longer), so a port already in use, or a ``--unix`` path in a missing
directory, is found before it, with the flag named, instead of after. The sockets are bound but
do not listen until the server is ready: a client connecting meanwhile is refused at once (as
by a stopped server, so it retries) rather than held in a backlog nobody accepts from.
"""

from __future__ import annotations

import os
import socket
import stat

from ..errors import StreamgrError


def _refuse_live_socket(path: str) -> None:
    """Listening on a Unix path replaces the socket file there; refuse when a server answers
    on it (a stale file of a dead server is removed, as asyncio's own unix server does)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise StreamgrError(f"--unix {path}: exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError, socket.timeout):
        os.unlink(path)  # nobody listens: a stale socket file
        return
    finally:
        probe.close()
    raise StreamgrError(f"--unix {path}: a server is already listening there")


def address(sock: socket.socket) -> str:
    """``host:port`` of a bound TCP socket (``[host]:port`` for IPv6)."""
    h, p = sock.getsockname()[:2]
    return f"[{h}]:{p}" if ":" in h else f"{h}:{p}"


def _why(err: OSError) -> str:
    return (err.strerror or str(err)).lower()


def _bind_tcp(flag: str, host: str, port: int) -> list[socket.socket]:
    """One socket per address ``host`` resolves to (as ``loop.create_server`` binds them)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise StreamgrError(f"--host {host}: not an address this machine resolves ({_why(err)})"
                            ) from None
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # (one socket a family, as asyncio binds them)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as err:
                raise StreamgrError(f"{flag} {port}: cannot listen on {addr[0]}:{addr[1]}: "
                                    f"{_why(err)}") from None
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


class Listeners:
    """Bound sockets for the protocol (``unix``, ``tcp``) and the metrics port (``metrics``);
    whatever is not handed to a server is closed by ``close``."""

    def __init__(self, host: str | None, port: int | None, unix: str | None,
                 metrics_port: int | None) -> None:
        self.unix: socket.socket | None = None
        self.unix_path = unix
        self.tcp: list[socket.socket] = []
        self.metrics: list[socket.socket] = []
        try:
            if unix:
                _refuse_live_socket(unix)
                self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    self.unix.bind(unix)
                except OSError as err:
                    raise StreamgrError(f"--unix {unix}: cannot listen there: {_why(err)}"
                                        ) from None
            if port is not None and host:
                self.tcp = _bind_tcp("--port", host, port)
            if metrics_port is not None:
                self.metrics = _bind_tcp("--metrics-port", host, metrics_port)
        except BaseException:
            self.close()
            raise

    def take_protocol(self) -> tuple[socket.socket | None, list[socket.socket]]:
        """(unix, tcp) for the protocol server, which owns them from here on."""
        out = (self.unix, self.tcp)
        self.unix, self.tcp = None, []
        return out

    def take_metrics(self) -> list[socket.socket]:
        out, self.metrics = self.metrics, []
        return out

    def close(self) -> None:
        """Close the sockets not taken (and remove the Unix socket file bound here)."""
        if self.unix is not None:
            self.unix.close()
            self.unix = None
            try:
                os.unlink(self.unix_path)
            except OSError:
                pass
        for sock in self.tcp + self.metrics:
            sock.close()
        self.tcp, self.metrics = [], []
