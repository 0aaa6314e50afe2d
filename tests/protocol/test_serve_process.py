"""`streamgr serve` as a real process: SIGTERM during load drains and exits 0; metrics endpoint."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from streamgr.protocol import messages as m
from tests.protocol.helpers import LOOPS, frame, rank_msg, recv_msg


def start_server(loop: str, *extra: str):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamgr", "serve", "rank-small", "--port", "0", "--loop", loop,
         "--set", "engine.device=cpu", "--set", "model.max_history=64", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    match = re.search(r"on 127\.0\.0\.1:(\d+)", line)
    assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, int(match.group(1)), line


def hello(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(frame(m.Hello(m.PROTOCOL_VERSION)))
    assert isinstance(recv_msg(sock), m.HelloAck)
    return sock


@pytest.mark.parametrize("loop", LOOPS)
def test_sigterm_during_load_drains_and_exits_zero(loop):
    proc, port, _ = start_server(loop, "--set", "engine.max_wait_ms=300", "--set",
                                 "engine.max_batch=64")
    try:
        sock = hello(port)
        sock.sendall(b"".join(frame(rank_msg(i, user=i)) for i in range(1, 9)))
        time.sleep(0.1)  # read by the server, waiting in its batcher
        proc.send_signal(signal.SIGTERM)
        replies = [recv_msg(sock) for _ in range(8)]
        assert all(isinstance(r, m.RankReply) for r in replies), replies
        assert sorted(r.id for r in replies) == list(range(1, 9))
        time.sleep(0.2)
        with pytest.raises(OSError):  # refused (or reset) once draining started
            hello(port)
        sock.close()
        assert proc.wait(timeout=20) == 0
        assert "drained" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_second_signal_forces():
    proc, port, _ = start_server("uvloop", "--set", "engine.max_wait_ms=5000", "--set",
                                 "engine.max_batch=64", "--drain-timeout", "60")
    try:
        sock = hello(port)
        sock.sendall(frame(rank_msg(1)))
        time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 1
        sock.close()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_prometheus_endpoint():
    proc, port, line = start_server("asyncio", "--metrics-port", "0")
    try:
        mport = int(re.search(r"metrics http://127\.0\.0\.1:(\d+)", line).group(1))
        with hello(port) as sock:
            for i in range(3):
                sock.sendall(frame(rank_msg(i + 1)))
                assert isinstance(recv_msg(sock), m.RankReply)
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
        assert 'streamgr_requests_total{kind="rank",outcome="ok"} 3' in text
        assert 'streamgr_request_latency_seconds_count{kind="rank"} 3' in text
        assert "streamgr_total_hit_ratio" in text and "streamgr_cache_evictions" in text
        # one request at a time: three batches of one; the history tokens by source sum to
        # the three requests' (5 events, 10 tokens each)
        assert 'streamgr_batches_total{kind="rank"} 3' in text
        assert 'streamgr_batched_requests_total{kind="rank"} 3' in text
        assert "streamgr_engine_queued 0" in text
        tokens = re.findall(r'^streamgr_rank_history_tokens_total\{source="(\w+)"\} (\d+)$',
                            text, re.M)
        assert [s for s, _ in tokens] == ["gpu", "host", "recomputed"]
        assert sum(int(n) for _, n in tokens) == 30, tokens
        assert "streamgr_generate_gpu_seconds_total" not in text  # a rank-only spec
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


def test_logs_startup_access_and_auth_failures_and_health(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    proc, port, line = start_server("uvloop", "--access-log", "--token-file", str(token),
                                    "--metrics-port", "0")
    try:
        mport = int(re.search(r"metrics http://127\.0\.0\.1:(\d+)", line).group(1))
        bad = socket.create_connection(("127.0.0.1", port), timeout=10)
        bad.sendall(frame(m.Hello(m.PROTOCOL_VERSION, "wrong")))
        assert isinstance(recv_msg(bad), m.Error)
        bad.close()
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(frame(m.Hello(m.PROTOCOL_VERSION, "s3cret")))
        assert isinstance(recv_msg(sock), m.HelloAck)
        sock.sendall(frame(rank_msg(5, user=77)))
        assert isinstance(recv_msg(sock), m.RankReply)
        for path, code in (("/health", 200), ("/ready", 200)):
            r = urllib.request.urlopen(f"http://127.0.0.1:{mport}{path}", timeout=10)
            assert r.status == code
        sock.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    err = proc.stderr.read()
    assert re.search(r"spec rank-small on cpu \(cpu, float32\): \{.*\"max_history\":64", err), err
    assert "auth failure from" in err and "wrong token" in err
    assert re.search(r"starting the engine .*\n(.*\n)*.*engine started in [\d.]+ s", err), err
    assert re.search(r"streamgr.access: .* rank id=5 user=77 ok [\d.]+ ms", err), err


def test_json_logs_carry_the_access_fields_as_keys():
    """``--log-format json``: every stderr line one JSON object; the access line's fields are
    keys (no parsing of the message), the startup lines keep their message."""
    import json
    proc, port, _ = start_server("asyncio", "--access-log", "--log-format", "json")
    try:
        with hello(port) as sock:
            sock.sendall(frame(rank_msg(9, user=55)))
            assert isinstance(recv_msg(sock), m.RankReply)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    lines = [json.loads(line) for line in proc.stderr.read().splitlines() if line.strip()]
    assert all({"ts", "level", "logger", "message"} <= set(r) for r in lines), lines
    assert any(r["logger"] == "streamgr.server" and "engine started in" in r["message"]
               for r in lines), lines
    access = [r for r in lines if r["logger"] == "streamgr.access"]
    assert len(access) == 1, lines
    a = access[0]
    assert (a["kind"], a["id"], a["user"], a["outcome"]) == ("rank", 9, 55, "ok"), a
    assert a["ms"] >= 0 and a["level"] == "INFO" and a["ts"].endswith("Z")
